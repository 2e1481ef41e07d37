"""The stage registry: what each stage is, in one table. The Snakemake rules (workflow/rules/stages.smk), dvcgen,
cli, layout, gpu_slots, profiling and the report (its parts) read it; tests/test_registry.py fails when a stage is missing from any of them.

No torch here: Snakemake reads this while it plans the DAG.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Callable

from .config import TASK_TOLERANCES, lookup
from .experiment import HEALED, MODEL, drafts_of, evaluated_models, finetune_run, merge_runs, model_paths
from .report_part import Part, Says, Table

# What stages write besides metrics.json, by name (layout says where; experiment.MODEL_KINDS which holds a model).
QAT_MODEL = "finetuned"  # qat's full-precision fine-tune
LOSS_CSV = "loss.csv"  # finetune's loss curve
LM_EVAL = "lm_eval"  # evaluate's task folder: efflab's lm-eval tasks as the job scored them (efflab.evaluation.task)


@dataclass(frozen=True)
class Stage:
    name: str
    # The params keys its jobs read: Snakemake and DVC rerun a job when they change. {name} is the job's grid entry;
    # {a.b} a params list, one key per entry (capacity reads only the variants and runs it searches).
    params: tuple[str, ...]
    # Wall-time limit in minutes for a CPU-sized run on a model of up to 1 GB; linear in size above.
    runtime_min: int
    # Host memory in units of the base model's in-memory size (weights in the compute dtype), on top of
    # common.smk's MEM_BASE_MB for Python, torch and the data; per method for finetune.
    mem_factor: float | dict = 0
    # The names its jobs run over; None for a single-job stage.
    grid: Callable[[dict], list[str]] | None = None
    # Why an experiment leaves the stage out, and the test of that (its grid is empty).
    left_out: tuple[str, Callable[[dict], bool]] | None = None
    # What a job writes besides metrics.json and figures.json, in its folder: its rule's outputs. A job that did not
    # run writes them too (a model folder holding only NOT_RUN.txt, an empty loss curve, empty tables), so that the
    # jobs after it run and record "skipped", and the report renders around it; except an essential stage's.
    outputs: tuple[str, ...] = ()
    # Without it nothing can run (base_model, prepare_data), or nothing reads it (report): its failure stops the run.
    essential: bool = False
    # Project files its jobs read besides their own code (paths from the repository root; a folder stands for the
    # files under it): its rule's inputs, so that editing one reruns the stage.
    code: tuple[str, ...] = ()
    # Its params section's `source` may name a local data file or model folder: that file's (or folder's) files are
    # its rule's inputs.
    sourced: bool = False
    # A fixed thread count, for a stage whose work is not torch's compute (reading and writing tables).
    threads: int | None = None
    # Its rule is written by hand, in workflow/rules/<stage>.smk, not made from this row (the report's, whose
    # outputs carry the captions of Snakemake's HTML report).
    own_rule: bool = False
    gpu: bool = False  # claims a GPU slot, and gets `gpu: 1` and `cpus_per_gpu` on GPU runs
    profiled: bool = False  # can run under torch.profiler (profile.stages)
    # Its numbers are timings, so on a CPU run it takes every core and runs alone; a stage that times nothing
    # (evaluate) takes half of them, so two of its jobs run side by side.
    timed: bool = True
    # The figures a person compares across experiments: paths into its record (efflab.figure_picks), written to each
    # job's figures.json, its DVC metric. A few per job, so that `dvc exp show` stays a table one can read.
    figures: tuple[str, ...] = ()
    # What a job reads of earlier jobs: paths under the results folder (`stage/name/file`, `stage/file`), given the
    # params and its grid entry. The rule's inputs, its provenance, DVC's deps and its skipped check derive from
    # it. None: the record of every job before it (claims, report: earlier_records), each of which carries its own
    # chain.
    reads: Callable[[dict, str | None], list[str]] | None = None
    # How the report shows it: its part of report.md (report_part.Part: title, section, tables, plots), or a line
    # saying where the report shows it instead.
    report: Part | str = ""


# How a model is scored (the evaluate stage; qat scores its models in its own job through the same code).
EVALUATION = ("evaluate.docs", "evaluate.max_new_tokens", "evaluate.batch_size",
              "evaluate.bootstrap_iters", *(f"tolerance.{m}" for m in TASK_TOLERANCES), "tolerance.task_relative")


# What jobs read of the first two stages: the base model's record (its size scales every job's resources; its
# folder is read through it) and prepare_data's splits and task documents.
BASE, TRAIN, VALIDATION, TASK = ("base_model/metrics.json", "prepare_data/train.parquet",
                                 "prepare_data/validation.parquet", f"prepare_data/{LM_EVAL}")


def _reading(*paths: str) -> Callable[[dict, str | None], list[str]]:
    return lambda cfg, name: list(paths)


def _quantize_reads(cfg: dict, name: str | None) -> list[str]:
    """A scheme is compared with the baseline scheme, so it reads the baseline's record."""
    baseline = cfg["report"]["baseline_scheme"]
    return [BASE, VALIDATION] + ([f"quantize/{baseline}/metrics.json"] if name != baseline else [])


