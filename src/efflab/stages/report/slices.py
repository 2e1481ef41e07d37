"""The base model's perplexity on each validation slice the stages read, reconciled: every stage reads the first N
validation rows, so the figures differ by the rows they read; where the largest slice kept its per-row losses,
each smaller slice's figure is recomputed from its first rows, and a figure that is not is said."""
from __future__ import annotations

import math

from ... import records
from ...quality import perplexity

# How far apart one model's mean loss on the same rows may lie, relative, when two stages compute it in `dtype` with
# other batches (other padding, so other kernels and summation orders): float32 agrees to the last digits; a 16-bit
# dtype to its unit roundoff (bfloat16 2^-8, float16 2^-11).
ROUNDING = {"float32": 1e-6, "bfloat16": 2 ** -8, "float16": 2 ** -11}


def base_slices(cfg: dict, metrics: dict) -> list[dict]:
    """(stage, rows, perplexity, per_row) of the base model as each stage measured it: the baseline scheme's
    quantize record, each pruning strategy's base, and QAT's base."""
    out = []
    for m in records.ok(metrics.get("quantize", [])):
        if m.get("name") == cfg["report"]["baseline_scheme"] and m.get("validation"):
            out.append(_slice("quantize", m["validation"], m.get("compute_dtype")))
    for m in records.ok(metrics.get("prune", []))[:1]:  # every strategy reads the same base rows
        out.append(_slice("prune", m["base"]["validation"], m.get("dtype")))
    for m in records.ok(metrics.get("qat", [])):
        if m.get("base_perplexity"):
            out.append({"stage": "qat", "rows": m["eval_rows"], "perplexity": m["base_perplexity"], "per_row": None,
                        "dtype": m.get("dtype")})
    return sorted(out, key=lambda s: s["rows"])


def _slice(stage: str, v: dict, dtype: str | None) -> dict:
    return {"stage": stage, "rows": v["rows"], "perplexity": v["perplexity"], "per_row": v.get("per_row"),
            "dtype": dtype}


def reconciled(slices: list[dict]) -> tuple[list[dict], list[dict]]:
    """(those the largest slice's per-row losses give, their mean loss within the rounding of their common dtype;
    those they do not): the latter are a second measurement of the base on those rows that disagrees, or rows that
    are not the first ones. Slices of another dtype than the largest's are in neither."""
    full = next((s for s in reversed(slices) if s["per_row"]), None)
    agree, differ = [], []
    for s in slices:
        if full is None or s["rows"] > len(full["per_row"]) or s["dtype"] != full["dtype"]:
            continue
        again = perplexity(full["per_row"][:s["rows"]])
        close = math.isclose(math.log(again), math.log(s["perplexity"]), rel_tol=ROUNDING.get(s["dtype"], 1e-6))
        (agree if close else differ).append(s | {"again": again})
    return agree, differ


def text(cfg: dict, metrics: dict) -> str:
    """One line for the run size: the base model's perplexity by slice, and whether the slices reconcile."""
    slices = base_slices(cfg, metrics)
    if len({s["rows"] for s in slices}) < 2:
        return ""
    said = ", ".join(f"{s['perplexity']:.2f} on {s['rows']} ({s['stage']})" for s in slices)
    agree, differ = reconciled(slices)
    largest = max(s["rows"] for s in slices)
    if differ:
        why = "; ".join(f"{s['stage']}'s {s['perplexity']:.4g} on {s['rows']} rows is not the first {s['rows']} of "
                        f"the {largest} rows' losses, which give {s['again']:.4g}" for s in differ)
        return f"- the base model's perplexity by validation slice: {said}; they do not reconcile: {why}.\n"
    dtypes = sorted({str(s["dtype"]) for s in slices})
    rounding = "" if dtypes == ["float32"] else (f", their mean losses within {dtypes[0]}'s rounding "
                                                 f"({ROUNDING.get(dtypes[0], 1e-6):.2g} relative)")
    tail = (f"; the {largest} rows' per-row losses give each slice's figure{rounding}: the first rows are the same "
            f"rows, so the figures differ by the rows read{' and by rounding' if rounding else ''}, not by the "
            f"model") if len(agree) == len(slices) \
        else f"; computed in {', '.join(dtypes)}, so not recomputed one from another" if len(dtypes) > 1 else ""
    return (f"- the base model's perplexity by validation slice (the first N rows of the validation split): "
            f"{said}{tail}. Each comparison pairs the rows of its own slice.\n")
