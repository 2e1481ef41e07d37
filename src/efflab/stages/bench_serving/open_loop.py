"""The open loop: requests sent at each offered rate with Poisson arrivals, each method's cells served in the
serving rounds, and their figures (measure.load: throughput, goodput, percentiles, saturation)."""
from __future__ import annotations

import logging

import torch

from ...measure import load
from ...measure.timing import SENTINEL_TOLERANCE
from .rounds import CPU, cell_name, serve_rounds
from .servers import unavailable_reason

log = logging.getLogger("efflab")


OPEN_COLUMNS = ("method", "rate", "repeat", "request", "arrival_s", "first_token_s", "finished_s", "prompt_tokens",
                "output_tokens")


def open_row(r: dict, rate: float) -> dict:
    """A served open-loop request as open_loop_requests.csv has it: its round is its repeat, its arrival scheduled."""
    return {"method": r["method"], "rate": rate, "repeat": r["burst"], "arrival_s": r["submitted_s"]} | {
        k: r[k] for k in ("request", "first_token_s", "finished_s", "prompt_tokens", "output_tokens")}


def measure_open(cells: list[dict], serve, repeats: int, slo: dict, device: torch.device = CPU,
                 tolerance: float = SENTINEL_TOLERANCE) -> tuple[list[dict], list[dict]]:
    """Rate by rate, the methods' cells at that rate (those not marked unavailable) served `repeats` stable rounds
    (serve_rounds: a warm-up, the balanced order, the speed sentinel), every method sent the same schedule in a round;
    then each cell's figures (measure.load.cell_figures) from its rows of the rounds the figures are of. Returns the
    rows of every round (OPEN_COLUMNS) and, per rate, the sentinel's record."""
    rows, sentinels = [], []
    for rate in sorted({c["rate"] for c in cells}):
        here = [c for c in cells if c["rate"] == rate and "status" not in c]
        served, sentinel = serve_rounds(serve, here, repeats, device, tolerance)
        rows += [open_row(r, rate) for r in served]
        kept = set(sentinel["figures_of_bursts"]) if sentinel else set()
        for c in (c for c in here if "status" not in c):
            c |= {"status": "ok"} | load.cell_figures([r for r in rows if (r["method"], r["rate"]) == (
                c["method"], rate) and r["repeat"] in kept], rate, slo)
        sentinels.append({"rate": rate, "sentinel": sentinel})
    return rows, sentinels


def sweep(s: dict, model, serve, device) -> tuple[list[dict], dict | None]:
    """The open-loop sweep of `open_loop` (None, or no rates or methods: left out): each method at each rate, at most
    max(`concurrency`) requests worked on at once; the rows and the record, with each method's saturation rate."""
    o, slo = s.get("open_loop") or {}, s.get("slo") or {}
    if not o.get("rates") or not o.get("methods"):
        return [], None
    reasons = {m: unavailable_reason(m, model) for m in o["methods"]}
    cells = [{"method": m, "rate": rate, "concurrency": max(s["concurrency"])} for rate in o["rates"]
             for m in o["methods"]]
    for c in cells:  # the name labels the cell in summary.csv (report.tidy), as in the round orders
        c |= {"name": cell_name(c)} | ({"status": "unavailable", "reason": reasons[c["method"]]}
                                       if reasons[c["method"]] else {})
    rows, sentinels = measure_open(cells, serve, o["repeats"], slo, device, s["sentinel_tolerance"])
    saturation = {m: load.saturation(ok) for m in o["methods"]
                  if (ok := [c for c in cells if c["method"] == m and c["status"] == "ok"])}
    for c in (c for c in cells if c["status"] == "ok"):
        log.info("open loop %s: %.2f requests/s achieved, goodput %.2f requests/s, TTFT p50 %.3f s%s", cell_name(c),
                 c["requests_per_s"]["median"], c["goodput_per_s"]["median"], (c["ttft_s"] or {}).get("p50", 0.0),
                 ", saturated" if c["saturated"] else "")
    return rows, o | {"concurrency": max(s["concurrency"]), "slo": slo, "measured": load.MEASURED,
                      "arrival": "Poisson (exponential gaps of mean 1/rate, seeded by seed, rate and repeat; the "
                                 "same schedule for every method); TTFT and latency from the scheduled arrival",
                      "saturation_rule": load.SATURATION_RULE, "by_rate": sentinels, "cells": cells,
                      "saturation": saturation}
