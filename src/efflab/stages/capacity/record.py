"""The capacity stage's record: each search's predictions, the memory and speed at its measured maximum, its
cells.csv rows, the record of a search that does not run, and each quantized cache's context gain."""
from __future__ import annotations

import csv

from ... import records
from ...measure.stats import summarize
from ...models import kv_cache
from .subjects import KV_DEFAULTS, Subject

CELLS_CSV = "cells.csv"
CELL_COLUMNS = ("subject", "kind", "dimension", "role", "batch_size", "seq_len", "new_tokens", "status", "peak_mib",
                "loaded_mib", "tensor_growth_mib", "file_growth_mib", "predicted_growth_mib", "predicted_peak_mib",
                "budget_mib", "timed_steps", "tokens_per_s", "cell_wall_s", "reason")


def predictions(found: dict, sizes: list, dimension: str, subject: Subject) -> tuple[list, list, dict]:
    """A search's predicted growth and peak per size (for cells.csv and at_max) and its record's prediction. The
    estimator does not model a quantized KV cache: such a search has none, and says where it started instead (the
    full-precision cache's predicted maximum, a lower bound on the quantized one's)."""
    first, n = found["seen"][0], len(sizes)
    growth = (first.get("predicted_growth_mib") if records.is_ok(first) else None) or [None] * n
    peaks = found["predicted_peak_mib"] or [None] * n
    if not found["predicted_peak_mib"]:
        return growth, peaks, {}
    guess = None if found["guess"] < 0 else size_along(sizes[found["guess"]], dimension)
    if subject.kv_quant != kv_cache.NONE:
        return [None] * n, [None] * n, {"predicted_max": None, "prediction": (
            "none: the estimator does not model a quantized KV cache; the search started at the full-precision "
            f"cache's predicted maximum ({guess}), a lower bound")}
    return growth, peaks, {"predicted_max": guess,
                           "predicted_peak_mib": dict(zip((size_along(s, dimension) for s in sizes), peaks))}


def at_max(cell_result: dict, predicted_growth: float | None, loaded_first: float) -> dict:
    """The memory at the measured maximum, like with like: the estimator's predicted tensor growth over the loaded
    model beside the measured live-tensor growth (their ratio is the estimator's error), and the growth of the
    memory the budget holds. Their gap is memory that is not live tensors, which the estimator does not model:
    on a CPU, what glibc malloc keeps after tensors are freed, libraries' own buffers, and file pages read in
    after loading (`file_growth_mib`: weights memory-mapped from their safetensors file, first read by a step).
    The prediction starts from the first cell's loaded memory; `loaded_shift_mib` is how much more this cell's
    held. So the measured peak is the predicted one plus the shift, the estimator's miss and the gap."""
    peak, loaded, tensors = (cell_result.get(k) for k in ("peak_mib", "loaded_mib", "tensor_growth_mib"))
    held = None if None in (peak, loaded) else peak - loaded
    return {"loaded_mib": loaded, "loaded_shift_mib": None if loaded is None else loaded - loaded_first,
            "peak_mib": peak, "predicted_growth_mib": predicted_growth,
            "tensor_growth_mib": tensors, "ratio": tensors / predicted_growth if tensors is not None and
            predicted_growth else None, "held_growth_mib": held,
            "gap_mib": None if None in (held, tensors) else held - tensors,
            "file_growth_mib": cell_result.get("file_growth_mib"),
            **({"tensor_unavailable": cell_result["tensor_unavailable"]} if "tensor_unavailable" in cell_result
               else {})}


def speed(result: dict) -> dict:
    """tokens/s over a cell's timed steps, one figure a step, summarized (an interval of the median from n=6)."""
    rates = [result["tokens"] / s for s in result["step_s"]["samples"]]
    return {"tokens_per_s_at_max": summarize(rates, unit="tokens/s", keep_samples=False),
            "step_s_at_max": result["step_s"]}


