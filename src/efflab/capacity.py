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
up to max_seq_len and the model's context. Every cell is a fresh process that loads the model and runs
warmup + timed steps (training: forward, backward, optimizer step on rows of exactly that many real tokens of
the training split; generation: greedy, exactly new_tokens tokens). An out-of-memory cell is a result.
1. The smallest size runs first; it measures the memory with the model loaded, and the estimator
   (memory_estimate.training_peak / generation_peak, the same as finetune and bench_inference compare with)
   predicts the peak of every size on top of it: the predicted maximum is the largest size predicted to fit.
2. The predicted maximum runs, then the next size; from there the search walks away from the prediction in
   doubling steps until it brackets the boundary, and bisects: it ends with a size that passes next to the
   next size, which fails (or with the grid's end passing: "fits the whole range").
Every cell goes to cells.csv (memory, prediction, speed, status and reason), from which every maximum in
metrics.json is recomputed by the tests.
"""
from __future__ import annotations

import csv
import json
import logging
import shutil
import time
from pathlib import Path

import torch

from . import cli, records
from .config import UserError, finetune_run
from .layout import Layout
from .measure import (MiB, CellJournal, _proc_status_kib, cuda_context_mib, environment, pick_device, run_cell,
                      set_threads, summarize, synchronize)
from .memory_estimate import generation_peak, quantized_layer_transient, training_peak, variant_quant
from .modeling import base_dtype, load_tokenizer, read_split

log = logging.getLogger("efflab")

CELLS_CSV = "cells.csv"
CELL_COLUMNS = ("subject", "kind", "dimension", "batch_size", "seq_len", "new_tokens", "status", "peak_mib",
                "loaded_mib", "predicted_peak_mib", "budget_mib", "tokens_per_s", "cell_wall_s", "reason")
DIMENSIONS = ("batch_size", "seq_len")
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


def grid(c: dict, kind: str, dimension: str, max_positions: int) -> list[tuple[int, int]]:
    """The (batch size, sequence length) cells a dimension is searched over, smallest first. Generation's
    sequence is its prompt; the prompt and its new tokens stay within the model's context."""
    fixed = c["train_seq_len"] if kind == "train" else c["generate"]["prompt_len"]
    top = max_positions - (0 if kind == "train" else c["generate"]["new_tokens"])
    if dimension == "batch_size":
        return [(b, fixed) for b in range(1, c["max_batch_size"] + 1)] if fixed <= top else []
    step = c["seq_len_step"]
    return [(1, n) for n in range(step, min(c["max_seq_len"], top) + 1, step)]


def search(n: int, passes, guess: int) -> int:
    """The largest index in 0..n-1 for which `passes` holds (-1: none), assuming it holds up to a boundary.
    Starts at `guess`, walks away from it in doubling steps until the boundary is bracketed, then bisects;
    every index is asked at most once, and the answer always has its neighbour above asked (or is n-1)."""
    lo, hi = -1, n  # largest index known to pass, smallest known to fail
    i, step, upward = min(max(guess, 0), n - 1), 1, None
    while hi - lo > 1:
        if passes(i):
            lo = i
        else:
            hi = i
        if upward is None:
            upward = lo == i
        if upward and hi == n:
            i = min(i + step, n - 1)
        elif not upward and lo == -1:
            i = max(i - step, 0)
        else:
            i = (lo + hi) // 2
        step *= 2
    return lo


def token_rows(layout, batch_size: int, seq_len: int) -> torch.Tensor:
    """batch_size rows of exactly seq_len real tokens: the training split's rows laid end to end, cycled."""
    stream = [t for row in read_split(layout.split("train")) for t in row["input_ids"]]
    needed = batch_size * seq_len
    stream = (stream * (needed // len(stream) + 1))[:needed]
    return torch.tensor(stream, dtype=torch.long).view(batch_size, seq_len)


def _memory_now(device: torch.device, context: float) -> float:
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device) / MiB + context
    return (_proc_status_kib("VmRSS") or 0) / 1024


def _memory_peak(device: torch.device, context: float) -> float | None:
    if device.type == "cuda":
        return torch.cuda.max_memory_reserved(device) / MiB + context
    hwm = _proc_status_kib("VmHWM")
    return None if hwm is None else hwm / 1024


def _train_work(cfg: dict, subject: str, layout, dtype: str, device: torch.device, batch_size: int, seq_len: int):
    from .finetune import build_model, mixed_precision
    from .training import training_step

    run_cfg = finetune_run(cfg, subject)
    model = build_model(run_cfg, layout, dtype, device)
    ids = token_rows(layout, batch_size, seq_len).to(device)
    batch = {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids)}
    precision = mixed_precision(run_cfg, dtype, device)

    def predicted(b: int, n: int) -> float | None:
        shape = {"batch_size": b, "max_steps": 2, "gradient_accumulation_steps": 1, "packing": False}
        return training_peak(layout.base_model(), run_cfg | shape, dtype, precision, [n] * b,
                             device.type)["total_mib"]
    step, _ = training_step(run_cfg, model, dtype, device, [[batch]],
                            str(layout.out("capacity") / ".trainer"), total_steps=10**6)
    return (lambda: step(0).item()), batch_size * seq_len, predicted


def _generate_work(cfg: dict, subject: str, layout, dtype: str, device: torch.device, batch_size: int,
                   seq_len: int):
    from .bench_inference import load_variant

    variant = cfg["bench_inference"]["variants"][subject]
    new_tokens = cfg["capacity"]["generate"]["new_tokens"]
    tokenizer = load_tokenizer(layout.base_model())
    model = load_variant(cfg, variant, layout, dtype, device)
    ids = token_rows(layout, batch_size, seq_len).to(device)
    frozen = not any(p.requires_grad for p in model.get_output_embeddings().parameters())
    transient = quantized_layer_transient(model, dtype) if device.type == "cpu" else 0

    def predicted(b: int, n: int) -> float | None:
        return generation_peak(layout.base_model(), dtype, variant_quant(cfg, variant), b, n, new_tokens, True,
                               frozen=frozen, device=device.type, quantized_transient_bytes=transient)["total_mib"]

    def work():
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, do_sample=False, num_beams=1,
                                 pad_token_id=tokenizer.pad_token_id)
        if out.shape[1] - seq_len != new_tokens:
            raise RuntimeError(f"generated {out.shape[1] - seq_len} tokens, not {new_tokens}")
    return work, batch_size * new_tokens, predicted


