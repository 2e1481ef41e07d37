from ... import cli
from . import run

cli.main("capacity", run)
