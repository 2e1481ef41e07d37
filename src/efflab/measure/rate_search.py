"""The highest request rate that meets a service-level objective: a bracketing search over the offered rate, each of
several Poisson schedules searched on its own, their brackets the answer's interval. Pure arithmetic and control
flow: the serving is passed in (`probe`), so a test drives the search with a simulated server of known service
rate, and every figure is recomputed from the rows a probe returns.

- **Requests per probe.** The SLO is judged at a percentile q of TTFT, TPOT and end-to-end latency; a probe sends
  enough requests that at least BEYOND of them lie beyond that percentile (requests_for: 1000 for p99, 100 for p90).
- **Schedules.** A schedule is n Poisson arrivals at rate 1 (unit_schedule), drawn again (seeded) until its achieved
  rate, n over the window its arrivals lie in, is within ±RATE_TOLERANCE of 1; at rate r its times are divided by r
  (the same schedule scaled: a probe at a higher rate sends the same requests closer together, so a schedule's
  outcome is close to monotone in the rate, as bisection needs).
- **A probe** (probe_figures): the percentiles against the SLO's bounds, and the goodput, requests meeting every
  bound per second over max(the schedule's window, the last finish): at most the requests/s served, which is at
  most the achieved arrival rate, by construction. A probe meets the SLO where every percentile is within its
  bound and the server kept up (`kept_up`, sustained: its requests left, first finish to last, at least
  measure.load.KEPT_UP as fast as they arrived, first arrival to last), so that a schedule which ends before an
  overloaded server's queue reaches the bound does not make a rate the server cannot sustain pass.
- **The search** (search): per (subject, schedule), a rate that meets is doubled and one that fails halved until a
  pair brackets the threshold (or the range [lowest, highest] ends), then `steps` geometric bisections. The
  subjects' searches advance a probe each per round, in a balanced order, so that compared subjects are
  interleaved.
- **The answer** (answer): the median over the schedules of the highest rate each met; its interval from the
  schedules' brackets, of the coverage the number of schedules gives (the order-statistic 95% interval from 6
  schedules; below 6, their whole range, which covers the median threshold with 1 - 2^(1-k)).
"""
from __future__ import annotations

import math
import random
import statistics
from dataclasses import dataclass, field

from . import load
from .stats import median_ci_order, percentile
from .timing import balanced_order

BEYOND = 10           # requests beyond the judged percentile, at least
RATE_TOLERANCE = 0.10  # a schedule's achieved rate within this share of the offered rate
DRAWS = 1000          # schedules drawn, at most, to find one within RATE_TOLERANCE
BOUNDS = ("ttft_s", "tpot_s", "e2e_s")
RULE = ("per schedule, a rate that meets the SLO doubled and one that fails halved until a pair brackets the highest "
        "rate that meets it, then geometric bisections; the answer the median over the schedules of the highest rate "
        "each met, its interval the schedules' brackets (95% from 6 schedules, else their range)")


def requests_for(q: float, beyond: int = BEYOND) -> int:
    """The fewest requests that put `beyond` of them past the q-th percentile (q in percent)."""
    return math.ceil(beyond / (1 - q / 100) - 1e-9)


def unit_schedule(n: int, seed: int, index: int, tolerance: float = RATE_TOLERANCE) -> dict:
    """Schedule `index`: n arrival offsets of a Poisson process at rate 1 (the first at 0, exponential gaps) and its
    window (the arrival after the last, the next one the schedule does not send: n unit gaps in all), drawn again,
    seeded by (seed, index, draw), until its achieved rate n / window is within ±tolerance of 1."""
    for draw in range(DRAWS):
        rng = random.Random(f"efflab slo search {seed} {index} {draw}")
        t, arrivals = 0.0, []
        for _ in range(n):
            arrivals.append(t)
            t += rng.expovariate(1.0)
        if abs(n / t - 1) <= tolerance:
            return {"index": index, "arrivals": arrivals, "window": t, "draws": draw + 1, "achieved": n / t}
    raise ValueError(f"no schedule of {n} arrivals within ±{tolerance:.0%} of its rate in {DRAWS} draws")


def at_rate(schedule: dict, rate: float) -> tuple[list[float], float]:
    """The schedule's arrivals and window at `rate` requests/s."""
    return [a / rate for a in schedule["arrivals"]], schedule["window"] / rate


def _tail(values: list[float | None], q: float) -> float:
    """The q-th percentile (q in percent) of values, a missing one (no first token, one output token) counted as
    beyond every bound."""
    return percentile(sorted(math.inf if v is None else v for v in values), q / 100)


