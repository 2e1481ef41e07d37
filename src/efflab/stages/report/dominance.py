"""Deciding between options from measurements with intervals: one axis at a time, then the frontier.

An option's value on an axis is a point with an interval (lo, hi), exact (a byte count: lo = hi = value), or a
point without one (a single measurement: it decides nothing). One option beats another on an axis only where
their intervals separate; it dominates another where it beats it on some axis and loses on none. The frontier is
what no option dominates, and a winner on an axis is named only where it beats every other option there.
"""
from __future__ import annotations


def axis(value, lo=None, hi=None, *, exact: bool = False, n: int | None = None) -> dict | None:
    """One measured value: `exact` values are their own interval; a value without lo/hi has no interval."""
    if value is None:
        return None
    if exact:
        lo = hi = value
    return {"value": value, "lo": lo, "hi": hi, "n": n}


def beats(a: dict | None, b: dict | None, better: str) -> bool:
    """Whether `a` is better than `b` on an axis where `better` is "min" or "max", by separated intervals."""
    if not a or not b or None in (a["lo"], a["hi"], b["lo"], b["hi"]):
        return False
    return a["hi"] < b["lo"] if better == "min" else a["lo"] > b["hi"]


def frontier(options: list[dict], better: dict[str, str]) -> list[str]:
    """The names of the options no other option dominates: beats on an axis and loses to on none, both measured
    on the same axes."""
    def dominates(a, b):
        if any((a["axes"].get(k) is None) != (b["axes"].get(k) is None) for k in better):
            return False  # measured on an axis where the other was not: nothing says it does not lose there
        wins = [beats(a["axes"].get(k), b["axes"].get(k), d) for k, d in better.items()]
        losses = [beats(b["axes"].get(k), a["axes"].get(k), d) for k, d in better.items()]
        return any(wins) and not any(losses)
    return [o["name"] for o in options if not any(dominates(p, o) for p in options if p is not o)]


def winner(options: list[dict], key: str, better: str) -> str | None:
    """The option that beats every other option on `key`, or None where no one does."""
    for o in options:
        others = [p for p in options if p is not o]
        if others and all(beats(o["axes"].get(key), p["axes"].get(key), better) for p in others):
            return o["name"]
    return None


def best_point(options: list[dict], key: str, better: str) -> str | None:
    """The option with the best point value on `key` (what a reader would guess from the table), to say when it
    is not a winner."""
    have = [o for o in options if (o["axes"].get(key) or {}).get("value") is not None]
    if not have:
        return None
    pick = min if better == "min" else max
    return pick(have, key=lambda o: o["axes"][key]["value"])["name"]
