"""Open-loop load: seeded Poisson arrival schedules, and what one served schedule's per-request rows say (throughput,
goodput under a service-level objective, TTFT / TPOT / end-to-end percentiles, whether the queue grew without
bound). Pure arithmetic on rows: no torch, no clock, so a test can plant a request log and recompute every figure.

A row: {request, arrival_s, first_token_s, finished_s, output_tokens}, its times in seconds since the schedule's
start (its first arrival is at 0). TTFT and end-to-end latency count from the scheduled arrival, not from when the
server took the request up: a server that falls behind pays for the queue it let grow.
"""
from __future__ import annotations

import random
import statistics

from .stats import percentile, summarize

# The saturation rule: a rate at which queueing grows without bound shows both signs at once, as medians over the
# repeats: the later half of the requests (by arrival) wait, to their first token, more than QUEUE_GROWTH times as
# long as the earlier half, and the requests finish at under KEPT_UP of the rate they arrive at.
QUEUE_GROWTH = 2.0
KEPT_UP = 0.9
SATURATION_RULE = (f"the lowest rate at which, as medians over its repeats, the later half of the requests waited "
                   f"more than {QUEUE_GROWTH:g}x as long for their first token (TTFT, from arrival) as the earlier "
                   f"half, and the achieved requests/s fell below {KEPT_UP:.0%} of the schedule's own offered rate")
MEASURED = ("offered rate: the schedule's requests over its window, its arrivals' span plus one mean gap (1/rate); "
            "throughput and goodput over the longer of that window and the span from its first arrival to its last "
            "finish, so that goodput <= requests/s served <= the offered rate")
PERCENTILES = (50, 90, 99)


def arrivals(n: int, rate: float, seed: int, repeat: int) -> list[float]:
    """n arrival offsets (s) of a Poisson process at `rate` requests/s: the first at 0, then exponential gaps of
    mean 1/rate, from a random.Random seeded by (seed, rate, repeat) alone, so that every method is sent the same
    schedule for a given rate and repeat, run after run."""
    rng = random.Random(f"efflab open loop {seed} {float(rate)!r} {repeat}")
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def request_times(row: dict) -> dict:
    """A request's TTFT and end-to-end latency (from its scheduled arrival) and its TPOT: (finished - first token)
    over its output tokens after the first (None with one token or no first-token stamp)."""
    first, out = row["first_token_s"], row["output_tokens"]
    return {"ttft_s": None if first is None else first - row["arrival_s"],
            "tpot_s": (row["finished_s"] - first) / (out - 1) if first is not None and out > 1 else None,
            "e2e_s": row["finished_s"] - row["arrival_s"]}


def meets(row: dict, slo: dict) -> bool:
    """Whether a request met every bound of the SLO (`ttft_s`, `tpot_s`, `e2e_s`; None or absent: no bound). A
    bound on a time the request lacks (no first-token stamp, one output token for TPOT) is not met."""
    times = request_times(row)
    return all(times[k] is not None and times[k] <= bound for k, bound in slo.items() if bound is not None)


def queue_growth(rows: list[dict]) -> float:
    """The later half's mean wait to the first token (TTFT; the end-to-end latency where unstamped) over the
    earlier half's, the requests in arrival order: about 1 while the server keeps up, growing with the queue."""
    ordered = sorted(rows, key=lambda r: r["arrival_s"])
    waits = [t["ttft_s"] if t["ttft_s"] is not None else t["e2e_s"] for t in map(request_times, ordered)]
    half = len(waits) // 2
    early, late = statistics.fmean(waits[:half] or waits), statistics.fmean(waits[half:])
    return late / max(early, 1e-9)


