"""The serving part's tables: throughput and its ratios per (method, concurrency), and the latency percentiles."""
from __future__ import annotations

import pandas as pd

from .... import records
from ....measure.stats import format_ratio, ratio_words
from ..fmt import env_of, status_text
from ..spread import of_median, text

SERVING_COLUMNS = ["method", "concurrency", "status", "requests/s", "output tokens/s", "x naive [95% CI]",
                   "verdict vs naive", "x static [95% CI]", "verdict vs static", "env"]


def _serving_ratio(cell: dict, key: str) -> tuple[str, str]:
    ratio = records.serving_ratio(cell, key)
    return (format_ratio(ratio), ratio_words(ratio)) if ratio else ("-", "-")


def serving_table(jobs: list[dict]) -> pd.DataFrame:
    """Per (method, concurrency): the median over the bursts of requests/s and output tokens/s with their 95%
    interval (or range), and the paired per-round throughput ratios over naive and, for continuous batching,
    over static batching at the same concurrency, each with its verdict."""
    out = []
    for job in records.ok(jobs):
        for c in job["cells"]:
            row = {"method": c["method"], "concurrency": c["concurrency"], "status": status_text(c), "env": env_of(job)}
            if records.is_ok(c):
                naive, static = _serving_ratio(c, "throughput_vs_naive"), _serving_ratio(c, "continuous_vs_static")
                row |= {"requests/s": text(of_median(c["requests_per_s"])),
                        "output tokens/s": text(of_median(c["output_tokens_per_s"])),
                        "x naive [95% CI]": naive[0], "verdict vs naive": naive[1],
                        "x static [95% CI]": static[0], "verdict vs static": static[1]}
            out.append(row)
    return pd.DataFrame(out, columns=SERVING_COLUMNS)


SERVING_LATENCY_COLUMNS = ["method", "concurrency", "TTFT p50 (s)", "TTFT p90 (s)", "TTFT p99 (s)", "latency p50 (s)",
                           "latency p90 (s)", "latency p99 (s)", "env"]


def serving_latency_table(jobs: list[dict]) -> pd.DataFrame:
    """Per measured (method, concurrency): TTFT and latency percentiles over the requests of all its bursts."""
    out = []
    for job in records.ok(jobs):
        for c in records.ok(job["cells"]):
            ttft, lat = (c.get("ttft_s") or {}), (c.get("latency_s") or {})
            out.append({"method": c["method"], "concurrency": c["concurrency"],
                        **{f"TTFT {q} (s)": ttft.get(q) for q in ("p50", "p90", "p99")},
                        **{f"latency {q} (s)": lat.get(q) for q in ("p50", "p90", "p99")}, "env": env_of(job)})
    return pd.DataFrame(out, columns=SERVING_LATENCY_COLUMNS)
