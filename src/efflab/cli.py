"""The thin command line every stage shares: validate, stage outputs atomically, record metrics.

`python -m efflab.stages.<stage> --params params.yaml [--name NAME] [--log FILE]`. User errors are one
line on stderr and exit code 2; the stage's folder is written under a temporary name and only
renamed into place when the stage succeeded, so a failure leaves no partial outputs.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import time
from pathlib import Path

from . import config, figure_picks, gpu_slots, provenance, records, registry
from .config import UserError
from .layout import METRICS, Job, Layout
from .logs import setup_logging
from .registry import STAGES, names, not_asked

# Snakemake imports this module while it plans the DAG: measure (and torch with it) is imported inside not_run.

log = logging.getLogger("efflab")


def write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=False, default=str) + "\n")


def _missing_result(err: Exception, results: str) -> bool:
    """A file of an earlier stage's results is missing: the user's error (run that stage first)."""
    return isinstance(err, FileNotFoundError) and bool(err.filename) and \
        Path(err.filename).resolve().is_relative_to(Path(results).resolve())


def not_run(stage: str, name: str, cfg: dict, layout: Layout, out: Path, err: Exception) -> dict:
    """The result of a job that failed or ran out of memory: its status, the reason and the traceback's
    last lines, with the stage's outputs written empty, so that the DAG goes on, the jobs that build on
    this one record themselves as skipped, and the report renders around it; the run's exit status still says
    it failed (failed_jobs). `snakemake --forcerun <rule>` (or deleting the folder) retries it."""
    from .measure.device import pick_device
    from .measure.env import environment
    from .measure.isolation import classify_failure

    failure = classify_failure(err)
    log.exception("%s[%s]: %s: %s", stage, name, failure["status"], failure["reason"])
    layout.write_not_run(stage, out, failure["status"], failure["reason"])
    try:
        return {**failure, "environment": environment(pick_device(cfg["runtime"]), cfg[stage])}
    except Exception:  # the device itself may be what failed: the result goes without its environment
        return failure


# A job that ended so is a failure of the run (unavailable and skipped are what the model or device allows).
FAILED = ("failed", "oom", "timeout")


def failed_jobs(cfg: dict, results: Path) -> list[str]:
    """'stage/name: status: reason' for every job of the experiment `cfg` whose record under `results` says it
    failed: what makes the run's exit status non-zero (the Snakefile's onsuccess) though every job wrote its
    record and the report rendered."""
    out = []
    for stage in STAGES:
        if not_asked(cfg, stage):
            continue
        for name in names(cfg, stage) or [None]:
            path = Layout(results).metrics(stage, name)
            record = records.load_if_there(path)
            if record.get("status") in FAILED:
                out.append(f"{stage}{'/' + name if name else ''}: {record['status']}: "
                           f"{record.get('reason', 'no reason given')}")
    return out


def _arguments(stage: str, run, argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=f"python -m {registry.module(stage)}", description=run.__doc__)
    parser.add_argument("--params", default="params.yaml", help="the experiment file (default: params.yaml)")
    parser.add_argument("--name", help="which run/scheme/variant of the stage's grid")
    parser.add_argument("--results", default="results", help="results folder (default: results)")
    parser.add_argument("--log", help="also write the log to this file")
    return parser.parse_args(argv)


def no_library_bars(stage: str) -> None:
    """transformers' own progress bars (a local model folder loaded or written: a fraction of a second each, 30 bars
    in a default run's console) off in every stage but base_model, the one that may download from the hub, where a
    bar is worth its line. The Trainer's progress bar is tqdm's own and stays."""
    if stage != "base_model":
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()


def main(stage: str, run, argv: list[str] | None = None) -> None:
    args = _arguments(stage, run, argv)
    setup_logging(args.log)
    staging = None
    try:
        cfg = config.load(args.params)
        grid = names(cfg, stage)
        if grid is not None and args.name not in grid:
            raise UserError(f"--name: {args.name!r} is not one of the {stage} jobs in {args.params} "
                            f"({', '.join(grid) or 'none'})")
        if grid is None and args.name:
            raise UserError(f"--name: stage {stage} has a single job and takes no name")
        left_out = not_asked(cfg, stage)
        if left_out:
            raise UserError(f"{stage} is not asked for in {args.params}: {left_out}")
        gpu_slots.assign(stage, cfg["runtime"])
        no_library_bars(stage)
        layout = Layout(Path(args.results))
        final = layout.out(stage, args.name)
        staging = final.with_name(f".{final.name}.partial")
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        t0 = time.perf_counter()
        slurm_job = os.environ.get("SLURM_JOB_ID")  # proof, in the job log, of where the job ran
        log.info("%s%s: start%s", stage, f"[{args.name}]" if args.name else "",
                 f" in SLURM job {slurm_job}" if slurm_job else "")
        try:
            metrics = run(cfg, Job(layout, args.name, staging, final, args.params, stage, cfg["runtime"]))
        except Exception as err:  # recorded, so that the DAG and the report go on around it (stages_failed)
            if STAGES[stage].essential or _missing_result(err, args.results):
                raise
            if isinstance(err, UserError):
                print(f"efflab {stage}: error: {err}", file=sys.stderr)
            metrics = not_run(stage, args.name, cfg, layout, staging, err)
        metrics = {"stage": stage, "name": args.name, "status": metrics.pop("status", "ok"),
                   "wall_s": time.perf_counter() - t0, **metrics,
                   "provenance": provenance.record(stage, args.name, cfg, layout, staging, args.params)}
        write_json(staging / METRICS, metrics)
        write_json(staging / figure_picks.FIGURES, figure_picks.pick(metrics, STAGES[stage].figures))
        shutil.rmtree(final, ignore_errors=True)
        staging.rename(final)
        log.info("%s%s: done in %.1f s -> %s", stage, f"[{args.name}]" if args.name else "",
                 metrics["wall_s"], final)
    except UserError as err:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
        print(f"efflab {stage}: error: {err}", file=sys.stderr)
        sys.exit(2)
    except FileNotFoundError as err:  # an upstream result read directly (metrics.json of another job)
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
        if _missing_result(err, args.results):
            print(f"efflab {stage}: error: {config.missing_input(err.filename)}", file=sys.stderr)
            sys.exit(2)
        raise
    except BaseException:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
        raise
