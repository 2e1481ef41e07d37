"""Pareto frontiers: the options the report's advice finds no other beats, their points as the plots draw them,
and their data for `dvc plots`.

The frontier is the decision's own (decisions.build: report.dominance.frontier over each option's intervals; the
fine-tuning one compares each pair of runs by its own measurement, question_facts.finetune_front), never one of point
values: an option is dominated only where another beats it on some axis and loses on none.
"""
from __future__ import annotations

from pathlib import Path

import pandas as pd

from ... import records
from .spread import of_axis, of_speedup, spread
from .tables.finetune import tokens_per_s

# The spread of a peak that is its kind's measured error (decisions.json `memory_error`), not a 95% interval.
MEASURED_ERROR = "measured error"


def of_memory(axis: dict | None) -> dict | None:
    """A run's peak memory as the plot draws it: ± its kind's measured error where the records measured one
    (`error_pct`, named as such), else the one measurement alone."""
    if not axis or axis.get("error_pct") is None:
        return of_axis(axis)
    return spread(axis["value"], axis["lo"], axis["hi"], kind=MEASURED_ERROR, n=axis.get("n"))


def finetune_pareto(rows: list[dict], facts: dict | None) -> list[dict]:
    """Each run: its peak training memory (one measurement, ± its kind's measured error where there is one: its
    `memory_error_pct`), its step time over the first run's (the decision's paired ratio), and its validation
    perplexity change over the first
    run (paired, where both carry per-row losses); dominated or not as the fine-tuning decision (decisions.build,
    each pair by its own comparison) says."""
    if not facts:
        return []
    runs = {r["run"]: r for r in records.ok(rows)}
    return [{"name": o["name"], "baseline": o["baseline"], "kind": o["memory_kind"],
             "memory": (o["axes"]["memory"] or {}).get("value"), "tokens_per_s": tokens_per_s(runs[o["name"]]),
             "memory_error_pct": (o["axes"]["memory"] or {}).get("error_pct"),
             # the step as the decision compares it: over the reference's, paired (records.step_ratio), never the
             # runs' own medians side by side (each timed in its own process)
             "x": of_memory(o["axes"]["memory"]), "y": of_axis(o["axes"]["step_ratio"]),
             "quality": of_axis(o["axes"]["quality"]), "quality_point": None,
             "dominated": o["name"] not in facts["front"]} for o in facts["options"]]


def inference_pareto(inference_rows: list[dict], quantize_rows: list[dict], facts: dict | None) -> list[dict]:
    """Each inference variant's batch-1 KV-cache cell: its footprint, its interleaved decode speedup over the base
    model (with its interval, or the range of its rounds) and the paired perplexity change its quantization costs
    (quantized variants; fine-tuned ones have none comparable). An old record's unpaired change is kept as a
    point (`quality_point`), which decides nothing."""
    if not facts:  # the inference decision (decisions.build): its options and frontier
        return []
    unpaired = {r["scheme"]: r.get("perplexity_change_pct") for r in records.ok(quantize_rows)}
    jobs = {j["variant"]: j for j in records.ok(inference_rows)}
    points = []
    for o in facts["options"]:
        job, cell = jobs[o["name"]], records.reference_cell(jobs[o["name"]])
        quality = of_axis(o["axes"]["quality"])
        point = 0.0 if o["baseline"] else unpaired.get(job["of"]) if job["kind"] == "quantized" else None
        speed = spread(1.0) if o["baseline"] else of_speedup(cell.get("vs_base"), "generation_speedup", "base")
        points.append({"name": o["name"], "baseline": o["baseline"], "footprint": o["axes"]["memory"]["value"],
                       "decode": cell["decode_tokens_per_s"]["median"],
                       "perplexity_change_pct": quality["value"] if quality else point,
                       "x": of_axis(o["axes"]["memory"]), "y": speed, "quality": quality,
                       "quality_point": None if quality else point, "dominated": o["name"] not in facts["front"]})
    return points


def write_fronts(fronts: dict, out: Path) -> None:
    """The frontiers' points as data too: `dvc plots show` draws them from these (dvc.yaml, scatter template)."""
    pd.DataFrame([{"config": p["name"], "peak_memory_mib": p["memory"], "tokens_per_s": p["tokens_per_s"],
                   "memory_kind": p["kind"], "dominated": p["dominated"]} for p in fronts["finetune"]],
                 columns=["config", "peak_memory_mib", "tokens_per_s", "memory_kind", "dominated"]
                 ).to_csv(out / "finetune_pareto.csv", index=False)
    # the plotted speed (the interleaved generation speedup) first; the cell's own decode rate beside it
    pd.DataFrame([{"config": p["name"], "footprint_mib": p["footprint"], "generation_speedup": (p["y"] or {}).get(
                   "value"), "decode_tokens_per_s": p["decode"], "perplexity_change_pct": p["perplexity_change_pct"],
                   "dominated": p["dominated"]} for p in fronts["inference"]],
                 columns=["config", "footprint_mib", "generation_speedup", "decode_tokens_per_s",
                          "perplexity_change_pct", "dominated"]).to_csv(out / "inference_pareto.csv", index=False)
