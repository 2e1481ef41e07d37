"""Parameters, FLOPs and measured matmul throughput: the compute ceiling (the MFU denominator) and the probe
that picks the dtype of 'auto'."""
from __future__ import annotations

import functools
import re

import torch

from .. import architecture
from .device import DTYPES
from .timing import time_fn


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
        if re.search(rf"\b{re.escape(key)}\b", name):  # a whole word: "NVIDIA L40" is no L4
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
    """`dtype` float32 is IEEE fp32 (TF32 off), `tf32` fp32 tensors on TF32 tensor cores (CUDA only).

    Timed as nn.Linear computes (F.linear: x @ W.T), the layout of every matmul the models run: on a CPU without
    native bf16 (AVX2 only), torch.mm of two row-major bf16 matrices takes a slow path, 1.0 GFLOP/s against
    F.linear's 19.1 on a 2-core AMD EPYC, which would put a bf16 run's MFU far above its real share."""
    device = torch.device(device)
    a = torch.randn(size, size, device=device).to(DTYPES.get(dtype, torch.float32))
    b = torch.randn(size, size, device=device).to(DTYPES.get(dtype, torch.float32))
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = dtype == "tf32"
    try:
        stats = time_fn(lambda: torch.nn.functional.linear(a, b), device, warmup=2, repeats=10)
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


def mfu(tokens_per_s: float, flops_per_token: float, ceiling_tflops: float | None) -> float | None:
    if not ceiling_tflops:
        return None
    return tokens_per_s * flops_per_token / (ceiling_tflops * 1e12)


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
