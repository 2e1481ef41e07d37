"""The boundary search of the capacity stage: the largest size that fits, from the estimator's predicted maximum,
with timed steps only where a passing cell would be the maximum. Pure: a search runs its cells through `measure`."""
from __future__ import annotations

from ... import records


def search(n: int, passes, guess: int) -> int:
    """The largest index in 0..n-1 for which `passes` holds (-1: none), assuming it holds up to a boundary.
    Starts at `guess`, walks away from it in doubling steps until the boundary is bracketed, then bisects;
    every index is asked at most once, and the answer always has its neighbour above asked (or is n-1)."""
    lo, hi = -1, n  # largest index known to pass, smallest known to fail
    i, step, upward = min(max(guess, 0), n - 1), 1, None
    while hi - lo > 1:
        if passes(i):
            lo = i
        else:
            hi = i
        if upward is None:
            upward = lo == i
        if upward and hi == n:
            i = min(i + step, n - 1)
        elif not upward and lo == -1:
            i = max(i - step, 0)
        else:
            i = (lo + hi) // 2
        step *= 2
    return lo


def boundary_search(n: int, measure, budget_mib: float, timed: int) -> dict:
    """One (subject, dimension) search over n sizes, with `measure(i, role, timed) -> result` running a cell.

    The first size runs first and predicts every size's peak: its loaded memory plus the estimator's growth.
    search() then finds the boundary from the predicted maximum. A cell runs `timed` timed steps where its
    passing would make it the maximum (the size above failed, it is the grid's last, or it is the predicted
    maximum) and none elsewhere, so tokens/s at the maximum has `timed` repeats and no other cell pays for them.
    A maximum found before the size above it failed has run no timed step: it runs once more with them (role
    'timing'). Resident memory can grow with each step, so that run may not fit: then the size does not pass
    (a size passes only if every run of it did) and the search goes on below it."""
    seen: dict[int, dict] = {}  # the search's cells
    timings: dict[int, dict] = {}  # the re-runs with timed steps
    guess, failure = None, None

    def result(i: int) -> dict | None:
        return timings.get(i, seen.get(i))

    def ask(i: int) -> dict:
        nonlocal failure
        if i not in seen:
            above = result(i + 1)
            maximum_if_passes = i in (n - 1, guess) or (above is not None and not records.is_ok(above))
            seen[i] = measure(i, "search", timed if maximum_if_passes else 0)
            if seen[i]["status"] not in ("ok", "oom") and failure is None:
                failure = seen[i]
        return result(i)

    first = ask(0)
    found = {"seen": seen, "timings": timings, "best": -1, "predicted_peak_mib": None, "guess": None}
    if not records.is_ok(first):
        return found | {"failure": failure}
    predicted = [None if g is None else first["loaded_mib"] + g for g in first["predicted_growth_mib"]]
    fits = [p is not None and p <= budget_mib for p in predicted]
    guess = next((i - 1 for i, f in enumerate(fits) if not f), n - 1)
    while True:
        best = search(n, lambda i: records.is_ok(ask(i)), max(guess, 0))
        if failure is not None or best < 0 or result(best).get("step_s"):
            break
        timings[best] = measure(best, "timing", timed)
        if timings[best]["status"] not in ("ok", "oom"):
            failure = timings[best]
    return found | {"best": best, "predicted_peak_mib": predicted, "guess": guess, "failure": failure}
