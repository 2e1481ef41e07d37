"""How the report writes a value: units, intervals, ratios, statuses and Markdown tables."""
from __future__ import annotations

import json

import pandas as pd

from .. import records
from ..measure import fingerprint, format_ratio


MiB = 2**20


def env_of(metrics: dict) -> str:
    """The environment fingerprint of a result (computed for results written before it was stored)."""
    env = metrics["environment"]
    return env.get("fingerprint") or fingerprint(env)


def pct(x: float | None) -> float | None:
    return None if x is None else 100 * x


def peak_mib(m: dict | None) -> float | None:
    return None if not m else m.get("peak_mib")


def status_text(row: dict) -> str:
    return "ok" if records.is_ok(row) else f"{row['status']}: {row.get('reason', '')}"


def interval_text(stats: dict, scale: float = 1.0) -> str:
    """The 95% interval of the median as lo–hi; where n gives none, the range of the n values, named so."""
    if "ci95_median" not in stats:
        return "-"
    if stats["ci95_median"] is None:
        return f"{scale * stats['min']:.4g}–{scale * stats['max']:.4g} (range, n={stats['n']})"
    lo, hi = stats["ci95_median"]
    return f"{scale * lo:.4g}–{scale * hi:.4g}"


def median_text(stats: dict | None) -> str:
    """The median with its 95% interval, or with the range of its n values where n gives no interval."""
    if not stats:
        return "-"
    if stats.get("ci95_median") is None:
        return f"{stats['median']:.2f} (range {stats['min']:.2f}–{stats['max']:.2f}, n={stats['n']})"
    lo, hi = stats["ci95_median"]
    return f"{stats['median']:.2f} [{lo:.2f}, {hi:.2f}]"


def speedup_text(pair: dict | None, key: str) -> str:
    """An interleaved comparison's speedup with its interval: '1.31 [1.22, 1.40]'."""
    ratio = (pair or {}).get(key) or {}
    if ratio.get("median") is None:
        return (pair or {}).get("unavailable", "-")
    return format_ratio(ratio)


def speedup_verdict(pair: dict | None, key: str) -> str:
    return ((pair or {}).get(key) or {}).get("verdict", "-")


def setting_text(value) -> str:
    """A setting as params.yaml spells it: false, 1e-05, [q_proj, v_proj], lora."""
    return value if isinstance(value, str) else json.dumps(value)


def ratio_of(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or not a else b / a


def one_line(text: str | None, limit: int = 240) -> str:
    text = " ".join((text or "").split())
    return (text[:limit] + "…" if len(text) > limit else text).replace("|", "\\|")


def markdown(df: pd.DataFrame) -> str:
    """A markdown table; cells with no value (a failed or unavailable row) print as '-', not 'nan'."""
    clean = df.astype(object).where(df.notna(), None)
    return clean.to_markdown(index=False, floatfmt=".4g", missingval="-")
