"""Stage capacity: the largest batch, and separately the longest sequence, that fits a memory budget, for each
fine-tuning method (capacity.runs, finetune runs) and each inference variant (capacity.variants).

The budget and the memory held against it:
- on a GPU, the card (capacity.budget_mib.cuda: null) or a set number of MiB (enforced with
  torch.cuda.set_per_process_memory_fraction); the memory is the caching allocator's peak reservation plus
  the CUDA context (NVML), and a cell that passes it raises torch's OutOfMemoryError;
- on a CPU, capacity.budget_mib.cpu (null: runtime.cell_memory_cap_mib); the memory is the cell process's
  peak resident set (VmHWM), what the kernel's OOM killer weighs. A cell whose resident set passes the budget
  is killed (run_cell's cap) or, if it passed it between two polls, judged by its high-water mark.

Each (subject, dimension) is searched over a grid: batch sizes 1..max_batch_size at `train_seq_len` tokens
(training) or `prompt_len` prompt tokens (generation), and sequence lengths in steps of seq_len_step at batch 1,
up to max_seq_len and the model's context. Every cell is a fresh process that loads the model and runs its
warm-up steps (training: forward, backward, optimizer step on rows of exactly that many real tokens of the
training split; generation: greedy, exactly new_tokens tokens) with the live-tensor peak tracked, then any timed
steps untracked. An out-of-memory cell is a result.
1. The smallest size runs first; it measures the memory with the model loaded, and the estimator
   (estimators.training_memory.training_peak / generation_memory.generation_peak, the same as finetune and
   bench_inference compare with) predicts the tensor growth of every size on top of it: the predicted maximum is
   the largest size predicted to fit.
2. The predicted maximum runs, then the next size; from there the search walks away from the prediction in
   doubling steps until it brackets the boundary, and bisects: it ends with a size that passes next to the
   next size, which fails (or with the grid's end passing: "fits the whole range").
3. Only a cell that is the maximum if it passes runs `capacity.timed` timed steps (see boundary_search): the
   tokens/s at the maximum has repeats, and the search's other cells pay for no timed step.
A subject's two searches share a cell of the same size: both start at batch 1 x train_seq_len when train_seq_len
is a multiple of seq_len_step (the default), and that cell runs once (`cells_shared` in the second's record).
The estimator predicts live tensors; the budget holds more (on a CPU the resident set, which also holds what
the allocator keeps and pages read from files). So every cell also measures the live-tensor growth of its
warm-up (measure.memory.tensor_peak), and each search record sets, at the measured maximum, the predicted tensor
growth beside the measured one (the estimator's error, like with like) and beside the growth of the memory the
budget holds (their gap: what the estimator does not model).
Every cell goes to cells.csv (memory, live tensors, prediction, speed, status and reason), from which every
maximum and gap in metrics.json is recomputed by the tests.

The longest context with a quantized KV cache (capacity.kv_quant, e.g. [quanto-4]): every generating subject's
sequence search runs again once per cache, a subject of its own (`<subject>+kv-<cache>`), the cache passed to
generate() (models.kv_cache.generate_kwargs, with bench_inference.kv_quant_options). The base model generates too
(subject `base`, the sequence search only) unless a variant of kind base is searched. The estimator does not model
a quantized cache: such a search has no prediction, and starts from the full-precision one's predicted maximum (a
lower bound). Each records `kv_quant`, `paired_with` (its full-precision search) and `context_gain`, its measured
maximum over the full-precision one's where both are decided (else null, `context_gain_why` says why: on the CPU
default the whole range may fit, which decides nothing; the GPU profile searches far longer contexts). A cache that
cannot run here (its backend not installed, a model with layers other than full attention) is `unavailable`.
"""
from __future__ import annotations

import logging
import shutil

import torch

from ... import records
from ...config import UserError
from ...layout import Job
from ...measure.env import environment
from ...measure.isolation import prestart
from ...measure.memory import CpuTensorPeak, MiB
from .cells import CellRunner
from .record import (
    CELLS_CSV,
    at_max,
    context_gain,
    kv_fields,
    kv_record,
    not_searched,
    predictions,
    row,
    size_along,
    speed,
    write_cells,
)
from .search import boundary_search
from .subjects import Subject, grid, kv_settings, max_positions, subjects

