"""The records with what is decided once from them before any question reads them: the verdicts decided again
against params.yaml's one tolerance (qat's precision range test, evaluate's gate), each capacity maximum's cause,
the fine-tuning runs' time to the target, and their memory kind's measured error beside each peak. decisions.build
answers its questions from these, and the tables read the records against_tolerance returns.
"""
from __future__ import annotations

from ... import quality, records
from ...config import task_relative, task_tolerance
from ...evaluation import scores
from . import target
from .tables.capacity import capacity_cause


def against_tolerance(cfg: dict, metrics: dict) -> dict:
    """The records' verdicts against a tolerance, decided again from their paired changes against the one tolerance
    of params.yaml's `tolerance` section (the same unless the records were made under another): qat's precision
    range test (tolerance.perplexity_pct) and evaluate's gate (the lm-eval metrics' tolerances)."""
    pct, tasks, relative = cfg["tolerance"]["perplexity_pct"], task_tolerance(cfg), task_relative(cfg)

    def qat(job: dict) -> dict:
        if not records.is_ok(job) or not job.get("reference_perplexity"):
            return job
        tests = {m: quality.range_test({v["bits"]: v.get("perplexity_change") for v in job["variants"]
                                        if v["method"] == m}, pct) for m in ("ptq", "qat")}
        return job | {"precision_range_test": tests, "tolerance_pct": pct}

    evaluated = {j["model"]: j for j in records.ok(metrics.get("evaluate", []))}

    def gated(job: dict) -> dict:
        if not records.is_ok(job) or not job.get("reference"):
            return job
        changes = scores.with_resolution(job, evaluated.get(job["reference"]))
        def held(m: str, c: dict) -> dict:
            if m == "empty answers":
                return c
            if m not in tasks:
                return c | {"tolerance": None, "gate": "not gated"}
            t = scores.tolerance_of(tasks[m], c.get("reference_value"), relative)
            return c | {"tolerance": t, "gate": scores.gate(c, t, c["higher_is_better"])}

        changes = {t: {m: held(m, c) for m, c in by.items()} for t, by in changes.items()}
        return job | {"changes": changes, "gate": scores.gate_verdict(changes)}

    return with_causes(metrics) | {"qat": [qat(j) for j in metrics.get("qat", [])],
                      "evaluate": [gated(j) for j in metrics.get("evaluate", [])],
                      "finetune": target.with_targets(cfg, metrics.get("finetune", []))}


def with_causes(metrics: dict) -> dict:
    """Each capacity maximum's cause against its prediction (tables.capacity.capacity_cause), decided once on its
    search: the capacity decision, its section and details.md read it there."""
    def caused(job: dict) -> dict:
        if not records.is_ok(job):
            return job
        return job | {"searches": [s | {"cause": capacity_cause(s)} if records.is_ok(s) else s
                                   for s in job.get("searches", [])]}

    return metrics | {"capacity": [caused(j) for j in metrics.get("capacity", [])]}


def with_memory_error(metrics: dict, errors: dict[str, dict]) -> dict:
    """The fine-tuning records with their memory kind's measured error (options.memory_errors) beside their peak,
    where the records measured one: what the fine-tuning options read as the peak's interval."""
    def put(r: dict) -> dict:
        error = errors.get((r.get("train_memory") or {}).get("kind"))
        return r | {"train_memory": r["train_memory"] | {"error": error}} if error and records.is_ok(r) else r
    return metrics | {"finetune": [put(r) for r in metrics.get("finetune", [])]}
