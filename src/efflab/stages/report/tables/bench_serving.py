"""The serving part's tables: throughput and its ratios per (method, concurrency), and the latency percentiles."""
from __future__ import annotations

import pandas as pd

from .... import records
from ....measure.stats import format_ratio, ratio_words
from .. import decisions
from ..spread import of_median, text
from ..writing import brief, env_of, status_text

SERVING_COLUMNS = ["method", "concurrency", "status", "requests/s", "output tokens/s", "x naive [95% CI]",
                   "verdict vs naive", "x static [95% CI]", "verdict vs static", "env"]


def _serving_ratio(cell: dict, key: str) -> tuple[str, str]:
    ratio = records.serving_ratio(cell, key)
    return (format_ratio(ratio), brief(ratio_words(ratio))) if ratio else ("-", "-")  # the section says why once


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


# Output tokens/s, TPOT p99 and E2E p50 are in summary.csv (the long results table), for report.md's size.
OPEN_LOOP_COLUMNS = ["rate (requests/s)", "method", "status", "requests/s", "goodput (requests/s)", "TTFT p50 (s)",
                     "TTFT p99 (s)", "TPOT p50 (s)", "E2E p99 (s)", "queue saturated", "method saturates at", "env"]


def _open_loop_row(c: dict, saturation: dict) -> dict:
    row = {"rate (requests/s)": c["rate"], "method": c["method"], "status": status_text(c)}
    if not records.is_ok(c):
        return row
    pct = {f"{name} {q} (s)": (c.get(key) or {}).get(q) for name, key in (("TTFT", "ttft_s"), ("TPOT", "tpot_s"),
                                                                          ("E2E", "e2e_s")) for q in ("p50", "p99")}
    return row | pct | {
        "requests/s": text(of_median(c["requests_per_s"])), "output tokens/s": text(of_median(c["output_tokens_per_s"])),
        "goodput (requests/s)": text(of_median(c["goodput_per_s"])),
        "queue saturated": f"{'yes' if c['saturated'] else 'no'} (x{c['queue_growth']:.1f} wait, "
                           f"{c['kept_up']:.0%} kept up)",
        "method saturates at": (saturation.get(c["method"]) or {}).get("said", "-")}


def open_loop_table(jobs: list[dict]) -> pd.DataFrame:
    """Per offered rate and method (open loop, Poisson arrivals): the medians over the repeats of requests/s, output
    tokens/s and goodput (requests/s meeting the SLO) with their 95% interval (or range), percentiles of TTFT, TPOT and
    end-to-end latency over the pooled requests, whether the queue grew without bound at this rate (the wait of the
    later half over the earlier half's, the share of the offered rate achieved) and the method's saturation rate."""
    out = []
    for job in records.ok(jobs):
        o = job.get("open_loop") or {}
        out += [_open_loop_row(c, o["saturation"]) | {"env": env_of(job)} for c in o.get("cells", [])]
    return pd.DataFrame(out, columns=OPEN_LOOP_COLUMNS)


SLO_SEARCH_COLUMNS = ["subject", "status", "highest rate meeting the SLO (requests/s)", "interval", "brackets",
                      "goodput there (requests/s)", "probes", "cache on vs off", "env"]


def _rate(x: float | None) -> str:
    return "-" if x is None else f"{x:.3g}"


def _interval(a: dict) -> str:
    kind = "95% CI" if a["interval"] == "ci95" else f"range, {a['coverage']:.0%} coverage"
    return f"[{_rate(a['lo'])}, {_rate(a['hi']) if a['hi'] is not None else 'over ' + _rate(a['highest'])}] ({kind})"


def slo_search_table(jobs: list[dict]) -> pd.DataFrame:
    """Per subject (method, workload, prefix cache) of the SLO search: the highest rate meeting the SLO (the median
    over the schedules of the highest rate each met) with the interval of their brackets and its coverage, each
    schedule's bracket, the goodput at it (held below the arrival rate), and the prefix cache's verdict, all as
    decisions.slo_search_answer holds them."""
    out = []
    for job in records.ok(jobs):
        o = job.get("slo_search") or {}
        d = decisions.slo_search_answer(o) or {"subjects": {}, "caching": {}}
        verdicts = {c["on"]: c["verdict"] for c in d["caching"].values()}
        for x in o.get("subjects", []):
            row = {"subject": x["name"], "status": status_text(x), "env": env_of(job)}
            if x["name"] in d["subjects"]:
                a, g = d["subjects"][x["name"]]["answer"], d["subjects"][x["name"]]["goodput"]
                row |= {"highest rate meeting the SLO (requests/s)": _rate(a["value"]) + (
                            f" ({a['censored']})" if a["censored"] else ""), "interval": _interval(a),
                        "brackets": "; ".join(f"{_rate(lo)}-{_rate(hi)}" for lo, hi in a["brackets"]),
                        "goodput there (requests/s)": _rate(g["value"]), "probes": a["probes"],
                        "cache on vs off": brief(verdicts.get(x["name"], "-"))}
            out.append(row)
    return pd.DataFrame(out, columns=SLO_SEARCH_COLUMNS)
