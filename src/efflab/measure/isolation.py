"""Isolation: one benchmark cell per process, so a crash or OOM becomes a recorded result."""
from __future__ import annotations

import json
import multiprocessing
import os
import signal
import threading
import time
import traceback
from multiprocessing import forkserver
from pathlib import Path

import torch
import tqdm

from ..logs import log_file_path, setup_child_logging
from .memory import proc_status_kib
from .preload import PRELOAD


def classify_failure(err: BaseException) -> dict:
    text = str(err).strip().splitlines()[0] if str(err).strip() else ""
    oom = isinstance(err, MemoryError) or isinstance(err, getattr(torch, "OutOfMemoryError", MemoryError)) \
        or "out of memory" in text.lower() or "can't allocate memory" in text.lower()
    # NotImplementedError: the library does not do this here (e.g. FlexAttention's backward on CPU).
    status = "oom" if oom else "unavailable" if isinstance(err, NotImplementedError) else "failed"
    return {"status": status, "reason": f"{type(err).__name__}: {text}"[:500],
            "traceback": traceback.format_exception(err)[-3:]}


def _cell_child(fn, kwargs: dict, conn, log_file: str | None, threads: int) -> None:
    setup_child_logging(log_file, "cell")
    torch.set_num_threads(threads)
    # tqdm's default lock is a multiprocessing semaphore, made on a cell's first progress bar (transformers'
    # "Loading weights"); a cell killed at the memory cap or the timeout cannot release it, and the resource
    # tracker then reports it leaked at shutdown. A cell is one process: a thread lock serves.
    tqdm.tqdm.set_lock(threading.RLock())
    try:
        result = {"status": "ok"} | fn(**kwargs)
    except BaseException as err:  # the whole point: any failure becomes a recorded result
        result = classify_failure(err)
    conn.send(result)
    conn.close()


# What the forkserver imports once. Without CUDA it is measure.preload's PRELOAD, what the pipeline's job server
# (efflab.zygote) imports but lm-eval (a job whose cells evaluate adds it: prestart's extra): torch, transformers'
# model and Trainer machinery, peft and bitsandbytes, so that a cell starts in about 0.05 s instead of paying those
# imports again. With CUDA it stays light: a library that touches CUDA at import would leave every forked cell unable
# to initialise it. A job whose cells only load and run a model (prestart's light) has it light too: its first cell
# waits for the forkserver's imports, 9 s of CPU instead of 15 on 2 cores.
_CELL_PRELOAD_LIGHT = ["torch", "transformers", "transformers.modeling_utils",
                       "transformers.models.auto.modeling_auto", "efflab.measure.isolation", "efflab.models.modeling"]


_EXTRA: list[str] = []  # what this job's cells also need (prestart's extra)
_LIGHT = False  # set by prestart(light=True): this job's cells need no Trainer, peft or bitsandbytes


def cell_preload() -> list[str]:
    """efflab first: its package import quiets the libraries' import-time noise (logs.quiet_libraries) before the
    forkserver imports them."""
    if torch.cuda.is_available() or _LIGHT:
        return ["efflab", *_CELL_PRELOAD_LIGHT, *_EXTRA]
    return ["efflab", *PRELOAD, *_EXTRA]


