"""Where every stage reads and writes: one definition shared by the CLIs, the DVC generator and tests.

Each stage writes one folder, results/<stage>/<name>/ (or results/<stage>/ for single-job stages),
holding metrics.json and, where the stage makes one, model/.
"""
from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from .experiment import ModelRef, model_paths
from .records import is_ok, read
from .registry import HEALED, LM_EVAL, LOSS_CSV, MODEL, QAT_MODEL, STAGES

METRICS = "metrics.json"
LOSS_COLUMNS = ("step", "loss", "learning_rate", "grad_norm")  # finetune's loss curve (LOSS_CSV)
FOLDERS = (MODEL, HEALED, QAT_MODEL, LM_EVAL)
NOT_RUN = "NOT_RUN.txt"


@dataclass(frozen=True)
class Layout:
    root: Path = Path("results")

    def out(self, stage: str, name: str | None = None) -> Path:
        return self.root / stage / name if name else self.root / stage

    def log(self, stage: str, name: str | None = None) -> Path:
        return self.root / "logs" / stage / f"{name or stage}.log"

    def base_model(self) -> Path:
        return self.out("base_model") / MODEL

    def split(self, split: str) -> Path:
        return self.out("prepare_data") / f"{split}.parquet"

    def model(self, stage: str, name: str) -> Path:
        return self.out(stage, name) / MODEL

    def variant_folders(self, ref: ModelRef) -> list[Path]:
        """The earlier stages' folders a model (experiment.ModelRef: a variant's, an evaluated model) loads: an
        adapter's base, then its own folder (experiment.MODEL_KINDS)."""
        return [self.root / path for path in model_paths(ref.kind, ref.of)]

    def lm_eval_docs(self) -> Path:
        """The documents of efflab's local lm-eval tasks (the validation split; efflab.evaluation.task), written by
        prepare_data: each job that scores with the tasks writes their task folder from them."""
        return self.out("prepare_data") / LM_EVAL

    def lm_eval_task(self, name: str) -> Path:
        """The task folder the evaluate job `name` scored with: its task files and their rerun line."""
        return self.out("evaluate", name) / LM_EVAL

    def metrics(self, stage: str, name: str | None = None) -> Path:
        return self.out(stage, name) / METRICS

    def job_metrics(self, job: str) -> Path:
        """The record of a job named as `stage` or `stage/name` (registry.upstream_jobs, experiment.made_by)."""
        return self.root / job / METRICS

    @staticmethod
    def write_not_run(stage: str, out: Path, status: str, reason: str) -> None:
        """Replace whatever a job that did not run left in its folder `out` with its stage's outputs, empty."""
        for leftover in out.iterdir():
            shutil.rmtree(leftover) if leftover.is_dir() else leftover.unlink()
        for output in STAGES[stage].outputs:
            if output in FOLDERS:
                (out / output).mkdir()
                (out / output / NOT_RUN).write_text(f"{status}: {reason}\n")
            elif output == LOSS_CSV:
                (out / output).write_text(",".join(LOSS_COLUMNS) + "\n")
            elif output.endswith(".json"):  # a summary others read: their reader sees the status and why
                (out / output).write_text(json.dumps({"status": status, "reason": reason}) + "\n")
            else:  # a table or page: empty, or saying why
                (out / output).write_text(f"{stage} did not run: {status}: {reason}\n" if output.endswith(".md")
                                          else "")

    def skipped_because(self, jobs: list[str]) -> dict | None:
        """A 'skipped' result naming why, when one of the jobs (`stage/name`) this one builds on did not succeed
        (registry.built_on: a fine-tuning run that failed or was unavailable on this device): the grid goes on
        without it."""
        for job in jobs:
            stage, _, name = job.partition("/")
            upstream = read(self, stage, name or None)
            if not is_ok(upstream):
                return {"status": "skipped", "reason": f"{stage} {name} is {upstream['status']}: "
                                                       f"{upstream.get('reason', 'no reason given')}"}
        return None


@dataclass(frozen=True)
class Job:
    """One job of a stage, as cli.main hands it to the stage's `run(cfg, job)`: where the results are, which grid
    entry it is (None for a single-job stage), the staging folder it writes to (renamed to `final` once its
    metrics are written), the params file it was started with, and what every measuring stage sets up the same
    way, each made when the stage first asks for it: its threads, device, the base model's dtype and tokenizer, and
    its cell journal."""
    layout: Layout
    name: str | None
    out: Path
    final: Path
    params: str = "params.yaml"
    stage: str | None = None
    runtime: dict = field(default_factory=lambda: {"device": "auto", "threads": None})  # params' runtime section

    # torch, transformers and the measuring code are imported when a job first asks for them: the report, the
    # claims and Snakemake's planning read this module without them.
    @cached_property
    def threads(self) -> int:
        """The CPU threads torch uses (runtime.threads, else OMP_NUM_THREADS, else every core), set once."""
        from .measure.device import set_threads

        return set_threads(self.runtime)

    @cached_property
    def device(self):
        """The torch device runtime.device names (auto: a GPU where there is one), the threads set first."""
        from .measure.device import pick_device

        _ = self.threads  # set before torch touches the device
        return pick_device(self.runtime)

    @cached_property
    def dtype(self) -> str:
        """The compute dtype base_model recorded."""
        from .models.modeling import base_dtype

        return base_dtype(self.layout)

    @cached_property
    def tokenizer(self):
        """The base model's tokenizer."""
        from .models.modeling import load_tokenizer

        return load_tokenizer(self.layout.base_model())

    def journal(self, settings: dict, file: str | None = None):
        """The job's cell journal (measure.isolation.CellJournal), a hidden file beside its folder (`file`, else
        `.<name>.cells.jsonl`, or `.cells.jsonl` for a single-job stage), kept while `settings` are the same."""
        from .measure.isolation import CellJournal

        file = file or (f".{self.name}.cells.jsonl" if self.name else ".cells.jsonl")
        return CellJournal(self.layout.out(self.stage) / file, settings)
