"""The console policy of every process efflab works in: a stage, a benchmark cell forked from the forkserver,
a DDP rank. Each sets it itself, since a forked or spawned process does not inherit it."""
from __future__ import annotations

import logging
import sys
import warnings
from pathlib import Path

# Libraries whose logged warnings speak to their own developers, not to whoever reads a benchmark: errors only.
# bitsandbytes logs "MatMul8bitLt: inputs will be cast from ... to float16" on every INT8 matmul whose input is
# not float16 (tens of thousands of lines per benchmark cell). torchao (imported by peft too) warns at import that
# a CPU build of torch cannot load its CUDA kernels, which efflab does not use, and torch's pytree module that
# torchao registers enums the deprecated way.
# lm-eval logs its own advice to task authors ("Custom kwargs can be passed to --metadata ...") on every run.
QUIET_LIBRARIES = ("transformers", "accelerate", "peft", "bitsandbytes", "torchao", "torch.utils._pytree", "urllib3",
                   "filelock", "httpx", "lm-eval", "lm_eval")
# Python warnings one library raises about another's use of it, which neither efflab nor its user can act on:
# peft reads transformers' deprecated is_gradient_checkpointing and calls gradient_checkpointing_enable (efflab
# itself calls activation_checkpointing_enable where transformers has it: training.checkpointing_enable); peft
# warns on every 4-bit/8-bit merge that rounding may change generations, which the merge stage measures.
LIBRARY_WARNINGS = (r"`is_gradient_checkpointing` is deprecated", r"`gradient_checkpointing_enable` is deprecated",
                    r"(Un)?[Mm]erge lora module to (4|8)-bit linear may get different generations")


def quiet_libraries() -> None:
    """Set QUIET_LIBRARIES to errors and ignore LIBRARY_WARNINGS, before anything imports those libraries: torchao
    and torch's pytree log their import-time warnings (a CPU build cannot load torchao's CUDA kernels; an enum
    registered the deprecated way) before any stage's logging is configured. efflab/__init__ calls it."""
    for noisy in QUIET_LIBRARIES:
        logging.getLogger(noisy).setLevel(logging.ERROR)
    for message in LIBRARY_WARNINGS:
        warnings.filterwarnings("ignore", message=message)


class WarningOnce(logging.Filter):
    """A handler filter that lets each distinct logged warning (same logger, same text) through once per
    process; other levels, errors above all, always pass."""

    def __init__(self):
        super().__init__()
        self.seen: set[tuple[str, str]] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        if not logging.WARNING <= record.levelno < logging.ERROR:
            return True
        key = (record.name, record.getMessage())
        if key in self.seen:
            return False
        self.seen.add(key)
        return True


def configure_logging(handlers: list[logging.Handler], fmt: str) -> None:
    """The console policy of every process efflab works in (a stage, a benchmark cell forked from the
    forkserver, a DDP rank), each of which must set it itself: INFO to `handlers`, QUIET_LIBRARIES at errors
    only, each distinct logged warning and each Python warning (same text and category) shown once per
    process. The 'once' action is a last filter, after Python's defaults (DeprecationWarning outside
    __main__ ignored), -W/PYTHONWARNINGS and a test runner's: those decide first. A warning meant for the
    user (a deprecated parameter) is a FutureWarning, which Python shows."""
    for handler in handlers:
        handler.addFilter(WarningOnce())
    logging.basicConfig(level=logging.INFO, format=fmt, handlers=handlers, force=True)
    quiet_libraries()
    warnings.filterwarnings("once", append=True)


def setup_logging(log_file: str | None) -> None:
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stderr)]
    if log_file:
        Path(log_file).parent.mkdir(parents=True, exist_ok=True)
        handlers.append(logging.FileHandler(log_file, mode="w"))
    configure_logging(handlers, "%(asctime)s %(levelname)s %(message)s")


def setup_child_logging(log_file: str | None, tag: str) -> None:
    """Log a child process (a benchmark cell, a DDP rank) to stderr and append to its stage's log file, with
    the stage's console policy (configure_logging): a cell forked from the forkserver inherits the
    forkserver's logging and warnings state, not the stage's."""
    handlers: list = [logging.StreamHandler(sys.stderr)]
    if log_file:
        handlers.append(logging.FileHandler(log_file, mode="a"))
    configure_logging(handlers, f"%(asctime)s %(levelname)s [{tag}] %(message)s")


def log_file_path() -> str | None:
    """The file this process logs to (the stage's --log), for child processes to append to."""
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            return handler.baseFilename
    return None