def run_figures(rows: list[dict], rate: float, slo: dict) -> dict:
    """One served schedule (a method at a rate, one repeat): requests/s, output tokens/s and goodput (requests/s
    meeting the SLO) over its span (MEASURED: at least the schedule's window, so that neither exceeds the offered
    rate), the offered rate of its own schedule, the share of it achieved and the queue's growth."""
    first_arrival = min(r["arrival_s"] for r in rows)
    window = max(r["arrival_s"] for r in rows) - first_arrival + 1 / rate  # the arrivals' span and one mean gap
    span = max(max(r["finished_s"] for r in rows) - first_arrival, window)
    offered = len(rows) / window
    good = sum(meets(r, slo) for r in rows)
    return {"requests": len(rows), "span_s": span, "offered_per_s": offered, "requests_per_s": len(rows) / span,
            "output_tokens_per_s": sum(r["output_tokens"] for r in rows) / span, "met_slo": good,
            "goodput_per_s": good / span, "kept_up": len(rows) / span / offered, "queue_growth": queue_growth(rows)}


def percentiles(rows: list[dict]) -> dict:
    """p50/p90/p99 of TTFT, TPOT and end-to-end latency over the rows (None where no row has that time)."""
    times = [request_times(r) for r in rows]
    out = {}
    for key in ("ttft_s", "tpot_s", "e2e_s"):
        xs = sorted(t[key] for t in times if t[key] is not None)
        out[key] = {f"p{q}": percentile(xs, q / 100) for q in PERCENTILES} if xs else None
    return out


def cell_figures(rows: list[dict], rate: float, slo: dict) -> dict:
    """A (method, rate) cell over its repeats (rows tagged `repeat`): each repeat's run_figures, the medians of
    requests/s, output tokens/s and goodput with their 95% interval where the repeats give one (summarize), the
    percentiles over the pooled requests, and whether the cell is saturated (SATURATION_RULE)."""
    runs = [{"repeat": k} | run_figures([r for r in rows if r["repeat"] == k], rate, slo)
            for k in sorted({r["repeat"] for r in rows})]
    median = lambda key: statistics.median(f[key] for f in runs)  # noqa: E731
    growth, kept_up = median("queue_growth"), median("kept_up")
    return {"rate": rate, "repeats": len(runs), "requests": runs[0]["requests"],
            "requests_per_s": summarize([f["requests_per_s"] for f in runs], "requests/s"),
            "output_tokens_per_s": summarize([f["output_tokens_per_s"] for f in runs], "tokens/s"),
            "goodput_per_s": summarize([f["goodput_per_s"] for f in runs], "requests/s"),
            **percentiles(rows), "queue_growth": growth, "kept_up": kept_up,
            "saturated": growth > QUEUE_GROWTH and kept_up < KEPT_UP, "by_round": runs}


def saturation(cells: list[dict]) -> dict:
    """One method's saturation rate from its cells (one per rate): the lowest saturated rate, or None, said."""
    rates = sorted(c["rate"] for c in cells)
    hit = [c["rate"] for c in cells if c["saturated"]]
    if hit:
        return {"saturation_rate": min(hit), "said": f"saturates at {min(hit):g} requests/s"}
    return {"saturation_rate": None, "said": f"not reached up to {rates[-1]:g} requests/s" if rates else "no rate"}


def best_goodput(cells: list[dict]) -> dict | None:
    """The cell of highest median goodput (the lower rate on a tie), as an axis: value, interval, n and rate; cells
    whose goodput was withheld (report.screen: beyond its bound) are not among them."""
    cells = [c for c in cells if c["goodput_per_s"].get("median") is not None]
    if not cells:
        return None
    c = max(sorted(cells, key=lambda c: c["rate"]), key=lambda c: c["goodput_per_s"]["median"])
    g = c["goodput_per_s"]
    lo, hi = g["ci95_median"] or (None, None)
    offered = [r["offered_per_s"] for r in c.get("by_round", [])]
    return {"value": g["median"], "lo": lo, "hi": hi, "n": g["n"], "rate": c["rate"], "min": g["min"],
            "max": g["max"], "bound": statistics.median(offered) if offered else None}
