"""The report's task-quality section: the evaluate stage's lm-eval scores per model, each model's paired change
against its reference with the interval, the quality gate, what that interval can decide at this size, and sample
answers beside the reference."""
from __future__ import annotations

import statistics

import pandas as pd

from ... import records
from ...config import task_relative, task_tolerance
from ...evaluation.scores import CANNOT_TELL
from ...measure.stats import NOT_DECIDED
from .writing import markdown, number, one_line

# The gate as the report's one vocabulary says it (records made before it said undecided)
GATE_WORDS = {"undecided": NOT_DECIDED}
GATES = ("passes", "fails", NOT_DECIDED, CANNOT_TELL)


def _num(value, digits: int = 4) -> str:
    return "–" if value is None else f"{value:.{digits}g}"


def score_text(score: dict) -> str:
    """lm-eval's value with its standard error."""
    return _num(score["value"]) + (f" ± {_num(score['stderr'], 2)}" if score.get("stderr") is not None else "")


def change_text(chg: dict | None) -> str:
    """A paired change with its interval, 3 significant digits; float noise (a merged model against its adapter:
    1.9e-07) and negative zero read 0."""
    if not chg:
        return "–"
    ci = chg.get("ci95")
    signed = lambda x: number(x, 3, signed=True)  # noqa: E731
    return signed(chg["change"]) + (f" [{signed(ci[0])}, {signed(ci[1])}]" if ci else f" (n={chg['n']}, no interval)")


def metrics_of(jobs: list[dict]) -> list[tuple[str, str]]:
    """Every (task, metric) any evaluated model has, in first-seen order."""
    seen: dict[tuple[str, str], None] = {}
    for job in records.ok(jobs):
        for task, result in job["tasks"].items():
            for metric in result.get("metrics", {}):
                seen[(task, metric)] = None
    return list(seen)


def table(jobs: list[dict]) -> pd.DataFrame:
    """One row per model: each metric's score ± standard error, each gated metric's change against the reference
    [95% interval], and the gate."""
    rows = []
    for job in records.ok(jobs):
        gate = job["gate"]["verdict"]
        row = {"model": job["model"], "paired with": job["reference"] or "–", "gate": GATE_WORDS.get(gate, gate)}
        for task, metric in metrics_of(jobs):
            result = job["tasks"].get(task, {})
            if result.get("status") != "ok":
                row[metric] = result.get("status", "–")
                continue
            row[metric] = score_text(result["metrics"][metric]) if metric in result["metrics"] else "–"
            chg = job["changes"].get(task, {}).get(metric)
            if chg and chg["gate"] != "not gated":  # the gated metrics' changes (the rest are in the records)
                row[f"Δ {metric} [95%]"] = change_text(chg)
        rows.append(row)
    return pd.DataFrame(rows)


def resolution(jobs: list[dict], tolerance: dict) -> list[dict]:
    """Per gated metric: the median half-width of the change's interval over the models, beside the tolerance
    (the least any model was held to: a tolerance relative to its reference's score may be less than the metric's
    own), and the number of documents: what the gate can decide at this size."""
    out = []
    for task, metric in metrics_of(jobs):
        if metric not in tolerance:
            continue
        changes = [j["changes"].get(task, {}).get(metric) for j in records.ok(jobs)]
        halves = [(c["ci95"][1] - c["ci95"][0]) / 2 for c in changes if c and c.get("ci95")]
        docs = sorted({c["n"] for c in changes if c})
        held = [c["tolerance"] for c in changes if c and c.get("tolerance") is not None]  # each its reference's
        out.append({"metric": metric, "tolerance": min(held, default=tolerance[metric]), "docs": docs,
                    "half_width": statistics.median(halves) if halves else None})
    return out


def answers(jobs: list[dict]) -> list[dict]:
    """Each sampled question with its reference answer and every model's answer and scores."""
    by_doc: dict[int, dict] = {}
    for job in records.ok(jobs):
        for s in job.get("samples", []):
            entry = by_doc.setdefault(s["doc_id"], {"reference": one_line(s["reference"]), "by": {}})
            score = ", ".join(f"{k} {_num(v, 3)}" for k, v in s.items()
                              if k not in ("doc_id", "reference", "answer") and isinstance(v, float))
            entry["by"][job["model"]] = {"answer": one_line(s["answer"]), "scores": score}
    return [by_doc[k] for k in sorted(by_doc)]


def facts(cfg: dict, jobs: list[dict]) -> dict:
    e = cfg["evaluate"]
    ok = records.ok(jobs)
    gates = {v: sorted(j["model"] for j in ok if GATE_WORDS.get(j["gate"]["verdict"], j["gate"]["verdict"]) == v)
             for v in GATES}
    cannot = sorted({f"{m} ({c['unresolved'].split(': ', 1)[1]})" for j in ok for by in j["changes"].values()
                     for m, c in by.items() if c.get("unresolved")})
    unavailable = sorted({f"{t} ({r['reason']})" for j in ok for t, r in j["tasks"].items() if r["status"] != "ok"})
    tolerance = task_tolerance(cfg)
    return {"e": e, "tolerance": tolerance, "relative": task_relative(cfg), "table": markdown(table(jobs)), "gates": gates,
            "resolution": resolution(jobs, tolerance),
            "failed_on": {j["model"]: j["gate"]["failed"] for j in ok if j["gate"]["failed"]}, "cannot": cannot,
            "unavailable": unavailable, "answers": answers(jobs),
            "commands": next((j["commands"] for j in ok if j["model"] == "base"), {})}