def cell(cfg: dict, results: str, kind: str, subject: str, batch_size: int, seq_len: int, dtype: str, device: str,
         budget_mib: float, sizes: list[tuple[int, int]]) -> dict:
    """Load the subject, run warmup + timed steps at (batch_size, seq_len), and report the peak memory, the
    memory with the model loaded, tokens/s over the timed steps and the estimator's prediction for `sizes`."""
    from transformers import set_seed

    c, layout, device = cfg["capacity"], Layout(Path(results)), torch.device(device)
    set_seed(0)
    context = 0.0
    if device.type == "cuda":
        torch.cuda.init()
        context = cuda_context_mib(device)["mib"] or 0.0
        card = torch.cuda.get_device_properties(device).total_memory / MiB
        if budget_mib < card:
            torch.cuda.set_per_process_memory_fraction(max(budget_mib - context, 0) / card, device)
        torch.cuda.reset_peak_memory_stats(device)
    build = _train_work if kind == "train" else _generate_work
    work, tokens, predicted = build(cfg, subject, layout, dtype, device, batch_size, seq_len)
    loaded = _memory_now(device, context)
    seconds = []
    for i in range(c["warmup"] + c["timed"]):
        synchronize(device)
        t0 = time.perf_counter()
        work()
        synchronize(device)
        if i >= c["warmup"]:
            seconds.append(time.perf_counter() - t0)
    step_s = summarize(seconds)
    return {"loaded_mib": loaded, "peak_mib": _memory_peak(device, context), "context_mib": context,
            "step_s": step_s, "tokens_per_s": tokens / step_s["median"],
            "predicted_peak_mib": [None if p is None else loaded + p for p in (predicted(b, n) for b, n in sizes)]}


def _judged(result: dict, budget_mib: float) -> dict:
    """A cell that ran but whose peak passed the budget between two polls is out of memory all the same."""
    if records.is_ok(result) and result.get("peak_mib") is not None and result["peak_mib"] > budget_mib:
        return result | {"status": "oom", "reason": f"peak memory {result['peak_mib']:.0f} MiB passed the budget of "
                                                    f"{budget_mib:.0f} MiB"}
    return result


def max_positions(layout) -> int:
    config = json.loads((layout.base_model() / "config.json").read_text())
    return int(config.get("max_position_embeddings") or 2**31)


def subjects(cfg: dict, layout) -> list[tuple[str, str, dict | None]]:
    """(kind, name, skipped result or None) for every run and variant the stage searches."""
    out = [("train", name, None) for name in cfg["capacity"]["runs"]]
    for name in cfg["capacity"]["variants"]:
        variant = cfg["bench_inference"]["variants"][name]
        upstream = {"quantized": "quantize", "merged": "merge", "adapter": "finetune"}.get(variant["kind"])
        out.append(("generate", name, layout.skipped_because(upstream, variant["of"]) if upstream else None))
    return out


