"""A figure with its spread, as the plots draw it: the value and its 95% interval where n gives one, else the
range of its n values (too few for a 95% interval, named so), else nothing (one measurement, or an exact count).
"""
from __future__ import annotations

from ...measure.stats import median_ci_order

CI, RANGE = "95% CI", "range"


def spread(value: float | None, lo: float | None = None, hi: float | None = None, kind: str | None = None,
           n: int | None = None) -> dict | None:
    if value is None:
        return None
    return {"value": value, "lo": lo, "hi": hi, "kind": kind if lo is not None else None, "n": n}


def gives_interval(n: int) -> bool:
    """Whether n values give a 95% order-statistic interval of their median (6 or more); records written before
    that rule carry a `ci95_median` for fewer, which is drawn as what it is, their range."""
    return median_ci_order(list(range(n))) is not None


def of_median(stats) -> dict | None:
    """A measure.stats.summarize figure: its median with the order-statistic 95% interval, or with the range of its n
    values where n gives none; a bare number has no spread."""
    if isinstance(stats, (int, float)):
        return spread(float(stats))
    if not stats or stats.get("median") is None:
        return None
    if stats.get("ci95_median") and gives_interval(stats.get("n") or 0):
        return spread(stats["median"], *stats["ci95_median"], kind=CI, n=stats.get("n"))
    return spread(stats["median"], stats.get("min"), stats.get("max"), kind=RANGE, n=stats.get("n"))


def of_speedup(pair: dict | None, key: str, reference: str) -> dict | None:
    """An interleaved speedup over `reference` (measure.stats.speedup under `key` of an interleave record): its median
    with its 95% interval, or, where its rounds give none, the range of the stable rounds' ratios."""
    ratio = (pair or {}).get(key) or {}
    if ratio.get("median") is None:
        return None
    if ratio.get("ci95"):
        return spread(ratio["median"], *ratio["ci95"], kind=CI, n=ratio.get("rounds"))
    ratios = [r["seconds"][reference] / s for r in pair.get("rounds", []) if r.get("stable", True)
              for side, s in r["seconds"].items() if side != reference]
    if not ratios:
        return spread(ratio["median"], n=ratio.get("rounds"))
    return spread(ratio["median"], min(ratios), max(ratios), kind=RANGE, n=len(ratios))


def of_ratio(ratio: dict | None) -> dict | None:
    """A ratio paired round by round (measure.stats.ratio_verdict, with its rounds' `ratios` beside it): its median with
    its 95% interval, or, where its rounds give none, the range of the rounds' ratios."""
    if not ratio or ratio.get("median") is None:
        return None
    if ratio.get("ci95"):
        return spread(ratio["median"], *ratio["ci95"], kind=CI, n=ratio.get("rounds"))
    ratios = ratio.get("ratios") or []
    if len(ratios) < 2:
        return spread(ratio["median"], n=ratio.get("rounds"))
    return spread(ratio["median"], min(ratios), max(ratios), kind=RANGE, n=len(ratios))


def of_change(change: dict | None) -> dict | None:
    """A paired perplexity change (quality.paired_change) in %, with its 95% interval where its rows give one; an
    unavailable comparison (no per-row losses, other rows) is None."""
    if not change or change.get("change_pct") is None:
        return None
    lo, hi = change.get("ci95_change_pct") or (None, None)
    return spread(change["change_pct"], lo, hi, kind=CI, n=change.get("n_rows"))


def of_axis(axis: dict | None) -> dict | None:
    """An option's axis (report.dominance.axis): its interval, none for an exact value or a single measurement."""
    if not axis:
        return None
    exact = axis["lo"] is not None and axis["lo"] == axis["hi"] == axis["value"]
    return spread(axis["value"], *((None, None) if exact else (axis["lo"], axis["hi"])), kind=CI, n=axis.get("n"))


def as_ratio(change: dict | None) -> dict | None:
    """A change in % as the ratio new / old (1 + change/100), interval and all."""
    if not change:
        return None
    to_ratio = (lambda v: None if v is None else 1 + v / 100)
    return spread(to_ratio(change["value"]), to_ratio(change["lo"]), to_ratio(change["hi"]), change["kind"],
                  change["n"])


def _short(v: float) -> str:
    return f"{v:.3g}" if abs(v) < 1000 else f"{v:,.0f}"


def text(s: dict | None, fmt=None) -> str:
    """'1.2 [1.1, 1.3]', '1.2 (range 1.0–1.4, n=3)', '1.2 (n=4, no interval)' or '1.2'; `fmt` a format string or a
    function of the number (3 significant digits, no exponent, thousands separated, by default)."""
    if not s:
        return "-"
    form = fmt if callable(fmt) else fmt.format if fmt else _short
    value = form(s["value"])
    if s["kind"] == CI:
        return f"{value} [{form(s['lo'])}, {form(s['hi'])}]"
    if s["kind"] == RANGE:
        return f"{value} (range {form(s['lo'])}–{form(s['hi'])}, n={s['n']})"
    return value + (f" (n={s['n']}, no interval)" if s["n"] and s["n"] > 1 else "")
