"""efflab: measure what efficiency techniques cost and buy on your own model."""

from .logs import quiet_libraries

__version__ = "0.1.0"

quiet_libraries()  # before any stage, cell or Snakefile imports the libraries whose import-time noise it silences
