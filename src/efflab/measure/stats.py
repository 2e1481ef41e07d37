"""Order-statistic intervals and verdicts: summaries of samples, paired ratios and what they say.

No torch here: records and the report read verdicts without loading it."""
from __future__ import annotations

import math
import statistics
from math import comb


def percentile(ordered: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default) of an already sorted list."""
    pos = (len(ordered) - 1) * q
    lo, hi = int(pos), min(int(pos) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def summarize(samples: list[float], unit: str = "s", keep_samples: bool = True) -> dict:
    """Median and spread of a list of measurements in `unit`: n, mean, std, p50/p90/p99, min, max and the
    distribution-free interval of the median from order statistics with its coverage (at least 95%), None when
    n is too small to give one (fewer than 6): then only the range [min, max] of the n values is known."""
    ordered = sorted(samples)
    n = len(ordered)
    stats = {
        "n": n,
        "unit": unit,
        "median": percentile(ordered, 0.5),
        "p50": percentile(ordered, 0.5),
        "p90": percentile(ordered, 0.9),
        "p99": percentile(ordered, 0.99),
        "mean": statistics.fmean(ordered),
        "std": statistics.stdev(ordered) if n > 1 else 0.0,
        "min": ordered[0],
        "max": ordered[-1],
    }
    interval = median_ci_order(ordered)
    stats["ci95_median"], stats["ci_median_coverage"] = interval if interval else (None, None)
    if keep_samples:
        stats["samples"] = list(samples)
    return stats


def median_ci_order(ordered: list[float], level: float = 0.95) -> tuple[list[float], float] | None:
    """The distribution-free confidence interval of a median from order statistics, [x(k), x(n+1-k)] with the
    largest k whose binomial coverage 1 - 2 P(Bin(n, 1/2) < k) is at least `level`, and that coverage; None
    when n is too small for any (at 95%: fewer than 6 values). A bootstrap of 3 to 5 values gives intervals
    far narrower than their real coverage: two reruns then disagreed with each other's "significant" ratios."""
    n = len(ordered)
    tail, k = 0.0, 0
    while k < n // 2 and 2 * (tail + comb(n, k) / 2**n) <= 1 - level:
        tail += comb(n, k) / 2**n
        k += 1
    if k == 0:
        return None
    return [ordered[k - 1], ordered[n - k]], 1 - 2 * tail


def interval_is_range(n: int | None, level: float = 0.95) -> bool:
    """Whether the order-statistic interval of n values' median (median_ci_order) is their whole range, [x(1), x(n)]:
    then a ratio's verdict rests on its extreme rounds (faster: every one of the n rounds was), and says so."""
    if not n:
        return False
    ci = median_ci_order(list(range(n)), level)
    return ci is not None and ci[0] == [0, n - 1]


# "No significant difference" is itself a claim: that the two sides are within this much of each other.
EQUIVALENCE_MARGIN = 0.10


def ratio_verdict(ratios: list[float], level: float = 0.95) -> dict:
    """The median of per-round ratios (b's time over a's), its order-statistic interval and a verdict at that
    level, in the one vocabulary: `slower` / `faster` only when the interval lies above / below 1; `same within
    ±10%` only when it lies within ±EQUIVALENCE_MARGIN of 1; `not decided at this size` when it holds 1 but is wider
    than that (the data cannot tell a 10% difference from none: a rerun may find one), or when there are too few
    rounds for an interval at that level, with why. Two reruns can then disagree only by one of them being not
    decided."""
    ordered = sorted(ratios)
    median = percentile(ordered, 0.5)
    ci = median_ci_order(ordered, level)
    if ci is None:
        return {"median": median, "ci95": None, "level": level, "rounds": len(ordered),
                "verdict": f"{NOT_DECIDED}: {len(ordered)} rounds cannot give a {level:.0%} interval of the "
                           f"median (6 needed at 95%)"}
    (lo, hi), coverage = ci
    m = EQUIVALENCE_MARGIN
    verdict = ("slower" if lo > 1 else "faster" if hi < 1 else same_within(m)
               if 1 / (1 + m) <= lo and hi <= 1 + m else
               f"{NOT_DECIDED}: the {level:.0%} interval [{lo:.3g}, {hi:.3g}] holds 1 but also a {m:.0%} difference")
    return {"median": median, "ci95": [lo, hi], "coverage": coverage, "level": level, "rounds": len(ordered),
            "interval": "order statistics (distribution-free)", "verdict": verdict}


# The one vocabulary of every comparison the report and the claims state (the report's reading guide defines it):
# the interval excludes the centre: `higher` / `lower` (faster / slower); it lies inside the equivalence band:
# "same within ±X%"; anything else: "not decided at this size", with about how many rounds would decide it.
NOT_DECIDED = "not decided at this size"


def same_within(band: float) -> str:
    return f"same within ±{100 * band:g}%"


