"""The fine-tuning part's run table (its knob table: report.knobs)."""
from __future__ import annotations

import pandas as pd

from .... import records
from ..fmt import env_of, median_text, pct, peak_mib


def tokens_per_s(run: dict) -> float:
    """A run's real-token throughput over its steady steps, the rate its MFU is computed from (the whole run's,
    first steps included, for runs recorded before throughput was measured steady)."""
    return run.get("throughput", {}).get("tokens_per_s", run["tokens_per_s"])


def finetune_table(rows: list[dict]) -> pd.DataFrame:
    """What each run cost and did; parameter counts, samples/s and the matmul ceiling the MFU is over are in
    summary.csv (the long results table)."""
    return pd.DataFrame([{
        "run": r["run"], "method": r["method"], "precision": r["mixed_precision"],
        "effective batch": r.get("effective_batch"),
        "pad tokens computed (%)": pct(r.get("pad_fraction")),
        "trainable (%)": r["parameters"]["trainable_pct"], "steps": r["steps"],
        "median step (s) [95%], warm-up excluded": median_text(r.get("step_time")),
        "tokens/s": tokens_per_s(r),
        "MFU (% of measured matmul)": pct(r.get("throughput", {}).get("mfu_vs_measured_ceiling")),
        "MFU (% of published peak)": pct(r.get("throughput", {}).get("mfu_vs_published_peak")),
        f"peak memory (MiB, {r['train_memory']['kind']})": peak_mib(r["train_memory"]),
        "val loss before": r["validation_before"]["loss"], "val loss after": r["validation_after"]["loss"],
        "energy (J/token)": (r.get("energy") or {}).get("joules_per_token"), "env": env_of(r),
    } for r in records.ok(rows)])
