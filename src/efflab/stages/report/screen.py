"""The records' figures held to their physical bounds (measure.bounds) before anything renders them: a figure that
cannot be true is taken out of the records the report reads (None, so that every table, line, plot and decision
shows it alike as missing) and kept in a list of what was withheld and why, which the report prints and the
statements ledger records."""
from __future__ import annotations

import copy

from ... import records
from ...measure.bounds import violation


def _withheld(stage: str, job: dict, where: str, metric: str, value, reason: str) -> dict:
    return {"stage": stage, "job": job.get("name") or stage, "where": where, "metric": metric, "value": value,
            "reason": reason}


def _inference(job: dict) -> list[dict]:
    out = []
    for c in job.get("cells", []):
        roof, where = c.get("roofline"), f"{records.cell_mode(c)} batch {c.get('batch_size')}"
        for key in ("bandwidth_fraction", "compute_fraction"):
            why = violation(key, (roof or {}).get(key))
            if why:
                out.append(_withheld("bench_inference", job, where, key, roof[key], why))
                roof[key], roof["bound"] = None, "withheld"
        spec = c.get("speculation") or {}
        checks = (("acceptance_rate", spec.get("acceptance_rate"), None),
                  ("accepted", spec.get("accepted"), spec.get("proposed")))
        for key, value, top in checks:
            why = violation(key, value, top)
            if why:
                out.append(_withheld("bench_inference", job, where, key, value, why))
                spec[key] = None
    return out


def _finetune(job: dict) -> list[dict]:
    out, rates = [], job.get("throughput") or {}
    for key in ("mfu_vs_measured_ceiling", "mfu_vs_published_peak"):
        why = violation("mfu", rates.get(key))
        if why:
            out.append(_withheld("finetune", job, "throughput", key, rates[key], why))
            rates[key] = None
    return out


def _open_loop(job: dict) -> list[dict]:
    """An open-loop cell whose rounds served more requests per second than their schedules sent (too few requests
    for a rate: the last one finished within a mean gap of its arrival): its requests/s and goodput withheld."""
    out = []
    for c in (job.get("open_loop") or {}).get("cells", []):
        over = [r for r in c.get("by_round", []) if r.get("offered_per_s") and records.is_ok(c)
                and violation("goodput", r["requests_per_s"], r["offered_per_s"])]
        if over:
            r = over[0]
            why = (f"requests/s served {violation('goodput', r['requests_per_s'], r['offered_per_s'])}, in "
                   f"{len(over)} of {len(c['by_round'])} schedules of {c['requests']} requests (too few for a rate)")
            out.append(_withheld("bench_serving", job, f"{c['method']} at {c['rate']:g} requests/s", "goodput",
                                 c["goodput_per_s"]["median"], why))
            for key in ("requests_per_s", "goodput_per_s", "output_tokens_per_s"):
                c[key] = c[key] | {"median": None, "ci95_median": None, "withheld": why}
    return out


SCREENS = {"bench_inference": _inference, "finetune": _finetune, "bench_serving": _open_loop}


def screen(metrics: dict) -> tuple[dict, list[dict]]:
    """The records with every figure beyond its bound withheld, and the list of what was withheld."""
    metrics, withheld = copy.deepcopy(metrics), []
    for stage, check in SCREENS.items():
        for job in records.ok(metrics.get(stage, [])):
            withheld += check(job)
    return metrics, withheld
