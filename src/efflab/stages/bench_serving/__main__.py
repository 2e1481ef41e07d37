from ... import cli
from . import run

cli.main("bench_serving", run)
