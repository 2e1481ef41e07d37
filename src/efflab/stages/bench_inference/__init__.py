"""Stage bench_inference: greedy generation of a fixed length over a fixed prompt set, per variant.

Variants: the base model, a quantized scheme, a merged run, or an adapter on its base; each over its
cells of KV cache on/off × batch size × generation mode, every cell in its own process (runtime.isolation).
A streamer timestamps every token as generate() emits it, so one call gives the prefill (time to first
token) and the decode (time per output token) apart; the generation length is forced so runs compare.

Generation modes (transformers' own): `dynamic`, generate()'s default growing KV cache; `static`, a
preallocated StaticCache (no compile); `compiled`, the static cache with the forward compiled by
torch.compile, its compile and first generations timed apart from the steady rate; `vllm`, vLLM's engine on
the same prompts where it runs (efflab.models.engines). A mode other than dynamic is interleaved with the same model's
dynamic generate(), round by round: what the mode buys, on the same prompts and forced length.
"""
from __future__ import annotations

import logging
import shutil

from ... import experiment, profiling, records
from ...estimators.fit import assess, budget, generation_prediction, measured_error, refusal, try_anyway
from ...estimators.generation_memory import Generation
from ...layout import Job
from ...measure.bandwidth import bandwidth_ceiling
from ...measure.env import environment
from ...measure.flops import matmul_ceiling
from ...measure.isolation import prestart, run_cell
from ...models import engines, speculative
from ...models.modeling import require_input
from ...registry import built_on
from .cells import engine_cell, inference_cell
from .generation import prompts

log = logging.getLogger("efflab")


def cells_of(b: dict, variant: dict) -> list[dict]:
    """A variant's cells: KV cache × batch size × generation mode (its own lists, else the stage's), in that order;
    `assisted` once per draft, and beside the dynamic cell one per quantized cache (kv_quant). A mode that is a way
    of keeping the KV cache (static, compiled, an engine, a speculative one, a quantized cache) has no cell
    without one."""
    drafts = experiment.drafts_of(b, variant)
    out = []
    for kv in variant.get("kv_cache", b["kv_cache"]):
        for batch in variant.get("batch_sizes", b["batch_sizes"]):
            for mode in variant.get("generation", b["generation"]):
                cell = {"kv_cache": kv, "batch_size": batch, "generation": mode}
                if not kv and mode != "dynamic":
                    continue
                out += [cell | {"draft": d} for d in drafts] if mode == "assisted" else [cell]
                if mode == "dynamic" and kv:
                    out += [cell | {"kv_quant": q} for q in variant.get("kv_quant", b.get("kv_quant") or [])]
    return out


def cell_folder(cell: dict) -> str:
    """A cell's folder name (its profiles): kv-cache-true-batch-1[-mode][-draft][-kv-quanto-4]."""
    return (f"kv-cache-{str(cell['kv_cache']).lower()}-batch-{cell['batch_size']}"
            + ("" if cell["generation"] == "dynamic" else f"-{cell['generation']}")
            + (f"-{cell['draft']}" if cell.get("draft") else "") + (f"-kv-{cell['kv_quant']}" if cell.get("kv_quant")
                                                                   else ""))


def cell_fit(cfg: dict, job: Job, variant: experiment.Variant):
    """cell -> its predicted peak against the device's memory (estimators.fit, as the dry run said it) on the longest
    of the job's prompts; None for a cell the estimator does not model (an engine's, which preallocates its own
    cache; a draft's, whose second model it does not count)."""
    b, folder, device = cfg["bench_inference"], job.layout.variant_folders(variant.model)[0], job.device
    longest = max(len(job.tokenizer(p["text"], add_special_tokens=False).input_ids)
                  for p in prompts(b, job.layout, job.tokenizer))
    room, errors = budget(cfg["runtime"], device.type), measured_error(job.layout.root)

    def fit(cell: dict) -> dict | None:
        if cell["generation"] in engines.ENGINES or cell.get("draft"):
            return None
        shape = Generation(cell["batch_size"], longest, b["max_new_tokens"], cell["kv_cache"])
        return assess(generation_prediction(folder, job.dtype, variant.model.quant, shape, device.type), room, errors)
    return fit


def run(cfg: dict, job: Job) -> dict:
    """Benchmark greedy generation of one variant over its KV-cache, batch-size and generation-mode cells."""
    b, rt, name, layout = cfg["bench_inference"], cfg["runtime"], job.name, job.layout
    variant = experiment.variant(cfg, name)  # built once, handed whole to each cell
    prestart(rt["isolation"])  # the cells' forkserver imports beside this job
    device, dtype = job.device, job.dtype
    skipped = layout.skipped_because(built_on(cfg, "bench_inference", name))
    if skipped:
        return {**skipped, "variant": name, "kind": variant.model.kind, "of": variant.model.of, "cells": [],
                "environment": environment(device, b)}
    for folder in layout.variant_folders(variant.model):  # a missing input is the user's error, not a failed cell
        require_input(folder)
    made_by = layout.job_metrics(experiment.made_by(variant.model.kind, variant.model.of))
    journal = job.journal({"bench_inference": b, "runtime": rt, "built_on": made_by.read_text()})
    cells = []
    # The machine's two limits, measured once in this job and given to every cell (each cell is a fresh process)
    limits = {"bandwidth": bandwidth_ceiling(device), "matmul": matmul_ceiling(dtype, device)}
    profiles = layout.out("bench_inference") / f".{name}.{profiling.FOLDER}"  # beside the journal, until the end
    if journal.resumed == 0:
        shutil.rmtree(profiles, ignore_errors=True)  # a killed earlier run's
    fitting = cell_fit(cfg, job, variant)
    for cell in cells_of(b, variant.settings):
        if reason := engines.unavailable(cell["generation"], device, variant.model.kind) or (
                speculative.batch_unavailable(cell["generation"], cell["batch_size"])):
            cells.append(cell | {"status": "unavailable", "reason": reason})
            continue
        fit = fitting(cell)
        if fit and (why := refusal(fit)) and not try_anyway(cfg):
            cells.append(cell | {"status": "unavailable", "reason": why, "memory_fit": fit})
            continue
        folder = cell_folder(cell)
        profile_dir = str(profiles / folder) if profiling.wanted(cfg, "bench_inference") else None
        result = journal.result(cell, lambda: run_cell(
            engine_cell if cell["generation"] in engines.ENGINES else inference_cell,
            dict(cfg=cfg, results=str(layout.root), variant=variant, dtype=dtype, device=str(device), cell=cell,
                 limits=limits, profile_dir=profile_dir),
            isolation=rt["isolation"], timeout_s=rt["cell_timeout_s"], memory_cap_mib=rt["cell_memory_cap_mib"]))
        if not records.is_ok(result):
            log.warning("%s %s: %s: %s", name, cell, result["status"], result.get("reason"))
        cells.append(cell | result | ({"memory_fit": fit} if fit else {}))
    journal.remove()
    if profiles.is_dir():
        shutil.move(str(profiles), str(job.out / profiling.FOLDER))
    return {
        "status": "ok" if records.ok(cells) else "failed",
        "variant": name, "kind": variant.model.kind, "of": variant.model.of, "dtype": dtype,
        "prompts": len(prompts(b, layout, job.tokenizer)),
        "prompts_from": "configured" if isinstance(b["prompts"], list) else "validation rows",
        "new_tokens": b["max_new_tokens"], "repeats": b["repeats"],
        "warmup": b["warmup"], "cells": cells, "limits": limits, "environment": environment(device, b),
    }
