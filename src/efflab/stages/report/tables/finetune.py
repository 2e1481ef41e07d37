"""The fine-tuning part's run table (its knob table: report.knobs)."""
from __future__ import annotations

import pandas as pd

from .... import records
from ..writing import env_of, init_text, median_text, pct, peak_mib


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


def target_table(rows: list[dict]) -> pd.DataFrame:
    """Each run's time to the loss target (report.target.with_targets put it on the record): the learning rate and
    adapter init it trained with, steps and time (the warm-up steps as measured + the rest × the median step time,
    its 95% interval), the measured training seconds at that step, and the peak memory it trained at. No verdict:
    the glance's, decided once."""
    out = []
    for r in records.ok(rows):
        t = r.get("time_to_target")
        if not t:
            continue
        out.append({
            "run": r["run"], "method": r["method"], "learning rate": r["settings"].get("learning_rate"),
            "adapter init (s)": init_text(r),
            "optimizer": r.get("optimizer"),
            "steps to target": t["steps"] if t["reached"] else t["why"],
            "time to target (s) [95%]": _time_text(t),
            "measured training (s)": t.get("measured_s"),
            f"peak memory (MiB, {r['train_memory']['kind']})": peak_mib(r["train_memory"]),
            "env": env_of(r)})
    return pd.DataFrame(out)


def _time_text(t: dict) -> str:
    if not t["reached"]:
        return f"> {t['lo']:.3g}" if t["lo"] is not None else "-"
    if t["time_s"] is None:
        return "no step timer"
    return f"{t['time_s']:.3g} [{t['lo']:.3g}, {t['hi']:.3g}]" if t["lo"] is not None else f"{t['time_s']:.3g}"
