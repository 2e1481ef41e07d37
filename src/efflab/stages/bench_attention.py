"""Stage bench_attention: one attention implementation over sequence lengths × batch sizes × modes.

Each cell (seq_len, batch, mode) runs the model's decoder stack (no LM head, whose logits would swamp
the attention memory) on random tokens: `forward` without gradients, or `forward_backward` with frozen
weights and a gradient into the input embeddings (the activation memory that training keeps). It
records latency (warmup + repeats: median, p90, p99, the median's 95% interval where n gives one), peak memory with its kind, and the
max |difference| of the output (forward) or of the input gradient (forward_backward) vs eager on the same
inputs. Every cell can run in its own process (runtime.isolation), so an OOM, crash or timeout becomes a
row with its status and the grid goes on; each cell's result is journalled as it ends (measure.isolation.CellJournal),
so a stage killed mid-grid resumes where it stopped. Per (mode, batch) the exponent of memory vs sequence length is
fitted: ≈2 means quadratic, ≈1 linear. An implementation that cannot run here is `unavailable` with the
reason, never a crash.
"""
from __future__ import annotations

import importlib.util
import logging
import math
import re
import warnings
from contextlib import contextmanager
from importlib.metadata import version

import torch

from .. import cli, records
from ..layout import Job
from ..measure.device import synchronize
from ..measure.env import environment
from ..measure.isolation import prestart, run_cell
from ..measure.memory import allocated_delta, track_memory
from ..measure.stats import speedup
from ..measure.timing import INTERLEAVE_RECORD, SENTINEL_TOLERANCE, interleave, time_fn
from ..models import model_check
from ..models.modeling import load_model, shape_only

# transformers and torch.nn.attention's kernels are imported where they are used: a benchmark cell runs in a
# process of its own and imports only what it needs.

log = logging.getLogger("efflab")


def flex_backward_reason(device: torch.device) -> str | None:
    """Ask torch on a tiny input whether FlexAttention can back-propagate on this device."""
    from torch.nn.attention.flex_attention import flex_attention

    q = torch.randn(1, 1, 16, 16, device=device, requires_grad=True)
    try:
        flex_attention(q, q.detach(), q.detach()).sum().backward()
    except NotImplementedError as err:
        return f"flex_attention: {str(err).splitlines()[0]}"
    return None


def unavailable_reason(impl: str, device: torch.device) -> str | None:
    from transformers.utils import is_flash_attn_2_available

    if impl == "flash_attention_2":
        if device.type != "cuda":
            return "flash_attention_2 needs a CUDA GPU (flash-attn has no CPU kernels)"
        if not is_flash_attn_2_available():
            return "the flash-attn package is not installed (README, Install: FlashAttention-2)"
    if impl == "flex_attention" and importlib.util.find_spec("torch.nn.attention.flex_attention") is None:
        return f"torch {torch.__version__} has no torch.nn.attention.flex_attention"
    if impl in SDPA_BACKENDS:
        from torch.nn.attention import SDPBackend

        if not hasattr(SDPBackend, SDPA_BACKENDS[impl]):
            return f"torch {torch.__version__} has no SDPA backend {SDPA_BACKENDS[impl]}"
    return None


# PyTorch SDPA with one backend forced (torch.nn.attention.sdpa_kernel): its FlashAttention-2 kernel where
# the flash-attn package cannot be installed, beside the memory-efficient, cuDNN and math ones. `sdpa` alone
# lets PyTorch choose.
SDPA_BACKENDS = {"sdpa_flash": "FLASH_ATTENTION", "sdpa_efficient": "EFFICIENT_ATTENTION",
                 "sdpa_cudnn": "CUDNN_ATTENTION", "sdpa_math": "MATH"}


@contextmanager
def attention_backend(impl: str, device: torch.device | None = None):
    """Force the SDPA backend an sdpa_<backend> implementation names. Where torch has no such kernel for these
    inputs, NotImplementedError carries torch's own reasons (the warnings it gives with the failure: "both fused
    kernels require query, key and value to have the same num_heads" for a grouped-query model, say)."""
    if impl not in SDPA_BACKENDS:
        yield
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(getattr(SDPBackend, SDPA_BACKENDS[impl])), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            yield
        except RuntimeError as err:
            if not any(text in str(err) for text in ("No available kernel", "No viable backend")):  # CUDA, CPU
                raise
            raise NotImplementedError(f"{impl}: torch {torch.__version__} has no {SDPA_BACKENDS[impl]} SDPA "
                                      f"kernel for these inputs on this device: {kernel_reasons(caught, device)}") from err
        finally:
            for w in caught:  # what ran warns as it would have
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)


