"""The physical bounds of the figures efflab reports, in one table, and the check that holds a figure to its bound.

A figure outside its bound cannot be true: a share of a measured ceiling over 100%, a KL divergence below 0, more
candidates accepted than were proposed, more requests served meeting the SLO per second than arrived. Such a figure
is a fault of the measurement (a byte count that assumed one weight pass per token, a rate over too few requests),
and the report withholds it with the reason (report.screen) rather than print it.

Each bound is (lowest, highest, slack): `slack` is the rounding a correct computation can leave past the bound (a
KL summed in float32 from log-probabilities of one distribution comes out a few 1e-9 below 0, not below -1e-6), and
a figure within it is the bound itself to within rounding. A bound given by another figure of the same record (the
arrival rate bounds goodput) is passed as `highest` by the caller.
"""
from __future__ import annotations

import math

INF = math.inf
# metric -> (lowest, highest, slack, what it is)
BOUNDS = {
    "bandwidth_fraction": (0.0, 1.0, 0.0, "a share of the machine's measured copy bandwidth"),
    "compute_fraction": (0.0, 1.0, 0.0, "a share of the machine's measured matmul ceiling"),
    "mfu": (0.0, 1.0, 0.0, "model FLOPs utilisation: a share of a matmul ceiling"),
    "kl": (0.0, INF, 1e-6, "a KL divergence"),
    "acceptance_rate": (0.0, 1.0, 0.0, "the share of proposed candidates accepted"),
    "accepted": (0.0, INF, 0.0, "candidates accepted, at most those proposed"),
    "goodput": (0.0, INF, 0.0, "requests/s meeting the SLO, at most the requests/s that arrived"),
    "share": (0.0, 1.0, 0.0, "a share"),
}


def violation(metric: str, value: float | None, highest: float | None = None) -> str | None:
    """Why `value` cannot be a true `metric` (None where it can, or where there is no value): outside its bound by
    more than the bound's slack. `highest`: a bound that another figure sets (the proposed candidates, the arrival
    rate), tighter than the table's."""
    if value is None:
        return None
    lowest, top, slack, what = BOUNDS[metric]
    top = top if highest is None else min(top, highest)
    if value < lowest - slack:
        return f"{value:.4g}, below {lowest:g}: {what}"
    if value > top + slack:
        return f"{value:.4g}, above {top:.4g}: {what}"
    return None


def at_bound(metric: str, value: float | None) -> bool:
    """Whether `value` is past its bound by no more than rounding (a KL of -3e-9): the bound itself, to be said so."""
    if value is None:
        return False
    lowest, top, slack, _ = BOUNDS[metric]
    return lowest - slack <= value < lowest or top < value <= top + slack
