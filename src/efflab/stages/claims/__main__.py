from ... import cli
from .stage import run

cli.main("claims", run)
