"""One GPU per job on a multi-GPU workstation: each GPU stage claims a free GPU slot before CUDA starts.

Snakemake's `gpu` resource (`--resources gpu=N`, see workflow/profiles/default) caps how many GPU jobs
run at once, but it does not say *which* GPU a job gets. The stage CLI therefore takes an exclusive
lock on one slot file per GPU (`<lock dir>/gpu<id>.<k>`, k < EFFLAB_JOBS_PER_GPU, default 1) and sets
CUDA_VISIBLE_DEVICES to that GPU before anything touches torch.cuda (the CUDA driver reads the variable
once, when it initialises). The lock lives as long as the process, so a crashed job frees its GPU.

What is honoured rather than overridden:
- a job under SLURM (SLURM_JOB_ID set): SLURM's gres binding already gave it its own GPUs;
- an existing CUDA_VISIBLE_DEVICES: its devices are the pool the slots are drawn from;
- runtime.device: cpu, and stages that do not use a GPU: no claim at all.
"""
from __future__ import annotations

import fcntl
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from .registry import STAGES

log = logging.getLogger("efflab")

NVIDIA_PROC = Path("/proc/driver/nvidia/gpus")


@dataclass
class Slot:
    device: str
    path: Path
    fd: int

    def release(self) -> None:
        os.close(self.fd)


_held: list[Slot] = []  # claimed slots stay locked until the process exits


def driver_gpu_count() -> int:
    """GPUs the NVIDIA driver exposes, read without initialising CUDA in this process."""
    try:
        return len(list(NVIDIA_PROC.iterdir()))
    except OSError:
        pass
    if not shutil.which("nvidia-smi"):  # some containers hide /proc/driver/nvidia but ship nvidia-smi
        return 0
    try:
        listing = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(line.startswith("GPU ") for line in listing.splitlines())


def visible_gpus(environ: dict, gpu_count: int) -> list[str]:
    """The pool of devices this job may use: CUDA_VISIBLE_DEVICES where set, else every GPU."""
    if "CUDA_VISIBLE_DEVICES" in environ:
        return [d.strip() for d in environ["CUDA_VISIBLE_DEVICES"].split(",") if d.strip()]
    return [str(i) for i in range(gpu_count)]


def claim(devices: list[str], lock_dir: Path, jobs_per_gpu: int = 1, timeout_s: float = 86400,
          poll_s: float = 0.5) -> Slot:
    """Lock the first free slot of `devices`, waiting up to timeout_s for one to come free."""
    if not lock_dir.is_dir():
        lock_dir.mkdir(parents=True, exist_ok=True)
        lock_dir.chmod(0o1777)  # shared by every user's jobs on the machine, like /tmp
    deadline = time.monotonic() + timeout_s
    waiting_logged = False
    while True:
        for device in devices:
            for k in range(jobs_per_gpu):
                path = lock_dir / f"gpu{device}.{k}"
                fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    os.close(fd)
                    continue
                os.ftruncate(fd, 0)
                os.write(fd, f"{os.getpid()}\n".encode())
                return Slot(device, path, fd)
        if time.monotonic() > deadline:
            raise TimeoutError(f"no free GPU slot among {devices} in {lock_dir} after {timeout_s:.0f} s")
        if not waiting_logged:
            log.info("all GPU slots %s busy (%s); waiting", devices, lock_dir)
            waiting_logged = True
        time.sleep(poll_s)


def assign(stage: str, runtime: dict, environ: dict | None = None, gpu_count: int | None = None) -> Slot | None:
    """Give this process its own GPU: set CUDA_VISIBLE_DEVICES in `environ` to a claimed device."""
    environ = os.environ if environ is None else environ
    if not STAGES[stage].gpu or runtime["device"] == "cpu" or "SLURM_JOB_ID" in environ:
        return None
    devices = visible_gpus(environ, driver_gpu_count() if gpu_count is None else gpu_count)
    if not devices:
        return None
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        raise RuntimeError("gpu_slots.assign must run before CUDA is initialised")
    lock_dir = Path(environ.get("EFFLAB_GPU_LOCK_DIR") or Path(tempfile.gettempdir()) / "efflab-gpu-slots")
    slot = claim(devices, lock_dir, int(environ.get("EFFLAB_JOBS_PER_GPU", 1)))
    environ["CUDA_VISIBLE_DEVICES"] = slot.device
    _held.append(slot)
    log.info("%s: GPU %s (slot %s)", stage, slot.device, slot.path)
    return slot