def kernel_reasons(caught, device: torch.device | None = None) -> str:
    """torch's reasons, once each, without its 'kernel not used because:' headers and source locations; on a CPU,
    where torch gives none, which kernels its CPU SDPA has."""
    reasons = []
    for w in caught:
        text = re.sub(r"\s*\(Triggered internally at [^)]*\)\.?", "", str(w.message)).strip()
        text = re.sub(r"\s*To broadcast dense inputs.*", "", text)
        if text and not text.endswith("because:") and text not in reasons:
            reasons.append(text)
    if not reasons and device is not None and device.type == "cpu":
        return "torch's CPU SDPA has the flash and math kernels only"
    return "; ".join(reasons) or "torch gave no reason"


def _inputs(model, seq_len: int, batch_size: int, device: torch.device) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seq_len * 1000 + batch_size)
    return torch.randint(0, model.config.vocab_size, (batch_size, seq_len), generator=gen).to(device)


def _step(decoder, ids: torch.Tensor, mode: str):
    """One measured call; returns (output, input-embedding gradient or None)."""
    if mode == "forward":
        with torch.no_grad():
            return decoder(input_ids=ids).last_hidden_state, None
    embeds = decoder.get_input_embeddings()(ids).detach().requires_grad_(True)
    out = decoder(inputs_embeds=embeds).last_hidden_state
    out.float().pow(2).mean().backward()
    return out.detach(), embeds.grad


def _frozen_decoder(folder: str, dtype: str, device: torch.device, impl: str):
    model = load_model(folder, dtype, device, attn_implementation="sdpa" if impl in SDPA_BACKENDS else impl)
    for p in model.parameters():
        p.requires_grad_(False)
    return model.get_decoder()


def attention_cell(folder: str, dtype: str, device: str, cell: dict, warmup: int, repeats: int,
                   sentinel_tolerance: float = SENTINEL_TOLERANCE) -> dict:
    """Measure one cell ({implementation, mode, seq_len, batch_size}): memory, then the difference from eager and
    the latency interleaved with eager's on the same inputs (so the speedup has an interval and drift cancels).
    Where eager itself cannot run (out of memory at long lengths), the implementation is timed alone and the
    comparison says why it is missing."""
    device = torch.device(device)
    impl, mode, seq_len, batch_size = cell["implementation"], cell["mode"], cell["seq_len"], cell["batch_size"]
    decoder = _frozen_decoder(folder, dtype, device, impl)
    ids = _inputs(decoder, seq_len, batch_size, device)
    mine = lambda r=None: _step(decoder, ids, mode)  # noqa: E731
    compared = "last hidden state" if mode == "forward" else "gradient of the input embeddings"
    with attention_backend(impl, device):
        for _ in range(max(warmup, 1)):  # one-time allocations and kernel choices stay out of the memory peak
            mine()
        synchronize(device)
        with track_memory(device) as mem:
            out, grad = mine()
        with track_memory(device) as again:  # the same work measured twice: the error a peak of it carries
            mine()
        eager, diff, vs_eager = None, 0.0, None
        if impl != "eager":
            try:
                eager_decoder = _frozen_decoder(folder, dtype, device, "eager")
                ref_out, ref_grad = _step(eager_decoder, ids, mode)
                eager = lambda r=None: _step(eager_decoder, ids, mode)  # noqa: E731
                diff = ((out, ref_out) if mode == "forward" else (grad, ref_grad))
                diff = (diff[0].float() - diff[1].float()).abs().max().item()
            except torch.OutOfMemoryError as err:
                diff, vs_eager = None, {"unavailable": f"eager ran out of memory here: {str(err).splitlines()[0]}"}
        del out, grad
        if eager:
            timed = interleave({impl: mine, "eager": eager}, repeats, device, warmup=warmup,
                               tolerance=sentinel_tolerance)
            latency = timed["variants"][impl] | ({"unstable": timed["unstable"]} if "unstable" in timed else {})
            # eager's time over this implementation's: the speedup; its verdict is said of this implementation
            vs_eager = {"speedup": speedup(timed, impl, "eager"), "eager_latency": timed["variants"]["eager"],
                        **{k: timed[k] for k in INTERLEAVE_RECORD}}
            latency |= {"warmup": warmup, "clock": timed["clock"], "interleaved_with": "eager"}
        else:
            latency = time_fn(mine, device, 0, repeats) | {"warmup": warmup}
    tokens = batch_size * seq_len
    times_eager = (vs_eager or {}).get("speedup", {}).get("median")
    log.info("%s %s seq %d batch %d: median %.4f s (p90 %.4f), peak delta %s MiB, |diff| %s%s", impl, mode,
             seq_len, batch_size, latency["median"], latency["p90"], mem.get("delta_mib"),
             "n/a" if diff is None else f"{diff:.2e}", f", {times_eager:.2f}x eager" if times_eager else "")
    return {"latency": latency, "memory": mem, "memory_again": again, "tokens_per_s": tokens / latency["median"],
            "max_abs_diff_vs_eager": diff, "compared": compared, "vs_eager": vs_eager}