def _cell_context():
    """Cells fork from a forkserver that has imported the libraries once but run no work: each cell starts in
    a clean process (nothing allocated, no threads) without paying the imports again."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(cell_preload())
    return ctx


def prestart(isolation: str, extra: list[str] = (), light: bool = False) -> None:
    """Start the cells' forkserver now, so that its imports (and `extra` modules the cells need) run beside the job's
    own instead of before the first cell. Call it before the job loads its models and before anything is timed.
    light: the cells only load and run a model (no Trainer, peft or bitsandbytes), so the forkserver imports less."""
    if isolation != "subprocess":
        return  # no cells in processes: `extra` must not reach a forkserver a later job in this process starts
    global _LIGHT
    _EXTRA.extend(m for m in extra if m not in _EXTRA)
    _LIGHT = _LIGHT or light
    if _cell_context().get_start_method() == "forkserver":
        forkserver.ensure_running()


class CellJournal:
    """Each benchmark cell's result, appended to a journal file as the cell ends, so that a stage killed
    mid-grid (a cluster's time limit, an OOM kill of the whole job) loses only the cell it was in: its
    rerun takes the journalled cells as they are and measures the rest. The journal is a hidden sibling
    of the job's folder (which the stage writes only at its end, and Snakemake deletes when a job fails);
    one written with other settings is discarded, and the stage deletes it once its metrics are in place."""

    def __init__(self, path: Path, settings: dict):
        self.path = Path(path)
        self.stamp = json.dumps({"settings": settings}, sort_keys=True, default=str)
        self.cells: dict[str, dict] = {}
        lines = self.path.read_text().splitlines() if self.path.is_file() else []
        if lines and lines[0] == self.stamp:
            for line in lines[1:]:
                try:
                    entry = json.loads(line)
                except json.JSONDecodeError:  # the line being written when the process was killed
                    break
                self.cells[entry["key"]] = entry["result"]
        else:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text(self.stamp + "\n")
        self.resumed = len(self.cells)

    @staticmethod
    def key(cell: dict) -> str:
        return json.dumps(cell, sort_keys=True)

    def result(self, cell: dict, measure) -> dict:
        """The cell's journalled result, or `measure()`'s, journalled before it is returned."""
        key = self.key(cell)
        if key not in self.cells:
            result = measure()
            with open(self.path, "a") as f:
                f.write(json.dumps({"key": key, "result": result}, default=str) + "\n")
                f.flush()
                os.fsync(f.fileno())
            self.cells[key] = result
        return self.cells[key]

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)


def _watch(proc, receiver, t0: float, timeout_s: float | None, memory_cap_mib: float | None):
    """Poll a cell's process until it reports, dies, passes the memory cap or runs out of time (the last two
    kill it): (its result or None, its peak resident MiB seen by the polls)."""
    result, peak_rss = None, 0.0
    while result is None:
        if receiver.poll(0.02):
            try:
                result = receiver.recv()
            except EOFError:  # the child died without a word
                break
            break
        if not proc.is_alive() and not receiver.poll(0):
            break
        rss = (proc_status_kib("VmRSS", proc.pid) or 0) / 1024
        peak_rss = max(peak_rss, rss)
        if memory_cap_mib is not None and rss > memory_cap_mib:
            proc.kill()
            result = {"status": "oom", "reason": f"resident memory {rss:.0f} MiB passed the cell memory cap "
                                                 f"of {memory_cap_mib:.0f} MiB"}
        elif timeout_s is not None and time.perf_counter() - t0 > timeout_s:
            proc.kill()
            result = {"status": "timeout", "reason": f"the cell ran longer than {timeout_s:g} s"}
    return result, peak_rss


def run_cell(fn, kwargs: dict, isolation: str = "subprocess", timeout_s: float | None = None,
             memory_cap_mib: float | None = None) -> dict:
    """Run one benchmark cell `fn(**kwargs) -> dict` and return its result with a `status`.

    With isolation 'subprocess' the cell runs in a fresh process (forked from a clean forkserver): its memory peak cannot
    be polluted by earlier work, and a crash, an out-of-memory (an allocation failure, the resident
    set passing `memory_cap_mib`, or a SIGKILL from the kernel's OOM killer) or passing `timeout_s`
    becomes a recorded result ('failed', 'oom', 'timeout' with the reason) and the grid goes on.
    With 'inprocess' the cell runs here; exceptions are still recorded, but not crashes or caps.
    """
    t0 = time.perf_counter()
    if isolation == "inprocess":
        try:
            result = {"status": "ok"} | fn(**kwargs)
        except (KeyboardInterrupt, SystemExit):
            raise
        except Exception as err:
            result = classify_failure(err)
        return result | {"isolation": "inprocess", "cell_wall_s": time.perf_counter() - t0}

    ctx = _cell_context()
    receiver, sender = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_cell_child, args=(fn, kwargs, sender, log_file_path(), torch.get_num_threads()))
    proc.start()
    sender.close()
    try:
        result, peak_rss = _watch(proc, receiver, t0, timeout_s, memory_cap_mib)
    finally:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
            proc.join()
        receiver.close()
    if result is None:
        code = proc.exitcode
        if code == -signal.SIGKILL:
            result = {"status": "oom", "reason": "the cell process was killed by SIGKILL (most likely the kernel's "
                                                 "out-of-memory killer)"}
        else:
            what = f"signal {signal.Signals(-code).name}" if code and code < 0 else f"exit code {code}"
            result = {"status": "failed", "reason": f"the cell process died with {what} before reporting"}
    return result | {"isolation": "subprocess", "cell_wall_s": time.perf_counter() - t0,
                     "cell_process_max_rss_mib": peak_rss or None}
