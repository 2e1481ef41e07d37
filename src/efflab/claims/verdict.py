"""Verdicts: a value against the claim's tolerance band, byte units read like with like."""
from __future__ import annotations

import math

# What one reported unit is in the base unit its quantity returns (bytes, parameters, a plain number).
UNIT_SCALE = {"params": 1, "M params": 1e6, "B params": 1e9, "bytes": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9,
              "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TB/s": 1e12, "bytes/param": 1, "bits": 1, "%": 1, "x": 1,
              "count": 1, "cycles": 1, "s": 1}
# Byte units whose prefix a seed may write loosely: the power of the prefix, and the convention the label itself
# names. A claim's `units.convention` (workflow/claims.yaml) says how the seed's label is to be read; without
# one the label is taken at its word (KB/MB/GB decimal, KiB/MiB/GiB binary).
PREFIX_POWER = {"KB": 1, "MB": 2, "GB": 3, "KiB": 1, "MiB": 2, "GiB": 3}
LABEL_CONVENTION = {"KB": "decimal", "MB": "decimal", "GB": "decimal",
                    "KiB": "binary", "MiB": "binary", "GiB": "binary"}
CONVENTION_BASE = {"decimal": 1000, "binary": 1024}
# The unit a label means under the other convention: decimal and binary prefixes are the usual confusion.
OTHER_UNIT = {"KB": "KiB", "MB": "MiB", "GB": "GiB", "KiB": "KB", "MiB": "MB", "GiB": "GB"}
VERDICTS = ("reproduced", "differs", "inconclusive", "not reproducible here", "needs GPU")


def _fmt(x: float) -> str:
    if isinstance(x, (list, tuple)):
        return "–".join(_fmt(v) for v in x)
    return f"{x:,.0f}" if abs(x) >= 1000 else f"{x:.4g}"


def reported_text(value) -> str:
    return "–".join(f"{v:,}" for v in value) if isinstance(value, list) else f"{value:,}"


def convention(claim: dict) -> str | None:
    """How the claim's byte unit is read: its registry `units.convention`, else what the label says; None for a
    unit without a decimal/binary prefix."""
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
    return (f"{_fmt(x)} {unit}" + (f" [{_fmt(interval[0])}, {_fmt(interval[1])}]" if interval else "")
            + (f" ({conv}: {meant})" if meant != unit else ""))


def units_label(claim: dict) -> str:
    """The claims.csv `units` column: the convention a byte claim is read in and what it rests on (source or
    arithmetic evidence recorded in the registry, or the default: the label taken at its word)."""
    conv = convention(claim)
    if not conv:
        return ""
    return f"{conv} ({claim['units']['evidence_kind'] if claim.get('units') else 'default'})"


def _units_note(claim: dict, conv: str) -> str:
    """The recorded convention and its evidence, as the row's reason states it."""
    units, unit = claim.get("units"), claim["reported"]["unit"]
    if not units:
        return ""
    return (f"the seed's {unit} are {_meant(unit, conv)} ({conv}, {units['evidence_kind']} evidence: "
            f"{units['evidence']})")


def _band(claim: dict) -> tuple[float, float]:
    """The values that reproduce the claim: its tolerance band around the reported value (or range, or bound)."""
    value, tol = claim["reported"]["value"], claim["tolerance"]
    if isinstance(value, list):
        return value[0] * (1 - tol), value[1] * (1 + tol)
    compare = claim.get("compare", "equal")
    if compare == "at_least":
        return value * (1 - tol), math.inf
    if compare == "at_most":
        return -math.inf, value * (1 + tol)
    return value - tol * abs(value) - 1e-12, value + tol * abs(value) + 1e-12


def _band_text(claim: dict) -> str:
    lo, hi = _band(claim)
    unit = claim["reported"]["unit"]
    if math.isinf(hi):
        return f"≥ {_fmt(lo)} {unit}"
    if math.isinf(lo):
        return f"≤ {_fmt(hi)} {unit}"
    return f"{_fmt(lo)}–{_fmt(hi)} {unit}"