def probe_figures(rows: list[dict], rate: float, window: float, slo: dict, q: float) -> dict:
    """One served schedule at `rate` (rows: measure.load's, arrivals from 0): each bounded time's q-th percentile
    and whether every one is within its bound (`meets`), the achieved arrival rate, and requests/s and goodput over
    max(window, last finish), so that goodput <= requests/s <= the achieved arrival rate."""
    times = [load.request_times(r) for r in rows]
    tails = {k: _tail([t[k] for t in times], q) for k in BOUNDS if slo.get(k) is not None}
    span = max(window, max(r["finished_s"] for r in rows))
    good = sum(load.meets(r, slo) for r in rows)
    kept_up = sustained(rows)
    return {"rate": rate, "requests": len(rows), "arrival_per_s": len(rows) / window, "span_s": span,
            "requests_per_s": len(rows) / span, "goodput_per_s": good / span, "met_slo": good,
            "attainment": good / len(rows), f"p{q:g}": tails, "kept_up": kept_up,
            "meets": kept_up >= load.KEPT_UP and all(v <= slo[k] for k, v in tails.items())}


def sustained(rows: list[dict]) -> float:
    """The rate the requests left at over the rate they arrived at: the span of their arrivals over the span of their
    finishes, first to last (about 1 where the server keeps up, its departures following its arrivals; its service
    rate over the arrival rate where it does not). Unlike requests/s over the whole run, it does not charge the last
    request's service time, which on a schedule of 20 requests is a tenth of it."""
    arrived = max(r["arrival_s"] for r in rows) - min(r["arrival_s"] for r in rows)
    left = max(r["finished_s"] for r in rows) - min(r["finished_s"] for r in rows)
    return arrived / left if left > 0 else 1.0


@dataclass
class Search:
    """One subject's search on one schedule: the highest rate that met, the lowest above it that failed."""
    subject: str
    schedule: int
    passed: float | None = None
    failed: float | None = None
    bisections: int = 0
    probes: list = field(default_factory=list)
    stopped: str | None = None

    def next_rate(self, start: float, lowest: float, highest: float, steps: int) -> float | None:
        """The next rate to probe, or None (and why, in `stopped`) when the search is done."""
        if self.stopped:
            return None
        if self.passed is None and self.failed is None:
            return min(max(start, lowest), highest)
        if self.passed is None:
            return self._stop("fails at the lowest rate") if self.failed <= lowest else max(self.failed / 2, lowest)
        if self.failed is None:
            return self._stop("meets at the highest rate") if self.passed >= highest else min(self.passed * 2, highest)
        return math.sqrt(self.passed * self.failed) if self.bisections < steps else self._stop("bracketed")

    def _stop(self, why: str) -> None:
        self.stopped = why
        return None

    def record(self, rate: float, figures: dict | None) -> None:
        """A probe's outcome (None: the serving failed, and the search stops)."""
        if figures is None:
            self.stopped = "failed"
            return
        self.bisections += self.passed is not None and self.failed is not None
        self.probes.append(figures)
        if figures["meets"]:
            self.passed = max(self.passed or 0.0, rate)
        else:
            self.failed = rate if self.failed is None else min(self.failed, rate)


def search(probe, subjects: list[str], schedules: int, start: float, lowest: float, highest: float,
           steps: int) -> list[Search]:
    """Every subject searched on every schedule (probe(subject, schedule, rate) -> probe_figures, or None where the
    serving failed): round by round, each unfinished search probes once, in measure.timing's balanced order."""
    searches = [Search(s, k) for k in range(schedules) for s in subjects]
    for index in range(10_000):
        due = [(s, r) for s in searches if (r := s.next_rate(start, lowest, highest, steps)) is not None]
        if not due:
            break
        for s, rate in balanced_order(due, index):
            s.record(rate, probe(s.subject, s.schedule, rate))
    return searches


def answer(searches: list[Search], lowest: float, highest: float) -> dict:
    """One subject's answer over its schedules: each schedule's bracket [highest rate met, lowest failed above it]
    (0 where none met down to `lowest`; infinity where none failed up to `highest`), the median of the rates met,
    and the interval of the coverage k schedules give (module docstring)."""
    met = sorted(s.passed or 0.0 for s in searches)
    failed = sorted(math.inf if s.failed is None else s.failed for s in searches)
    k = len(searches)
    ci_lo, ci_hi = median_ci_order(met), median_ci_order(failed)
    if ci_lo and ci_hi:
        lo, hi, coverage, kind = ci_lo[0][0], ci_hi[0][1], min(ci_lo[1], ci_hi[1]), "ci95"
    else:
        lo, hi, coverage, kind = met[0], failed[-1], 1 - 2 ** (1 - k), "range"
    value = statistics.median(met)
    return {"value": value, "lo": lo, "hi": None if math.isinf(hi) else hi, "n": k, "interval": kind,
            "coverage": coverage, "brackets": [[s.passed, s.failed] for s in searches],
            "censored": ("below the lowest rate" if value == 0.0 else
                         "above the highest rate" if math.isinf(hi) else None),
            "lowest": lowest, "highest": highest, "probes": sum(len(s.probes) for s in searches),
            "stopped": sorted({s.stopped for s in searches if s.stopped})}
