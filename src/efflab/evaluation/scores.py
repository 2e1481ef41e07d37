"""Per-document scores of two models on the same documents, paired: the change of each metric with its interval,
and the quality gate (the tolerance section of params.yaml) decided by that interval.

A metric's per-document item is lm-eval's own: a number (exact_match, acc), a (log-likelihood, weight) pair
(bits_per_byte: weight = bytes of the answer), or a (reference, response) pair of a corpus metric (chrf, bleu),
scored per document by lm-eval's own aggregation on that one document. Pairs of log-likelihoods are compared by
the ratio estimator of quality.paired_change (the change of the corpus value); numbers by a paired t interval.
"""
from __future__ import annotations

import math

from .. import quality
from ..measure.stats import NOT_DECIDED

# lm-eval may be absent (an offline machine's bundle can leave it out: the evaluate stage then records itself
# unavailable), and the report and claims stages import this module all the same: lm-eval's aggregation registry is
# imported inside per_doc, which only scores lm-eval made reach.

LN2 = math.log(2)
# lm-eval aggregations over (log-likelihood, weight) items, and how a change in mean negative log-likelihood per
# weight unit (nats) reads in the metric's own units.
WEIGHTED = {"bits_per_byte": lambda nats: nats / LN2}


def per_doc(item, metric: str):
    """One document's score: a number, or (nll, weight) for a WEIGHTED metric, or lm-eval's aggregation of the
    metric on this one document; None where the item is neither."""
    if isinstance(item, bool | int | float):
        return float(item)
    if metric in WEIGHTED and isinstance(item, list | tuple) and len(item) == 2:
        return (-float(item[0]), float(item[1]))
    from lm_eval.api.registry import get_aggregation

    try:
        return float(get_aggregation(metric)([item]))
    except Exception:  # noqa: BLE001 - an aggregation this module cannot apply to one document
        return None


def doc_scores(result: dict, metric: str) -> dict[int, object]:
    return {d["doc_id"]: per_doc(d["scores"][metric], metric) for d in result["docs"] if metric in d["scores"]}


def change(reference: dict, variant: dict, metric: str) -> dict | None:
    """The variant's metric minus the reference's over the documents both scored: the change, n, and its 95%
    interval where n >= quality.MIN_ROWS (else None)."""
    ref, var = doc_scores(reference, metric), doc_scores(variant, metric)
    ids = sorted(i for i in ref.keys() & var.keys() if ref[i] is not None and var[i] is not None)
    if not ids:
        return None
    if metric in WEIGHTED:
        paired = quality.paired_change([[ref[i][1], ref[i][0]] for i in ids], [[var[i][1], var[i][0]] for i in ids])
        to_units = WEIGHTED[metric]
        ci = paired["ci95_loss_change"]
        return {"change": to_units(paired["loss_change"]), "n": len(ids),
                "ci95": None if ci is None else [to_units(ci[0]), to_units(ci[1])], "method": paired["method"]}
    return quality.paired_mean_change([ref[i] for i in ids], [var[i] for i in ids])


# Metrics that are a share of documents (0-1): a model's score resolves no finer than one document in n.
SHARES = {"exact_match", "acc"}
CANNOT_TELL = "cannot tell at this size"


def unresolved(metric: str, base_value: float | None, n: int | None, higher_is_better: bool) -> str | None:
    """Why a metric cannot gate at this size, or None: a higher-is-better score the base model does not get above
    what n documents resolve (a share: one document in n; any other score: 0) has nothing to lose."""
    if not higher_is_better or base_value is None or not n:
        return None
    floor = 1 / n if metric in SHARES else 0.0
    if base_value <= floor:
        return (f"{CANNOT_TELL}: the base model scores {base_value:.3g} on {metric}, no more than "
                + (f"one document in {n}" if metric in SHARES else "0"))
    return None


def tolerance_of(absolute: float, reference_value: float | None, relative: float | None) -> float:
    """The change a score may take in the worse direction: the metric's own tolerance, or `relative` of the reference
    model's score where that is less (10 chrF points on a base score of 12 would let most of the score go)."""
    if relative is None or not reference_value:
        return absolute
    return min(absolute, relative * abs(reference_value))


def gate(chg: dict | None, tolerance: float, higher_is_better: bool) -> str:
    """`fails` when the whole interval of the drop (the change in the worse direction) exceeds `tolerance`,
    `passes` when the whole interval is within it, not decided at this size otherwise or without an interval; a
    change recorded unresolved (`unresolved`) cannot tell."""
    if chg and chg.get("unresolved"):
        return chg["unresolved"]
    if not chg or chg.get("ci95") is None:
        return NOT_DECIDED
    lo, hi = sorted(-x if higher_is_better else x for x in chg["ci95"])
    return "fails" if lo > tolerance else "passes" if hi <= tolerance else NOT_DECIDED


