"""A run as compare reads it: its findings (the report's ledger), its answers (decisions.json) and, per stage, the
machine, library versions and params its jobs ran with (each job's environment and provenance)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ...config import REPO_ROOT, UserError
from ...measure.env import FINGERPRINT_KEYS

LEDGER = Path("report") / "statements.jsonl"
DECISIONS = Path("report") / "decisions.json"
REFERENCES = REPO_ROOT / "results" / "reference"
MACHINE_KEYS = tuple(k for k in FINGERPRINT_KEYS if k != "packages")


@dataclass(frozen=True)
class Stage:
    """What a stage's jobs ran on and with: the machine (environment's hardware fields), the library versions,
    the params hash of its section and, where the records keep them (provenance.params), the settings read."""
    machine: dict
    packages: dict
    params: frozenset
    settings: dict


@dataclass(frozen=True)
class Run:
    folder: Path
    label: str
    commit: str | None
    findings: dict  # (finding, subject, metric) -> the ledger's statement
    answers: dict  # decisions.json's question -> its answer
    stages: dict  # stage -> Stage


def resolve(given: str, which: str) -> Path:
    """A results folder, or the name of a kept reference (results/reference/<name>); one line where it is neither."""
    for folder in (Path(given), REFERENCES / given):
        if (folder / LEDGER).is_file() and (folder / DECISIONS).is_file():
            return folder
    raise UserError(f"{which}: {given}: expected a finished run's results folder (with {LEDGER} and {DECISIONS}) "
                    f"or the name of a kept reference under {REFERENCES.relative_to(REPO_ROOT)}/")


def _json(path: Path, which: str):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise UserError(f"{which}: {path}: not readable JSON ({err})") from None


def _findings(folder: Path, which: str) -> dict:
    """The ledger by (finding, subject, metric); a figure stated twice is one finding (its first statement)."""
    out: dict = {}
    for number, line in enumerate((folder / LEDGER).read_text().splitlines(), 1):
        try:
            s = json.loads(line)
            out.setdefault((s["finding"], s["subject"], s["metric"]), s)
        except (ValueError, KeyError, TypeError):
            raise UserError(f"{which}: {folder / LEDGER}:{number}: expected a statement "
                            "(finding, subject, metric, value, lo, hi, n, verdict)") from None
    return out


def _stages(folder: Path, which: str) -> dict:
    jobs: dict[str, list[dict]] = {}
    for path in sorted(folder.glob("*/metrics.json")) + sorted(folder.glob("*/*/metrics.json")):
        stage = path.relative_to(folder).parts[0]
        if stage not in ("report", "reference", "compare"):
            jobs.setdefault(stage, []).append(_json(path, which))
    out = {}
    for stage, records in jobs.items():
        envs = [r.get("environment") or {} for r in records]
        settings = {}
        for r in records:
            settings |= ((r.get("provenance") or {}).get("params") or {}).get("settings") or {}
        out[stage] = Stage(machine={k: envs[0].get(k) for k in MACHINE_KEYS if envs[0].get(k) is not None},
                           packages=envs[0].get("packages") or {},
                           params=frozenset(e.get("params_sha256") for e in envs if e.get("params_sha256")),
                           settings=settings)
    return out


def label_of(folder: Path, commit: str | None) -> str:
    """A run's name on the page: a kept reference's folder name, else the folder at its commit."""
    if folder.resolve().parent == REFERENCES.resolve():
        return folder.name
    return f"{folder.resolve().name}@{commit}" if commit else folder.resolve().name


def read(given: str, which: str) -> Run:
    """The run `given` names (`which`: RUN_A or RUN_B, for the one-line error)."""
    folder = resolve(given, which)
    decisions = _json(folder / DECISIONS, which)
    stages = _stages(folder, which)
    base = folder / "base_model" / "metrics.json"
    commit = (_json(base, which).get("environment") or {}).get("git_commit") if base.is_file() else None
    return Run(folder=folder, label=label_of(folder, commit), commit=commit, findings=_findings(folder, which),
               answers={k: q.get("answer") for k, q in (decisions.get("questions") or {}).items()}, stages=stages)
