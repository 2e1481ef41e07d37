"""The one place efflab measures time, memory and the environment; every stage uses it.

Memory results always name their kind: `cuda_max_allocated` / `cuda_max_reserved` on GPU,
`cpu_peak_rss` (the kernel's high-water mark of resident memory, reset before the measured work)
on CPU. A measurement that cannot be taken is None with a reason, never 0.
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import statistics
import subprocess
import time
from contextlib import contextmanager
from importlib import metadata
from pathlib import Path

import torch

MiB = 1024 * 1024


def pick_device(runtime: dict) -> torch.device:
    from .config import UserError

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


def summarize(samples: list[float], unit: str = "s") -> dict:
    """Median and spread of a list of measurements in `unit`."""
    ordered = sorted(samples)
    n = len(ordered)

    def pct(q: float) -> float:  # linear interpolation, like numpy's default
        pos = (n - 1) * q
        lo, hi = int(pos), min(int(pos) + 1, n - 1)
        return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)

    return {
        "n": n,
        "unit": unit,
        "median": pct(0.5),
        "p90": pct(0.9),
        "mean": statistics.fmean(ordered),
        "std": statistics.stdev(ordered) if n > 1 else 0.0,
        "min": ordered[0],
        "max": ordered[-1],
        "samples": samples,
    }


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
            t0 = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t0)
    return summarize(samples) | {"warmup": warmup, "clock": "cuda_events" if device.type == "cuda" else "perf_counter"}


def _proc_status_kib(field: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
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


@contextmanager
def track_memory(device: torch.device):
    """Peak memory of the work inside the block, with the kind of memory named.

    On CPU the peak RSS is the process high-water mark after resetting it at entry, so earlier work
    in the process does not count; `cpu_peak_rss_delta_mib` is that peak over the RSS at entry.
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
        return
    _release_freed_memory()
    reset = _reset_cpu_peak()
    base = _proc_status_kib("VmRSS")
    yield result
    peak = _proc_status_kib("VmHWM")
    result["kind"] = "cpu_peak_rss"
    if not reset or peak is None or base is None:
        result["peak_mib"] = None
        result["delta_mib"] = None
        result["unavailable"] = "cannot reset or read the RSS high-water mark (/proc/self/clear_refs, VmHWM)"
        return
    result["peak_mib"] = peak / 1024
    result["delta_mib"] = (peak - base) / 1024


def package_versions() -> dict:
    out = {}
    for pkg in ("torch", "transformers", "peft", "bitsandbytes", "accelerate", "flash-attn", "datasets"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = None
    return out


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _git_commit() -> str | None:
    from .config import REPO_ROOT

    try:
        out = subprocess.run(["git", "-C", str(REPO_ROOT), "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True, timeout=10)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def environment(device: torch.device, params_section: dict | None = None) -> dict:
    """Where a number was measured: hardware, library versions, commit, params hash."""
    env = {
        "device": device.type,
        "cpu": _cpu_model(),
        "cpu_cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "packages": package_versions(),
        "git_commit": _git_commit(),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env |= {"gpu": props.name, "gpu_memory_mib": props.total_memory / MiB, "cuda": torch.version.cuda}
    if params_section is not None:
        blob = json.dumps(params_section, sort_keys=True).encode()
        env["params_sha256"] = hashlib.sha256(blob).hexdigest()[:16]
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