def _holds(x: float, claim: dict) -> bool:
    lo, hi = _band(claim)
    return lo <= x <= hi


def _ratio(x: float, claim: dict):
    value = claim["reported"]["value"]
    return None if isinstance(value, list) or value == 0 else x / value


def judge(base_value: float, claim: dict,
          unexplained: str = "the seed's figure does not follow from its stated inputs",
          ci: list[float] | None = None) -> dict:
    """Compare a value in the base unit with the reported one, like with like: a byte unit is read in the
    claim's convention (decimal unless the registry records binary with its evidence). Reproduced, or differs
    with a reason; a figure that fits only in the other convention still differs, and says so.

    A measured value may come with `ci`, the 95% CI [lo, hi] of its median in the same base unit. Then the
    claim is judged by equivalence against its tolerance band: the whole CI inside the band is reproduced, the
    whole CI outside it differs, and a CI across either edge of the band is inconclusive, wherever its median
    lies."""
    unit = claim["reported"]["unit"]
    conv = convention(claim)
    scale = unit_scale(unit, conv)
    x = base_value / scale
    interval = sorted(v / scale for v in ci) if ci is not None else None
    recorded = claim.get("units")
    out = {"reproduced": _shown(x, unit, conv, interval), "ratio": _ratio(x, claim)}
    ci_text = f"95% CI [{_fmt(interval[0])}, {_fmt(interval[1])}] {unit}" if interval else ""
    other = {"decimal": "binary", "binary": "decimal"}.get(conv)
    alt = base_value / unit_scale(unit, other) if other else None
    note = _units_note(claim, conv) if conv else ""
    band_lo, band_hi = _band(claim)
    if interval and not band_lo <= interval[0] <= interval[1] <= band_hi and \
            interval[1] >= band_lo and interval[0] <= band_hi:
        return {**out, "verdict": "inconclusive",
                "why": "; ".join(filter(None, [f"the {ci_text} crosses an edge of the tolerance band "
                                               f"{_band_text(claim)} (median {_fmt(x)} {unit})", note]))}
    if _holds(x, claim):
        r, r_alt = _ratio(x, claim), (_ratio(alt, claim) if other else None)
        if r_alt is not None and abs(r_alt - 1) < 0.002 < abs(r - 1):
            note = "; ".join(filter(None, [note, f"closer in {other}: {_fmt(alt)} {_meant(unit, other)} "
                                                 f"(within {abs(r_alt - 1):.2%})"]))
        if interval:
            note = "; ".join(filter(None, [f"the {ci_text} lies inside the tolerance band {_band_text(claim)}",
                                           note]))
        return {**out, "verdict": "reproduced", "why": note}
    # A diagnosis in the registry is the reason found by reading the seed; a figure that fits only in the other
    # convention is reported as such, against the convention recorded (or the label, where none is).
    mismatch = ""
    if other and _holds(alt, claim):
        mismatch = (f"fits only in {other}: {_fmt(x)} {_meant(unit, conv)} = {_fmt(alt)} {_meant(unit, other)}, "
                    + (f"but the seed's {unit} are recorded as {conv} ({recorded['evidence_kind']} evidence: "
                       f"{recorded['evidence']})" if recorded else
                       f"but nothing in the seed says its {unit} are {_meant(unit, other)} (record units: "
                       f"{other} with the evidence, if the seed gives any)"))
    reasons = [claim.get("diagnosis") or ("" if mismatch else unexplained), mismatch or note,
               interval and f"the whole {ci_text} lies outside the tolerance band {_band_text(claim)}"]
    return {**out, "verdict": "differs", "why": "; ".join(filter(None, reasons))}



def verdict_class(verdict: str) -> str:
    return next(v for v in VERDICTS if verdict.startswith(v))