def fit_exponent(rows: list[dict]) -> dict:
    """Least-squares slope of log(allocated memory delta) vs log(sequence length) over the ok rows, with the
    kind of memory fitted (measure.memory.allocated_delta: live tensors on CPU, allocated on CUDA)."""
    measured = [(r["seq_len"], *allocated_delta(r["memory"])) for r in rows if records.is_ok(r)]
    points = [(math.log(seq), math.log(mib)) for seq, mib, _ in measured if (mib or 0) > 0]
    kind = next((k for _, mib, k in measured if (mib or 0) > 0), None)
    if len(points) < 2:
        return {"exponent": None, "points": len(points), "memory_kind": kind,
                "reason": "fewer than two measured sequence lengths"}
    mx = sum(x for x, _ in points) / len(points)
    my = sum(y for _, y in points) / len(points)
    sxx = sum((x - mx) ** 2 for x, _ in points)
    slope = sum((x - mx) * (y - my) for x, y in points) / sxx
    residual = sum((y - (my + slope * (x - mx))) ** 2 for x, y in points)
    total = sum((y - my) ** 2 for _, y in points)
    return {"exponent": slope, "points": len(points), "r2": 1 - residual / total if total else 1.0,
            "memory_kind": kind}


def run(cfg: dict, job: Job) -> dict:
    """Benchmark one attention implementation over the configured grid."""
    b, rt, impl, layout = cfg["bench_attention"], cfg["runtime"], job.name, job.layout
    prestart(rt["isolation"], light=True)  # the cells' forkserver imports beside this job (a model: no Trainer)
    device, dtype = job.device, job.dtype
    skeleton = shape_only(layout.base_model())
    offers = model_check.attention_offers(skeleton)
    if ("sdpa" if impl.startswith("sdpa") else impl) not in offers:  # recorded as unavailable (cli.not_run)
        raise NotImplementedError(f"{type(skeleton).__name__} does not support {impl} in transformers "
                                  f"{version('transformers')} (it offers {', '.join(offers)})")
    reason = unavailable_reason(impl, device)
    journal = job.journal({"bench_attention": b, "runtime": rt, "base": layout.metrics("base_model").read_text()})
    if journal.resumed:
        log.info("%s: %d cells measured before this run was stopped are taken from %s", impl, journal.resumed,
                 journal.path)
    rows, fits = [], []
    for mode in b["modes"]:
        mode_reason = reason or (flex_backward_reason(device) if impl == "flex_attention"
                                 and mode == "forward_backward" else None)
        for batch_size in b["batch_sizes"]:
            group = []
            for seq_len in b["seq_lens"]:
                cell = {"implementation": impl, "mode": mode, "seq_len": seq_len, "batch_size": batch_size}
                if mode_reason:
                    group.append(cell | {"status": "unavailable", "reason": mode_reason})
                    continue
                result = journal.result(cell, lambda: run_cell(attention_cell, dict(
                    folder=str(layout.base_model()), dtype=dtype, device=str(device), cell=cell, warmup=b["warmup"],
                    repeats=b["repeats"]),
                    isolation=rt["isolation"], timeout_s=rt["cell_timeout_s"],
                    memory_cap_mib=rt["cell_memory_cap_mib"]))
                if not records.is_ok(result):
                    log.warning("%s %s seq %d batch %d: %s: %s", impl, mode, seq_len, batch_size,
                                result["status"], result.get("reason"))
                group.append(cell | result)
            rows += group
            if not mode_reason:
                fits.append({"implementation": impl, "mode": mode, "batch_size": batch_size,
                             **fit_exponent(group)})
    journal.remove()
    statuses = {r["status"] for r in rows}
    status = "unavailable" if statuses == {"unavailable"} else "ok"
    if status == "unavailable" and not reason:  # every cell said why: the job says it too (the report's Did not run)
        reason = "; ".join(dict.fromkeys(r["reason"] for r in rows if r.get("reason"))) or None
    return {"status": status, "implementation": impl, "reason": reason, "dtype": dtype,
            "measured": "decoder stack (no LM head) on random tokens", "rows": rows, "memory_exponents": fits,
            "environment": environment(device, b)}


if __name__ == "__main__":
    cli.main("bench_attention", run)
