"""Measured memory bandwidth, the decode ceiling: a generated token must read every weight (and its KV cache) once,
so bytes per token over the bytes a second the machine moves bounds decode speed, as the matmul ceiling bounds
compute (measure.flops). Probed like the matmul ceiling: a STREAM-style copy, once per process, device and threads.
Then where a decode figure stands between the two limits (`roofline`)."""
from __future__ import annotations

import functools

import torch

from . import timing

# A cell whose decode reaches less than this fraction of both the bandwidth and the matmul ceilings spends its time
# neither reading weights nor multiplying them: in the framework (Python, kernel launches, synchronisations).
FRAMEWORK_BOUND = 0.10


def bandwidth_ceiling(device: torch.device, nbytes: int | None = None) -> dict:
    """The best copy rate this machine reaches (STREAM's copy: bytes read plus bytes written, per second), over a
    buffer far larger than the caches (256 MiB on a CPU, 1 GiB on a GPU), measured once per process."""
    nbytes = nbytes or (2**30 if device.type == "cuda" else 2**28)
    return dict(_bandwidth(str(device), nbytes, torch.get_num_threads()))


@functools.lru_cache(maxsize=None)
def _bandwidth(device: str, nbytes: int, threads: int) -> dict:
    device = torch.device(device)
    source = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    target = torch.empty_like(source)
    stats = timing.time_fn(lambda: target.copy_(source), device, warmup=2, repeats=10)
    moved = 2 * nbytes  # STREAM counts the read and the write
    # As for the matmul ceiling, the fastest repeat is the machine's rate: other work only ever slows one down.
    return {"gb_per_s": moved / stats["min"] / 1e9, "median_gb_per_s": moved / stats["median"] / 1e9,
            "bytes_copied": nbytes, "best_s": stats["min"], "median_s": stats["median"], "threads": threads,
            "counts": "bytes read + bytes written (STREAM copy)"}


def decode_roofline(shape: dict, weight_bytes: int, element_bytes: int, matmul_params: int, prompt_len: int,
                    new_tokens: int, batch: int, kv_cache: bool) -> dict:
    """Bytes and FLOPs one generated token costs in a decode step (greedy, batch `batch`), averaged over the steps:
    every weight read once per step for the whole batch (`weight_bytes`: the footprint less an input embedding
    that is not also the output head, of which a step reads one row), plus each sequence's KV cache so far (with a
    cache), and 2 FLOPs per matmul weight per token processed (without a cache every step runs the whole sequence
    again)."""
    mean_context = prompt_len + (new_tokens - 2) / 2  # positions read by decode steps 1 .. new_tokens - 1
    kv_per_position = shape["layers"] * 2 * shape["kv_heads"] * shape["head_dim"] * element_bytes
    kv_bytes = kv_per_position * mean_context if kv_cache else 0
    tokens_processed = 1 if kv_cache else mean_context + 1
    attention = 4 * shape["layers"] * shape["heads"] * shape["head_dim"] * mean_context * tokens_processed
    return {"bytes_per_token": weight_bytes / batch + kv_bytes,
            "flops_per_token": 2 * matmul_params * tokens_processed + attention,
            "mean_context": mean_context, "weights_bytes": weight_bytes, "kv_cache_bytes_per_token": kv_bytes}


def speculative_costs(costs: dict, counts: dict) -> dict:
    """A decode step's costs where the model verifies candidates (speculative decoding, prompt lookup, batch 1): a
    pass of the model reads its weights and its cache once for all the tokens it gives (accepted + 1), and processes
    every candidate it was shown (proposed + 1), so per new token the bytes shrink and the FLOPs grow by those
    counts. A draft model's own reads are not counted: they could only lower the fraction of a ceiling."""
    steps, proposed, accepted = counts["steps"], counts["proposed"], counts["accepted"]
    given, shown = (steps + accepted) / steps, (steps + proposed) / (steps + accepted)
    return costs | {"bytes_per_token": costs["bytes_per_token"] / given, "flops_per_token": costs["flops_per_token"]
                    * shown, "tokens_per_pass": given, "counted": "the model's own passes, not a draft's"}


def roofline(tokens_per_s: float, costs: dict, bandwidth: dict, ceiling: dict) -> dict:
    """The fractions of the bandwidth and matmul ceilings a decode rate reaches, and what bounds it."""
    bandwidth_fraction = tokens_per_s * costs["bytes_per_token"] / (bandwidth["gb_per_s"] * 1e9)
    compute_fraction = tokens_per_s * costs["flops_per_token"] / (ceiling["tflops"] * 1e12)
    if max(bandwidth_fraction, compute_fraction) < FRAMEWORK_BOUND:
        bound = "framework-bound"
    else:
        bound = "memory-bound" if bandwidth_fraction >= compute_fraction else "compute-bound"
    return costs | {"bandwidth_fraction": bandwidth_fraction, "compute_fraction": compute_fraction, "bound": bound,
                    "framework_bound_below": FRAMEWORK_BOUND, "bandwidth_gb_per_s": bandwidth["gb_per_s"],
                    "matmul_tflops": ceiling["tflops"]}