def _variant_model(cfg: dict, name: str) -> str:
    """The model folder a bench_inference variant loads (an adapter's own: its base is read through BASE)."""
    variant = cfg["bench_inference"]["variants"][name]
    return model_paths(variant["kind"], variant.get("of"))[-1]


def _draft_models(cfg: dict, name: str) -> list[str]:
    """The model folders of the drafts a variant's assisted cells load, those this run makes (a `source` draft is
    outside the results folder)."""
    b = cfg["bench_inference"]
    used = [b["speculative"]["drafts"][d] for d in drafts_of(b, b["variants"][name])]
    return [model_paths(d["kind"], d.get("of"))[-1] for d in used if "kind" in d]


def _evaluate_reads(cfg: dict, name: str | None) -> list[str]:
    """The evaluated model's folders, the task documents, and the record of the model it is paired with."""
    model = evaluated_models(cfg)[name]
    reference = [f"evaluate/{model['reference']}/metrics.json"] if model["reference"] else []
    return [BASE, TASK, *model_paths(model["kind"], model["of"]), *reference]


def _stages(*stages: Stage) -> dict[str, Stage]:
    return {s.name: s for s in stages}


# In DAG order. Full fine-tuning holds weights, gradients and two Adam moments in fp32; LoRA and QLoRA hold the
# frozen base plus small adapters; quantize and merge hold a second copy of the model; the benchmarks hold one
# model and its activations.
STAGES = _stages(
    Stage("base_model", ("runtime", "base_model"), runtime_min=15, mem_factor=3, outputs=(MODEL,), essential=True,
          sourced=True,
          figures=("dtype", "parameters", "memory_footprint_bytes"),
          reads=_reading(),
          report="the header (sections.header)"),
    Stage("prepare_data", ("prepare_data",), runtime_min=10, outputs=("train.parquet", "validation.parquet", LM_EVAL),
          essential=True, sourced=True, threads=1,
          figures=("train.rows", "train.tokens", "validation.rows"),
          reads=_reading(BASE),
          report="the header (sections.header)"),
    Stage("quantize", ("runtime", "quantize.eval_rows", "quantize.batch_size", "quantize.schemes.{name}",
                       "report.baseline_scheme"), runtime_min=20, mem_factor=3,
          grid=lambda cfg: list(cfg["quantize"]["schemes"]), outputs=(MODEL,), gpu=True,
          figures=("memory_footprint_bytes", "footprint_ratio_vs_base", "perplexity_change.change_pct",
                   "perplexity_change.ci95_change_pct"),
          reads=_quantize_reads,
          report=Part(
              "## Quantization (post-training: bitsandbytes, torchao, HQQ)", "Quantization", section="quantize",
              tables=(Table("quantize", "tables.quantize.quantize_table"),
                      Table("quantize_adapter", "tables.quantize.adapter_table", keys=2,
                            details="LoRA on each quantization scheme")),
              plots=("quantize",))),
    Stage("prune", ("runtime", "prune.importance", "prune.calibration_rows", "prune.eval_rows", "prune.prompt",
                    "prune.max_new_tokens", "prune.repeats", "prune.heal", "prune.strategies.{name}"),
          runtime_min=20, mem_factor=3, grid=lambda cfg: list(cfg["prune"]["strategies"]),
          left_out=("prune.strategies is empty", lambda cfg: not cfg["prune"]["strategies"]),
          outputs=(MODEL, HEALED), gpu=True,
          figures=("parameter_ratio", "footprint_ratio", "pruned.perplexity_change.change_pct",
                   "pruned.perplexity_change.ci95_change_pct", "generation_speedup.median", "generation_speedup.ci95",
                   "generation_speedup.verdict"),
          reads=_reading(BASE, TRAIN, VALIDATION),
          report=Part(
              "## Structured pruning", "Pruning", section="prune",
              tables=(Table("prune", "tables.prune.prune_table", keys=1,
                            says=(Says("prune", "{strategy}", "verdict vs base", "speed"),)),),
              plots=("prune",))),
    Stage("qat", ("runtime", "qat", "tolerance.perplexity_pct", *EVALUATION), runtime_min=40, mem_factor=6,
          left_out=("qat.bits is empty", lambda cfg: not cfg["qat"]["bits"]),
          outputs=(QAT_MODEL, "evals.csv", "losses.csv"), gpu=True,
          figures=("variants[variant].perplexity",),
          reads=_reading(BASE, TRAIN, VALIDATION, TASK),
          report=Part(
              "## Quantization-aware training and the precision range test", "Quantization-aware training", section="qat",
              tables=(Table("qat", "tables.qat.qat_table", keys=1,
                            says=(Says("qat", "ptq {bits} bits", "PTQ verdict", "quality"),
                                  Says("qat", "qat {bits} bits", "QAT verdict", "quality"))),),
              plots=("qat",))),
    Stage("finetune", ("runtime", "finetune.defaults", "finetune.runs.{name}", "profile"), runtime_min=60,
          mem_factor={"full": 5, "lora": 2, "qlora": 2}, grid=lambda cfg: list(cfg["finetune"]["runs"]),
          left_out=("finetune.runs is empty", lambda cfg: not cfg["finetune"]["runs"]),
          outputs=(MODEL, LOSS_CSV), gpu=True, profiled=True,
          figures=("tokens_per_s", "step_time", "train_memory.peak_mib", "train_memory.kind", "validation_after.loss"),
          reads=_reading(BASE, TRAIN, VALIDATION),
          report=Part(
              "## Fine-tuning: full vs LoRA vs QLoRA", "Fine-tuning", section="finetune",
              tables=(Table("finetune", "tables.finetune.finetune_table", keys=1),
                      Table("finetune_target", "tables.finetune.target_table", keys=1,
                            details="Time to target, run by run"),
                      Table("finetune_knobs", "knobs.knob_table", keys=3, reads=("finetune", "bench_finetune"),
                            says=(Says("finetune_knobs", "{runs}", "step time verdict", "step_ratio"),))),
              plots=("finetune", "finetune_pareto", "finetune_loss"))),
    Stage("merge", ("runtime", "merge", "finetune.defaults", "finetune.runs.{name}"), runtime_min=20, mem_factor=3,
          grid=merge_runs,
          left_out=("no adapter run to merge (merge.runs, finetune.runs)", lambda cfg: not merge_runs(cfg)),
          outputs=(MODEL,), gpu=True,
          figures=("merged.max_abs_logit_diff", "merged.perplexity_change.change_pct"),
          reads=lambda cfg, name: [BASE, VALIDATION, model_paths("adapter", name)[-1]],
          report=Part(
              "## Merging adapters", "Merging", section="merge",
              tables=(Table("merge", "tables.merge.merge_table", keys=1),
                      Table("merge_targets", "tables.merge.merge_targets_table", keys=2)))),
    Stage("bench_finetune", ("runtime", "bench_finetune", "finetune.defaults", "finetune.runs"), runtime_min=30,
          mem_factor=7, code=("src/efflab/stages/finetune",),  # its cells train as the finetune stage does
          left_out=("finetune.runs has fewer than two runs to compare", lambda cfg: len(cfg["finetune"]["runs"]) < 2),
          gpu=True,
          figures=("pairs[a,b].step_time_ratio.median", "pairs[a,b].step_time_ratio.ci95",
                   "pairs[a,b].step_time_ratio.verdict"),
          reads=_reading(BASE, TRAIN),
          report="fine-tuning's part: its knob table and plot read the interleaved steps"),
    Stage("bench_attention", ("runtime", "bench_attention.seq_lens", "bench_attention.batch_sizes",
                              "bench_attention.modes", "bench_attention.warmup", "bench_attention.repeats"),
          runtime_min=20, mem_factor=2, grid=lambda cfg: list(cfg["bench_attention"]["implementations"]),
          left_out=("bench_attention.implementations is empty",
                    lambda cfg: not cfg["bench_attention"]["implementations"]),
          gpu=True,
          figures=("rows[mode,seq_len,batch_size].latency",),
          reads=_reading(BASE),
          report=Part(
              "## Attention implementations", "Attention", section="attention",
              tables=(Table("bench_attention", "tables.bench_attention.attention_table", keys=4,
                            says=(Says("attention", "{implementation} {mode} L={seq len} B={batch}", "verdict vs eager",
                                       "speed"),)),
                      Table("attention_memory_exponent", "tables.bench_attention.exponent_table",
                            details="Attention memory against sequence length")),
              plots=("bench_attention", "bench_attention_memory"))),
    Stage("bench_inference", ("runtime", "bench_inference.max_new_tokens", "bench_inference.warmup",
                              "bench_inference.repeats", "bench_inference.kv_cache", "bench_inference.batch_sizes",
                              "bench_inference.generation", "bench_inference.kv_quant",
                              "bench_inference.kv_quant_options", "bench_inference.speculative",
                              "bench_inference.prompts", "bench_inference.variants.{name}", "profile"),
          runtime_min=20, mem_factor=2, grid=lambda cfg: list(cfg["bench_inference"]["variants"]),
          left_out=("bench_inference.variants is empty", lambda cfg: not cfg["bench_inference"]["variants"]),
          gpu=True, profiled=True,
          figures=tuple(f"cells[kv_cache,batch_size,generation,draft?,kv_quant?].{f}" for f in (
              "decode_tokens_per_s", "ttft", "memory.peak_mib", "roofline.bandwidth_fraction",
              "generation_tokens_per_s")),
          reads=lambda cfg, name: [BASE, VALIDATION, _variant_model(cfg, name), *_draft_models(cfg, name)],
          report=Part(
              "## Inference variants (greedy, fixed length)", "Inference", section="inference",
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
              plots=("bench_inference", "inference_pareto"))),
    Stage("bench_serving", ("runtime", "bench_serving"), runtime_min=20, mem_factor=3,
          left_out=("bench_serving.methods is empty", lambda cfg: not cfg["bench_serving"]["methods"]),
          outputs=("requests.csv", "open_loop_requests.csv", "slo_search_requests.csv"), gpu=True,
          figures=("cells[method,concurrency].output_tokens_per_s", "open_loop.cells[method,rate].goodput_per_s",
                   "slo_search.subjects[name].answer.value"),
          reads=_reading(BASE, TRAIN, VALIDATION),
          report=Part(
              "## Serving: naive vs static vs continuous batching", "Serving", section="serving",
              tables=(Table("bench_serving", "tables.bench_serving.serving_table", keys=2,
                            says=(Says("serving", "{method} at {concurrency}", "verdict vs naive", "speed"),
                                  Says("serving", "{method} at {concurrency}", "verdict vs static", "versus_static"))),
                      Table("bench_serving_latency", "tables.bench_serving.serving_latency_table", keys=2),
                      Table("bench_serving_open_loop", "tables.bench_serving.open_loop_table", keys=2,
                            details="Open-loop serving, rate by rate"),
                      Table("bench_serving_slo_search", "tables.bench_serving.slo_search_table", keys=1,
                            says=(Says("serving", "{subject}", "cache on vs off", "prefix_caching"),))),
              plots=("bench_serving",))),
    Stage("capacity", ("runtime", "capacity", "finetune.defaults", "finetune.runs.{capacity.runs}",
                       "bench_inference.variants.{capacity.variants}.kind",
                       "bench_inference.variants.{capacity.variants}.of", "bench_inference.kv_quant_options"),
          runtime_min=40, mem_factor=6,
          left_out=("capacity.runs, capacity.variants and capacity.kv_quant are empty",
                    lambda cfg: not (cfg["capacity"]["runs"] or cfg["capacity"]["variants"]
                                     or cfg["capacity"].get("kv_quant"))),
          outputs=("cells.csv",), gpu=True,
          figures=("searches[subject,kind,dimension].measured_max",),
          reads=lambda cfg, name: [BASE, TRAIN, *sorted({_variant_model(cfg, v)
                                                         for v in cfg["capacity"]["variants"]})],
          report=Part(
              "## Capacity: the largest batch and sequence that fit", "Capacity", section="capacity",
              tables=(Table("capacity", "tables.capacity.capacity_table", keys=2),),
              plots=("capacity",))),
    Stage("evaluate", ("runtime", "evaluate.tasks", *EVALUATION, "evaluate.samples"),
          runtime_min=20, mem_factor=3, grid=lambda cfg: list(evaluated_models(cfg)), outputs=(LM_EVAL,), gpu=True,
          left_out=("evaluate.models is empty", lambda cfg: not evaluated_models(cfg)),
          timed=False,
          figures=("tasks.*.metrics.*.value", "gate.verdict"),
          reads=_evaluate_reads,
          report=Part(
              "## Task quality (lm-evaluation-harness) and the quality gate", "Task quality", section="evaluate")),
    Stage("claims", ("claims", "tolerance"), runtime_min=10, outputs=("claims.csv", "claims.md", "summary.json"),
          code=("src/efflab/estimators/analytic.py", "workflow/claims.yaml", "workflow/schemas/claims.schema.yaml",
                "workflow/models"),  # the shipped architecture configs it computes from
          threads=1, figures=("by_verdict",),
          report="the notes above the sections (notes.claims_lines)"),
    Stage("report", ("report", "tolerance"), runtime_min=10, essential=True, own_rule=True, threads=1,
          # the larger experiment (what this run leaves out of it), and the questions it answers (in the core: the
          # compare command reads them too)
          code=("workflow/profiles/gpu/params.yaml", "src/efflab/questions.py"),
          figures=("not_run", "decisions.*"),
          report="the report itself"),
)


