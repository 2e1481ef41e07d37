"""Stage claims: evaluate every registered claim and write claims.csv, claims.md and summary.json."""
from __future__ import annotations

import json
import logging
import math
from collections.abc import Sequence
from pathlib import Path

import pandas as pd

from ...config import REPO_ROOT
from ...layout import Job
from ...registry import names
from .page import markdown
from .quantities import DEFINITIONS, compute
from .readings import DEFINITION_METRICS, read, scale_note
from .registry import REGISTRY, default_tolerance, load
from .sentences import sentence_counts, with_sentences
from .verdict import EVIDENCE, VERDICTS, NotHere, band, band_text, judge, reported_text, units_label, verdict_class

log = logging.getLogger("efflab")

COLUMNS = ["id", "source", "quote", "kind", "evidence", "quantity", "reported", "units", "band", "band_low",
           "band_high", "reproduced", "value", "ci_low", "ci_high", "ratio", "verdict", "unit_fit", "reason", "finding",
           "sentence_verdict", "sentence_claim"]


def evidence_of(claim: dict) -> str:
    """What the claim's verdict rests on, or would: a definition (a count, a format, a default), arithmetic on the
    seed's own inputs (computed), or a measurement of this run (a GPU's, for a hardware claim)."""
    if claim.get("quantity") in DEFINITIONS or claim.get("metric", {}).get("kind") in DEFINITION_METRICS:
        return "definition"
    return "computed" if claim["kind"] == "analytic" else "measured"


def _quantity(claim: dict) -> str:
    """What is compared: the estimator quantity, or the results metric (with the record key it reads)."""
    if claim.get("quantity"):
        return claim["quantity"]
    if claim.get("metric"):
        return ":".join(filter(None, [claim["metric"]["kind"], claim["metric"].get("key")]))
    return claim.get("estimate", {}).get("quantity", "")


def band_said(claim: dict, tolerance: dict) -> str:
    """The band, and beside a quality claim where it comes from: params.yaml's tolerance of its metric, or the
    seed's own words where that band differs from the tolerance."""
    said = band_text(claim)
    if claim.get("band_of"):
        return f"{said} (`{claim['band_of']}`)"
    metric = claim.get("metric", {})
    if metric.get("kind") == "task_change" and metric.get("metric") in tolerance:
        return f"{said} (the seed's words; `tolerance.{metric['metric']}` is {tolerance[metric['metric']]:g})"
    return said


def _row(claim: dict, tolerance: dict) -> dict:
    lo, hi = band(claim)
    return {"id": claim["id"], "source": claim["source"], "quote": claim["quote"], "kind": claim["kind"],
            "evidence": evidence_of(claim),
            "quantity": _quantity(claim),
            "reported": f"{reported_text(claim['reported']['value'])} {claim['reported']['unit']}"
                        + {"at_least": " (at least)", "at_most": " (at most)"}.get(claim.get("compare"), ""),
            "units": units_label(claim), "band": band_said(claim, tolerance),
            "band_low": None if math.isinf(lo) else lo, "band_high": None if math.isinf(hi) else hi,
            "reproduced": "", "ratio": None, "finding": ""}


def _judged(row: dict, j: dict, reasons: list[str], cause: str = "") -> dict:
    why = "; ".join(filter(None, [j["why"], cause if j["verdict"] != "reproduced" else ""]))
    interval = j["interval"]
    return {**row, "reproduced": j["shown"], "value": j["value"], "ratio": j["ratio"], "verdict": j["verdict"],
            "ci_low": interval[0] if interval else None, "ci_high": interval[1] if interval else None,
            "unit_fit": j["fit"], "reason": "; ".join(filter(None, [why, *reasons])), "finding": why}


def evaluate(claim: dict, layout, tolerance: dict | None = None, finetune: Sequence[str] = ()) -> dict:
    """A claim's row: its verdict and why, a measured one read from the results in `layout`, whose fine-tuning runs
    are the jobs `finetune` (registry.names(cfg, "finetune"), the grid the report reads)."""
    row = _row(claim, tolerance or {})
    notes = [claim["assumption"]] if claim.get("assumption") else []
    if claim.get("unreproducible"):
        return {**row, "verdict": "not reproducible here", "reason": claim["unreproducible"]}
    if claim["kind"] == "analytic":
        value, how = compute(claim["quantity"], claim["inputs"])
        return _judged(row, judge(value, claim), [how, *notes])
    if "metric" in claim:
        try:
            reading = read(layout, claim["metric"], list(finetune))
        except NotHere as why:
            if claim["kind"] == "hardware":
                return _needs_gpu(row, claim, notes)
            return {**row, "verdict": "not reproducible here", "reason": str(why)}
        exact = "an exact count (this run's tensors: no sampling spread)" if reading.exact else ""
        j = judge(reading.value, claim, unexplained="", measured=True, ci=reading.ci, exact=reading.exact)
        return _judged(row, j, [reading.how, exact, scale_note(layout), *notes], reading.cause)
    return _needs_gpu(row, claim, notes)


