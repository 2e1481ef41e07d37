"""Quality on validation rows and the paired change between two models on the same rows.

Every stage that changes a model (quantize, merge, prune, qat, finetune) evaluates it on validation rows. The
per-row losses of the two models are paired by row, so the change in perplexity gets an interval: a
token-weighted ratio estimator (the change in mean next-token loss, Σ ΔNLL_i / Σ T_i) with a Student-t interval
over rows as the units (its standard error by linearization, the usual one for a ratio of sums). It is called
95% only with at least MIN_ROWS rows; with fewer the change is given with its n and no interval, and nothing
is decided from it.
"""
from __future__ import annotations

import math

from .measure.stats import NOT_DECIDED

# scipy.stats takes 1-2 s to import on 2 cores and only a t interval needs it: it is imported inside the two
# functions that compute one, and only with MIN_ROWS rows or more, so that importing this module (every stage that
# compares models, evaluation.scores, the report and claims) does not pay it, nor a comparison too small for one.

# The same floor as a median's order-statistic interval (measure.stats.median_ci_order): below it a t interval leans
# wholly on normality of a handful of per-row differences.
MIN_ROWS = 6
INTERVAL_METHOD = "paired t over validation rows, token-weighted (ratio estimator)"


def row_losses(per_row: list) -> list[tuple[int, float]]:
    """(tokens, summed NLL) of each row, from either [tokens, nll] pairs or {"tokens", "nll_sum"} dicts."""
    return [(int(r["tokens"]), float(r["nll_sum"])) if isinstance(r, dict) else (int(r[0]), float(r[1]))
            for r in per_row]


def perplexity(per_row: list) -> float:
    rows = row_losses(per_row)
    return math.exp(sum(n for _, n in rows) / sum(t for t, _ in rows))


def paired_change(reference: list, variant: list, level: float = 0.95) -> dict:
    """The variant's perplexity over the reference's on the same rows: the ratio, the change in %, and its
    `level` interval where there are MIN_ROWS rows or more (None below). Rows must match token for token."""
    ref, var = row_losses(reference), row_losses(variant)
    if len(ref) != len(var) or any(a[0] != b[0] for a, b in zip(ref, var)):
        raise ValueError("paired_change: the two evaluations are not over the same rows and tokens")
    n, tokens = len(ref), sum(t for t, _ in ref)
    diffs = [v - r for (_, r), (_, v) in zip(ref, var)]
    mean = sum(diffs) / tokens  # change in mean next-token loss (nats per token)
    out = {"ratio": math.exp(mean), "change_pct": 100 * math.expm1(mean), "loss_change": mean, "n_rows": n,
           "tokens": tokens, "ci95_change_pct": None, "ci95_loss_change": None, "method": INTERVAL_METHOD}
    if n < MIN_ROWS:
        return out
    from scipy.stats import t as student_t

    resid = [d - mean * t for d, (t, _) in zip(diffs, ref)]
    se = math.sqrt(n / (n - 1) * sum(z * z for z in resid)) / tokens
    half = float(student_t.ppf(0.5 + level / 2, n - 1)) * se
    out["ci95_loss_change"] = [mean - half, mean + half]
    out["ci95_change_pct"] = [100 * math.expm1(mean - half), 100 * math.expm1(mean + half)]
    return out


def against_tolerance(change: dict | None, tolerance_pct: float) -> str:
    """Whether a perplexity change stays within `tolerance_pct` (a rise of at most that much), decided only by
    its interval: `within` when the whole interval is at or below it, `beyond` when the whole interval is above,
    `undecided` otherwise (the interval straddles it, or there are too few rows for one)."""
    if not change or change.get("ci95_change_pct") is None:
        return "undecided"
    lo, hi = change["ci95_change_pct"]
    return "within" if hi <= tolerance_pct else "beyond" if lo > tolerance_pct else "undecided"


# The precision range test (qat's and the report's): one verdict per weight width, then B_min.
def width_verdicts(changes: dict[int, dict | None], tolerance_pct: float) -> dict[int, str]:
    """Each width's verdict against the perplexity tolerance (tolerance.perplexity_pct), decided by the interval of
    its paired perplexity change over the full-precision fine-tune (against_tolerance): `passes` when the
    whole interval is within +tolerance_pct %, `fails` when it is wholly beyond, `undecided` otherwise (or with too
    few rows for one)."""
    said = {"within": "passes", "beyond": "fails", "undecided": "undecided"}
    return {b: "not run" if c is None else said[against_tolerance(c, tolerance_pct)]
            for b, c in changes.items()}