def module(stage: str) -> str:
    """The stage's module, run as `python -m <module>`."""
    return f"efflab.stages.{stage}"


def names(cfg: dict, stage: str) -> list[str] | None:
    """The names a stage's jobs run over, or None for a single-job stage."""
    grid = STAGES[stage].grid
    return None if grid is None else grid(cfg)


def reads(cfg: dict, stage: str, name: str | None = None) -> list[str] | None:
    """What the job `stage`/`name` reads of earlier jobs, as paths under the results folder (Stage.reads), or None
    for a stage that reads every job's record."""
    read = STAGES[stage].reads
    return None if read is None else read(cfg, name)


def job_of(path: str) -> str:
    """The job (`stage` or `stage/name`) whose folder a path under the results folder is in."""
    stage, name, *_ = path.split("/") + [""]
    return stage if STAGES[stage].grid is None else f"{stage}/{name}"


def upstream_jobs(cfg: dict, stage: str, name: str | None = None) -> list[str]:
    """The earlier jobs a job reads, each once, in the order it reads them ([] for a stage that reads every
    job's record: each record carries its own chain)."""
    return list(dict.fromkeys(job_of(path) for path in reads(cfg, stage, name) or []))


def built_on(cfg: dict, stage: str, name: str | None = None) -> list[str]:
    """The earlier jobs whose artifacts (not just their records) a job loads and which can fail without stopping
    the run (their stage writes its outputs empty): where one did not succeed, the job is skipped."""
    return list(dict.fromkeys(job_of(path) for path in reads(cfg, stage, name) or []
                              if not path.endswith("/metrics.json") and not STAGES[path.split("/")[0]].essential))


