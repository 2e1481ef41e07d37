"""Keep a run's numbers as reference results: `python -m efflab.reference [--results results] [--to results/reference]`.

Copies what a person compares against (every stage's metrics.json, the loss curves, the claims table, page and
summary, the report's Markdown, CSV and PNG files) into <to>/<device>/, named after the GPU (or CPU) the
base_model stage ran on, so that users can diff their numbers with ours. Model weights are never copied.
"""
from __future__ import annotations

import argparse
import re
import shutil
import sys
from pathlib import Path

from . import records

KEPT = ("metrics.json", "loss.csv", "claims.csv", "claims.md", "summary.json", "report.md", "details.md", "summary.csv",
        "*_pareto.csv", "requests.csv", "cells.csv", "evals.csv", "*.png")  # the raw CSVs the report cites too


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
                    if "model" not in p.relative_to(results).parts and to.resolve() not in p.resolve().parents})
    if target.exists():
        shutil.rmtree(target)
    for src in files:
        dest = target / src.relative_to(results)
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dest)
    return target


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m efflab.reference", description=__doc__.splitlines()[0])
    parser.add_argument("--results", default="results", help="the run's results folder (default: results)")
    parser.add_argument("--to", default="results/reference", help="where reference runs are kept")
    args = parser.parse_args(argv)
    try:
        target = copy_reference(Path(args.results), Path(args.to))
    except FileNotFoundError as err:
        print(f"efflab reference: error: {err}", file=sys.stderr)
        sys.exit(2)
    print(f"reference results: {target} ({sum(1 for p in target.rglob('*') if p.is_file())} files)")


if __name__ == "__main__":
    main()
