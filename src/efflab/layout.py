"""Where every stage reads and writes: one definition shared by the CLIs, the DVC generator and tests.

Each stage writes one folder, results/<stage>/<name>/ (or results/<stage>/ for single-job stages),
holding metrics.json and, where the stage makes one, model/.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

METRICS = "metrics.json"
MODEL = "model"


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

    def metrics(self, stage: str, name: str | None = None) -> Path:
        return self.out(stage, name) / METRICS
