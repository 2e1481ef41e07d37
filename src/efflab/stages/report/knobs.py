"""What each fine-tuning knob costs and buys: pairs of runs that differ in one setting, compared."""
from __future__ import annotations

import pandas as pd

from ... import records
from ...measure.stats import format_ratio, median_ci_order, percentile
from ...measure.timing import SENTINEL_TOLERANCE
from .fmt import env_of, median_text, pct, peak_mib, ratio_of, setting_text


def step_time_ratio(a: dict, b: dict) -> dict | None:
    """Run b's step time over run a's, with the 95% interval of the median from order statistics (none under 6
    steps: then no verdict) and a verdict at that level:
    `slower` / `faster` only when the interval lies above / below 1, else `no significant difference`.

    Runs that drew the same batches in the same order (same seed and rows, so the same real tokens) are
    compared step by step: the ratio of each step to the same step of the other run, which takes the batches'
    different lengths out of the spread. Otherwise the two runs' median steps and their intervals are compared,
    and the verdict needs the intervals apart. Runs recorded without per-step times have none."""
    sa, sb = a.get("step_time"), b.get("step_time")
    if not sa or not sb or sa.get("n", 0) < 2 or sb.get("n", 0) < 2:
        return None
    ratios = records.paired_step_times(a, b)
    if ratios:
        interval = median_ci_order(ratios)
        if interval is None:
            return {"median": percentile(ratios, 0.5), "ci95": None, "paired": True,
                    "verdict": f"not a verdict: {len(ratios)} paired steps cannot give a 95% interval (6 needed)"}
        (lo, hi), _ = interval
        verdict = "slower" if lo > 1 else "faster" if hi < 1 else "no significant difference"
        return {"median": percentile(ratios, 0.5), "ci95": [lo, hi], "paired": True, "verdict": verdict}
    if sa.get("ci95_median") is None or sb.get("ci95_median") is None:
        return {"median": sb["median"] / sa["median"], "ci95": None, "paired": False,
                "verdict": "not a verdict: too few steps for a 95% interval of either median (6 needed)"}
    (lo_a, hi_a), (lo_b, hi_b) = sa["ci95_median"], sb["ci95_median"]
    verdict = "slower" if lo_b > hi_a else "faster" if hi_b < lo_a else "no significant difference"
    return {"median": sb["median"] / sa["median"], "ci95": None, "paired": False, "verdict": verdict}


def _tensor_peaks(a: dict, b: dict) -> str:
    """The CPU live-tensor peaks of two runs (cpu_tensor_peak: counted from the allocator's events, the same
    for the same params on a rerun, so any difference is the knob's)."""
    peaks = [(r["train_memory"].get("tensors") or {}).get("delta_mib") for r in (a, b)]
    return "-" if None in peaks else f"{peaks[0]:.0f} → {peaks[1]:.0f}"


def _ratio_ci(ratio: dict | None) -> str:
    if not ratio or ratio.get("median") is None:
        return "-"
    if ratio.get("interleaved"):
        return f"{format_ratio(ratio)} (interleaved, {ratio['rounds']} rounds)"
    if not ratio["paired"]:
        return f"{ratio['median']:.2f} (runs' intervals)"
    lo, hi = ratio["ci95"]
    return f"{ratio['median']:.2f} [{lo:.2f}, {hi:.2f}] (paired steps)"


def speed_changed(a: dict, b: dict, tolerance: float = SENTINEL_TOLERANCE) -> str | None:
    """Why two runs' own step times cannot be compared, when the matmul ceilings their processes measured
    differ by more than `tolerance`: the machine ran at another speed for one of them."""
    ca, cb = (r.get("throughput", {}).get("matmul_ceiling", {}).get("tflops") for r in (a, b))
    if ca and cb and abs(cb / ca - 1) > tolerance:
        return (f"not a verdict: the machine's speed changed between the runs (matmul ceiling {1000 * ca:.0f} vs "
                f"{1000 * cb:.0f} GFLOP/s)")
    return None


def knob_timing(a: dict, b: dict, bench_finetune: list[dict]) -> tuple[dict | None, float | None]:
    """A knob pair's step-time ratio and tokens/s ratio: from bench_finetune's interleaved steps where it
    measured the pair, else from the two runs' own steps, unless the machine's speed changed between them."""
    pair = records.interleaved_pair(bench_finetune, a["run"], b["run"])
    if pair:
        rates = [pair["runs"][r]["tokens_per_s"] for r in (a["run"], b["run"])]
        return pair["step_time_ratio"] | {"interleaved": True}, ratio_of(*rates)
    ratio = step_time_ratio(a, b)
    changed = speed_changed(a, b)
    if ratio and changed:
        ratio = ratio | {"verdict": changed}
    return ratio, ratio_of(a["tokens_per_s"], b["tokens_per_s"])


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
            "peak memory (MiB)": f"{mem_a:.0f} → {mem_b:.0f}" if mem_a and mem_b else "-",
            "training memory over baseline (MiB)": f"{delta_a:.0f} → {delta_b:.0f}" if delta_a and delta_b else "-",
            "memory change (%)": pct(memory_ratio - 1) if memory_ratio else None,
            "memory kind": a["train_memory"]["kind"],
            "live tensor peak (MiB)": _tensor_peaks(a, b),
            "median step, separate runs (s)": f"{median_text(a.get('step_time'))} → {median_text(b.get('step_time'))}",
            "step time ratio [95% CI]": _ratio_ci(ratio),
            "step time verdict": ratio["verdict"] if ratio else "-",
            "tokens/s ratio (interleaved)": tokens_ratio if (ratio or {}).get("interleaved") else None,
            "val loss after": f"{a['validation_after']['loss']:.4f} → {b['validation_after']['loss']:.4f}",
            "env": env_of(a) if env_of(a) == env_of(b) else f"{env_of(a)} / {env_of(b)}",
        })
    return pd.DataFrame(out)
