"""The report's plots drawn from what the stage made: a part's plot `<plot>` (report.parts) is drawn by the function
`<plot>` here, from the records, tables, frontiers and decisions (the plots themselves: report.plots and
report.bench_plots). draw_plots draws every part's plots, or for a stage left out or without numbers a placeholder
saying why."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ... import records, registry
from ...layout import Layout
from .bench_plots import (
    attention_speedups,
    plot_attention,
    plot_attention_memory,
    plot_capacity,
    plot_inference,
    plot_serving,
)
from .notes import same_updates
from .parts import PARTS
from .plots import (
    plot_finetune,
    plot_finetune_pareto,
    plot_inference_pareto,
    plot_loss,
    plot_prune,
    plot_qat,
    plot_quantize,
)
from .plotting import placeholder_plot
from .results import absent


@dataclass(frozen=True)
class Inputs:
    """What the plots are drawn from: the records, the tables, the frontiers, and the decisions (decisions.json's
    questions: every verdict and frontier drawn is read from there, so no plot decides again)."""
    cfg: dict
    metrics: dict
    tables: dict
    fronts: dict
    layout: Layout
    questions: dict

    @property
    def tolerance_pct(self) -> float:
        return self.cfg["tolerance"]["perplexity_pct"]


def quantize(given: Inputs, path: Path) -> None:
    plot_quantize(given.metrics["quantize"], path, given.tolerance_pct, given.questions.get("quantize"))


def prune(given: Inputs, path: Path) -> None:
    plot_prune(given.metrics["prune"], path)


def qat(given: Inputs, path: Path) -> None:
    plot_qat(given.questions["qat"], records.ok(given.metrics["qat"])[0], path, given.tolerance_pct)


def finetune(given: Inputs, path: Path) -> None:
    plot_finetune(given.questions["finetune"], given.metrics["finetune"], given.metrics.get("bench_finetune", []), path)


def finetune_pareto(given: Inputs, path: Path) -> None:
    plot_finetune_pareto(given.fronts["finetune"], path, given.questions.get("finetune"))


def finetune_loss(given: Inputs, path: Path) -> None:
    runs = given.metrics["finetune"]
    plot_loss(given.layout, registry.names(given.cfg, "finetune") or [], runs, path, same_updates(runs))


def bench_attention(given: Inputs, path: Path) -> None:
    plot_attention(attention_speedups(given.metrics["bench_attention"]), path)


def bench_attention_memory(given: Inputs, path: Path) -> None:
    plot_attention_memory(given.tables["bench_attention"], given.tables["attention_memory_exponent"], path)


def bench_inference(given: Inputs, path: Path) -> None:
    plot_inference(given.metrics["bench_inference"], path, given.questions.get("inference"))


def inference_pareto(given: Inputs, path: Path) -> None:
    plot_inference_pareto(given.fronts["inference"], path, given.questions.get("inference"))


def bench_serving(given: Inputs, path: Path) -> None:
    plot_serving(given.metrics["bench_serving"], path)


def capacity(given: Inputs, path: Path) -> None:
    plot_capacity(given.metrics["capacity"], path)


def draw_plots(given: Inputs, out: Path) -> list[str]:
    """Every part's plots into `out` (given.questions: out/decisions.json's, which the stage writes first)."""
    drawn = []
    for stage, part in PARTS.items():
        why = absent(given.cfg, given.metrics, stage)
        for plot in part.plots:
            path = out / f"{plot}.png"
            placeholder_plot(path, f"{stage}: {why}") if why else globals()[plot](given, path)
            drawn.append(path.name)
    return sorted(drawn)


def questions(out: Path) -> dict:
    """The decisions the stage wrote to out/decisions.json (report.decisions), by question."""
    return json.loads((out / "decisions.json").read_text())["questions"]
