"""Runs Python command lines the way their programs would, each in a process forked from this one, which has
imported what they share (Snakemake, torch, transformers, efflab, DVC's parser) once: a second a command instead of
the five its own process would spend importing. Used by tests/test_docs_commands.py:

    python tests/command_runner.py JOBS.json TIMEOUT_S

JOBS.json is a list of {"kind", "argv", "cwd", "env", "log"}; each job's output goes to its log; the exit codes, in
order, are printed as JSON. Two jobs run at a time. Kinds:

- snakemake: Snakemake's CLI with its execution made a dry run after every check a real run makes (cores,
  executor settings): a command a real run would refuse is refused, and one it would run does nothing;
- module, script: `python -m module ARGS`, `python script.py ARGS`;
- entry: a console script of the venv (`hf`, `accelerate`, `mkdocs`) by its entry point;
- dvc: DVC's own argument parser, and its own `-S` code (`dvc.utils.hydra.apply_overrides`) on a copy of params.yaml,
  validated as efflab does.

Variables a library reads at import (HF_HUB_OFFLINE) are read here, before the forks, so a job's own assignment of
one does not reach that library."""
from __future__ import annotations

import json
import os
import runpy
import shutil
import sys
import tempfile
import time
import traceback
from importlib.metadata import entry_points
from pathlib import Path

from dvc.cli import parse_args
from snakemake import api, cli

from efflab import config
from efflab.models import model_check, modeling  # noqa: F401  what planning the workflow imports

REAL_EXECUTE = api.DAGApi.execute_workflow


def dry_run(self, *args, **kwargs):
    kwargs["pseudo_executor"] = kwargs.get("pseudo_executor") or "dryrun"
    return REAL_EXECUTE(self, *args, **kwargs)


api.DAGApi.execute_workflow = dry_run


def dvc(argv: list[str]) -> None:
    """DVC's parser, then its own `-S` code (hydra's override grammar, as `dvc exp run` applies it: a key params.yaml
    lacks is refused without `+`) on a copy of params.yaml, which efflab's schema then validates."""
    from dvc.utils.hydra import apply_overrides

    args = parse_args(argv)
    overrides = getattr(args, "set_param", None) or []
    if not overrides:
        return
    with tempfile.TemporaryDirectory() as scratch:
        copy = Path(scratch) / "params.yaml"
        shutil.copy("params.yaml", copy)
        apply_overrides(copy, overrides)
        config.validate(config.load(copy), f"-S {' '.join(overrides)}")


def run(job: dict) -> None:
    kind, argv = job["kind"], job["argv"]
    if kind == "snakemake":
        cli.main(argv)
    elif kind == "module":
        sys.argv = [argv[0], *argv[1:]]
        runpy.run_module(argv[0], run_name="__main__", alter_sys=True)
    elif kind == "script":
        sys.argv = list(argv)
        sys.path.insert(0, str(Path(argv[0]).resolve().parent))
        runpy.run_path(argv[0], run_name="__main__")
    elif kind == "entry":
        (point,) = entry_points(group="console_scripts", name=argv[0])
        sys.argv = list(argv)
        sys.exit(point.load()())
    elif kind == "dvc":
        dvc(argv)
    else:
        raise ValueError(f"unknown kind {kind!r}")


def child(job: dict) -> None:
    os.chdir(job["cwd"])
    os.environ.update(job["env"])
    log = os.open(job["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(log, 1)
    os.dup2(log, 2)
    code = 0
    try:
        run(job)
    except SystemExit as exit:
        code = exit.code if isinstance(exit.code, int) else 0 if exit.code is None else 1
        if isinstance(exit.code, str):
            print(exit.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main() -> None:
    jobs, timeout = json.loads(Path(sys.argv[1]).read_text()), float(sys.argv[2])
    here = os.getcwd()
    try:  # what the model check imports lazily, and its caches, warmed once on the CI params
        os.chdir(jobs[0]["cwd"])
        model_check.check(config.load("params.yaml"), "params.yaml")
    except Exception:
        pass  # a job that meets the same error says so
    os.chdir(here)
    codes, running, waiting = {}, {}, list(range(len(jobs)))
    while waiting or running:
        while waiting and len(running) < 2:
            i = waiting.pop(0)
            pid = os.fork()
            if pid == 0:
                child(jobs[i])
            running[pid] = (i, time.monotonic())
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid:
            codes[running.pop(pid)[0]] = os.waitstatus_to_exitcode(status)
            continue
        for pid, (_, start) in list(running.items()):
            if time.monotonic() - start > timeout:
                os.kill(pid, 9)
        time.sleep(0.02)
    print(json.dumps([codes[i] for i in range(len(jobs))]))


if __name__ == "__main__":
    main()