# transformers takes seconds to import: it is imported inside the function that uses it.

log = logging.getLogger("efflab")

MEMORY = {"cpu": "cpu_peak_rss: the cell process's resident-set high-water mark (VmHWM)",
          "cuda": "cuda_peak_reserved_plus_context: torch.cuda.max_memory_reserved plus the CUDA context (NVML)"}


def budget(c: dict, runtime: dict, device: torch.device) -> dict:
    """The memory budget in MiB, where it comes from and what memory is held against it."""
    if device.type == "cuda":
        card = torch.cuda.get_device_properties(device).total_memory / MiB
        chosen = c["budget_mib"]["cuda"]
        if chosen is None:
            return {"mib": card, "source": f"the whole card ({card:.0f} MiB)", "memory": MEMORY["cuda"]}
        return {"mib": min(chosen, card), "source": "capacity.budget_mib.cuda", "memory": MEMORY["cuda"]}
    if c["budget_mib"]["cpu"] is not None:
        return {"mib": c["budget_mib"]["cpu"], "source": "capacity.budget_mib.cpu", "memory": MEMORY["cpu"]}
    if runtime["cell_memory_cap_mib"] is not None:
        return {"mib": runtime["cell_memory_cap_mib"], "source": "runtime.cell_memory_cap_mib",
                "memory": MEMORY["cpu"]}
    raise UserError("capacity.budget_mib.cpu: null needs runtime.cell_memory_cap_mib (a number of MiB): on a CPU "
                    "there is no card to fill, so the budget must be set")


def _measurer(runner: CellRunner, subject: Subject, dimension: str, sizes: list, subject_sizes: list, shared: dict,
              reused: list):
    """A search's measure(i, role, timed) -> result: a cell in a fresh process under the budget, journaled. A search
    cell the subject's other search already ran with the same size and timed steps is not run again (`shared`
    keeps the subject's search cells; `reused` collects the indices taken from it), and a first cell predicts
    over all of `subject_sizes`."""
    kind = subject.kind

    def measure(i: int, role: str, timed: int) -> dict:
        batch_size, seq_len = sizes[i]
        predicts = i == 0 and role == "search"  # the first cell predicts over the subject's grids
        again = shared.get((batch_size, seq_len, timed)) if role == "search" else None
        reuse = again is not None and (not predicts or _predicted(again) or not records.is_ok(again))
        if reuse:
            reused.append(i)
            result = again
        else:
            result = runner.run(subject, dimension, (batch_size, seq_len), role, timed,
                                subject_sizes if predicts else [])
            if predicts:
                result = _by_size(result, subject_sizes)
            if role == "search":
                shared[(batch_size, seq_len, timed)] = result
        log.info("capacity %s %s batch %d x %d tokens%s: %s%s%s", kind, subject.name, batch_size, seq_len,
                 f" ({role}, {timed} timed)" if timed else "", result["status"],
                 f", peak {result['peak_mib']:.0f} MiB" if result.get("peak_mib") else
                 f" ({result.get('reason')})" if not records.is_ok(result) else "",
                 " (the cell the other search ran)" if reuse else "")
        return _on_grid(result, sizes) if predicts else result
    return measure


def _by_size(result: dict, sizes: list) -> dict:
    """A first cell's result with its predictions keyed by size (a cell that did not run has none)."""
    growth = result.get("predicted_growth_mib")
    return result if growth is None else result | {"predicted_growth_mib": dict(zip(map(tuple, sizes), growth))}


def _predicted(result: dict) -> bool:
    return isinstance(result.get("predicted_growth_mib"), dict)


def _on_grid(result: dict, sizes: list) -> dict:
    """A first cell's result with its predictions for one search's grid, in the grid's order."""
    growth = result.get("predicted_growth_mib")
    return result | {"predicted_growth_mib": [growth[tuple(s)] for s in sizes]} if _predicted(result) else result


