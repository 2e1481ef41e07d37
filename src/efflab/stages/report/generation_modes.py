"""The options of two bench_inference questions that compare a model with its own dynamic generation: which
speculative mode (prompt lookup, a draft) pays on this model, and what a quantized KV cache saves and costs.

Speed is each cell's interleaved speedup over the same model's dynamic generation (vs_dynamic); a speculative
option carries what its verification steps accepted and whether its greedy tokens equalled the model's own; a
quantized cache its paired perplexity change on validation rows read through the cache and the memory it holds
after the longest prefill both caches were measured at (exact bytes of the tensors held: no spread).
"""
from __future__ import annotations

from ... import records
from ...models.speculative import SPECULATIVE
from .dominance import axis
from .options import change_axis, ratio_axis
from .writing import env_of


def _cells(inference: list[dict], keep) -> list[tuple[dict, dict]]:
    return [(job, c) for job in records.ok(inference) for c in records.ok(job.get("cells", [])) if keep(c)]


def _name(job: dict, cell: dict) -> str:
    return f"{job['variant']}: {records.cell_mode(cell)}" + ("" if cell["batch_size"] == 1 else
                                                             f", batch {cell['batch_size']}")


def speculative_options(inference: list[dict]) -> list[dict]:
    """Each speculative cell: its speed over the same model's dynamic generation, its acceptance and whether its
    greedy tokens were the model's own."""
    out = []
    for job, c in _cells(inference, lambda c: c.get("generation") in SPECULATIVE):
        s = c.get("speculation") or {}
        out.append({"name": _name(job, c), "baseline": False, "variant": job["variant"], "mode": c["generation"],
                    "draft": c.get("draft"), "acceptance_rate": s.get("acceptance_rate"),
                    "accepted_per_step": s.get("accepted_per_step"), "tokens_per_step": s.get("tokens_per_step"),
                    "proposed": s.get("proposed"), "greedy_equal": s.get("greedy_equal"), "vs_dynamic": c.get("vs_dynamic"),
                    "prompts": s.get("batches_compared"), "passes": s.get("steps"),
                    "env": env_of(job),
                    "axes": {"speed": ratio_axis((c.get("vs_dynamic") or {}).get("generation_speedup"))}})
    return out


def speculative_status(option: dict, speed_verdict: str) -> str:
    """Whether a speculative option pays: `pays` (faster, the model's own tokens), `changes the output`, `acceptance
    too low to pay` (slower, or the same within the band: the accepted candidates did not buy the draft's and the
    check's cost), else the speed verdict as it is."""
    if option["greedy_equal"] is False:
        return "changes the output"
    if speed_verdict == "faster":
        return "pays"
    if speed_verdict == "slower" or speed_verdict.startswith("same within"):
        return "acceptance too low to pay"
    return speed_verdict


def _longest_shared(memory: list[dict]) -> dict | None:
    both = [m for m in memory if m.get("full_mib") and m.get("quantized_mib")]
    return max(both, key=lambda m: m["context"]) if both else None


def kv_quant_options(inference: list[dict]) -> dict[str, list[dict]]:
    """By variant, each quantized-cache cell after the variant's full-precision cache (the baseline): the memory held
    after the longest prefill both were measured at, the speed over the full-precision cache, the perplexity
    change."""
    by_variant: dict[str, list[dict]] = {}
    for job, c in _cells(inference, lambda c: c.get("kv_quant")):
        out = by_variant.setdefault(job["variant"], [])
        q = c.get("quantized_cache") or {}
        at = _longest_shared(q.get("memory_by_context") or [])
        name = _name(job, c | {"kv_quant": None})
        if not any(o["name"] == f"{name}, full-precision cache" for o in out) and at:
            out.append({"name": f"{name}, full-precision cache", "baseline": True, "variant": job["variant"],
                        "context": at["context"], "memory_kind": at["kind"],
                        "axes": {"memory": axis(at["full_mib"], exact=True), "speed": axis(1.0, exact=True),
                                 "quality": axis(0.0, exact=True)}})
        out.append({"name": _name(job, c), "baseline": False, "variant": job["variant"], "cache": c["kv_quant"],
                    "context": at and at["context"], "memory_kind": at and at["kind"],
                    "memory_ratio": at and at["quantized_mib"] / at["full_mib"],
                    "axes": {"memory": axis(at["quantized_mib"], exact=True) if at else None,
                             "speed": ratio_axis((c.get("vs_dynamic") or {}).get("generation_speedup")),
                             "quality": change_axis(q.get("perplexity_change"))}})
    return by_variant
