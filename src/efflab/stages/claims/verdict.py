"""Verdicts: a value against the claim's tolerance band, by equivalence, byte units read in the seed's convention.

A measured value with its 95% interval is reproduced only when the whole interval lies inside the band, differs
only when it lies wholly outside, and is inconclusive when it crosses an edge. A measured value without an
interval (one burst, a fit through three points, two timings) is inconclusive wherever it lies. A computed value
(arithmetic on the seed's own inputs) or a count of this run's tensors (exact: its interval is the value itself)
is judged as it stands. A measured claim's figure is a Reading, or NotHere where its results are not there.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

# What one reported unit is in the base unit its quantity returns (bytes, parameters, a plain number).
UNIT_SCALE = {"params": 1, "M params": 1e6, "B params": 1e9, "bytes": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9,
              "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TB/s": 1e12, "bytes/param": 1, "bits": 1, "%": 1, "x": 1,
              "count": 1, "cycles": 1, "s": 1, "exponent": 1, "bits/byte": 1}
# Byte units whose prefix a seed may write loosely: the power of the prefix, and the convention the label itself
# names. Each seed's `units.convention` (workflow/claims.yaml) says how its labels are read; a claim outside the
# registry without one is taken at its word (KB/MB/GB decimal, KiB/MiB/GiB binary).
PREFIX_POWER = {"KB": 1, "MB": 2, "GB": 3, "KiB": 1, "MiB": 2, "GiB": 3}
LABEL_CONVENTION = {"KB": "decimal", "MB": "decimal", "GB": "decimal",
                    "KiB": "binary", "MiB": "binary", "GiB": "binary"}
CONVENTION_BASE = {"decimal": 1000, "binary": 1024}
OTHER = {"decimal": "binary", "binary": "decimal"}
# The unit a label means under the other convention: decimal and binary prefixes are the usual confusion.
OTHER_UNIT = {"KB": "KiB", "MB": "MiB", "GB": "GiB", "KiB": "KB", "MiB": "MB", "GiB": "GB"}
VERDICTS = ("reproduced", "differs", "inconclusive", "not reproducible here", "needs GPU")
# What a verdict rests on: measured by this run (with its interval), computed from the seed's own inputs, or a
# definition (a parameter count, a format, a library default or another identity).
EVIDENCE = ("measured", "computed", "definition")


@dataclass(frozen=True)
class Reading:
    """A figure read from this run's results, in the claim's base unit. `ci`: its 95% interval; `exact`: a count
    of this run's tensors (bytes, parameters), whose value has no sampling spread; `cause`: why it is what it is,
    computed from the records, said where the verdict is not reproduced."""
    value: float
    how: str
    ci: tuple[float, float] | None = None
    exact: bool = False
    cause: str = ""


class NotHere(Exception):
    """The results a measured claim needs are not in this results folder."""


def fmt(x: float) -> str:
    if isinstance(x, (list, tuple)):
        return "–".join(fmt(v) for v in x)
    return f"{x:,.0f}" if abs(x) >= 1000 else f"{x:.4g}"


def reported_text(value) -> str:
    return "–".join(f"{v:,}" for v in value) if isinstance(value, list) else f"{value:,}"


def convention(claim: dict) -> str | None:
    """How the claim's byte unit is read: its seed's convention, else what the label says; None for a unit
    without a decimal/binary prefix."""
    unit = claim["reported"]["unit"]
    if unit not in PREFIX_POWER:
        return None
    return (claim.get("units") or {}).get("convention", LABEL_CONVENTION[unit])


def unit_scale(unit: str, conv: str | None) -> float:
    """One `unit` in its base unit, the prefix read in convention `conv` (decimal 1000^n, binary 1024^n)."""
    return CONVENTION_BASE[conv] ** PREFIX_POWER[unit] if conv else UNIT_SCALE[unit]


def _meant(unit: str, conv: str) -> str:
    """The unambiguous unit a label stands for under a convention: GB read as binary is GiB."""
    return unit if conv == LABEL_CONVENTION[unit] else OTHER_UNIT[unit]


def _shown(x: float, unit: str, conv: str | None, interval: list[float] | None = None) -> str:
    meant = _meant(unit, conv) if conv else unit
    return (f"{fmt(x)} {unit}" + (f" [{fmt(interval[0])}, {fmt(interval[1])}]" if interval else "")
            + (f" ({conv}: {meant})" if meant != unit else ""))


def units_label(claim: dict) -> str:
    """The claims.csv `units` column: the convention a byte claim is read in and what it rests on (the seed's
    recorded evidence, or the default: the label taken at its word)."""
    conv = convention(claim)
    if not conv:
        return ""
    return f"{conv} ({claim['units']['evidence_kind'] if claim.get('units') else 'default'})"


def band(claim: dict) -> tuple[float, float]:
    """The values that reproduce the claim, in its reported unit: its tolerance band around the reported value
    (or range, or bound)."""
    value, tol = claim["reported"]["value"], claim["tolerance"]
    if isinstance(value, list):
        return value[0] * (1 - tol), value[1] * (1 + tol)
    compare = claim.get("compare", "equal")
    if compare == "at_least":
        return value * (1 - tol), math.inf
    if compare == "at_most":
        return -math.inf, value * (1 + tol)
    return value - tol * abs(value), value + tol * abs(value)


def band_text(claim: dict) -> str:
    lo, hi = band(claim)
    unit = claim["reported"]["unit"]
    if math.isinf(hi):
        return f"≥ {fmt(lo)} {unit}"
    if math.isinf(lo):
        return f"≤ {fmt(hi)} {unit}"
    return f"{fmt(lo)} {unit}" if lo == hi else f"{fmt(lo)}–{fmt(hi)} {unit}"


def _holds(x: float, claim: dict) -> bool:
    lo, hi = band(claim)
    return lo - 1e-12 * abs(lo) <= x <= hi + 1e-12 * abs(hi)


def _ratio(x: float, claim: dict):
    value = claim["reported"]["value"]
    return None if isinstance(value, list) or value == 0 else x / value


def unit_fit(base_value: float, claim: dict) -> str:
    """Which readings of a byte claim's prefix reproduce the value: decimal, binary, both or neither; '' for a
    unit without one."""
    unit = claim["reported"]["unit"]
    if unit not in PREFIX_POWER:
        return ""
    fits = [c for c in CONVENTION_BASE if _holds(base_value / unit_scale(unit, c), claim)]
    return "both" if len(fits) == 2 else fits[0] if fits else "neither"


def _mismatch(base_value: float, x: float, claim: dict, conv: str | None) -> str:
    """Where the value fits only in the other convention: said against the seed's recorded one (or the label's)."""
    other = OTHER.get(conv)
    if not other:
        return ""
    unit = claim["reported"]["unit"]
    alt = base_value / unit_scale(unit, other)
    if not _holds(alt, claim):
        return ""
    said = (f"fits only in {other}: {fmt(x)} {_meant(unit, conv)} = {fmt(alt)} {_meant(unit, other)}, "
            f"but this seed's {unit} are {conv}")
    if claim.get("units"):
        return said + f" (its unit convention: {claim['units']['evidence_kind']} evidence)"
    return said.replace("this seed's", "nothing says the seed's").replace(f" are {conv}", f" are {other}")


def judge(base_value: float, claim: dict, unexplained: str = "the seed's figure does not follow from its stated inputs",
          ci: list[float] | None = None, measured: bool = False, exact: bool = False) -> dict:
    """Compare a value in the base unit with the reported one, like with like: a byte unit is read in the seed's
    convention. `ci`: the value's 95% interval [lo, hi] in the same base unit; `measured`: the value is a
    measurement, so without an interval it decides nothing; `exact`: a count of this run's tensors, its own
    interval.

    Returns the value and interval in the reported unit, as shown, with the verdict and why."""
    unit = claim["reported"]["unit"]
    conv = convention(claim)
    scale = unit_scale(unit, conv)
    x = base_value / scale
    interval = [x, x] if exact else sorted(v / scale for v in ci) if ci is not None else None
    out = {"shown": _shown(x, unit, conv, None if exact else interval), "value": x,
           "interval": interval, "ratio": _ratio(x, claim), "fit": unit_fit(base_value, claim)}
    where = f"the tolerance band {band_text(claim)}"
    if measured and interval is None:
        side = "inside" if _holds(x, claim) else "outside"
        return {**out, "verdict": "inconclusive",
                "why": f"a measurement without a 95% interval ({fmt(x)} {unit}, {side} {where}): only an "
                       f"interval decides"}
    if interval and not exact:
        ci_text = f"95% interval [{fmt(interval[0])}, {fmt(interval[1])}] {unit}"
        lo, hi = band(claim)
        if _holds(interval[0], claim) and _holds(interval[1], claim):
            return {**out, "verdict": "reproduced", "why": f"the {ci_text} lies inside {where}"}
        if interval[0] <= hi and interval[1] >= lo:
            return {**out, "verdict": "inconclusive",
                    "why": f"the {ci_text} crosses an edge of {where} (median {fmt(x)} {unit})"}
        return {**out, "verdict": "differs", "why": "; ".join(filter(None, [
            claim.get("diagnosis") or unexplained, f"the whole {ci_text} lies outside {where}"]))}
    if _holds(x, claim):
        return {**out, "verdict": "reproduced", "why": ""}
    mismatch = _mismatch(base_value, x, claim, conv)
    reasons = [claim.get("diagnosis") or ("" if mismatch else unexplained), mismatch]
    return {**out, "verdict": "differs", "why": "; ".join(filter(None, reasons))}


def verdict_class(verdict: str) -> str:
    return next(v for v in VERDICTS if verdict.startswith(v))
