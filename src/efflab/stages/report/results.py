"""The records the report reads: every stage's metrics, and why a stage has none."""
from __future__ import annotations

from ... import records
from ...registry import STAGES, names, not_asked


def absent(cfg: dict, metrics: dict, stage: str) -> str | None:
    """Why a stage's section or plot has nothing to show: left out of the experiment, or no job produced numbers."""
    why = not_asked(cfg, stage)
    if why:
        return f"not asked for: {why}"
    return None if records.ok(metrics[stage]) else "no job of this stage produced numbers (see *Did not run*)"


def read_results(cfg: dict, layout) -> dict[str, list[dict]]:
    """Every stage's records, in grid order; [] for a stage this experiment leaves out (registry.not_asked)."""
    return {s: [] if not_asked(cfg, s) else records.read_stage(layout, s, names(cfg, s))
            for s in STAGES if s != "report"}