def earlier_records(cfg: dict, stage: str) -> list[str]:
    """The records (paths under the results folder) of every job of the stages before `stage`, in DAG order, none
    of a stage the experiment leaves out: what a stage that reads every job's record (claims, report) waits for."""
    paths = []
    for earlier in list(STAGES)[:list(STAGES).index(stage)]:
        grid = names(cfg, earlier)
        if grid is None:
            paths += [] if not_asked(cfg, earlier) else [f"{earlier}/metrics.json"]
        else:
            paths += [f"{earlier}/{name}/metrics.json" for name in grid]
    return paths


def not_asked(cfg: dict, stage: str) -> str | None:
    """Why `stage` is left out of this experiment (its grid is empty), or None when it runs."""
    left_out = STAGES[stage].left_out
    return left_out[0] if left_out and left_out[1](cfg) else None


def param_keys(cfg: dict, stage: str, name: str | None = None) -> list[str]:
    """The params keys a job reads (Stage.params with its placeholders filled in), those that `cfg` has."""
    keys = []
    for key in STAGES[stage].params:
        found = re.search(r"\{([^}]+)\}", key)
        if not found:
            keys.append(key)
            continue
        entries = [name] if found.group(1) == "name" else lookup(cfg, found.group(1)) or []
        keys += [key.replace(found.group(0), str(entry)) for entry in entries]
    return [key for key in keys if _has(cfg, key)]


def _has(cfg: dict, dotted: str) -> bool:
    try:
        lookup(cfg, dotted)
    except (KeyError, TypeError):
        return False
    return True


def settings(cfg: dict, stage: str, name: str | None = None) -> str:
    """The params a job reads, as canonical JSON: a Snakemake rule param, so edits rerun the job."""
    return json.dumps({k: lookup(cfg, k) for k in param_keys(cfg, stage, name)}, sort_keys=True)


def mem_factor(cfg: dict, stage: str, name: str | None = None) -> float:
    """The stage's host memory in units of the base model's size (for finetune, its run's method's)."""
    factor = STAGES[stage].mem_factor
    return factor.get(finetune_run(cfg, name).method, 0) if isinstance(factor, dict) else factor
