"""The finetune stage's DDP runs: `accelerate launch` of its training as worker processes, and the worker's own
command line (`python -m efflab.stages.finetune --ddp-worker ...`, one rank each)."""
from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Callable

from ... import config
from ...config import UserError
from ...experiment import FinetuneRun, finetune_run
from ...layout import Job, Layout
from ...logs import log_file_path, setup_child_logging

log = logging.getLogger("efflab")

WORKER_FLAG = "--ddp-worker"
HANDOFF = "rank0_metrics.json"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch_distributed(run_cfg: FinetuneRun, job: Job) -> dict:
    """Run this stage's training as `accelerate launch` DDP workers (gloo on CPU, NCCL on GPU); rank 0
    writes the outputs into this job's folder and hands its metrics back through a file."""
    log_file = log_file_path()
    config = run_cfg.accelerate_config
    if config and not Path(config).is_file():
        raise UserError(f"finetune.accelerate_config: {config!r} does not exist (expected an accelerate config file)")
    kind = ["--config_file", config] if config else ["--multi_gpu"]  # multi_gpu: gloo DDP on a CPU-only machine
    cmd = [sys.executable, "-m", "accelerate.commands.launch", *kind,
           "--num_processes", str(run_cfg.num_processes * run_cfg.num_machines),
           "--num_machines", str(run_cfg.num_machines), "--main_process_port", str(_free_port()),
           "--mixed_precision", "no", "--dynamo_backend", "no", "-m", "efflab.stages.finetune", WORKER_FLAG,
           "--params", str(job.params), "--name", job.name, "--results", str(job.layout.root),
           "--out", str(job.out)] + (["--log", log_file] if log_file else [])
    log.info("%s: launching %d DDP processes: %s", job.name, run_cfg.num_processes, " ".join(cmd))
    proc = subprocess.run(cmd)
    handoff = job.out / HANDOFF
    if proc.returncode != 0 or not handoff.is_file():
        raise RuntimeError(f"accelerate launch exited with code {proc.returncode}; see the log above")
    metrics = json.loads(handoff.read_text())
    handoff.unlink()
    return metrics


def worker_main(argv: list[str], train: Callable[[dict, Job, dict], dict]) -> None:
    """Entry point of one `accelerate launch` rank: `train` (the stage's), and on rank 0 hand the metrics back."""
    parser = argparse.ArgumentParser()
    for flag in ("--params", "--name", "--results", "--out", "--log"):
        parser.add_argument(flag)
    args = parser.parse_args(argv)
    rank = int(os.environ.get("RANK", 0))
    setup_child_logging(args.log, f"rank {rank}")
    cfg = config.load(args.params)
    out = Path(args.out)
    metrics = train(cfg, Job(Layout(Path(args.results)), args.name, out, out, args.params, "finetune",
                             cfg["runtime"]), finetune_run(cfg, args.name))
    if rank == 0:
        (out / HANDOFF).write_text(json.dumps(metrics, default=str))
