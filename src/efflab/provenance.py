"""Provenance: every job's metrics carry the content hash of what it wrote and of what it read, along the chain
dataset -> quantized model -> adapter -> merged model -> benchmark.

A job that writes an artifact (a model folder, the tokenized splits) records its SHA-256 over the files' names and
bytes (`outputs_sha256`). A job that reads earlier jobs' artifacts records, for each, the hash that job recorded
and that job's own inputs, so each metrics file holds the whole chain that produced its numbers. `check` compares
every recorded input hash with what the upstream job's metrics say now: a mismatch means the numbers were
measured on an artifact that has since been replaced, and the report refuses to put them beside the others.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from . import config, records
from .experiment import MODEL_KINDS
from .registry import TASK, TRAIN, VALIDATION, settings, upstream_jobs

# What each stage writes that later jobs read (relative to its job folder): the folders of the models it makes
# (experiment.MODEL_KINDS), and prepare_data's splits and task documents.
ARTIFACTS = {stage: tuple(dict.fromkeys(k.folder for k in MODEL_KINDS.values() if k.stage == stage))
             for stage in dict.fromkeys(k.stage for k in MODEL_KINDS.values())} | {
    "prepare_data": tuple(path.split("/", 1)[1] for path in (TRAIN, VALIDATION, TASK))}


def content_sha256(paths: list[Path]) -> str:
    """SHA-256 over every file under `paths`, in sorted order, each as its name relative to its root and its
    bytes: two folders with the same files hash the same wherever they are."""
    digest = hashlib.sha256()
    for root in paths:
        # Hidden files are bookkeeping, not content (Snakemake stamps directory outputs with .snakemake_timestamp).
        files = sorted(p for p in root.rglob("*") if p.is_file() and not any(
            part.startswith(".") for part in p.relative_to(root).parts)) if root.is_dir() else [root]
        for file in files:
            digest.update(f"{root.name}/{file.relative_to(root) if root.is_dir() else ''}\0".encode())
            with open(file, "rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    digest.update(block)
    return digest.hexdigest()


def _metrics(layout, job: str) -> dict:
    return records.load_if_there(layout.job_metrics(job))


def driver() -> str:
    """Which tool ran this job: `dvc` (dvc repro / dvc exp run set DVC_STAGE for the stage's command) or
    `snakemake or command line`."""
    return "dvc" if os.environ.get("DVC_STAGE") else "snakemake or command line"


def written_by_dvc(results: Path) -> list[str]:
    """The jobs under `results` whose metrics say DVC ran them in this workspace: Snakemake keeps no record of
    their params and code, so it would not rerun them when those change."""
    found = []
    for path in sorted(Path(results).glob("*/metrics.json")) + sorted(Path(results).glob("*/*/metrics.json")):
        try:
            made = records.load(path).get("provenance", {}).get("driver")
        except (OSError, ValueError):
            continue
        if made == "dvc":
            found.append(str(path.parent.relative_to(results)))
    return sorted(found)


def record(stage: str, name: str | None, cfg: dict, layout, out: Path, params: str) -> dict:
    """The provenance block of a job that has just written `out`: its artifacts' hash, its inputs' chain, the tool
    that ran it, and its experiment: the params files it was read from (an overlay, then what it extends) and the
    settings the job read, resolved."""
    inputs = {}
    for job in upstream_jobs(cfg, stage, name):
        upstream = _metrics(layout, job).get("provenance", {})
        inputs[job] = {"sha256": upstream.get("outputs_sha256"), "inputs": upstream.get("inputs", {})}
    artifacts = [out / a for a in ARTIFACTS.get(stage, ()) if (out / a).exists()]
    return {"outputs_sha256": content_sha256(artifacts) if artifacts else None, "inputs": inputs,
            "driver": driver(), "params": {"files": config.files(params),
                                           "settings": json.loads(settings(cfg, stage, name))}}


def chain(provenance: dict) -> list[str]:
    """The chain as lines `job sha256[:12]`, nearest input first, each job once."""
    lines, seen = [], set()

    def walk(inputs: dict):
        for job, entry in inputs.items():
            if job not in seen:
                seen.add(job)
                lines.append(f"{job} {(entry.get('sha256') or 'no artifact')[:12]}")
                walk(entry.get("inputs", {}))
    walk(provenance.get("inputs", {}))
    return lines


def check(layout, jobs: dict[str, dict]) -> list[str]:
    """Every recorded input hash that is not the hash its upstream job records now (`jobs`: job -> metrics)."""
    stale = []
    for job, metrics in jobs.items():
        for upstream, entry in metrics.get("provenance", {}).get("inputs", {}).items():
            source = jobs[upstream] if upstream in jobs else _metrics(layout, upstream)  # read only if not given
            now = source.get("provenance", {}).get("outputs_sha256")
            if entry.get("sha256") != now:
                stale.append(f"{job} was measured on {upstream} {str(entry.get('sha256'))[:12]}, "
                             f"which is now {str(now)[:12]}")
    return stale