def range_test(changes: dict[int, dict | None], tolerance_pct: float) -> dict:
    """The precision range test: from the lowest width up, the first that passes is B_min. A width whose
    interval straddles the tolerance leaves B_min undecided from there (`undecided_at`): the scan cannot say
    whether it passes. Widths above B_min that fail again are named (the scan is not monotone)."""
    widths, verdict = sorted(changes), width_verdicts(changes, tolerance_pct)
    b_min = undecided_at = None
    for b in widths:
        if verdict[b] == "passes":
            b_min = b
            break
        if verdict[b] != "fails":
            undecided_at = b
            break
    return {"b_min": b_min, "undecided_at": undecided_at, "verdicts": verdict,
            "passing": [b for b in widths if verdict[b] == "passes"],
            "fail_above_b_min": [b for b in widths if b_min is not None and b > b_min and verdict[b] == "fails"]}


def direction(change: dict | None) -> str:
    """`better` / `worse` when the interval of the change excludes zero, else `no difference measured`;
    `undecided` without an interval."""
    if not change or change.get("ci95_change_pct") is None:
        return "undecided"
    lo, hi = change["ci95_change_pct"]
    return "worse" if lo > 0 else "better" if hi < 0 else "no difference measured"


def paired_mean_change(reference: list[float], variant: list[float], level: float = 0.95) -> dict:
    """The mean of the per-row differences variant - reference, with its paired-t `level` interval where there are
    MIN_ROWS rows or more (None below)."""
    diffs = [v - r for r, v in zip(reference, variant, strict=True)]
    n = len(diffs)
    mean = sum(diffs) / n
    out = {"change": mean, "n": n, "ci95": None, "method": "paired t over documents"}
    if n < MIN_ROWS:
        return out
    from scipy.stats import t as student_t

    se = math.sqrt(sum((d - mean) ** 2 for d in diffs) / (n - 1) / n)
    half = float(student_t.ppf(0.5 + level / 2, n - 1)) * se
    out["ci95"] = [mean - half, mean + half]
    return out


RECOVERED_METHOD = "bootstrap percentile over validation rows (paired: the three models' losses resampled together)"
BOOTSTRAP = 2000


def recovered_share(reference: list, ptq: list, qat: list, level: float = 0.95, seed: int = 0) -> dict:
    """The share of post-training quantization's perplexity gap that quantization-aware training recovers, as
    torchao reports it: (ppl_ptq - ppl_qat) / (ppl_ptq - ppl_reference), the three evaluated on the same rows. Its
    `level` interval resamples the rows (each row's three losses together) where there are MIN_ROWS rows or more,
    and only where PTQ's own change is decided worse (its paired interval above 0): with no gap there is nothing to
    recover, and the share is not computed (`why`)."""
    rows = [row_losses(x) for x in (reference, ptq, qat)]
    if len({len(r) for r in rows}) != 1 or any(a[0] != b[0] for r in rows[1:] for a, b in zip(rows[0], r)):
        raise ValueError("recovered_share: the three evaluations are not over the same rows and tokens")
    gap = paired_change(reference, ptq)
    out = {"share": None, "ci95": None, "n_rows": len(rows[0]), "ptq_change_pct": gap["change_pct"],
           "qat_change_pct": paired_change(reference, qat)["change_pct"], "method": RECOVERED_METHOD}
    if direction(gap) != "worse":
        return out | {"why": f"PTQ's perplexity change is {direction(gap)}: no gap decided, nothing to recover"}
    out["share"] = _share(rows, range(len(rows[0])))
    if len(rows[0]) >= MIN_ROWS:
        import random

        draw = random.Random(seed)
        picks = [[draw.randrange(len(rows[0])) for _ in rows[0]] for _ in range(BOOTSTRAP)]
        shares = sorted(s for s in (_share(rows, p) for p in picks) if s is not None)
        cut = (1 - level) / 2
        out["ci95"] = [shares[int(cut * len(shares))], shares[min(len(shares) - 1, int((1 - cut) * len(shares)))]]
    return out


def _share(rows: list[list[tuple[int, float]]], picked) -> float | None:
    picked = list(picked)
    tokens = sum(rows[0][i][0] for i in picked)
    ppl = [math.exp(sum(r[i][1] for i in picked) / tokens) for r in rows]
    return None if ppl[1] == ppl[0] else (ppl[1] - ppl[2]) / (ppl[1] - ppl[0])


def warmup_seconds(step_time: dict | None) -> list[float]:
    """The seconds of the steps the steady step time leaves out (timing_warmup_steps), first first: recorded as
    `warmup_steps_s`, or (records made before) the first step alone where one was left out."""
    st = step_time or {}
    if st.get("warmup_steps_s") is not None:
        return list(st["warmup_steps_s"])
    return [st["first_step_s"]] if st.get("excluded") and st.get("first_step_s") is not None else []


