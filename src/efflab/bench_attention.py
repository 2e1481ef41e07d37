"""Stage bench_attention: one attention implementation over the configured sequence lengths.

Forward latency (warmup + repeats: median, p90), peak memory of one forward (kind named), and
max |logit difference| vs eager on the same inputs. An implementation that cannot run here is a row
with status 'unavailable' and the reason, never a crash.
"""
from __future__ import annotations

import logging

import torch

from . import cli
from .measure import environment, pick_device, set_threads, time_fn, track_memory
from .modeling import base_dtype, load_model

log = logging.getLogger("efflab")


def unavailable_reason(impl: str, device: torch.device) -> str | None:
    if impl != "flash_attention_2":
        return None
    from transformers.utils import is_flash_attn_2_available

    if device.type != "cuda":
        return "flash_attention_2 needs a CUDA GPU (flash-attn has no CPU kernels)"
    if not is_flash_attn_2_available():
        return "the flash-attn package is not installed (pip install 'efflab[gpu]')"
    return None


def run(cfg: dict, paths: dict) -> dict:
    """Benchmark one attention implementation against eager."""
    b, impl, layout = cfg["bench_attention"], paths["name"], paths["layout"]
    set_threads(cfg["runtime"])
    device = pick_device(cfg["runtime"])
    dtype = base_dtype(layout)
    reason = unavailable_reason(impl, device)
    model = None
    if reason is None:
        try:
            model = load_model(layout.base_model(), dtype, device, attn_implementation=impl)
        except (ImportError, ValueError) as err:
            reason = f"{impl} could not be loaded: {str(err).splitlines()[0]}"
    eager = model if impl == "eager" else (
        load_model(layout.base_model(), dtype, device, attn_implementation="eager") if model else None)
    vocab = model.config.vocab_size if model else None
    rows = []
    for seq_len in b["seq_lens"]:
        row = {"implementation": impl, "seq_len": seq_len, "batch_size": b["batch_size"]}
        if model is None:
            rows.append(row | {"status": "unavailable", "reason": reason})
            continue
        gen = torch.Generator().manual_seed(seq_len)
        ids = torch.randint(0, vocab, (b["batch_size"], seq_len), generator=gen).to(device)
        with torch.no_grad():
            # Timing first: its warmup absorbs one-time allocations the memory peak should not count.
            latency = time_fn(lambda: model(input_ids=ids), device, b["warmup"], b["repeats"])
            with track_memory(device) as mem:
                logits = model(input_ids=ids).logits
            reference = logits if eager is model else eager(input_ids=ids).logits
            diff = (logits.float() - reference.float()).abs().max().item()
            del logits, reference
        rows.append(row | {"status": "ok", "latency": latency, "memory": mem, "max_abs_diff_vs_eager": diff,
                           "tokens_per_s": b["batch_size"] * seq_len / latency["median"]})
        log.info("%s seq %d: median %.3f s (p90 %.3f), peak %s, |diff| %.2e", impl, seq_len,
                 latency["median"], latency["p90"], mem.get("delta_mib"), diff)
    status = "ok" if model is not None else "unavailable"
    return {"status": status, "implementation": impl, "reason": reason, "dtype": dtype, "rows": rows,
            "environment": environment(device, b)}


if __name__ == "__main__":
    cli.main("bench_attention", run)