def row(c: dict, search: dict, size: tuple[int, int], role: str, result: dict, growth: float | None,
         peak: float | None, budget_mib: float) -> dict:
    """A cells.csv row of a cell of `search` (its subject, kind and dimension)."""
    return {**{k: search[k] for k in ("subject", "kind", "dimension")}, "role": role, "batch_size": size[0],
            "seq_len": size[1], "new_tokens": c["generate"]["new_tokens"] if search["kind"] == "generate" else "",
            "status": result["status"], "peak_mib": result.get("peak_mib"), "loaded_mib": result.get("loaded_mib"),
            "tensor_growth_mib": result.get("tensor_growth_mib"), "file_growth_mib": result.get("file_growth_mib"),
            "predicted_growth_mib": growth, "predicted_peak_mib": peak, "budget_mib": budget_mib,
            "timed_steps": (result.get("step_s") or {}).get("n", 0), "tokens_per_s": result.get("tokens_per_s"),
            "cell_wall_s": result.get("cell_wall_s"), "reason": result.get("reason", "")}


def write_cells(path, cells: list[dict]) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CELL_COLUMNS)
        writer.writeheader()
        writer.writerows(cells)


def kv_fields(subject: Subject) -> dict:
    """A quantized-cache search's cache and the full-precision search it is paired with (none for the others)."""
    if subject.kv_quant == kv_cache.NONE:
        return {}
    return {"kv_quant": subject.kv_quant, "paired_with": subject.paired_with}


def not_searched(subject: Subject, dimension: str, sizes: list, config) -> dict | None:
    """The record of a search that does not run: its subject skipped, its grid empty, or its cache unavailable."""
    entry = {"subject": subject.name, "kind": subject.kind, "dimension": dimension,
             "grid": [sizes[0], sizes[-1]] if sizes else None, **kv_fields(subject)}
    if subject.skipped:
        return entry | subject.skipped
    if not sizes:
        return entry | {"status": "skipped", "reason": "the grid is empty: the fixed length does not fit the "
                                                       "model's context"}
    why = kv_cache.unavailable(subject.kv_quant, config)
    return entry | {"status": "unavailable", "reason": why} if why else None


def context_gain(searches: list[dict]) -> list[dict]:
    """Each quantized-cache search with `context_gain`: its longest context over its full-precision search's,
    where both are decided (a measured maximum below the grid's end); else null and `context_gain_why`."""
    plain = {s["subject"]: s for s in searches if s["dimension"] == "seq_len" and "kv_quant" not in s}
    return [s | dict(zip(("context_gain", "context_gain_why"), _gain(s, plain.get(s["paired_with"]))))
            if "kv_quant" in s else s for s in searches]


def _gain(quantized: dict, full: dict | None) -> tuple[float | None, str | None]:
    for name, s in (("the quantized cache's", quantized), ("the full-precision cache's", full)):
        if s is None or not records.is_ok(s):
            return None, f"{name} search did not run ({(s or {}).get('status', 'absent')})"
        if s["measured_max"] is None:
            return None, f"{name} search found nothing that fits"
    if full["whole_range_fits"]:
        return None, ("the full-precision cache fits the whole range: nothing decided (on the CPU default the "
                      "grid is short; the GPU profile searches longer contexts)")
    if quantized["whole_range_fits"]:
        return None, (f"the quantized cache fits the whole range: at least {quantized['measured_max']} against "
                      f"{full['measured_max']}, its gain undecided (a longer capacity.max_seq_len decides it)")
    return quantized["measured_max"] / full["measured_max"], None


def kv_record(cfg: dict) -> dict:
    caches = cfg["capacity"].get("kv_quant") or []
    if not caches:
        return {}
    options = cfg["bench_inference"].get("kv_quant_options")
    return {"kv_quant": {"caches": caches, "options": options or KV_DEFAULTS,
                         "options_from": "bench_inference.kv_quant_options" if options else
                         "transformers' QuantizedCache defaults (None: the layer's own)",
                         "note": "the longest context at batch 1 with each cache and without (the full-precision "
                                 "one); where a search fits the whole range it decides nothing (on the CPU default "
                                 "the range is short; the GPU profile searches far longer contexts)"}}


def size_along(size: tuple[int, int], dimension: str) -> int:
    return size[0] if dimension == "batch_size" else size[1]
