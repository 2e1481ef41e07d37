"""Generate dvc.yaml from the Snakemake DAG, so that DVC runs exactly the jobs Snakemake would.

Snakemake is the source of truth: this asks `snakemake --dry-run --forceall --printshellcmds` for
every job of the given params file and writes one DVC stage per job with the same command, the same
inputs as deps, the same outputs (each job's figures.json as its DVC metric, the whole record and the rest as
outputs; all in DVC's cache, none in git: the numbers committed to compare with live in results/reference/),
and the params sections the stage reads; then the plots `dvc plots show` draws, with titles and axis
labels. `--check` fails when the committed dvc.yaml has drifted.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import yaml

from .. import config
from ..config import REPO_ROOT
from ..figure_picks import FIGURES
from ..registry import LOSS_CSV, STAGES, param_keys


def snakemake_jobs(params: str = "params.yaml", workdir: Path | None = None) -> list[dict]:
    """Every job Snakemake would run for `params`: rule, name, inputs, outputs, log and command."""
    cmd = [sys.executable, "-m", "snakemake", "--snakefile", str(REPO_ROOT / "Snakefile"), "--configfile",
           params, "--dry-run", "--forceall", "--printshellcmds", "--nocolor", "--cores", "1"]
    if workdir is not None:
        cmd += ["--directory", str(workdir)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=workdir, timeout=300)
    if proc.returncode != 0:
        raise SystemExit(f"efflab dvcgen: snakemake dry-run failed:\n{proc.stderr.strip()[-2000:]}")
    jobs, job = [], None
    for line in proc.stdout.splitlines():
        if line.startswith(("rule ", "localrule ")):
            job = {"rule": line.split()[1].rstrip(":"), "input": [], "output": [], "log": [], "wildcards": {}}
            jobs.append(job)
        elif job is not None and line.startswith("    ") and ": " in line:
            key, value = line.strip().split(": ", 1)
            if key in ("input", "output", "log"):
                job[key] = [v.strip() for v in value.split(", ")]
            elif key == "wildcards":
                job["wildcards"] = dict(kv.split("=", 1) for kv in value.split(", "))
        elif job is not None and line.startswith("Shell command: "):
            job["cmd"] = line[len("Shell command: "):]
    jobs = [j for j in jobs if j["rule"] in STAGES]
    return sorted(jobs, key=lambda j: (list(STAGES).index(j["rule"]), j["wildcards"].get("name", "")))


def _relative(path: str) -> str:
    p = Path(path)
    return str(p.relative_to(REPO_ROOT)) if p.is_absolute() and p.is_relative_to(REPO_ROOT) else path


# What `dvc plots show` draws (dvc.yaml's top-level plots): the loss curves of every run in one plot, the
# Pareto tables, and the report's figures as images.
PARETO = {"finetune_pareto.csv": ("Fine-tuning: speed against peak memory", "peak_memory_mib", "peak memory (MiB)",
                                  "tokens_per_s", "training tokens/s"),
          "inference_pareto.csv": ("Inference: generation speed against footprint", "footprint_mib",
                                   "weights in memory (MiB)", "generation_speedup",
                                   "generation speed × the base model's")}


def plots(jobs: list[dict]) -> list[dict]:
    outputs = [_relative(out) for job in jobs for out in job["output"]]
    losses = [out for out in outputs if out.endswith(LOSS_CSV)]
    defined = [{"Training loss": {"template": "linear", "x": "step", "y": {path: "loss" for path in losses},
                                  "title": "Training loss by fine-tuning run", "x_label": "optimizer step",
                                  "y_label": "training loss"}}] if losses else []
    for out in outputs:
        name = Path(out).name
        if name in PARETO:
            title, x, x_label, y, y_label = PARETO[name]
            defined.append({out: {"template": "scatter", "x": x, "y": y, "title": title, "x_label": x_label,
                                  "y_label": y_label}})
        elif name.endswith(".png"):
            defined.append(out)
    return defined


def dvc_stages(jobs: list[dict], cfg: dict) -> dict:
    """One DVC stage per job: its figures.json is the DVC metric; the whole record (metrics.json) and everything
    else it writes are outputs."""
    stages = {}
    for job in jobs:
        name = job["wildcards"].get("name")
        stage = {"cmd": job["cmd"], "deps": [_relative(d) for d in job["input"]],
                 "params": param_keys(cfg, job["rule"], name)}
        for out in job["output"]:
            stage.setdefault("metrics" if out.endswith(FIGURES) else "outs", []).append(out)
        stages[f"{job['rule']}-{name}" if name else job["rule"]] = stage
    return stages


def render(params: str = "params.yaml", workdir: Path | None = None) -> str:
    header = ("# Generated from the Snakemake DAG by `python -m efflab.tools.dvcgen` (make dvc.yaml); do not edit.\n"
              "# Snakemake is the source of truth; tests fail when this file drifts from it.\n")
    jobs = snakemake_jobs(params, workdir)
    cfg = config.load((workdir or Path.cwd()) / params)
    return header + yaml.safe_dump({"stages": dvc_stages(jobs, cfg), "plots": plots(jobs)}, sort_keys=False, width=120)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m efflab.tools.dvcgen", description=__doc__.splitlines()[0])
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--output", default="dvc.yaml")
    parser.add_argument("--check", action="store_true", help="exit 1 if the file differs from the DAG")
    args = parser.parse_args(argv)
    text = render(args.params, Path.cwd())
    target = Path(args.output)
    if args.check:
        if not target.is_file() or target.read_text() != text:
            sys.exit(f"efflab dvcgen: {target} is out of date with the Snakemake DAG; run `make dvc.yaml`")
        return
    target.write_text(text)


if __name__ == "__main__":
    main()
