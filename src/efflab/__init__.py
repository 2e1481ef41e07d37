"""efflab: measure what efficiency techniques cost and buy on your own model."""

__version__ = "0.1.0"