def rounds_to_decide(median: float, lo: float, hi: float, n: int | None, centre: float, band_lo: float,
                     band_hi: float) -> int | None:
    """About how many rounds would decide a comparison whose interval [lo, hi] from n rounds holds the centre:
    an interval narrows as 1/sqrt(n), so n (half-width / room)², for the room to exclude the centre or to fit the
    band, whichever is less. None where n is unknown or there is no room (the median on the centre or an edge)."""
    if not n:
        return None
    half = (hi - lo) / 2
    rooms = [r for r in (abs(median - centre), min(band_hi - median, median - band_lo)) if r > 0]
    return math.ceil(n * (half / max(rooms)) ** 2) if rooms and half > 0 else None


def compare(median: float | None, lo: float | None, hi: float | None, *, n: int | None = None,
            higher: str = "faster", lower: str = "slower", why: str | None = None) -> str:
    """The verdict of one ratio in the one vocabulary: `higher` / `lower` where the interval lies wholly above /
    below 1; "same within ±band" where it lies inside [1/(1+band), 1+band] (band: EQUIVALENCE_MARGIN); else "not
    decided at this size", with the rounds that would decide it where computable. `why`: the reason there is no
    comparison (e.g. the machine's speed changed)."""
    centre, band = 1.0, EQUIVALENCE_MARGIN
    if why:
        return f"not decided: {why.removeprefix('not a verdict: ')}"
    if median is None:
        return "not measured"
    if lo is None or hi is None:
        return f"{NOT_DECIDED} ({'n=' + str(n) + ', ' if n else ''}no 95% interval)"
    if lo > centre:
        return higher
    if hi < centre:
        return lower
    band_lo, band_hi = centre / (1 + band), centre * (1 + band)
    if band_lo <= lo and hi <= band_hi:
        return same_within(band)
    need = rounds_to_decide(median, lo, hi, n, centre, band_lo, band_hi)
    return NOT_DECIDED + (f" (about n={need} would decide it; n={n} here)" if need and need > n else "")


def ratio_words(ratio: dict | None, higher: str = "faster", lower: str = "slower") -> str:
    """A ratio record (paired_ratio, speedup, a step-time ratio: median, ci95, rounds or n) in the vocabulary;
    `higher` is what a ratio above 1 means (a speedup: faster; a time ratio: slower)."""
    if not ratio:
        return "not measured"
    lo, hi = ratio.get("ci95") or (None, None)
    why = ratio.get("why") or (ratio["verdict"] if ratio.get("median") is None and ratio.get("verdict") else None)
    return compare(ratio.get("median"), lo, hi, n=ratio.get("rounds") or ratio.get("n"), higher=higher,
                   lower=lower, why=why)


def against_tolerance(value: float | None, lo: float | None, hi: float | None, tolerance: float, unit: str = "%",
                      n: int | None = None) -> str:
    """A quality change (higher is worse) against its one tolerance, in the same vocabulary: "within +X" where the
    whole interval is at or below it, "beyond +X" where the whole interval is above it, else "not decided at this
    size"."""
    if value is None:
        return "not measured"
    if lo is None or hi is None:
        return f"{NOT_DECIDED} ({'n=' + str(n) + ', ' if n else ''}no 95% interval)"
    return (f"within +{tolerance:g}{unit}" if hi <= tolerance else f"beyond +{tolerance:g}{unit}" if lo > tolerance
            else NOT_DECIDED)


def said_of_faster_side(ratio: dict) -> dict:
    """A ratio of the reference's time over this side's (a speedup) with its verdict said of this side: the
    reference `slower` means this side is `faster`; other verdicts read the same."""
    return ratio | {"verdict": {"slower": "faster", "faster": "slower"}.get(ratio["verdict"], ratio["verdict"])}


def speedup(result: dict, mine: str, reference: str) -> dict:
    """The reference's time over `mine`'s from an interleave() result, with paired_ratio's interval and the
    verdict said of `mine`."""
    return said_of_faster_side(paired_ratio(result, mine, reference))


def format_ratio(ratio: dict | None, digits: int = 2) -> str:
    """'1.13 [1.02, 1.30]', '1.13 (no 95% interval: 3 rounds)' or '-'."""
    if not ratio or ratio.get("median") is None:
        return "-"
    if not ratio.get("ci95"):
        return f"{ratio['median']:.{digits}f} (no 95% interval: {ratio['rounds']} rounds)"
    lo, hi = ratio["ci95"]
    return f"{ratio['median']:.{digits}f} [{lo:.{digits}f}, {hi:.{digits}f}]"


def paired_ratio(result: dict, a: str, b: str, level: float = 0.95) -> dict:
    """b's time over a's from an interleave() result: the ratio within each stable round (so drift between
    rounds cancels), with ratio_verdict's interval and verdict. An unstable comparison gets no verdict."""
    kept = [r for r in result["rounds"] if r["stable"]]
    if "unstable" in result or len(kept) < 2:
        why = result.get("unstable") or f"only {len(kept)} stable round(s)"
        return {"median": None, "ci95": None, "rounds": len(kept), "verdict": f"not a verdict: {why}"}
    return ratio_verdict([r["seconds"][b] / r["seconds"][a] for r in kept], level)
