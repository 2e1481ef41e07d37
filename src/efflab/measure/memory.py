"""Memory, by named kind.

Memory results always name their kind: `cuda_max_allocated` / `cuda_max_reserved` on GPU,
`cpu_peak_rss` (the kernel's high-water mark of resident memory, reset before the measured work)
on CPU, and beside it `cpu_tensor_peak` (the most bytes live CPU tensors held at once, from the CPU
allocator's own events: the CPU counterpart of cuda_max_allocated). A measurement that cannot be
taken is None with a reason, never 0. A process run under a memory budget (cap_cuda_memory) is held to it by
the memory the budget holds (held_mib, held_peak_mib), and run_steps probes a unit of work against it."""
from __future__ import annotations

import ctypes
import ctypes.util
import gc
import os
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from .device import nvml_handle, synchronize
from .timing import time_fn

# pynvml is optional (the gpu extra) and torch.profiler slow to import: each is imported where it is used.


MiB = 1024 * 1024


def proc_status_kib(field: str, pid: int | str = "self") -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except (OSError, ValueError):  # a process may exit while being read
        return None
    return None


def _release_freed_memory() -> None:
    """Collect garbage and hand freed heap pages back to the OS (glibc malloc_trim), so memory that
    earlier work freed but the allocator kept resident is not silently reused inside a measurement."""
    gc.collect()
    try:
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _reset_cpu_peak() -> bool:
    """Reset the kernel's resident-memory high-water mark (VmHWM) of this process."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


# Kineto's log severities: VERBOSE 0, INFO 1, WARNING 2, STAGE 3, ERROR 4, USDT 5. Every profiler start and stop
# logs "USDT:<time> <pid>:<tid> SyncActivityProfilerHandler.cpp:52] profiler_start" (and profiler_stop) at USDT,
# above the ERROR threshold torch sets, so only a threshold above USDT silences them (Kineto's errors with them).
KINETO_QUIET_LEVEL = "6"


@contextmanager
def _kineto_quiet():
    """KINETO_LOG_LEVEL set while the first torch.profiler start in a process initialises Kineto, which reads
    it then, once, and never again; unset afterwards, so it reaches only efflab's own profiler. A
    KINETO_LOG_LEVEL the user has set is theirs (e.g. 0 to see every Kineto message)."""
    if "KINETO_LOG_LEVEL" in os.environ:
        yield
        return
    os.environ["KINETO_LOG_LEVEL"] = KINETO_QUIET_LEVEL
    try:
        yield
    finally:
        os.environ.pop("KINETO_LOG_LEVEL", None)


class CpuTensorPeak:
    """The most bytes that live CPU tensors held at once while it ran, above those live at its start: the
    CPU counterpart of torch.cuda.max_memory_allocated, which resident memory is not (RSS also holds what
    glibc malloc keeps after tensors are freed, and grows with each new largest batch).

    Counted from the allocation and free events that PyTorch's CPU allocator reports to torch.profiler
    (profile_memory=True) in order. Operator events are switched off on this thread (RecordFunction), so the
    profiler costs one small event per allocation: a 12-step LoRA run of the default model makes 375k, which
    lengthened each step by ~5% (its backward) on a 2-core AVX2 CPU (benchmarks/finetune_throughput.py), hence
    `pause()` and `resume()`. It sees the tensors of this thread and of the threads it hands work to (the
    autograd engine's), not Python objects, not allocator overhead. It counts the tensors allocated inside the
    block: each event carries its block's address, and a free is counted only where this counter saw that
    address allocated. The allocator itself reports some frees of blocks allocated before (its size table keeps
    the addresses an earlier profiler saw allocated and not freed while it ran, stale once reused), with a
    size that may not be the block's: those are skipped and counted in `unpaired_frees`.

    `pause()` stops the recording and keeps its results, `resume()` starts a new one: the steps that cannot hold
    the peak run without the per-allocation cost (callbacks.CountLongestSteps). The recordings are counted in order
    at stop(): walking a step's events takes tens of ms of Python (about 4 µs an event), which would otherwise fall
    between two training steps. While paused nothing is counted: not what is allocated,
    not the free of what was counted before. A counter never started (on a GPU, where track_memory reads CUDA's
    allocator instead) stays off through resume(). What pauses and resumes take is in `overhead_s`."""

    KIND = "cpu_tensor_peak"
    _warm = False
    _kineto_initialised = False  # per process: a forkserver child inherits the forkserver's False

    @classmethod
    def warm_up(cls) -> None:
        """Start and stop the profiler once per process: its first start maps ~70 MiB (Kineto), which must
        be resident before a resident-memory baseline is read, not inside the measurement."""
        if not cls._warm and not torch.autograd._profiler_enabled():
            cls().start().stop()
            cls._warm = True

    def __init__(self, unavailable: str | None = None):
        """`unavailable`: the reason it is not to run (e.g. another torch.profiler will): start() does nothing."""
        self.current = self.peak = self.events = self.unpaired_frees = 0
        self._live: dict[int, int] = {}  # address -> bytes of each block allocated while counting, not yet freed
        self.overhead_s = 0.0
        self._profiler = None
        self._recorded: list = []  # the profiler results of each recording not yet counted
        self._paused = False  # resume() restarts only a count that pause() stopped, never one not started
        self.unavailable: str | None = unavailable

    def start(self) -> "CpuTensorPeak":
        from torch.profiler import ProfilerActivity, profile

        if self.unavailable:
            return self
        if torch.autograd._profiler_enabled():
            self.unavailable = "torch.profiler is already running in this process"
            return self
        self._profiler = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        if CpuTensorPeak._kineto_initialised:
            self._profiler.start()
        else:
            with _kineto_quiet():
                self._profiler.start()
            CpuTensorPeak._kineto_initialised = True
        torch.autograd._enable_record_function(False)
        return self

    def _stop_recording(self) -> None:
        """Stop the profiler and keep its results: the walk of their event tree (tens of ms of Python per step's
        events) waits for stop(), outside the training."""
        torch.autograd._enable_record_function(True)
        self._profiler.stop()
        self._recorded.append(self._profiler.profiler.kineto_results)
        self._profiler = None

    def _fold(self) -> None:
        """Count the events of every recording so far, in order."""
        for results in self._recorded:
            events = _cpu_allocations(results.experimental_event_tree())
            for ptr, nbytes in events:
                self._count(ptr, nbytes)
            self.events += len(events)
        self._recorded = []

    def _count(self, ptr: int, nbytes: int) -> None:
        if nbytes >= 0:
            # a block allocated again at an address still held was freed while paused: it is gone now
            self.current += nbytes - self._live.get(ptr, 0)
            self._live[ptr] = nbytes
            self.peak = max(self.peak, self.current)
        elif ptr in self._live:
            self.current -= self._live.pop(ptr)
        else:
            self.unpaired_frees += 1

    @property
    def counting(self) -> bool:
        return self._profiler is not None

    def pause(self) -> None:
        if self._profiler is not None:
            t0 = time.perf_counter()
            self._stop_recording()
            self._paused = True
            self.overhead_s += time.perf_counter() - t0

    def resume(self) -> None:
        if self._paused:
            t0 = time.perf_counter()
            self._paused = False
            self.start()
            self.overhead_s += time.perf_counter() - t0

    def stop(self) -> dict:
        self._paused = False
        if self._profiler is not None:
            self._stop_recording()
        self._fold()
        if self.unavailable:
            return {"kind": self.KIND, "delta_mib": None, "unavailable": self.unavailable}
        return {"kind": self.KIND, "delta_mib": self.peak / MiB, "end_delta_mib": self.current / MiB,
                "allocator_events": self.events, "unpaired_frees": self.unpaired_frees,
                "pause_resume_s": self.overhead_s}


def _cpu_allocations(tree) -> list[tuple[int, int]]:
    """(address, bytes: negative for a free) of every CPU allocator event in a profiler's event tree, in time
    order; an allocation made inside an operator the autograd engine's threads record is its child."""
    from torch._C._profiler import _EventType

    found, stack = [], list(reversed(tree))
    while stack:  # depth first, in recorded order: events of one time keep it
        event = stack.pop()
        stack.extend(reversed(event.children))
        if event.tag == _EventType.Allocation and event.typed[1].device.type == "cpu":
            found.append((event.start_time_ns, len(found), event.typed[1].ptr, event.typed[1].alloc_size))
    found.sort()
    return [(ptr, nbytes) for _, _, ptr, nbytes in found]


def live_tensor_bytes(fn) -> float | None:
    """The peak bytes of CPU tensors that `fn()` allocates and holds at once (CpuTensorPeak around one call):
    for probing what an op allocates on this machine. None when it cannot be measured (a profiler running)."""
    counter = CpuTensorPeak().start()
    fn()
    seen = counter.stop()["delta_mib"]
    return None if seen is None else seen * MiB


@contextmanager
def track_memory(device: torch.device, tensors: CpuTensorPeak | None = None):
    """Peak memory of the work inside the block, with the kind of memory named.

    On CPU the peak RSS is the process high-water mark after resetting it at entry, so earlier work
    in the process does not count; `delta_mib` is that peak over the RSS at entry, and `tensors` the
    `cpu_tensor_peak` of the block (pass a CpuTensorPeak to pause and resume it from inside, e.g. on chosen steps).
    """
    result: dict = {}
    if device.type == "cuda":
        synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        yield result
        synchronize(device)
        result["kind"] = "cuda_max_allocated"
        result["peak_mib"] = torch.cuda.max_memory_allocated(device) / MiB
        result["delta_mib"] = (torch.cuda.max_memory_allocated(device) - base) / MiB
        result["cuda_max_reserved_mib"] = torch.cuda.max_memory_reserved(device) / MiB
        result["nvml_process_mib"], reason = nvml_process_mib(device)
        if reason:
            result["nvml_unavailable"] = reason
        return
    CpuTensorPeak.warm_up()
    _release_freed_memory()
    reset = _reset_cpu_peak()
    base = proc_status_kib("VmRSS")
    tensors = (tensors or CpuTensorPeak()).start()
    try:
        yield result
    finally:
        peak = proc_status_kib("VmHWM")
        result["tensors"] = tensors.stop()
    result["kind"] = "cpu_peak_rss"
    if not reset or peak is None or base is None:
        result["peak_mib"] = None
        result["delta_mib"] = None
        result["unavailable"] = "cannot reset or read the RSS high-water mark (/proc/self/clear_refs, VmHWM)"
        return
    result["peak_mib"] = peak / 1024
    result["baseline_mib"] = base / 1024
    result["delta_mib"] = (peak - base) / 1024


def allocated_delta(mem: dict) -> tuple[float | None, str | None]:
    """What a block allocated, from a track_memory record, with its kind: CUDA's allocated peak, or on CPU the
    live-tensor peak. The resident delta also moves with what the allocator kept from earlier work and reuses,
    so a law of memory in input size (bench_attention's exponent) is fitted on this, never on RSS."""
    tensors = mem.get("tensors") or {}
    if mem.get("kind") == "cpu_peak_rss" and tensors.get("delta_mib") is not None:
        return tensors["delta_mib"], tensors["kind"]
    return mem.get("delta_mib"), mem.get("kind")


@contextmanager
def tensor_peak(device: torch.device):
    """The live-tensor peak of the work inside the block over the tensors live at its start (`delta_mib`), the
    kind of memory estimators.memory predicts: `cpu_tensor_peak` on CPU, `cuda_max_allocated` on GPU. Unlike
    track_memory it leaves the process's resident high-water mark alone, so a caller can still hold the whole
    process's peak against a budget; on CUDA the allocator's peaks must be reset, so the reserved peak before
    the block is kept in `reserved_before_mib`. The CPU counter is a profiler: time nothing inside the block.
    Stopping it reads its events into Python objects, a transient of 60-100 MiB for a step of the default model,
    and a resident peak of its own: so on CPU the high-water mark is read before it stops (`hwm_before_stop_mib`)
    and reset after (`hwm_reset`), and the process's peak over the block and what follows is the larger of that
    figure and the high-water mark at the end. The freed memory is handed back too."""
    result: dict = {}
    if device.type == "cuda":
        synchronize(device)
        result["reserved_before_mib"] = torch.cuda.max_memory_reserved(device) / MiB
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        yield result
        synchronize(device)
        result |= {"kind": "cuda_max_allocated", "delta_mib": (torch.cuda.max_memory_allocated(device) - base) / MiB}
        return
    gc.collect()  # garbage an earlier counter in this process saw allocated would report its frees inside the block
    tensors = CpuTensorPeak().start()
    try:
        yield result
    finally:
        hwm = proc_status_kib("VmHWM")
        result |= tensors.stop()
        # The event objects, freed but kept resident by the allocators, would lift the resident peak of any work
        # that follows by ~100 MiB (measured after a LoRA step of the default model). Handed back, they do not.
        _release_freed_memory()
        result |= {"hwm_before_stop_mib": None if hwm is None else hwm / 1024, "hwm_reset": _reset_cpu_peak()}


def nvml_process_mib(device: torch.device) -> tuple[float | None, str | None]:
    """GPU memory NVML attributes to this process (what nvidia-smi shows: allocator reserve, CUDA
    context, kernels), at the time of the call; None and a reason where NVML cannot say."""
    try:
        import pynvml
    except ImportError:
        return None, "pynvml (nvidia-ml-py) is not installed"
    try:
        handle = nvml_handle(device)
        for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
            if proc.pid == os.getpid() and proc.usedGpuMemory is not None:
                return proc.usedGpuMemory / MiB, None
        return None, "NVML lists no memory for this process (containers often hide PIDs)"
    except Exception as err:  # NVML errors are not user errors: record, don't crash
        return None, f"NVML failed: {err}"


def cuda_context_mib(device: torch.device) -> dict:
    """GPU memory this process holds outside PyTorch's caching allocator: the CUDA context, kernel images and
    library workspaces (NVML's figure for the process minus torch.cuda.memory_reserved)."""
    process, reason = nvml_process_mib(device)
    if process is None:
        return {"mib": None, "unavailable": reason}
    reserved = torch.cuda.memory_reserved(device) / MiB
    return {"mib": process - reserved, "nvml_process_mib": process, "torch_reserved_mib": reserved}


def cap_cuda_memory(device: torch.device, budget_mib: float) -> float:
    """Hold this process's GPU memory to `budget_mib` (torch.cuda.set_per_process_memory_fraction, where the budget
    is below the card): the budget less the CUDA context, which the caching allocator does not see. Resets the
    allocator's peaks; returns the context's MiB (0 where NVML cannot say)."""
    torch.cuda.init()
    context = cuda_context_mib(device)["mib"] or 0.0
    card = torch.cuda.get_device_properties(device).total_memory / MiB
    if budget_mib < card:
        torch.cuda.set_per_process_memory_fraction(max(budget_mib - context, 0) / card, device)
    torch.cuda.reset_peak_memory_stats(device)
    return context


def held_mib(device: torch.device, context: float) -> float:
    """The memory a budget holds now: CUDA's allocated memory plus the context, or on CPU the resident set."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device) / MiB + context
    return (proc_status_kib("VmRSS") or 0) / 1024


def held_peak_mib(device: torch.device, context: float, tensors: dict) -> float | None:
    """The peak of the memory the budget holds, over the whole cell; the tensor counter's own stop is in none
    of it (tensor_peak reads the high-water mark before it and resets it after)."""
    if device.type == "cuda":
        reserved = max(torch.cuda.max_memory_reserved(device) / MiB, tensors.get("reserved_before_mib", 0.0))
        return reserved + context
    hwm, before = proc_status_kib("VmHWM"), tensors.get("hwm_before_stop_mib")
    return None if hwm is None or before is None else max(hwm / 1024, before)


def file_pages_mib() -> float | None:
    """The file pages this process holds resident (RssFile): what it has read of memory-mapped files."""
    kib = proc_status_kib("RssFile")
    return None if kib is None else kib / 1024


def run_steps(work, device: torch.device, warmup: int, timed: int, fits=lambda tensors: True) -> dict:
    """`warmup` untimed calls of work() with the live-tensor peak tracked over them (tensor_peak), then
    `timed` timed calls, untracked: the CPU counter is a profiler and would slow what is timed. The timed calls
    run only if `fits(tensors)` after the warm-up: a cell already past its budget is out of memory whatever
    its speed. `step_s` is None where nothing was timed."""
    with tensor_peak(device) as tensors:
        for _ in range(warmup):
            work()
    timed = timed if fits(tensors) else 0
    return {"tensors": tensors, "step_s": time_fn(work, device, warmup=0, repeats=timed) if timed else None}
