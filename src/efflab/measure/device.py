"""The device a job runs on: its choice, threads, synchronization, the dtype names and NVML handles."""
from __future__ import annotations

import os

import torch

from ..config import UserError

# pynvml is optional (the gpu extra): it is imported where NVML is read.


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def pick_device(runtime: dict) -> torch.device:
    want = runtime["device"]
    if want == "cuda" and not torch.cuda.is_available():
        raise UserError("runtime.device: 'cuda' was asked for but no CUDA device is available")
    if want == "auto":
        want = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(want)


def thread_count(runtime: dict) -> int:
    """The CPU threads a job computes with: runtime.threads, else $OMP_NUM_THREADS, else every core."""
    return runtime["threads"] or int(os.environ.get("OMP_NUM_THREADS", 0)) or os.cpu_count()


def set_threads(runtime: dict) -> int:
    threads = thread_count(runtime)
    torch.set_num_threads(threads)
    return threads


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def nvml_handle(device: torch.device):
    """NVML's handle of the GPU torch calls `device`, found by UUID: NVML numbers the GPUs physically, torch
    within CUDA_VISIBLE_DEVICES (which gpu_slots sets to one GPU per job)."""
    import pynvml

    pynvml.nvmlInit()
    index = device.index if device.index is not None else torch.cuda.current_device()
    uuid = str(getattr(torch.cuda.get_device_properties(index), "uuid", "") or "")
    if uuid:
        return pynvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}")
    return pynvml.nvmlDeviceGetHandleByIndex(index)