def overall(verdicts: list[str]) -> str:
    """A variant fails the gate when any metric fails, passes when every metric that resolves at this size passes,
    cannot tell where none resolves; else not decided at this size. A metric that cannot tell does not count."""
    if any(v.startswith("fails") for v in verdicts):
        return "fails"
    counted = [v for v in verdicts if not v.startswith(CANNOT_TELL)]
    if not counted:
        return CANNOT_TELL if verdicts else NOT_DECIDED
    return "passes" if all(v == "passes" for v in counted) else NOT_DECIDED


def empty_answers(result: dict, ref: dict) -> dict | None:
    """A generation task whose every answer is empty where the reference model answered: a gate that fails whatever
    its scores' intervals (chrF 0 on six documents has no interval to fail by)."""
    answers = [d.get("response") for d in result.get("docs", []) if "response" in d]
    if not answers or any((a or "").strip() for a in answers):
        return None
    if not any((d.get("response") or "").strip() for d in ref.get("docs", [])):
        return None
    return {"change": float(len(answers)), "n": len(answers), "ci95": None, "method": "answers counted",
            "higher_is_better": False, "tolerance": 0, "gate": f"fails: all {len(answers)} answers empty"}


def paired_changes(results: dict, reference: dict | None, tolerance: dict, relative: float | None = None) -> dict:
    """Per task and metric of `results` (harness.evaluate's): the change against `reference` (a record holding the
    reference model's "tasks") on the same documents, its interval and its gate ("not gated" without a
    tolerance for the metric; cannot tell where the reference's score does not resolve at this size), and a
    generation task's empty answers (`empty answers`, failing). A metric's tolerance is `tolerance_of` its own and
    `relative` of the reference's score."""
    out = {}
    for task, result in results.items():
        ref = (reference or {}).get("tasks", {}).get(task)
        if result["status"] != "ok" or not ref or ref.get("status") != "ok":
            continue
        for metric in result["metrics"]:
            chg = change(ref, result, metric)
            if chg is None:
                continue
            better_up = bool(result["higher_is_better"].get(metric, True))
            base = (ref.get("metrics", {}).get(metric) or {}).get("value")
            chg = chg | {"reference_value": base, "unresolved": unresolved(metric, base, chg.get("n"), better_up)}
            held = tolerance_of(tolerance[metric], base, relative) if metric in tolerance else None
            out.setdefault(task, {})[metric] = {
                **chg, "higher_is_better": better_up, "tolerance": held,
                "gate": gate(chg, held, better_up) if held is not None else "not gated"}
        if empty := empty_answers(result, ref):
            out.setdefault(task, {})["empty answers"] = empty
    return out


def with_resolution(job: dict, reference: dict | None) -> dict:
    """A record's changes with what paired_changes adds to records made before it (the reference's score and whether
    it resolves at this size, a generation task's empty answers), read from the reference model's own record."""
    out = {}
    for task, by in job["changes"].items():
        ref = ((reference or {}).get("tasks") or {}).get(task) or {}
        out[task] = {}
        for metric, c in by.items():
            if "unresolved" not in c and metric != "empty answers":
                base = (ref.get("metrics", {}).get(metric) or {}).get("value")
                c = c | {"reference_value": base,
                         "unresolved": unresolved(metric, base, c.get("n"), c["higher_is_better"])}
            out[task][metric] = c
        if "empty answers" not in by and ref.get("status") == "ok" and \
                (empty := empty_answers(job["tasks"].get(task, {}), ref)):
            out[task]["empty answers"] = empty
    return out


def gate_verdict(changes: dict) -> dict:
    """The model's gate over its gated metrics, and the metrics it fails on."""
    verdicts = [m["gate"] for task in changes.values() for m in task.values() if m["gate"] != "not gated"]
    failed = sorted(f"{t}/{m}" for t, task in changes.items() for m, c in task.items() if c["gate"].startswith("fails"))
    return {"verdict": overall(verdicts), "failed": failed}


def samples(results: dict, count: int, task: str) -> list[dict]:
    """The first `count` generated answers of a generation task, each beside its reference and its scores."""
    gen = results.get(task)
    if not gen or gen["status"] != "ok":
        return []
    return [{"doc_id": d["doc_id"], "reference": d["target"], "answer": d["response"],
             **{m: per_doc(v, m) for m, v in d["scores"].items()}} for d in gen["docs"][:count]]