def run(cfg: dict, paths: dict) -> dict:
    """Search every subject's largest batch and longest sequence within the budget; write cells.csv."""
    c, rt, layout = cfg["capacity"], cfg["runtime"], paths["layout"]
    set_threads(rt)
    device = pick_device(rt)
    dtype = base_dtype(layout)
    limit = budget(c, rt, device)
    positions = max_positions(layout)
    journal = CellJournal(layout.out("capacity") / ".cells.jsonl",
                          {"capacity": c, "runtime": rt, "base": layout.metrics("base_model").read_text(),
                           "budget": limit})
    cells, searches = [], []
    for kind, subject, skipped in subjects(cfg, layout):
        for dimension in DIMENSIONS:
            sizes = grid(c, kind, dimension, positions)
            entry = {"subject": subject, "kind": kind, "dimension": dimension,
                     "grid": [sizes[0], sizes[-1]] if sizes else None}
            if skipped or not sizes:
                searches.append(entry | (skipped or {"status": "skipped", "reason": "the grid is empty: the "
                                                     "fixed length does not fit the model's context"}))
                continue
            seen: dict[int, dict] = {}

            def measure(i: int) -> dict:
                batch_size, seq_len = sizes[i]
                key = {"kind": kind, "subject": subject, "dimension": dimension, "batch_size": batch_size,
                       "seq_len": seq_len}  # the first cell of each dimension predicts over that dimension's grid
                result = journal.result(key, lambda: _judged(run_cell(
                    cell, dict(cfg=cfg, results=str(layout.root), kind=kind, subject=subject, batch_size=batch_size,
                               seq_len=seq_len, dtype=dtype, device=str(device), budget_mib=limit["mib"],
                               sizes=sizes if i == 0 else []),
                    isolation="subprocess", timeout_s=rt["cell_timeout_s"],
                    memory_cap_mib=limit["mib"] if device.type == "cpu" else None), limit["mib"]))
                seen[i] = result
                log.info("capacity %s %s batch %d x %d tokens: %s%s", kind, subject, batch_size, seq_len,
                         result["status"], f", peak {result['peak_mib']:.0f} MiB" if result.get("peak_mib") else
                         f" ({result.get('reason')})" if not records.is_ok(result) else "")
                return result

            first = measure(0)
            failure = None
            if records.is_ok(first):
                predicted = first["predicted_peak_mib"]
                fits = [p is not None and p <= limit["mib"] for p in predicted]
                guess = next((i - 1 for i, f in enumerate(fits) if not f), len(sizes) - 1)
                entry["predicted_max"] = None if guess < 0 else _size(sizes[guess], dimension)
                entry["predicted_peak_mib"] = dict(zip((_size(s, dimension) for s in sizes), predicted))

                def passes(i: int) -> bool:
                    nonlocal failure
                    result = seen[i] if i in seen else measure(i)
                    if result["status"] not in ("ok", "oom") and failure is None:
                        failure = result
                    return records.is_ok(result)
                best = search(len(sizes), passes, max(guess, 0))
            else:
                best, failure = -1, None if first["status"] == "oom" else first
            for i, result in sorted(seen.items()):
                batch_size, seq_len = sizes[i]
                cells.append({"subject": subject, "kind": kind, "dimension": dimension, "batch_size": batch_size,
                              "seq_len": seq_len, "new_tokens": c["generate"]["new_tokens"] if kind == "generate"
                              else "", "status": result["status"], "peak_mib": result.get("peak_mib"),
                              "loaded_mib": result.get("loaded_mib"),
                              "predicted_peak_mib": (first.get("predicted_peak_mib") or [None] * len(sizes))[i]
                              if records.is_ok(first) else None,
                              "budget_mib": limit["mib"], "tokens_per_s": result.get("tokens_per_s"),
                              "cell_wall_s": result.get("cell_wall_s"), "reason": result.get("reason", "")})
            if failure is not None:
                searches.append(entry | {"status": "failed", "reason": f"a cell {failure['status']}: "
                                                                       f"{failure.get('reason')}"})
                continue
            at_max = seen.get(best)
            entry |= {"status": "ok", "measured_max": _size(sizes[best], dimension) if best >= 0 else None,
                      "whole_range_fits": best == len(sizes) - 1,
                      "first_failing": _size(sizes[best + 1], dimension) if best + 1 < len(sizes) else None,
                      "cells": len(seen)}
            if at_max:
                entry |= {"peak_mib_at_max": at_max["peak_mib"], "tokens_per_s_at_max": at_max["tokens_per_s"],
                          "step_s_at_max": at_max["step_s"]}
            log.info("capacity %s %s, largest %s: predicted %s, measured %s%s (%d cells)", kind, subject, dimension,
                     entry.get("predicted_max"), entry["measured_max"],
                     " (the whole range fits)" if entry["whole_range_fits"] else "", len(seen))
            searches.append(entry)
    with open(paths["out"] / CELLS_CSV, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CELL_COLUMNS)
        writer.writeheader()
        writer.writerows(cells)
    journal.remove()
    shutil.rmtree(layout.out("capacity") / ".trainer", ignore_errors=True)
    return {"dtype": dtype, "budget": limit, "model_context": positions,
            "fixed": {"train_seq_len": c["train_seq_len"], "prompt_len": c["generate"]["prompt_len"],
                      "new_tokens": c["generate"]["new_tokens"]},
            "steps": {"warmup": c["warmup"], "timed": c["timed"]}, "searches": searches,
            "environment": environment(device, c)}


def _size(size: tuple[int, int], dimension: str) -> int:
    return size[0] if dimension == "batch_size" else size[1]


if __name__ == "__main__":
    cli.main("capacity", run)
