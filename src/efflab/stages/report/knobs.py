"""What each fine-tuning knob costs and buys: pairs of runs that differ in one setting, compared."""
from __future__ import annotations

import pandas as pd

from ... import records
from ...measure.timing import SENTINEL_TOLERANCE
from .writing import env_of, init_text, pct, peak_mib, ratio_of, setting_text


def _tensor_peaks(a: dict, b: dict) -> str:
    """The CPU live-tensor peaks of two runs (cpu_tensor_peak: counted from the allocator's events, the same
    for the same params on a rerun, so any difference is the knob's)."""
    peaks = [(r["train_memory"].get("tensors") or {}).get("delta_mib") for r in (a, b)]
    return "-" if None in peaks else f"{peaks[0]:,.0f} → {peaks[1]:,.0f}"


def _ratio_ci(ratio: dict | None) -> str:
    if not ratio or ratio.get("median") is None:
        return "-"
    how = {"interleaved": f"interleaved, {ratio['n']} rounds", "paired": f"{ratio['n']} paired steps",
           "runs": "the runs' intervals"}[ratio["source"]]
    if not ratio.get("ci95"):
        return f"{ratio['median']:.2f} ({how}, no 95% interval)"
    lo, hi = ratio["ci95"]
    return f"{ratio['median']:.2f} [{lo:.2f}, {hi:.2f}] ({how})"


def knob_timing(a: dict, b: dict, bench_finetune: list[dict]) -> tuple[dict | None, float | None]:
    """A knob pair's step-time ratio (records.step_ratio: the one measurement the claims read too) and, where
    bench_finetune interleaved the pair, its tokens/s ratio."""
    ratio = records.step_ratio(a, b, bench_finetune, SENTINEL_TOLERANCE)
    if ratio and ratio["source"] == "interleaved":
        runs = ratio["pair"]["runs"]
        return ratio, ratio_of(*[runs[r]["tokens_per_s"] for r in (a["run"], b["run"])])
    return ratio, ratio_of(a["tokens_per_s"], b["tokens_per_s"])


def _steps(r: dict) -> str:
    """A run's steps to the loss target (report.target.with_targets), or "not reached"."""
    t = r.get("time_to_target")
    return "-" if not t else str(t["steps"]) if t["reached"] else f"not reached ({t['steps_run']})"


def knob_table(rows: list[dict], bench_finetune: list[dict] = ()) -> pd.DataFrame:
    out = []
    for knob, value_a, value_b, a, b in records.knob_pairs(rows):
        value_a, value_b = setting_text(value_a), setting_text(value_b)
        mem_a, mem_b = peak_mib(a["train_memory"]), peak_mib(b["train_memory"])
        delta_a, delta_b = a["train_memory"].get("delta_mib"), b["train_memory"].get("delta_mib")
        memory_ratio = ratio_of(delta_a, delta_b)
        ratio, tokens_ratio = knob_timing(a, b, bench_finetune)
        out.append({
            "knob": knob, "from → to": f"{value_a} → {value_b}",
            "runs": f"{a['run']} → {b['run']}",
            "peak memory (MiB)": f"{mem_a:,.0f} → {mem_b:,.0f}" if mem_a and mem_b else "-",
            "training memory over baseline (MiB)": f"{delta_a:,.0f} → {delta_b:,.0f}" if delta_a and delta_b else "-",
            "memory change (%)": pct(memory_ratio - 1) if memory_ratio else None,
            "memory kind": a["train_memory"]["kind"],
            "live tensor peak (MiB)": _tensor_peaks(a, b),
            "step time ratio [95% CI]": _ratio_ci(ratio),
            "step time verdict": ratio["verdict"] if ratio else "-",
            "tokens/s ratio (interleaved)": tokens_ratio if (ratio or {}).get("source") == "interleaved" else None,
            "val loss after": f"{a['validation_after']['loss']:.4f} → {b['validation_after']['loss']:.4f}",
            "steps to target": f"{_steps(a)} → {_steps(b)}" if a.get("time_to_target") else None,
            "adapter init (s)": f"{init_text(a)} → {init_text(b)}" if knob == "lora.init" else None,
            "env": env_of(a) if env_of(a) == env_of(b) else f"{env_of(a)} / {env_of(b)}",
        })
    return pd.DataFrame(out)