def searched(runner: CellRunner, subject: Subject, dimension: str, sizes: list, subject_sizes: list,
             shared: dict) -> tuple[list[dict], dict]:
    """One (subject, dimension) boundary search, every cell in a fresh process under the budget (_measurer): its
    rows for cells.csv and its entry for the record."""
    c, limit, kind = runner.cfg["capacity"], runner.limit, subject.kind
    entry = {"subject": subject.name, "kind": kind, "dimension": dimension, "grid": [sizes[0], sizes[-1]],
             **kv_fields(subject)}
    reused = []
    measure = _measurer(runner, subject, dimension, sizes, subject_sizes, shared, reused)
    found = boundary_search(len(sizes), measure, limit["mib"], c["timed"])
    first, best = found["seen"][0], found["best"]
    growth, peaks, prediction = predictions(found, sizes, dimension, subject)
    ran = [(i, "search", r) for i, r in sorted(found["seen"].items())]
    ran += [(i, "timing", r) for i, r in sorted(found["timings"].items())]
    rows = [row(c, entry, sizes[i], role, result, growth[i], peaks[i], limit["mib"])
            for i, role, result in ran]
    entry |= prediction
    if found["failure"] is not None:
        failure = found["failure"]
        return rows, entry | {"status": "failed", "reason": f"a cell {failure['status']}: {failure.get('reason')}"}
    entry |= {"status": "ok", "measured_max": size_along(sizes[best], dimension) if best >= 0 else None,
              "whole_range_fits": best == len(sizes) - 1,
              "first_failing": size_along(sizes[best + 1], dimension) if best + 1 < len(sizes) else None,
              "cells": len(found["seen"]), "cells_shared": len(reused), "timing_runs": len(found["timings"])}
    if best >= 0:
        rerun = best in found["timings"]
        maximum = found["timings"][best] if rerun else found["seen"][best]
        entry |= {"at_max": at_max(maximum, growth[best], first["loaded_mib"]),
                  "timed_in": "a re-run of the maximum" if rerun else "the search's cell", **speed(maximum),
                  # the same work's peak read twice, in two processes: what a training peak's error is measured on
                  **({"search_peak_mib": found["seen"][best].get("peak_mib")} if rerun else {})}
    log.info("capacity %s %s, largest %s: predicted %s, measured %s%s (%d cells)", kind, subject.name, dimension,
             entry.get("predicted_max"), entry["measured_max"],
             " (the whole range fits)" if entry["whole_range_fits"] else "", len(found["seen"]))
    return rows, entry


def run(cfg: dict, job: Job) -> dict:
    """Search every subject's largest batch and longest sequence within the budget; write cells.csv."""
    from transformers import AutoConfig

    c, rt, layout = cfg["capacity"], cfg["runtime"], job.layout
    prestart("subprocess")  # the cells' forkserver imports beside this job
    device, dtype = job.device, job.dtype
    limit, positions = budget(c, rt, device), max_positions(layout)
    journal = job.journal({"capacity": c, "runtime": rt, "base": layout.metrics("base_model").read_text(),
                           "budget": limit, "kv_quant_options": kv_settings(cfg)})
    runner = CellRunner(cfg, layout, journal, limit, device, dtype)
    model_config = AutoConfig.from_pretrained(layout.base_model())
    cells, searches = [], []
    for subject in subjects(cfg, layout):
        grids = {dimension: grid(c, subject.kind, dimension, positions) for dimension in subject.dimensions}
        subject_sizes, shared = list(dict.fromkeys(size for sizes in grids.values() for size in sizes)), {}
        for dimension, sizes in grids.items():
            entry = not_searched(subject, dimension, sizes, model_config)
            if entry is None:
                rows, entry = searched(runner, subject, dimension, sizes, subject_sizes, shared)
                cells += rows
            searches.append(entry)
    write_cells(job.out / CELLS_CSV, cells)
    journal.remove()
    shutil.rmtree(layout.out("capacity") / ".trainer", ignore_errors=True)
    return {"dtype": dtype, "budget": limit, "model_context": positions,
            "fixed": {"train_seq_len": c["train_seq_len"], "prompt_len": c["generate"]["prompt_len"],
                      "new_tokens": c["generate"]["new_tokens"]},
            "steps": {"warmup": c["warmup"], "timed": c["timed"]},
            "tensors": {"kind": "cuda_max_allocated" if device.type == "cuda" else CpuTensorPeak.KIND,
                        "over": "the warm-up steps, over the loaded model"},
            **kv_record(cfg), "searches": context_gain(searches), "environment": environment(device, c)}