def time_to_target(points: list[dict], target: float, step_time: dict | None) -> dict:
    """Time to quality on one run's validation curve (MLPerf Training's measure): the first point (step, loss) at or
    below `target`, and the time of the steps it took: its warm-up steps as measured (the first included) and the
    rest × the median steady step, with that median's 95% interval where the run's steps give one. One seed: the
    step count itself has no interval. A run that never reaches the target is "not reached in N steps", and the least
    time it would have needed is more than N steps' (`lo`)."""
    median = (step_time or {}).get("median")
    lo, hi = (step_time or {}).get("ci95_median") or (None, None)
    n, warm = (step_time or {}).get("n"), warmup_seconds(step_time)

    def took(steps: int, per_step: float | None) -> float | None:
        return None if per_step is None else sum(warm[:steps]) + max(0, steps - len(warm)) * per_step
    hit = next((p for p in points if p["loss"] <= target), None)
    if hit is None:
        ran = points[-1]["step"] if points else 0
        return {"reached": False, "steps": None, "steps_run": ran, "why": f"not reached in {ran} steps",
                "time_s": None, "lo": took(ran, lo), "hi": None, "n": n,
                "last_loss": points[-1]["loss"] if points else None}
    steps = hit["step"]
    return {"reached": True, "steps": steps, "steps_run": points[-1]["step"], "loss": hit["loss"],
            "time_s": took(steps, median), "lo": took(steps, lo), "hi": took(steps, hi), "n": n,
            "warmup_steps": min(steps, len(warm)), "measured_s": hit.get("train_s")}


def first_to_target(times: dict[str, dict], step_ratio=None) -> tuple[str | None, str]:
    """The run that reaches the target first, decided on the paired step measurement where `step_ratio(best, other)`
    gives it (records.step_ratio: other's step time over best's, interleaved or paired): a run is first where, for
    every other run, its steps over this one's × that ratio's lower end exceed 1 (a run that never reached it took
    more than the steps it ran), and only where it also has the least time with its warm-up steps (measured once per
    run): where the two measurements order the runs two ways, none is first. Without `step_ratio`,
    where the least time's interval ends before every other run's begins. (name or None, why)."""
    reached = {k: t for k, t in times.items() if t["reached"] and t["time_s"] is not None}
    if not reached:
        return None, "no run reached the target"
    if step_ratio is not None:  # the least time, where its pairs put it ahead of every other run too
        order = sorted(reached, key=lambda k: reached[k]["time_s"])
        by_pairs = lambda k: _first_by_pairs(k, reached[k], {o: t for o, t in times.items() if o != k},  # noqa: E731
                                             step_ratio)
        least = by_pairs(order[0])
        if least[0]:
            return least
        ahead = next((k for k in order[1:] if by_pairs(k)[0]), None)
        if ahead:  # the two measurements order the runs two ways: no answer
            return None, (f"not decided: {ahead} is ahead on the paired steady steps, {order[0]} on the time with "
                          "its warm-up step (one measurement per run)")
        return least
    best = min(reached, key=lambda k: reached[k]["time_s"])
    others = {k: t for k, t in times.items() if k != best}
    if reached[best]["hi"] is None or any(t["lo"] is None for t in others.values()):
        return None, "not decided at this size: a step time without a 95% interval"
    if all(reached[best]["hi"] < t["lo"] for t in others.values()):
        return best, "its interval ends before every other run's begins"
    return None, "not decided at this size: the intervals overlap"


def _first_by_pairs(best: str, b: dict, others: dict[str, dict], step_ratio) -> tuple[str | None, str]:
    """first_to_target on the paired step times: best's steps against each other run's, each scaled by the ratio."""
    for name, t in others.items():
        r = step_ratio(best, name)
        if not r or r.get("why"):
            return None, f"not decided: {name} against {best}: " + ((r or {}).get("why") or "no paired step time")
        if not r.get("ci95"):
            return None, f"{NOT_DECIDED}: {name}'s step time over {best}'s has no 95% interval"
        steps = t["steps"] if t["reached"] else t["steps_run"]
        if not b["steps"] or steps / b["steps"] * r["ci95"][0] <= 1:
            return None, (f"{NOT_DECIDED}: {name}'s steps to it ({steps}{'' if t['reached'] else '+'}) × its step "
                          f"time over {best}'s ({r['ci95'][0]:.3g}–{r['ci95'][1]:.3g}) reach {best}'s {b['steps']}")
    return best, "its steps × every other run's paired step time over its own lie apart"

