"""The report laid out by stage, in one table: each stage's part of report.md (its title and section), its tables
(with the columns that name a row), its plots (with their category in Snakemake's HTML report), in the order the
report gives them. The report stage (report.stage, report.tables, report.draw) and workflow/rules/report.smk (its
plots and their captions) read it; tests/test_report_parts.py fails when a stage has no part and is not
in ELSEWHERE, or when a part's section, table builder, plot drawer or caption is missing.

Each part names its code by convention, all of it in this package:
- its section: `sections.<section>_body(cfg, metrics, table)` renders `templates/sections/<section>.md.j2`;
- a table: `Table.build`, a function `module.name` of this package, given the records of the stages it reads;
- a plot `<plot>`: drawn to results/report/<plot>.png by `draw.<plot>`, captioned by workflow/report/<plot>.rst.

No pandas, torch or matplotlib here: Snakemake reads this while it plans the DAG.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass


@dataclass(frozen=True)
class Says:
    """A verdict column of a table, stated in the ledger (report.ledger) as the verdict of `finding` (a question of
    decisions.json, or the table's own) on `metric` of the row's subject: `subject` formats the row's columns
    (str.format). Where decisions.json states the same finding, subject and metric, the checker holds them equal."""
    finding: str
    subject: str
    column: str
    metric: str


@dataclass(frozen=True)
class Table:
    name: str  # its key among the report's tables (in the section's `table(name)` and the report's metrics.json)
    build: str  # its builder, `module.function` of this package, e.g. "tables.prune.prune_table"
    # How many leading columns name a row: a table wider than the report allows is split into parts that repeat
    # them (fmt.markdown; None: its leading text columns, up to 4).
    keys: int | None = None
    reads: tuple[str, ...] = ()  # the stages whose records the builder takes, in order; () for its part's own
    # A table a reader looks up rather than reads: its heading in details.md, where it goes; report.md links it there.
    details: str | None = None
    says: tuple[Says, ...] = ()  # its verdict columns, each a finding's verdict in the ledger


@dataclass(frozen=True)
class Part:
    stage: str  # the stage whose records it shows: left out, or without numbers, it says why in one line
    title: str  # its heading in report.md
    section: str  # sections.<section>_body renders templates/sections/<section>.md.j2
    category: str  # its plots' category in Snakemake's HTML report
    tables: tuple[Table, ...] = ()
    plots: tuple[str, ...] = ()  # results/report/<plot>.png: drawn by draw.<plot>, caption workflow/report/<plot>.rst


def _parts(*parts: Part) -> dict[str, Part]:
    return {p.stage: p for p in parts}


# In the report's order.
PARTS = _parts(
    Part("quantize", "## Quantization (post-training: bitsandbytes, torchao, HQQ)", "quantize", "Quantization",
         tables=(Table("quantize", "tables.quantize.quantize_table"),
                 Table("quantize_adapter", "tables.quantize.adapter_table", keys=2,
                       details="LoRA on each quantization scheme")),
         plots=("quantize",)),
    Part("prune", "## Structured pruning", "prune", "Pruning",
         tables=(Table("prune", "tables.prune.prune_table", keys=1,
                       says=(Says("prune", "{strategy}", "verdict vs base", "speed"),)),),
         plots=("prune",)),
    Part("qat", "## Quantization-aware training and the precision range test", "qat", "Quantization-aware training",
         tables=(Table("qat", "tables.qat.qat_table", keys=1,
                       says=(Says("qat", "ptq {bits} bits", "PTQ verdict", "quality"),
                             Says("qat", "qat {bits} bits", "QAT verdict", "quality"))),),
         plots=("qat",)),
    Part("finetune", "## Fine-tuning: full vs LoRA vs QLoRA", "finetune", "Fine-tuning",
         tables=(Table("finetune", "tables.finetune.finetune_table", keys=1),
                 Table("finetune_target", "tables.finetune.target_table", keys=1,
                       details="Time to target, run by run"),
                 Table("finetune_knobs", "knobs.knob_table", keys=3, reads=("finetune", "bench_finetune"),
                       says=(Says("finetune_knobs", "{runs}", "step time verdict", "step_ratio"),))),
         plots=("finetune", "finetune_pareto", "finetune_loss")),
    Part("merge", "## Merging adapters", "merge", "Merging",
         tables=(Table("merge", "tables.merge.merge_table", keys=1),
                 Table("merge_targets", "tables.merge.merge_targets_table", keys=2))),
    Part("bench_attention", "## Attention implementations", "attention", "Attention",
         tables=(Table("bench_attention", "tables.bench_attention.attention_table", keys=4,
                       says=(Says("attention", "{implementation} {mode} L={seq len} B={batch}", "verdict vs eager",
                                  "speed"),)),
                 Table("attention_memory_exponent", "tables.bench_attention.exponent_table",
                       details="Attention memory against sequence length")),
         plots=("bench_attention", "bench_attention_memory")),
    Part("bench_inference", "## Inference variants (greedy, fixed length)", "inference", "Inference",
         tables=(Table("bench_inference", "tables.bench_inference.inference_table", keys=6,
                       says=(Says("bench_inference", "{variant} (KV cache {KV cache}, batch {batch}, {generation})", "verdict",
                                  "speed"),)),
                 Table("bench_inference_costs", "tables.bench_inference.costs_table", keys=6,
                       details="Inference cells: per-token latency, memory and the roofline"),
                 Table("speculative", "tables.bench_inference.speculative_table", keys=3,
                       says=(Says("speculative", "{variant}: {mode}", "verdict", "speed"),
                             Says("speculative", "{variant}: {mode}", "pays?", "status"))),
                 Table("kv_quant", "tables.bench_inference.kv_quant_table", keys=3,
                       says=(Says("kv_quant", "{variant} {cache} at {context (tokens)}", "verdict", "speed"),))),
         plots=("bench_inference", "inference_pareto")),
    Part("bench_serving", "## Serving: naive vs static vs continuous batching", "serving", "Serving",
         tables=(Table("bench_serving", "tables.bench_serving.serving_table", keys=2,
                       says=(Says("serving", "{method} at {concurrency}", "verdict vs naive", "speed"),
                             Says("serving", "{method} at {concurrency}", "verdict vs static", "versus_static"))),
                 Table("bench_serving_latency", "tables.bench_serving.serving_latency_table", keys=2),
                 Table("bench_serving_open_loop", "tables.bench_serving.open_loop_table", keys=2,
                       details="Open-loop serving, rate by rate")),
         plots=("bench_serving",)),
    Part("capacity", "## Capacity: the largest batch and sequence that fit", "capacity", "Capacity",
         tables=(Table("capacity", "tables.capacity.capacity_table", keys=2),),
         plots=("capacity",)),
    Part("evaluate", "## Task quality (lm-evaluation-harness) and the quality gate", "evaluate", "Task quality"),
)

# The stages with no part of their own, and where the report shows them instead. The report rule waits for every
# earlier job's record all the same (registry.earlier_records).
ELSEWHERE = {
    "base_model": "the header (sections.header)",
    "prepare_data": "the header (sections.header)",
    "bench_finetune": "fine-tuning's part: its knob table and plot read the interleaved steps",
    "claims": "the notes above the sections (notes.claims_lines)",
    "report": "the report itself",
}


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
