"""The report laid out by stage: each stage's part of report.md, read from its registry row (registry.Stage.report,
a report_part.Part: its title and section, its tables, its plots), in the registry's order, and where the report
shows the stages without a part. The report stage (report.stage, report.tables, report.draw) and
workflow/rules/report.smk (its plots and their captions) read it; tests/test_report_parts.py fails when a part's
section, table builder, plot drawer or caption is missing.

No pandas, torch or matplotlib here: Snakemake reads this while it plans the DAG.
"""
from __future__ import annotations

import importlib

from ...registry import STAGES
from ...report_part import Part, Table

PARTS: dict[str, Part] = {s.name: s.report for s in STAGES.values() if isinstance(s.report, Part)}
# The stages with no part of their own, and where the report shows them instead. The report rule waits for every
# earlier job's record all the same (registry.earlier_records).
ELSEWHERE: dict[str, str] = {s.name: s.report for s in STAGES.values() if isinstance(s.report, str)}


def details_tables() -> list[Table]:
    """The tables report.md links to details.md, in the report's order."""
    return [t for part in PARTS.values() for t in part.tables if t.details]


def report_plots() -> list[tuple[str, str]]:
    """Every plot of the report with its category, in the report's order."""
    return [(plot, part.category) for part in PARTS.values() for plot in part.plots]


def resolve(name: str):
    """A function of this package by its name, `module.function` (its module imported only now)."""
    module, _, function = name.rpartition(".")
    return getattr(importlib.import_module(f"{__package__}.{module}"), function)
