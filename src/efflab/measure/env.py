"""Where a number was measured: hardware, library versions, commit and the fingerprint of the comparable part."""
from __future__ import annotations

import hashlib
import json
import os
import platform
import subprocess
from importlib import metadata
from pathlib import Path

import torch

from ..config import REPO_ROOT
from .memory import MiB


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


def cpu_kind(isa) -> str:
    """Which of the CPU kinds efflab plans for a recorded `cpu_isa` is (README, "CPU kinds")."""
    isa = set(isa or ())
    if "avx512_bf16" in isa:
        return f"AVX512-BF16 {'with' if 'amx_bf16' in isa else 'without'} AMX"
    return "AVX512 without BF16" if "avx512f" in isa else "AVX2 only" if "avx2" in isa else "no AVX2"


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