def _needs_gpu(row: dict, claim: dict, notes: list[str]) -> dict:
    """A hardware claim without a GPU measurement: needs its GPU; an analytic cross-check, where the registry gives
    one, is shown. Where the registry says the estimate is sufficient (a footprint whose only missing piece is
    the real weights), the cross-check is the verdict, its evidence computed."""
    out = {**row, "verdict": f"needs GPU: {claim['gpu']}", "reason": "; ".join(notes)}
    if "estimate" not in claim:
        return out
    value, how = compute(claim["estimate"]["quantity"], claim["estimate"]["inputs"])
    j = judge(value, claim)
    if claim["estimate"].get("sufficient"):
        label = (f"computed verdict (no GPU measurement here; one on {claim['gpu']} would take precedence): "
                 f"{claim['estimate']['sufficient']}")
        return _judged({**row, "evidence": "computed"}, j, [how, label, *notes])
    agrees = "agrees" if j["verdict"] == "reproduced" else "does not agree"
    return {**out, "reproduced": f"{j['shown']} (analytic)", "ratio": j["ratio"], "unit_fit": j["fit"],
            "reason": "; ".join(filter(None, [f"analytic cross-check {agrees} with the band {row['band']}", j["why"],
                                              how, *notes]))}


def evaluate_all(claims: list[dict], layout, tolerance: dict | None = None,
                 finetune: Sequence[str] = ()) -> pd.DataFrame:
    rows = pd.DataFrame([evaluate(c, layout, tolerance, finetune) for c in claims], columns=COLUMNS[:-2])
    return with_sentences(rows.fillna({"finding": "", "unit_fit": ""}))


def summary(df: pd.DataFrame, seeds: dict) -> dict:
    """The counts the report quotes: claims by evidence x verdict, and each seed's unit convention with how many
    of its byte figures fit only decimal, only binary, both or neither."""
    classes = df["verdict"].map(verdict_class)
    counts = {e: {v: int(((df["evidence"] == e) & (classes == v)).sum()) for v in VERDICTS} for e in EVIDENCE}
    fits = {s: {f: int(((df["source"] == s) & (df["unit_fit"] == f)).sum())
                for f in ("decimal", "binary", "both", "neither")} for s in seeds}
    return {"claims": len(df), "verdicts": list(VERDICTS), "evidence": list(EVIDENCE), "counts": counts,
            "by_verdict": {v: int((classes == v).sum()) for v in VERDICTS},
            "by_evidence": {e: int((df["evidence"] == e).sum()) for e in EVIDENCE},
            "units": {s: {**{k: seed["units"][k] for k in ("convention", "evidence_kind")}, "byte_figures": fits[s]}
                      for s, seed in seeds.items() if "units" in seed},
            **sentence_counts(df, VERDICTS, EVIDENCE),
            "differs": df.loc[classes == "differs", "id"].tolist(),
            "inconclusive": df.loc[classes == "inconclusive", "id"].tolist()}


def readings(df: pd.DataFrame, claims: list[dict]) -> list[dict]:
    """Each measured claim's reading of this run's records, with what it read (its `metric`): the report states it
    beside its own finding of the same quantity, and its checker holds the two equal."""
    values = df.set_index("id")
    out = []
    for c in claims:
        if c["kind"] == "measured" and c.get("metric") and c["id"] in values.index:
            r = values.loc[c["id"]]
            if pd.notna(r["value"]):
                out.append({"id": c["id"], "metric": c["metric"], "value": float(r["value"]),
                            "lo": None if pd.isna(r["ci_low"]) else float(r["ci_low"]),
                            "hi": None if pd.isna(r["ci_high"]) else float(r["ci_high"]), "verdict": r["verdict"]})
    return out


def run(cfg: dict, job: Job) -> dict:
    """Evaluate every registered claim against the estimator and this pipeline's results."""
    registry = (cfg.get("claims") or {}).get("registry") if isinstance(cfg, dict) else None
    tolerance = cfg.get("tolerance") if isinstance(cfg, dict) else None
    reg = load(REPO_ROOT / registry if registry else REGISTRY, tolerance)
    df = evaluate_all(reg["claims"], job.layout, tolerance or default_tolerance(), names(cfg, "finetune"))
    counts = summary(df, reg["seeds"])
    out = Path(job.out)
    out.mkdir(parents=True, exist_ok=True)
    df.to_csv(out / "claims.csv", index=False)
    (out / "claims.md").write_text(markdown(df, reg["seeds"], counts))
    (out / "summary.json").write_text(json.dumps(counts, indent=1) + "\n")
    log.info("claims: %s", ", ".join(f"{n} {v}" for v, n in counts["by_verdict"].items()))
    return {"claims": len(df), "by_kind": df["kind"].value_counts().to_dict(), **{
        k: counts[k] for k in ("by_verdict", "by_evidence", "counts", "differs", "inconclusive")},
        "readings": readings(df, reg["claims"])}
