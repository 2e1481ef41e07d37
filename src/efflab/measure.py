"""The one place efflab measures time, memory and the environment; every stage uses it.

Memory results always name their kind: `cuda_max_allocated` / `cuda_max_reserved` on GPU,
`cpu_peak_rss` (the kernel's high-water mark of resident memory, reset before the measured work)
on CPU, and beside it `cpu_tensor_peak` (the most bytes live CPU tensors held at once, from the CPU
allocator's own events: the CPU counterpart of cuda_max_allocated). A measurement that cannot be
taken is None with a reason, never 0.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import re
import statistics
import subprocess
import time
from contextlib import contextmanager
from importlib import metadata
from pathlib import Path

import torch

from . import architecture
from .config import REPO_ROOT, UserError
from .logs import log_file_path, setup_child_logging

MiB = 1024 * 1024
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# The host clock of CPU timings (time_fn, interleave). Tests replace it with a simulated clock that the timed
# work advances by known amounts, so that no test of a verdict or a threshold races the real machine.
clock = time.perf_counter


def pick_device(runtime: dict) -> torch.device:
    want = runtime["device"]
    if want == "cuda" and not torch.cuda.is_available():
        raise UserError("runtime.device: 'cuda' was asked for but no CUDA device is available")
    if want == "auto":
        want = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(want)


def set_threads(runtime: dict) -> int:
    threads = runtime["threads"] or int(os.environ.get("OMP_NUM_THREADS", 0)) or os.cpu_count()
    torch.set_num_threads(threads)
    return threads


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def percentile(ordered: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default) of an already sorted list."""
    pos = (len(ordered) - 1) * q
    lo, hi = int(pos), min(int(pos) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def summarize(samples: list[float], unit: str = "s", keep_samples: bool = True) -> dict:
    """Median and spread of a list of measurements in `unit`: n, mean, std, p50/p90/p99, min, max and the
    distribution-free interval of the median from order statistics with its coverage (at least 95%), None when
    n is too small to give one (fewer than 6): then only the range [min, max] of the n values is known."""
    ordered = sorted(samples)
    n = len(ordered)
    stats = {
        "n": n,
        "unit": unit,
        "median": percentile(ordered, 0.5),
        "p50": percentile(ordered, 0.5),
        "p90": percentile(ordered, 0.9),
        "p99": percentile(ordered, 0.99),
        "mean": statistics.fmean(ordered),
        "std": statistics.stdev(ordered) if n > 1 else 0.0,
        "min": ordered[0],
        "max": ordered[-1],
    }
    interval = median_ci_order(ordered)
    stats["ci95_median"], stats["ci_median_coverage"] = interval if interval else (None, None)
    if keep_samples:
        stats["samples"] = list(samples)
    return stats


def time_fn(fn, device: torch.device, warmup: int, repeats: int) -> dict:
    """Run fn `warmup` times untimed, then `repeats` timed times; CUDA events on GPU."""
    for _ in range(warmup):
        fn()
    synchronize(device)
    samples = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize(device)
            samples.append(start.elapsed_time(end) / 1000.0)
        else:
            t0 = clock()
            fn()
            samples.append(clock() - t0)
    return summarize(samples) | {"warmup": warmup, "clock": "cuda_events" if device.type == "cuda" else "perf_counter"}


# --- interleaved comparisons with a speed sentinel -------------------------------------------------

# How far a speed probe may stray from the median probe before its round is set aside. Probes on a quiet
# shared 2-core VM spread about ±15%; a core taken by another process halves them.
SENTINEL_TOLERANCE = 0.25


def speed_probe(device: torch.device) -> float:
    """The machine's speed right now: the best of three short fixed fp32 matmuls, in GFLOP/s (about 30 ms on
    two CPU cores). Another process taking a core, a clock change or thermal throttling shows as a drop.
    Sized so that on a quiet 2-core machine 30 probes in a row stay within ±10% of their median (384 or
    512 were too short for that: 72-153 GFLOP/s around 125)."""
    size = 4096 if device.type == "cuda" else 768
    a = torch.randn(size, size, device=device)
    best = min(time_fn(lambda: torch.mm(a, a), device, warmup=1, repeats=3)["samples"])
    return 2 * size**3 / best / 1e9


def interleave(variants: dict, rounds: int, device: torch.device, warmup: int = 1,
               tolerance: float = SENTINEL_TOLERANCE, extra_rounds: int | None = None) -> dict:
    """Time each variant's `fn(round)` once per round, the variants interleaved (A B, then B A, ...) so that a
    drift of the machine's speed hits every variant alike, with a speed probe before and after each round.

    A round whose probes fall outside ±tolerance of the median probe is set aside, and another round is run
    in its place (at most `extra_rounds` more, default `rounds`); if fewer than `rounds` stable rounds are
    left, the result is `unstable`, with the probes that say so, and must not be read as a verdict (its
    figures are then of every round). The probes run outside the timed calls; `sentinel_s` is what they
    cost. Returns the per-round record and, per variant, the summary of its stable rounds."""
    names = list(variants)
    for r in range(warmup):
        for name in names:
            variants[name](r)
    synchronize(device)
    extra = rounds if extra_rounds is None else extra_rounds
    log, sentinel_s, probe_before = [], 0.0, None
    while True:
        t0 = clock()
        probe_before = probe_before or speed_probe(device)
        order = names if len(log) % 2 == 0 else names[::-1]
        times = {}
        sentinel_s += clock() - t0
        for name in order:
            times[name] = time_fn(lambda: variants[name](warmup + len(log)), device, 0, 1)["samples"][0]
        t0 = clock()
        probe_after = speed_probe(device)
        sentinel_s += clock() - t0
        log.append({"order": order, "seconds": times, "probe_gflops": [probe_before, probe_after]})
        probe_before = probe_after  # the probe after one round is the probe before the next
        stable = _mark_stable(log, tolerance)
        if stable >= rounds or len(log) >= rounds + extra:
            break
    kept = [r for r in log if r["stable"]]
    figures = kept if len(kept) >= rounds else log  # unstable: every round, flagged as such
    probes = [p for r in log for p in r["probe_gflops"]]
    out = {"rounds": log, "stable_rounds": len(kept), "set_aside": len(log) - len(kept), "warmup_rounds": warmup,
           "probe": summarize(probes, unit="GFLOP/s", keep_samples=False) | {"tolerance": tolerance},
           "sentinel_s": sentinel_s, "clock": "cuda_events" if device.type == "cuda" else "perf_counter",
           "variants": {n: summarize([r["seconds"][n] for r in figures]) for n in names}}
    if len(kept) < rounds:
        out["unstable"] = (f"the machine's speed changed: {len(log) - len(kept)} of {len(log)} rounds had a speed "
                           f"probe outside ±{tolerance:.0%} of the median {out['probe']['median']:.1f} GFLOP/s "
                           f"(range {out['probe']['min']:.1f}–{out['probe']['max']:.1f})")
    return out


def _mark_stable(log: list[dict], tolerance: float) -> int:
    median = statistics.median(p for r in log for p in r["probe_gflops"])
    for r in log:
        r["stable"] = all(abs(p / median - 1) <= tolerance for p in r["probe_gflops"])
    return sum(r["stable"] for r in log)


def median_ci_order(ordered: list[float], level: float = 0.95) -> tuple[list[float], float] | None:
    """The distribution-free confidence interval of a median from order statistics, [x(k), x(n+1-k)] with the
    largest k whose binomial coverage 1 - 2 P(Bin(n, 1/2) < k) is at least `level`, and that coverage; None
    when n is too small for any (at 95%: fewer than 6 values). A bootstrap of 3 to 5 values gives intervals
    far narrower than their real coverage: two reruns then disagreed with each other's "significant" ratios."""
    from math import comb

    n = len(ordered)
    tail, k = 0.0, 0
    while k < n // 2 and 2 * (tail + comb(n, k) / 2**n) <= 1 - level:
        tail += comb(n, k) / 2**n
        k += 1
    if k == 0:
        return None
    return [ordered[k - 1], ordered[n - k]], 1 - 2 * tail


# "No significant difference" is itself a claim: that the two sides are within this much of each other.
EQUIVALENCE_MARGIN = 0.10


def ratio_verdict(ratios: list[float], level: float = 0.95) -> dict:
    """The median of per-round ratios (b's time over a's), its order-statistic interval and a verdict at that
    level: `slower` / `faster` only when the interval lies above / below 1; `no significant difference` only
    when it lies within ±EQUIVALENCE_MARGIN of 1; `inconclusive` when it holds 1 but is wider than that (the data
    cannot tell a 10% difference from none: a rerun may find one), or when there are too few rounds for an
    interval at that level. Two reruns can then disagree only by one of them being inconclusive."""
    ordered = sorted(ratios)
    median = percentile(ordered, 0.5)
    ci = median_ci_order(ordered, level)
    if ci is None:
        return {"median": median, "ci95": None, "level": level, "rounds": len(ordered),
                "verdict": f"inconclusive: {len(ordered)} rounds cannot give a {level:.0%} interval of the median "
                           f"(6 needed at 95%)"}
    (lo, hi), coverage = ci
    m = EQUIVALENCE_MARGIN
    verdict = ("slower" if lo > 1 else "faster" if hi < 1 else "no significant difference"
               if 1 / (1 + m) <= lo and hi <= 1 + m else
               f"inconclusive: the {level:.0%} interval [{lo:.3g}, {hi:.3g}] holds 1 but also a {m:.0%} difference")
    return {"median": median, "ci95": [lo, hi], "coverage": coverage, "level": level, "rounds": len(ordered),
            "interval": "order statistics (distribution-free)", "verdict": verdict}


def said_of_faster_side(ratio: dict) -> dict:
    """A ratio of the reference's time over this side's (a speedup) with its verdict said of this side: the
    reference `slower` means this side is `faster`; other verdicts read the same."""
    return ratio | {"verdict": {"slower": "faster", "faster": "slower"}.get(ratio["verdict"], ratio["verdict"])}


def speedup(result: dict, mine: str, reference: str) -> dict:
    """The reference's time over `mine`'s from an interleave() result, with paired_ratio's interval and the
    verdict said of `mine`."""
    return said_of_faster_side(paired_ratio(result, mine, reference))


# What an interleave() result keeps beside its figures: the rounds, the sentinel's probes and cost.
INTERLEAVE_RECORD = ("rounds", "stable_rounds", "set_aside", "probe", "sentinel_s")


def format_ratio(ratio: dict | None, digits: int = 2) -> str:
    """'1.13 [1.02, 1.30]', '1.13 (no 95% interval: 3 rounds)' or '-'."""
    if not ratio or ratio.get("median") is None:
        return "-"
    if not ratio.get("ci95"):
        return f"{ratio['median']:.{digits}f} (no 95% interval: {ratio['rounds']} rounds)"
    lo, hi = ratio["ci95"]
    return f"{ratio['median']:.{digits}f} [{lo:.{digits}f}, {hi:.{digits}f}]"


def paired_ratio(result: dict, a: str, b: str, level: float = 0.95) -> dict:
    """b's time over a's from an interleave() result: the ratio within each stable round (so drift between
    rounds cancels), with ratio_verdict's interval and verdict. An unstable comparison gets no verdict."""
    kept = [r for r in result["rounds"] if r["stable"]]
    if "unstable" in result or len(kept) < 2:
        why = result.get("unstable") or f"only {len(kept)} stable round(s)"
        return {"median": None, "ci95": None, "rounds": len(kept), "verdict": f"not a verdict: {why}"}
    return ratio_verdict([r["seconds"][b] / r["seconds"][a] for r in kept], level)


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
    import ctypes
    import ctypes.util
    import gc

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
    profiler costs one small event per allocation (a 12-step LoRA run: 375k events, step time within noise).
    It sees the tensors of this thread and of the threads it hands work to (the autograd engine's), not
    Python objects, not allocator overhead. Frees of tensors allocated before the block are not reported
    (the allocator learns a block's size only while the profiler runs), so it counts the tensors allocated
    inside the block. `flush()` folds the events recorded so far into the running count and restarts, so a
    long run does not hold millions of events; its time is in `overhead_s`."""

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
        self.current = self.peak = self.events = 0
        self.overhead_s = 0.0
        self._profiler = None
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

    def _fold(self) -> None:
        torch.autograd._enable_record_function(True)
        self._profiler.stop()
        events = [e for e in self._profiler.profiler.kineto_results.events() if e.name() == "[memory]"
                  and e.device_type() == torch.autograd.DeviceType.CPU]
        events.sort(key=lambda e: e.start_ns())  # stable: same-time events keep their recorded order
        for e in events:
            self.current += e.nbytes()
            self.peak = max(self.peak, self.current)
        self.events += len(events)
        self._profiler = None

    def flush(self) -> None:
        if self._profiler is not None:
            t0 = time.perf_counter()
            self._fold()
            self.start()
            self.overhead_s += time.perf_counter() - t0

    def stop(self) -> dict:
        if self._profiler is not None:
            self._fold()
        if self.unavailable:
            return {"kind": self.KIND, "delta_mib": None, "unavailable": self.unavailable}
        return {"kind": self.KIND, "delta_mib": self.peak / MiB, "end_delta_mib": self.current / MiB,
                "allocator_events": self.events, "flush_s": self.overhead_s}


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
    `cpu_tensor_peak` of the block (pass a CpuTensorPeak to flush it from inside, e.g. every N steps).
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
    kind of memory memory_estimate predicts: `cpu_tensor_peak` on CPU, `cuda_max_allocated` on GPU. Unlike
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


def _nvml_handle(device: torch.device):
    """NVML's handle of the GPU torch calls `device`, found by UUID: NVML numbers the GPUs physically, torch
    within CUDA_VISIBLE_DEVICES (which gpu_slots sets to one GPU per job)."""
    import pynvml

    pynvml.nvmlInit()
    index = device.index if device.index is not None else torch.cuda.current_device()
    uuid = str(getattr(torch.cuda.get_device_properties(index), "uuid", "") or "")
    if uuid:
        return pynvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}")
    return pynvml.nvmlDeviceGetHandleByIndex(index)


def nvml_process_mib(device: torch.device) -> tuple[float | None, str | None]:
    """GPU memory NVML attributes to this process (what nvidia-smi shows: allocator reserve, CUDA
    context, kernels), at the time of the call; None and a reason where NVML cannot say."""
    try:
        import pynvml
    except ImportError:
        return None, "pynvml (nvidia-ml-py) is not installed"
    try:
        handle = _nvml_handle(device)
        for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
            if proc.pid == os.getpid() and proc.usedGpuMemory is not None:
                return proc.usedGpuMemory / MiB, None
        return None, "NVML lists no memory for this process (containers often hide PIDs)"
    except Exception as err:  # NVML errors are not user errors: record, don't crash
        return None, f"NVML failed: {err}"


# --- energy: counters read before and after the measured work -------------------------------------

POWERCAP_ENV = "EFFLAB_POWERCAP_ROOT"  # tests point it at a fake /sys/class/powercap tree
RAPL_PACKAGE = re.compile(r"^intel-rapl:\d+$")  # top-level zones: one per CPU package (AMD's too, same driver)


def _rapl_packages() -> tuple[list[Path], str | None]:
    root = Path(os.environ.get(POWERCAP_ENV) or "/sys/class/powercap")
    if not root.is_dir():
        return [], f"no {root} (the kernel exposes no RAPL powercap interface here, as in most VMs)"
    zones = sorted(z for z in root.iterdir() if RAPL_PACKAGE.match(z.name) and (z / "energy_uj").exists())
    if not zones:
        return [], f"{root} has no intel-rapl package zone"
    return zones, None


def _read_uj(zone: Path) -> int:
    return int((zone / "energy_uj").read_text())


class EnergyMeter:
    """Joules used while a block runs, from hardware energy counters read at its start and end only (nothing
    runs in between): on a CUDA device NVML's total-energy counter of the GPU board (millijoules, Volta and
    newer); on CPU the RAPL package counters (microjoules, through powercap: the whole socket, every process on
    it, not this job alone); otherwise `unavailable` with the reason. `stop()` gives joules, seconds, mean watts
    and what was measured."""

    def __init__(self, device: torch.device):
        self.device, self.reason, self.start_counts = device, None, None

    def start(self) -> "EnergyMeter":
        self.t0 = time.perf_counter()
        try:
            self.start_counts = self._counts()
        except Exception as err:  # a counter that cannot be read is a recorded fact, not a crash
            self.reason = self.reason or f"{type(err).__name__}: {err}"
        return self

    def _counts(self) -> dict:
        if self.device.type == "cuda":
            try:
                import pynvml
            except ImportError:
                self.reason = "pynvml (nvidia-ml-py, the [gpu] extra) is not installed"
                raise
            synchronize(self.device)
            return {"gpu": pynvml.nvmlDeviceGetTotalEnergyConsumption(_nvml_handle(self.device)) / 1e3}
        zones, reason = _rapl_packages()
        if reason:
            self.reason = reason
            raise FileNotFoundError(reason)
        self.zones = zones
        return {z.name: _read_uj(z) / 1e6 for z in zones}

    def stop(self) -> dict:
        seconds = time.perf_counter() - self.t0
        if self.start_counts is None:
            return {"unavailable": self.reason or "no energy counter"}
        try:
            end = self._counts()
        except Exception as err:
            return {"unavailable": self.reason or f"{type(err).__name__}: {err}"}
        joules = 0.0
        for key, before in self.start_counts.items():
            delta = end[key] - before
            if delta < 0 and self.device.type != "cuda":  # the counter wrapped (once) at max_energy_range_uj
                delta += int((self.zones[[z.name for z in self.zones].index(key)] / "max_energy_range_uj")
                             .read_text()) / 1e6
            joules += delta
        source = ("NVML total energy of the GPU board" if self.device.type == "cuda" else
                  f"RAPL package energy ({', '.join(self.start_counts)}): the whole CPU socket, all its processes")
        return {"joules": joules, "seconds": seconds, "watts": joules / seconds if seconds else None,
                "source": source}


def energy_of(work, device: torch.device, min_seconds: float = 2.0) -> tuple[dict, int]:
    """Energy of repeating `work() -> tokens` until `min_seconds` have passed (counters tick every few
    milliseconds; a longer window averages that out): the meter's result and the tokens made. Nothing runs
    when no counter can be read."""
    meter = EnergyMeter(device).start()
    if meter.start_counts is None:
        return {"unavailable": meter.reason}, 0
    tokens, t0 = 0, time.perf_counter()
    while not tokens or time.perf_counter() - t0 < min_seconds:
        tokens += work()
    return meter.stop(), tokens


def energy_per_token(energy: dict, tokens: float) -> dict:
    """Joules per token from an EnergyMeter result, or its unavailable reason."""
    if "joules" not in energy or not tokens:
        return {"unavailable": energy.get("unavailable", "no tokens")}
    return {"joules_per_token": energy["joules"] / tokens, "tokens": tokens} | energy


# --- isolation: one benchmark cell per process -------------------------------------------------

def classify_failure(err: BaseException) -> dict:
    import traceback

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
    try:
        result = {"status": "ok"} | fn(**kwargs)
    except BaseException as err:  # the whole point: any failure becomes a recorded result
        result = classify_failure(err)
    conn.send(result)
    conn.close()


_CELL_PRELOAD = ["torch", "transformers", "efflab.measure", "efflab.modeling"]


def _cell_context():
    """Cells fork from a forkserver that has imported torch and transformers once but run no work: each
    cell starts in a clean process (nothing allocated, no threads) without paying the imports again."""
    import multiprocessing

    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(_CELL_PRELOAD)
    return ctx


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


def run_cell(fn, kwargs: dict, isolation: str = "subprocess", timeout_s: float | None = None,
             memory_cap_mib: float | None = None) -> dict:
    """Run one benchmark cell `fn(**kwargs) -> dict` and return its result with a `status`.

    With isolation 'subprocess' the cell runs in a fresh process (forked from a clean forkserver): its memory peak cannot
    be polluted by earlier work, and a crash, an out-of-memory (an allocation failure, the resident
    set passing `memory_cap_mib`, or a SIGKILL from the kernel's OOM killer) or passing `timeout_s`
    becomes a recorded result ('failed', 'oom', 'timeout' with the reason) and the grid goes on.
    With 'inprocess' the cell runs here; exceptions are still recorded, but not crashes or caps.
    """
    import multiprocessing
    import signal

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
    result, peak_rss = None, 0.0
    try:
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


# --- parameters, FLOPs and the compute ceiling ---------------------------------------------------

def count_parameters(model) -> dict:
    """Trainable and total parameters, counted as the full-precision model would have them: a packed
    bitsandbytes 4-bit weight stores two parameters per byte, so its element count is not its size."""
    total = trainable = 0
    for p in model.parameters():
        state = getattr(p, "quant_state", None)
        n = int(torch.Size(state.shape).numel()) if p.__class__.__name__ == "Params4bit" and state is not None \
            else p.numel()
        total += n
        if p.requires_grad:
            trainable += n
    return {"trainable": trainable, "total": total, "trainable_pct": 100.0 * trainable / total}


def matmul_params(model) -> dict:
    """Weights that take part in a token's matrix multiplies (every nn.Linear and Conv1D, bnb layers and the LM
    head included, at their full shape; of a mixture of experts' stacked expert weights, the experts_per_token
    experts a token is routed to), and how many of them train."""
    total = trainable = 0
    for module in model.modules():
        features = architecture.matmul_shape(module)
        if features:
            n = features[0] * features[1]
            total += n
            if module.weight.requires_grad:
                trainable += n
    routed = architecture.shape(model.config)["experts_per_token"]
    for weight in architecture.expert_weights(model):
        n = weight[0].numel() * routed
        total += n
        trainable += n if weight.requires_grad else 0
    return {"total": total, "trainable": trainable}


def training_flops_per_token(model, seq_len: float, gradient_checkpointing: bool = False) -> dict:
    """Model FLOPs per trained token (PaLM appendix B): forward 2N + 4·L·d_attn·T, backward 2N + 8·L·d_attn·T
    for the activation gradients plus 2·N_trainable for the weight gradients; full fine-tuning gives the
    familiar 6N + 12·L·d_attn·T. Checkpointing recomputes the forward once more (counted as hardware FLOPs)."""
    a = architecture.shape(model.config)
    mm = matmul_params(model)
    attn_fwd = 4 * a["layers"] * a["heads"] * a["head_dim"] * seq_len
    forward = 2 * mm["total"] + attn_fwd
    model_flops = forward + (2 * mm["total"] + 2 * attn_fwd) + 2 * mm["trainable"]
    return {"model_flops_per_token": model_flops,
            "hardware_flops_per_token": model_flops + (forward if gradient_checkpointing else 0),
            "matmul_params": mm["total"], "matmul_params_trainable": mm["trainable"], "seq_len": seq_len,
            "formula": "2N + 4*L*d*T forward, 2N + 8*L*d*T activation grads, 2*N_trainable weight grads"}


# Dense (no sparsity) tensor-core peaks from NVIDIA's datasheets, TFLOP/s; matched by device name.
PUBLISHED_PEAK_TFLOPS = {
    "H200": {"bfloat16": 989.4, "float16": 989.4, "float32": 66.9},
    "H100 PCIe": {"bfloat16": 756.5, "float16": 756.5, "float32": 51.2},
    "H100": {"bfloat16": 989.4, "float16": 989.4, "float32": 66.9},
    "A100": {"bfloat16": 312.0, "float16": 312.0, "float32": 19.5},
    "L40S": {"bfloat16": 362.1, "float16": 362.1, "float32": 91.6},
    "L4": {"bfloat16": 121.0, "float16": 121.0, "float32": 30.3},
    "V100": {"float16": 125.0, "float32": 15.7},
    "T4": {"float16": 65.0, "float32": 8.1},
}


def published_peak_tflops(device: torch.device, dtype: str) -> dict:
    if device.type != "cuda":
        return {"tflops": None, "reason": "no published peak for a CPU; the measured matmul ceiling is used"}
    name = torch.cuda.get_device_name(device)
    for key, peaks in PUBLISHED_PEAK_TFLOPS.items():  # most specific names first
        if key in name:
            if dtype in peaks:
                return {"tflops": peaks[dtype], "gpu": key, "source": "NVIDIA datasheet, dense"}
            return {"tflops": None, "reason": f"{key} has no published {dtype} tensor peak"}
    return {"tflops": None, "reason": f"no published peak known for {name!r}"}


def matmul_ceiling(dtype: str, device: torch.device, size: int | None = None) -> dict:
    """The best matmul throughput this machine reaches in `dtype` (the MFU denominator), measured once per
    process, dtype, device and thread count: a stage runs one job per process, and a test or notebook that
    runs several in one process need not pay 1-2 s of matmuls for each."""
    # On a CPU a 1024 matmul already runs at the full rate of a few cores (1-2 threads here: 67 and 104
    # GFLOP/s at 1024 against 62 and 112 at 2048) in a seventh of the time; many cores need a larger one.
    size = size or (8192 if device.type == "cuda" else 1024 if torch.get_num_threads() <= 8 else 2048)
    return dict(_matmul_ceiling(dtype, str(device), size, torch.get_num_threads()))


@functools.lru_cache(maxsize=None)
def _matmul_ceiling(dtype: str, device: str, size: int, threads: int) -> dict:
    """`dtype` float32 is IEEE fp32 (TF32 off), `tf32` fp32 tensors on TF32 tensor cores (CUDA only)."""
    device = torch.device(device)
    a = torch.randn(size, size, device=device).to(DTYPES.get(dtype, torch.float32))
    b = torch.randn(size, size, device=device).to(DTYPES.get(dtype, torch.float32))
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = dtype == "tf32"
    try:
        stats = time_fn(lambda: torch.mm(a, b), device, warmup=2, repeats=10)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    # A ceiling is the best rate reached: other work on the machine (a parallel job) only ever slows a repeat
    # down, so the fastest repeat, not the median, is the machine's rate.
    return {"tflops": 2 * size**3 / stats["min"] / 1e12, "dtype": dtype, "size": size, "best_s": stats["min"],
            "median_s": stats["median"], "median_tflops": 2 * size**3 / stats["median"] / 1e12,
            "threads": torch.get_num_threads()}


GPU_MATMUL_DTYPES = ("float32", "tf32", "bfloat16", "float16")


def gpu_matmul_rates(device: torch.device) -> dict:
    """The matmul ceiling of each tensor-core precision against IEEE fp32, on a CUDA GPU: what the seeds'
    "tensor cores give 2-4x" and "fp16 is 2x TF32" claims are about."""
    return {dtype: matmul_ceiling(dtype, device) for dtype in GPU_MATMUL_DTYPES}


def cuda_context_mib(device: torch.device) -> dict:
    """GPU memory this process holds outside PyTorch's caching allocator: the CUDA context, kernel images and
    library workspaces (NVML's figure for the process minus torch.cuda.memory_reserved)."""
    process, reason = nvml_process_mib(device)
    if process is None:
        return {"mib": None, "unavailable": reason}
    reserved = torch.cuda.memory_reserved(device) / MiB
    return {"mib": process - reserved, "nvml_process_mib": process, "torch_reserved_mib": reserved}


def mfu(tokens_per_s: float, flops_per_token: float, ceiling_tflops: float | None) -> float | None:
    if not ceiling_tflops:
        return None
    return tokens_per_s * flops_per_token / (ceiling_tflops * 1e12)


def package_versions() -> dict:
    out = {}
    for pkg in ("torch", "transformers", "peft", "bitsandbytes", "accelerate", "flash-attn", "datasets"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = None
    return out


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# The instruction sets that decide which CPU kernels torch runs: bf16 matmul is ~4x faster than fp32 with
# AVX512-BF16 or AMX, and ~7x slower with AVX2 only (README, "CPU kinds").
CPU_ISA = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni", "amx_tile", "amx_bf16")
FAST_BF16_ISA = {"avx512_bf16", "amx_bf16"}


def cpu_isa() -> list[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                return [f for f in CPU_ISA if f in flags]
    except OSError:
        pass
    return []


def _git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(REPO_ROOT), "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True, timeout=10)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def _gpu_driver() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
    except (OSError, subprocess.SubprocessError):
        return None


# What makes two results comparable: the machine and the software stack, not the commit or the params
# (those differ between stages by design and are recorded for provenance).
FINGERPRINT_KEYS = ("device", "cpu", "cpu_isa", "cpu_cores", "gpu", "gpu_memory_mib", "gpu_driver", "cuda", "packages")


def fingerprint(env: dict) -> str:
    """A short hash of the environment fields that make results comparable."""
    blob = json.dumps({k: env.get(k) for k in FINGERPRINT_KEYS}, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:12]


def environment(device: torch.device, params_section: dict | None = None) -> dict:
    """Where a number was measured: hardware, library versions, commit, params hash and the fingerprint
    of the comparable part (see FINGERPRINT_KEYS)."""
    env = {
        "device": device.type,
        "cpu": cpu_model(),
        "cpu_isa": cpu_isa(),
        "cpu_cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "packages": package_versions(),
        "git_commit": _git_commit(),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env |= {"gpu": props.name, "gpu_memory_mib": props.total_memory / MiB, "cuda": torch.version.cuda,
                "gpu_driver": _gpu_driver()}
    if params_section is not None:
        blob = json.dumps(params_section, sort_keys=True).encode()
        env["params_sha256"] = hashlib.sha256(blob).hexdigest()[:16]
    env["fingerprint"] = fingerprint(env)
    return env


def linear_gflops(dtype: torch.dtype, device: torch.device, size: int = 1024, repeats: int = 5) -> float:
    """Measured throughput of a square nn.Linear matmul (the op that dominates a transformer)."""
    x = torch.randn(size, size, device=device).to(dtype)
    w = torch.randn(size, size, device=device).to(dtype)
    stats = time_fn(lambda: torch.nn.functional.linear(x, w), device, warmup=1, repeats=repeats)
    return 2 * size**3 / stats["median"] / 1e9


def resolve_dtype(requested: str, device: torch.device) -> tuple[str, dict]:
    """The compute dtype for 'auto', and the evidence for the choice."""
    if requested != "auto":
        return requested, {"requested": requested}
    if device.type == "cuda":
        chosen = "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
        return chosen, {"requested": "auto", "reason": f"CUDA device, {chosen} supported"}
    probe = {name: linear_gflops(dt, device) for name, dt in (("float32", torch.float32),
                                                                ("bfloat16", torch.bfloat16))}
    chosen = max(probe, key=probe.get)
    return chosen, {"requested": "auto", "linear_gflops": probe,
                    "reason": f"{chosen} is the faster linear layer on this CPU "
                              f"(bf16 {probe['bfloat16']:.1f} vs fp32 {probe['float32']:.1f} GFLOP/s)"}
