import sys

from ... import cli
from . import run, train
from .launch import WORKER_FLAG, worker_main

if WORKER_FLAG in sys.argv:  # one rank of `accelerate launch` (launch_distributed)
    worker_main([a for a in sys.argv[1:] if a != WORKER_FLAG], train)
else:
    cli.main("finetune", run)
