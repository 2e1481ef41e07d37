"""Where every stage reads and writes: one definition shared by the CLIs, the DVC generator and tests.

Each stage writes one folder, results/<stage>/<name>/ (or results/<stage>/ for single-job stages),
holding metrics.json and, where the stage makes one, model/.
"""
from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

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

    def variant_folders(self, variant: dict) -> list[Path]:
        """The earlier stages' folders a variant (bench_inference's, or an evaluated model) loads: an adapter's base,
        then its own folder."""
        kind, of = variant["kind"], variant.get("of")
        return {"base": [self.base_model()], "quantized": [self.model("quantize", of)],
                "merged": [self.model("merge", of)], "finetuned": [self.model("finetune", of)],
                "pruned": [self.model("prune", of)], "healed": [self.out("prune", of) / HEALED],
                "adapter": [self.base_model(), self.model("finetune", of)]}[kind]

    def lm_eval_docs(self) -> Path:
        """The documents of efflab's local lm-eval tasks (the validation split; efflab.evaluation.task), written by
        prepare_data: each job that scores with the tasks writes their task folder from them."""
        return self.out("prepare_data") / LM_EVAL

    def lm_eval_task(self, name: str) -> Path:
        """The task folder the evaluate job `name` scored with: its task files and their rerun line."""
        return self.out("evaluate", name) / LM_EVAL

    def metrics(self, stage: str, name: str | None = None) -> Path:
        return self.out(stage, name) / METRICS

    @staticmethod
    def write_not_run(stage: str, out: Path, status: str, reason: str) -> None:
        """Replace whatever a job that did not run left in its folder `out` with its stage's outputs, empty."""
        for leftover in out.iterdir():
            shutil.rmtree(leftover) if leftover.is_dir() else leftover.unlink()
        for output in STAGES[stage].outputs or ():
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

    def skipped_because(self, stage: str, name: str) -> dict | None:
        """A 'skipped' result naming why, when the job `stage/name` this one builds on did not succeed
        (a fine-tuning run that failed or was unavailable on this device): the grid goes on without it."""
        upstream = read(self, stage, name)
        if is_ok(upstream):
            return None
        return {"status": "skipped",
                "reason": f"{stage} {name} is {upstream['status']}: {upstream.get('reason', 'no reason given')}"}


@dataclass(frozen=True)
class Job:
    """One job of a stage, as cli.main hands it to the stage's `run(cfg, job)`: where the results are, which grid
    entry it is (None for a single-job stage), the staging folder it writes to (renamed to `final` once its
    metrics are written) and the params file it was started with."""
    layout: Layout
    name: str | None
    out: Path
    final: Path
    params: str = "params.yaml"
