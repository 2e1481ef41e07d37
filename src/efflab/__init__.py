"""efflab: measure what efficiency techniques cost and buy on your own model."""

import os

from .logs import quiet_libraries

__version__ = "0.1.0"

# torch's C++ warnings at errors only, unless the user asks (TORCH_CPP_LOG_LEVEL=WARNING): it is read when torch is
# imported, which efflab precedes in every process it starts. Their noise: the CPU allocator's "memory block of
# unknown size was allocated before the profiling started" on every resumed live-tensor count
# (measure.memory.CpuTensorPeak), which counts only what it sees allocated, by design.
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
quiet_libraries()  # before any stage, cell or Snakefile imports the libraries whose import-time noise it silences
