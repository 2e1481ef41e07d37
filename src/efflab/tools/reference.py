"""Keep a run's numbers as reference results: `python -m efflab.tools.reference [--results results] [--to results/reference]`.

Copies what a person compares against (every stage's metrics.json, the loss curves, the claims table, page and
summary, the report's Markdown, CSV, decisions.json and PNG files) into <to>/<device>/, named after the GPU (or CPU)
the base_model stage ran on, so that users can diff their numbers with ours. Model weights are never copied.

`python -m efflab.tools.reference --rerender results/reference/<device>` renders a kept run's claims and report again
from its records with this commit's code and params.yaml, and writes them back: the committed pages are always what
the code makes of the records (tests/test_reference.py re-renders them and diffs).
"""
from __future__ import annotations

import argparse
import importlib
import re
import shutil
import sys
import tempfile
from pathlib import Path

import yaml

from .. import cli, config, records, registry
from ..config import REPO_ROOT

# the raw CSVs the report cites too
KEPT = ("metrics.json", "loss.csv", "claims.csv", "claims.md", "summary.json", "report.md", "details.md", "summary.csv",
        "*_pareto.csv", "requests.csv", "cells.csv", "evals.csv", "decisions.json", "statements.jsonl", "*.png")
# What a re-render makes again from the records: the claims stage, then the report (it quotes the claims' counts).
RENDERED = ("claims", "report")


def device_name(results: Path) -> str:
    """A folder name for the machine the run's base_model stage measured: the GPU's name, else the CPU's."""
    metrics = results / "base_model" / "metrics.json"
    if not metrics.is_file():
        raise FileNotFoundError(f"{metrics} does not exist (expected a finished run: run the pipeline first)")
    env = records.load(metrics).get("environment", {})
    isa = env.get("cpu_isa") or []
    cpu_kind = "avx512-bf16" if {"avx512_bf16", "amx_bf16"} & set(isa) else "avx2" if "avx2" in isa else None
    name = env.get("gpu") or " ".join(filter(None, [env.get("cpu"), cpu_kind])) or "unknown-device"
    return re.sub(r"[^A-Za-z0-9.]+", "-", name).strip("-").lower()


def copy_reference(results: Path, to: Path) -> Path:
    target = to / device_name(results)
    files = sorted({p for pattern in KEPT for p in results.rglob(pattern)
                    if "model" not in p.relative_to(results).parts and to.resolve() not in p.resolve().parents
                    and p.relative_to(results).parts[0] != "reference"})  # a clone's kept runs are not this run's
    if target.exists():
        shutil.rmtree(target)
    for src in files:
        dest = target / src.relative_to(results)
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dest)
    return target


def rerender_params(run: Path, params: Path) -> dict:
    """params.yaml as a kept run is re-rendered with: a stage the run kept no records of (the evaluate stage, in runs
    made before it) is left out, so that the report says so instead of asking for its records."""
    cfg = config.load(params)
    if not (run / "evaluate").is_dir():
        cfg["evaluate"]["models"] = []
    return cfg


def rerender(run: Path, to: Path | None = None, params: Path = REPO_ROOT / "params.yaml") -> Path:
    """Render a kept run's claims and report again from its records (in a scratch copy), and copy their kept files
    to `to` (default: the run itself). Returns `to`."""
    to = to or run
    with tempfile.TemporaryDirectory() as scratch:
        results = Path(scratch) / "results"
        shutil.copytree(run, results)
        cfg_path = Path(scratch) / "params.yaml"
        cfg_path.write_text(yaml.safe_dump(rerender_params(run, params), sort_keys=False))
        for stage in RENDERED:
            module = importlib.import_module(f"{registry.module(stage)}.stage")
            kept = run / stage / "metrics.json"
            cli.main(stage, module.run, ["--params", str(cfg_path), "--results", str(results)])
            if kept.is_file():  # rendering again does not time the run again: the job keeps the run's wall time
                made = results / stage / "metrics.json"
                cli.write_json(made, records.load(made) | {"wall_s": records.load(kept)["wall_s"]})
            (to / stage).mkdir(parents=True, exist_ok=True)
            for old in (to / stage).iterdir():
                if old.is_file():
                    old.unlink()
            for pattern in KEPT:
                for made in (results / stage).glob(pattern):
                    shutil.copy2(made, to / stage / made.name)
    return to


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m efflab.tools.reference", description=__doc__.splitlines()[0])
    parser.add_argument("--results", default="results", help="the run's results folder (default: results)")
    parser.add_argument("--to", default="results/reference", help="where reference runs are kept")
    parser.add_argument("--rerender", metavar="RUN", help="render a kept run's claims and report again from its "
                        "records, in place (e.g. results/reference/<device>)")
    args = parser.parse_args(argv)
    if args.rerender:
        print(f"re-rendered: {rerender(Path(args.rerender))}")
        return
    try:
        target = copy_reference(Path(args.results), Path(args.to))
    except FileNotFoundError as err:
        print(f"efflab reference: error: {err}", file=sys.stderr)
        sys.exit(2)
    print(f"reference results: {target} ({sum(1 for p in target.rglob('*') if p.is_file())} files)")


if __name__ == "__main__":
    main()
