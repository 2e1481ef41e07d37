"""The capacity part's table: each search's predicted and measured maximum, and what its memory says of the
estimator."""
from __future__ import annotations

import pandas as pd

from .... import records
from ..writing import env_of, median_text, status_text
from . import MEMORY_TARGET


def capacity_held(jobs: list[dict]) -> str:
    """The memory the capacity budget holds, in two words: the allocator's reservation on a GPU, else RSS."""
    return "reserved memory" if any(j["budget"]["memory"].startswith("cuda") for j in records.ok(jobs)) else "RSS"


def capacity_columns(jobs: list[dict]) -> list[str]:
    return ["subject", "largest", "predicted max", "measured max", "tensors predicted (MiB)", "tensors measured (MiB)",
            f"{capacity_held(jobs)} growth (MiB)", "tokens/s at max", "status", "env"]


def capacity_largest(search: dict, fixed: dict) -> str:
    work = "training" if search["kind"] == "train" else "generation"
    if search["dimension"] == "seq_len":
        cache = f", {search['kv_quant']} KV cache" if search.get("kv_quant") else ""
        return f"{work} sequence (batch 1{cache})"
    return f"{work} batch ({fixed['train_seq_len'] if search['kind'] == 'train' else fixed['prompt_len']} tokens)"


def capacity_measured(search: dict) -> str | None:
    if not records.is_ok(search):
        return None
    top, failing = search.get("measured_max"), search.get("first_failing")
    if top is None:
        return f"none fits ({failing} fails)"
    return f">= {top} (whole range)" if search.get("whole_range_fits") else f"{top} ({failing} fails)"


def capacity_table(jobs: list[dict]) -> pd.DataFrame:
    """Each search's predicted and measured maximum and, at the measured maximum, the estimator's tensor growth
    beside the measured one and beside the growth of the memory the budget holds (all over the loaded model)."""
    columns, out = capacity_columns(jobs), []
    for job in records.ok(jobs):
        for s in job["searches"]:
            m = s.get("at_max") or {}
            out.append(dict(zip(columns, [s["subject"], capacity_largest(s, job["fixed"]), s.get("predicted_max"),
                                          _with_gain(capacity_measured(s), s), m.get("predicted_growth_mib"),
                                          m.get("tensor_growth_mib"), m.get("held_growth_mib"),
                                          _rate_text(s.get("tokens_per_s_at_max")), status_text(s), env_of(job)])))
    return pd.DataFrame(out, columns=columns)


def _with_gain(measured: str | None, search: dict) -> str | None:
    """A quantized KV cache's longest context with its gain over the full-precision cache's, or why none."""
    if measured is None or "kv_quant" not in search:
        return measured
    gain = search.get("context_gain")
    return f"{measured}; {gain:.2f}× {search['paired_with']}'s" if gain else f"{measured}; gain not decided"


def _rate_text(stats: dict | None) -> str:
    """tokens/s at a maximum: one timed step is a value alone; more, the median with their interval or range."""
    return f"{stats['median']:.2f} (n=1)" if stats and stats["n"] == 1 else median_text(stats)


def capacity_cause(search: dict) -> str | None:
    """What the memory at a search's measured maximum says of its prediction, like with like. The peak measured
    there is the predicted one plus three parts: 'loaded', how much more the loaded model held than in the first
    cell, where the prediction starts; 'estimator', the live tensors measured minus those predicted; 'gap', the
    memory the budget holds beyond the live tensors, which the estimator does not model. The cause is the part
    that moved the peak most in the direction of the whole difference, the estimator's only where its tensors
    are off by more than ±MEMORY_TARGET (else it is right, and never named); 'none' where no part moved it that
    way; 'gap_short' where the gap moved it down (the held memory grew by less than the live tensors). None where
    the maximum's tensors were not measured."""
    m = search.get("at_max") or {}
    if m.get("ratio") is None or m.get("gap_mib") is None:
        return None
    miss = m["tensor_growth_mib"] - m["predicted_growth_mib"]
    parts = {"gap": m["gap_mib"], "loaded": m.get("loaded_shift_mib") or 0.0}
    direction = 1 if sum(parts.values()) + miss >= 0 else -1
    if capacity_estimator_off(m):
        parts["estimator"] = miss
    cause = max(parts, key=lambda k: direction * parts[k])
    if direction * parts[cause] <= 0:
        return "none"
    return "gap_short" if cause == "gap" and parts["gap"] < 0 else cause  # held memory grew less than the tensors


def capacity_estimator_off(at_max: dict) -> bool:
    return abs(at_max["ratio"] - 1) > MEMORY_TARGET
