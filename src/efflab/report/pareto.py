"""Pareto frontiers: the configurations no other beats on every axis, and their data for `dvc plots`."""
from __future__ import annotations

from pathlib import Path

import pandas as pd

from .. import records
from .fmt import MiB, peak_mib
from .tables import tokens_per_s


def dominated(points: list[dict], better: dict[str, str]) -> list[bool]:
    """For each point, whether another is at least as good on every criterion and better on one. `better` maps
    a key to "min" or "max"; a criterion a point lacks (None) is left out of the comparisons it is in."""
    def as_good(a: dict, b: dict, key: str) -> bool:
        return a[key] <= b[key] if better[key] == "min" else a[key] >= b[key]

    out = []
    for p in points:
        beaten = False
        for q in points:
            keys = [k for k in better if p.get(k) is not None and q.get(k) is not None]
            if q is p or not keys:
                continue
            if all(as_good(q, p, k) for k in keys) and any(q[k] != p[k] for k in keys):
                beaten = True
                break
        out.append(beaten)
    return out


def finetune_pareto(rows: list[dict]) -> list[dict]:
    points = [{"name": r["run"], "memory": peak_mib(r["train_memory"]), "tokens_per_s": tokens_per_s(r),
               "kind": r["train_memory"]["kind"]} for r in records.ok(rows) if peak_mib(r["train_memory"]) is not None]
    for p, beaten in zip(points, dominated(points, {"memory": "min", "tokens_per_s": "max"})):
        p["dominated"] = beaten
    return points


def inference_pareto(inference_rows: list[dict], quantize_rows: list[dict]) -> list[dict]:
    """One point per inference variant (its KV-cache, batch-1 cell): footprint, decode tokens/s and the
    perplexity change its quantization costs (quantized variants; 0 for the base model; fine-tuned variants
    have no comparable figure)."""
    ppl = {r["scheme"]: r["perplexity_change_pct"] for r in records.ok(quantize_rows)}
    points = []
    for r in records.ok(inference_rows):
        cell = next((c for c in r.get("cells", []) if records.is_ok(c) and c["kv_cache"] and c["batch_size"] == 1),
                    None)
        if cell is None:
            continue
        delta = 0.0 if r["kind"] == "base" else ppl.get(r["of"]) if r["kind"] == "quantized" else None
        points.append({"name": r["variant"], "footprint": cell["memory_footprint_bytes"] / MiB,
                       "decode": cell["decode_tokens_per_s"]["median"], "perplexity_change_pct": delta})
    for p, beaten in zip(points, dominated(points, {"footprint": "min", "decode": "max",
                                                   "perplexity_change_pct": "min"})):
        p["dominated"] = beaten
    return points


def write_fronts(fronts: dict, out: Path) -> None:
    """The frontiers' points as data too: `dvc plots show` draws them from these (dvc.yaml, scatter template)."""
    pd.DataFrame([{"config": p["name"], "peak_memory_mib": p["memory"], "tokens_per_s": p["tokens_per_s"],
                   "memory_kind": p["kind"], "dominated": p["dominated"]} for p in fronts["finetune"]],
                 columns=["config", "peak_memory_mib", "tokens_per_s", "memory_kind", "dominated"]
                 ).to_csv(out / "finetune_pareto.csv", index=False)
    pd.DataFrame([{"config": p["name"], "footprint_mib": p["footprint"], "decode_tokens_per_s": p["decode"],
                   "perplexity_change_pct": p["perplexity_change_pct"], "dominated": p["dominated"]}
                  for p in fronts["inference"]],
                 columns=["config", "footprint_mib", "decode_tokens_per_s", "perplexity_change_pct", "dominated"]
                 ).to_csv(out / "inference_pareto.csv", index=False)
