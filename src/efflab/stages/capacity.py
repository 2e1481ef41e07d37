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

import csv
import json
import logging
import shutil
import statistics
from dataclasses import dataclass
from pathlib import Path

import torch

from .. import cli, records
from ..config import UserError
from ..estimators.generation_memory import Generation, generation_peak, quantized_layer_transient, variant_quant
from ..estimators.training_memory import training_peak
from ..experiment import finetune_run, made_by
from ..layout import Job, Layout
from ..measure.env import environment
from ..measure.isolation import prestart, run_cell
from ..measure.memory import CpuTensorPeak, MiB, cuda_context_mib, proc_status_kib, tensor_peak
from ..measure.stats import summarize
from ..measure.timing import time_fn
from ..models import kv_cache
from ..models.modeling import load_tokenizer, load_variant, read_split
from ..training import build_model, mixed_precision, training_step

# transformers takes seconds to import: it is imported inside the function that uses it.

log = logging.getLogger("efflab")

CELLS_CSV = "cells.csv"
CELL_COLUMNS = ("subject", "kind", "dimension", "role", "batch_size", "seq_len", "new_tokens", "status", "peak_mib",
                "loaded_mib", "tensor_growth_mib", "file_growth_mib", "predicted_growth_mib", "predicted_peak_mib",
                "budget_mib", "timed_steps", "tokens_per_s", "cell_wall_s", "reason")
DIMENSIONS = ("batch_size", "seq_len")
BASE = "base"  # the base model, generating: a subject where capacity.kv_quant asks and no variant of kind base is
# transformers' QuantizedCache defaults (None: the layer's own) where bench_inference has no kv_quant_options
KV_DEFAULTS = {"residual_length": None, "group_size": None}
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
    return (proc_status_kib("VmRSS") or 0) / 1024


def _memory_peak(device: torch.device, context: float, tensors: dict) -> float | None:
    """The peak of the memory the budget holds, over the whole cell; the tensor counter's own stop is in none
    of it (tensor_peak reads the high-water mark before it and resets it after)."""
    if device.type == "cuda":
        reserved = max(torch.cuda.max_memory_reserved(device) / MiB, tensors.get("reserved_before_mib", 0.0))
        return reserved + context
    hwm, before = proc_status_kib("VmHWM"), tensors.get("hwm_before_stop_mib")
    return None if hwm is None or before is None else max(hwm / 1024, before)


def _file_pages_mib() -> float | None:
    kib = proc_status_kib("RssFile")
    return None if kib is None else kib / 1024


def run_steps(work, device: torch.device, warmup: int, timed: int, fits=lambda tensors: True) -> dict:
    """`warmup` untimed calls of work() with the live-tensor peak tracked over them (measure.memory.tensor_peak), then
    `timed` timed calls, untracked: the CPU counter is a profiler and would slow what is timed. The timed calls
    run only if `fits(tensors)` after the warm-up: a cell already past its budget is out of memory whatever
    its speed. `step_s` is None where nothing was timed."""
    with tensor_peak(device) as tensors:
        for _ in range(warmup):
            work()
    timed = timed if fits(tensors) else 0
    return {"tensors": tensors, "step_s": time_fn(work, device, warmup=0, repeats=timed) if timed else None}


def _train_work(cfg: dict, subject: str, layout, dtype: str, device: torch.device, batch_size: int, seq_len: int):
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


def _generate_work(cfg: dict, variant: dict, layout, dtype: str, device: torch.device, batch_size: int,
                   seq_len: int, kv: str = kv_cache.NONE):
    cache = kv_cache.generate_kwargs(kv, kv_settings(cfg))
    new_tokens = cfg["capacity"]["generate"]["new_tokens"]
    tokenizer = load_tokenizer(layout.base_model())
    model = load_variant(cfg, variant, layout, dtype, device)
    ids = token_rows(layout, batch_size, seq_len).to(device)
    frozen = not any(p.requires_grad for p in model.get_output_embeddings().parameters())
    transient = quantized_layer_transient(model, dtype) if device.type == "cpu" else 0

    def predicted(b: int, n: int) -> float | None:
        return generation_peak(layout.base_model(), dtype, variant_quant(cfg, variant), Generation(b, n, new_tokens),
                               frozen=frozen, device=device.type, quantized_transient_bytes=transient)["total_mib"]

    def work():
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, do_sample=False, num_beams=1,
                                 pad_token_id=tokenizer.pad_token_id, **cache)
        if out.shape[1] - seq_len != new_tokens:
            raise RuntimeError(f"generated {out.shape[1] - seq_len} tokens, not {new_tokens}")
    return work, batch_size * new_tokens, predicted


def cell(cfg: dict, results: str, spec: dict, timed: int) -> dict:
    """Load the subject (`spec`: kind, subject, batch_size, seq_len, dtype, device, budget_mib and the `sizes` to
    predict over) and run at (batch_size, seq_len) its warm-up steps (capacity.warmup, the live-tensor peak
    tracked over them) and then `timed` timed steps. Reports the peak of the memory the budget holds, that memory
    with the model loaded, the live tensors' peak growth over the loaded model, the file pages (CPU) the process
    read in meanwhile, the timed steps, and the estimator's predicted growth over the loaded model for `sizes`."""
    from transformers import set_seed

    c, layout, device = cfg["capacity"], Layout(Path(results)), torch.device(spec["device"])
    kind, dtype, budget_mib = spec["kind"], spec["dtype"], spec["budget_mib"]
    set_seed(0)
    context = 0.0
    if device.type == "cuda":
        torch.cuda.init()
        context = cuda_context_mib(device)["mib"] or 0.0
        card = torch.cuda.get_device_properties(device).total_memory / MiB
        if budget_mib < card:
            torch.cuda.set_per_process_memory_fraction(max(budget_mib - context, 0) / card, device)
        torch.cuda.reset_peak_memory_stats(device)
    size = (spec["batch_size"], spec["seq_len"])
    if kind == "train":
        work, tokens, predicted = _train_work(cfg, spec["subject"], layout, dtype, device, *size)
    else:
        work, tokens, predicted = _generate_work(cfg, spec["variant"], layout, dtype, device, *size,
                                                 kv=spec.get("kv_quant", kv_cache.NONE))
    if device.type == "cpu":
        # The counter's first start imports and maps what it needs (~2 MiB resident): after the load, so the
        # load's own transient cannot stand on it, and before the loaded memory is read.
        CpuTensorPeak.warm_up()
    loaded, files = _memory_now(device, context), _file_pages_mib()
    ran = run_steps(work, device, c["warmup"][kind], timed,
                    fits=lambda tensors: (_memory_peak(device, context, tensors) or 0) <= budget_mib)
    tensors, step_s, files_after = ran["tensors"], ran["step_s"], _file_pages_mib()
    return {"loaded_mib": loaded, "peak_mib": _memory_peak(device, context, tensors), "context_mib": context,
            "tensor_growth_mib": tensors.get("delta_mib"),
            **({"tensor_unavailable": tensors["unavailable"]} if "unavailable" in tensors else {}),
            "file_growth_mib": None if device.type == "cuda" or None in (files, files_after) else files_after - files,
            "tokens": tokens, "step_s": step_s,
            # the median of the steps' rates: the one figure the record's speed() states too (tokens over the median
            # step differs from it wherever the steps are even in number)
            "tokens_per_s": statistics.median(tokens / s for s in step_s["samples"]) if step_s else None,
            "predicted_growth_mib": [predicted(b, n) for b, n in spec["sizes"]]}


def _judged(result: dict, budget_mib: float) -> dict:
    """A cell that ran but whose peak passed the budget between two polls is out of memory all the same."""
    if records.is_ok(result) and result.get("peak_mib") is not None and result["peak_mib"] > budget_mib:
        return result | {"status": "oom", "reason": f"peak memory {result['peak_mib']:.0f} MiB passed the budget of "
                                                    f"{budget_mib:.0f} MiB"}
    return result


def max_positions(layout) -> int:
    config = json.loads((layout.base_model() / "config.json").read_text())
    return int(config.get("max_position_embeddings") or 2**31)


@dataclass(frozen=True)
class Subject:
    """What a search runs: training (a finetune run) or generating (`variant`, a bench_inference variant or the base
    model) with `kv_quant`'s cache; its record name, the dimensions searched, and why it is skipped (None: it runs)."""
    kind: str
    name: str
    variant: dict | None = None
    kv_quant: str = kv_cache.NONE
    dimensions: tuple[str, ...] = DIMENSIONS
    skipped: dict | None = None
    paired_with: str | None = None  # a quantized cache's full-precision subject


def kv_settings(cfg: dict) -> dict:
    return cfg["bench_inference"].get("kv_quant_options") or KV_DEFAULTS


def subjects(cfg: dict, layout) -> list[Subject]:
    """Every run and variant the stage searches; where capacity.kv_quant asks, each generating subject's sequence
    search again per quantized cache, and the base model generating if no variant of kind base is searched."""
    c, variants = cfg["capacity"], cfg["bench_inference"]["variants"]
    caches = c.get("kv_quant") or []
    out = [Subject("train", name) for name in c["runs"]]
    generating = [(name, variants[name], DIMENSIONS) for name in c["variants"]]
    if caches and not any(variant["kind"] == "base" for _, variant, _ in generating):
        generating.append((BASE, {"kind": "base"}, ("seq_len",)))
    for name, variant, dimensions in generating:
        skipped = layout.skipped_because([made_by(variant["kind"], variant.get("of"))])
        out.append(Subject("generate", name, variant, dimensions=dimensions, skipped=skipped))
        out += [Subject("generate", f"{name}+kv-{kv}", variant, kv, ("seq_len",), skipped, paired_with=name)
                for kv in caches]
    return out


def boundary_search(n: int, measure, budget_mib: float, timed: int) -> dict:
    """One (subject, dimension) search over n sizes, with `measure(i, role, timed) -> result` running a cell.

    The first size runs first and predicts every size's peak: its loaded memory plus the estimator's growth.
    search() then finds the boundary from the predicted maximum. A cell runs `timed` timed steps where its
    passing would make it the maximum (the size above failed, it is the grid's last, or it is the predicted
    maximum) and none elsewhere, so tokens/s at the maximum has `timed` repeats and no other cell pays for them.
    A maximum found before the size above it failed has run no timed step: it runs once more with them (role
    'timing'). Resident memory can grow with each step, so that run may not fit: then the size does not pass
    (a size passes only if every run of it did) and the search goes on below it."""
    seen: dict[int, dict] = {}  # the search's cells
    timings: dict[int, dict] = {}  # the re-runs with timed steps
    guess, failure = None, None

    def result(i: int) -> dict | None:
        return timings.get(i, seen.get(i))

    def ask(i: int) -> dict:
        nonlocal failure
        if i not in seen:
            above = result(i + 1)
            maximum_if_passes = i in (n - 1, guess) or (above is not None and not records.is_ok(above))
            seen[i] = measure(i, "search", timed if maximum_if_passes else 0)
            if seen[i]["status"] not in ("ok", "oom") and failure is None:
                failure = seen[i]
        return result(i)

    first = ask(0)
    found = {"seen": seen, "timings": timings, "best": -1, "predicted_peak_mib": None, "guess": None}
    if not records.is_ok(first):
        return found | {"failure": failure}
    predicted = [None if g is None else first["loaded_mib"] + g for g in first["predicted_growth_mib"]]
    fits = [p is not None and p <= budget_mib for p in predicted]
    guess = next((i - 1 for i, f in enumerate(fits) if not f), n - 1)
    while True:
        best = search(n, lambda i: records.is_ok(ask(i)), max(guess, 0))
        if failure is not None or best < 0 or result(best).get("step_s"):
            break
        timings[best] = measure(best, "timing", timed)
        if timings[best]["status"] not in ("ok", "oom"):
            failure = timings[best]
    return found | {"best": best, "predicted_peak_mib": predicted, "guess": guess, "failure": failure}


def at_max(cell_result: dict, predicted_growth: float | None, loaded_first: float) -> dict:
    """The memory at the measured maximum, like with like: the estimator's predicted tensor growth over the loaded
    model beside the measured live-tensor growth (their ratio is the estimator's error), and the growth of the
    memory the budget holds. Their gap is memory that is not live tensors, which the estimator does not model:
    on a CPU, what glibc malloc keeps after tensors are freed, libraries' own buffers, and file pages read in
    after loading (`file_growth_mib`: weights memory-mapped from their safetensors file, first read by a step).
    The prediction starts from the first cell's loaded memory; `loaded_shift_mib` is how much more this cell's
    held. So the measured peak is the predicted one plus the shift, the estimator's miss and the gap."""
    peak, loaded, tensors = (cell_result.get(k) for k in ("peak_mib", "loaded_mib", "tensor_growth_mib"))
    held = None if None in (peak, loaded) else peak - loaded
    return {"loaded_mib": loaded, "loaded_shift_mib": None if loaded is None else loaded - loaded_first,
            "peak_mib": peak, "predicted_growth_mib": predicted_growth,
            "tensor_growth_mib": tensors, "ratio": tensors / predicted_growth if tensors is not None and
            predicted_growth else None, "held_growth_mib": held,
            "gap_mib": None if None in (held, tensors) else held - tensors,
            "file_growth_mib": cell_result.get("file_growth_mib"),
            **({"tensor_unavailable": cell_result["tensor_unavailable"]} if "tensor_unavailable" in cell_result
               else {})}


def speed(result: dict) -> dict:
    """tokens/s over a cell's timed steps, one figure a step, summarized (an interval of the median from n=6)."""
    rates = [result["tokens"] / s for s in result["step_s"]["samples"]]
    return {"tokens_per_s_at_max": summarize(rates, unit="tokens/s", keep_samples=False),
            "step_s_at_max": result["step_s"]}


def _row(c: dict, search: dict, size: tuple[int, int], role: str, result: dict, growth: float | None,
         peak: float | None, budget_mib: float) -> dict:
    """A cells.csv row of a cell of `search` (its subject, kind and dimension)."""
    return {**{k: search[k] for k in ("subject", "kind", "dimension")}, "role": role, "batch_size": size[0],
            "seq_len": size[1], "new_tokens": c["generate"]["new_tokens"] if search["kind"] == "generate" else "",
            "status": result["status"], "peak_mib": result.get("peak_mib"), "loaded_mib": result.get("loaded_mib"),
            "tensor_growth_mib": result.get("tensor_growth_mib"), "file_growth_mib": result.get("file_growth_mib"),
            "predicted_growth_mib": growth, "predicted_peak_mib": peak, "budget_mib": budget_mib,
            "timed_steps": (result.get("step_s") or {}).get("n", 0), "tokens_per_s": result.get("tokens_per_s"),
            "cell_wall_s": result.get("cell_wall_s"), "reason": result.get("reason", "")}


@dataclass(frozen=True)
class Searching:
    """What every search of the job shares: the results, the cells' journal, the budget, the device and dtype."""
    layout: Layout
    journal: object  # measure.isolation.CellJournal
    limit: dict
    device: torch.device
    dtype: str


def _measurer(cfg: dict, at: Searching, subject: Subject, dimension: str, sizes: list, subject_sizes: list,
              shared: dict, reused: list):
    """A search's measure(i, role, timed) -> result: a cell in a fresh process under the budget, journaled. A search
    cell the subject's other search already ran with the same size and timed steps is not run again (`shared`
    keeps the subject's search cells; `reused` collects the indices taken from it), and a first cell predicts
    over all of `subject_sizes`."""
    rt, limit, device, kind = cfg["runtime"], at.limit, at.device, subject.kind

    def run_one(batch_size: int, seq_len: int, role: str, timed: int, predicts: bool) -> dict:
        key = {"kind": kind, "subject": subject.name, "dimension": dimension, "batch_size": batch_size,
               "seq_len": seq_len, "role": role, "timed": timed, "predicts_over": subject_sizes if predicts else []}
        spec = {"kind": kind, "subject": subject.name, "variant": subject.variant, "kv_quant": subject.kv_quant,
                "batch_size": batch_size, "seq_len": seq_len, "dtype": at.dtype, "device": str(device),
                "budget_mib": limit["mib"], "sizes": subject_sizes if predicts else []}
        result = at.journal.result(key, lambda: _judged(run_cell(
            cell, dict(cfg=cfg, results=str(at.layout.root), spec=spec, timed=timed),
            isolation="subprocess", timeout_s=rt["cell_timeout_s"],
            memory_cap_mib=limit["mib"] if device.type == "cpu" else None), limit["mib"]))
        return _by_size(result, subject_sizes) if predicts else result

    def measure(i: int, role: str, timed: int) -> dict:
        batch_size, seq_len = sizes[i]
        predicts = i == 0 and role == "search"  # the first cell predicts over the subject's grids
        again = shared.get((batch_size, seq_len, timed)) if role == "search" else None
        reuse = again is not None and (not predicts or _predicted(again) or not records.is_ok(again))
        if reuse:
            reused.append(i)
            result = again
        else:
            result = run_one(batch_size, seq_len, role, timed, predicts)
            if role == "search":
                shared[(batch_size, seq_len, timed)] = result
        log.info("capacity %s %s batch %d x %d tokens%s: %s%s%s", kind, subject.name, batch_size, seq_len,
                 f" ({role}, {timed} timed)" if timed else "", result["status"],
                 f", peak {result['peak_mib']:.0f} MiB" if result.get("peak_mib") else
                 f" ({result.get('reason')})" if not records.is_ok(result) else "",
                 " (the cell the other search ran)" if reuse else "")
        return _on_grid(result, sizes) if predicts else result
    return measure


def _predictions(found: dict, sizes: list, dimension: str, subject: Subject) -> tuple[list, list, dict]:
    """A search's predicted growth and peak per size (for cells.csv and at_max) and its record's prediction. The
    estimator does not model a quantized KV cache: such a search has none, and says where it started instead (the
    full-precision cache's predicted maximum, a lower bound on the quantized one's)."""
    first, n = found["seen"][0], len(sizes)
    growth = (first.get("predicted_growth_mib") if records.is_ok(first) else None) or [None] * n
    peaks = found["predicted_peak_mib"] or [None] * n
    if not found["predicted_peak_mib"]:
        return growth, peaks, {}
    guess = None if found["guess"] < 0 else _size(sizes[found["guess"]], dimension)
    if subject.kv_quant != kv_cache.NONE:
        return [None] * n, [None] * n, {"predicted_max": None, "prediction": (
            "none: the estimator does not model a quantized KV cache; the search started at the full-precision "
            f"cache's predicted maximum ({guess}), a lower bound")}
    return growth, peaks, {"predicted_max": guess,
                           "predicted_peak_mib": dict(zip((_size(s, dimension) for s in sizes), peaks))}


def searched(cfg: dict, at: Searching, subject: Subject, dimension: str, sizes: list, subject_sizes: list,
             shared: dict) -> tuple[list[dict], dict]:
    """One (subject, dimension) boundary search, every cell in a fresh process under the budget (_measurer): its
    rows for cells.csv and its entry for the record."""
    c, limit, kind = cfg["capacity"], at.limit, subject.kind
    entry = {"subject": subject.name, "kind": kind, "dimension": dimension, "grid": [sizes[0], sizes[-1]],
             **_kv_fields(subject)}
    reused = []
    measure = _measurer(cfg, at, subject, dimension, sizes, subject_sizes, shared, reused)
    found = boundary_search(len(sizes), measure, limit["mib"], c["timed"])
    first, best = found["seen"][0], found["best"]
    growth, peaks, prediction = _predictions(found, sizes, dimension, subject)
    ran = [(i, "search", r) for i, r in sorted(found["seen"].items())]
    ran += [(i, "timing", r) for i, r in sorted(found["timings"].items())]
    rows = [_row(c, entry, sizes[i], role, result, growth[i], peaks[i], limit["mib"])
            for i, role, result in ran]
    entry |= prediction
    if found["failure"] is not None:
        failure = found["failure"]
        return rows, entry | {"status": "failed", "reason": f"a cell {failure['status']}: {failure.get('reason')}"}
    entry |= {"status": "ok", "measured_max": _size(sizes[best], dimension) if best >= 0 else None,
              "whole_range_fits": best == len(sizes) - 1,
              "first_failing": _size(sizes[best + 1], dimension) if best + 1 < len(sizes) else None,
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


def _kv_fields(subject: Subject) -> dict:
    """A quantized-cache search's cache and the full-precision search it is paired with (none for the others)."""
    if subject.kv_quant == kv_cache.NONE:
        return {}
    return {"kv_quant": subject.kv_quant, "paired_with": subject.paired_with}


def context_gain(searches: list[dict]) -> list[dict]:
    """Each quantized-cache search with `context_gain`: its longest context over its full-precision search's,
    where both are decided (a measured maximum below the grid's end); else null and `context_gain_why`."""
    plain = {s["subject"]: s for s in searches if s["dimension"] == "seq_len" and "kv_quant" not in s}
    return [s | dict(zip(("context_gain", "context_gain_why"), _gain(s, plain.get(s["paired_with"]))))
            if "kv_quant" in s else s for s in searches]


def _gain(quantized: dict, full: dict | None) -> tuple[float | None, str | None]:
    for name, s in (("the quantized cache's", quantized), ("the full-precision cache's", full)):
        if s is None or not records.is_ok(s):
            return None, f"{name} search did not run ({(s or {}).get('status', 'absent')})"
        if s["measured_max"] is None:
            return None, f"{name} search found nothing that fits"
    if full["whole_range_fits"]:
        return None, ("the full-precision cache fits the whole range: nothing decided (on the CPU default the "
                      "grid is short; the GPU profile searches longer contexts)")
    if quantized["whole_range_fits"]:
        return None, (f"the quantized cache fits the whole range: at least {quantized['measured_max']} against "
                      f"{full['measured_max']}, its gain undecided (a longer capacity.max_seq_len decides it)")
    return quantized["measured_max"] / full["measured_max"], None


def _not_searched(subject: Subject, dimension: str, sizes: list, config) -> dict | None:
    """The record of a search that does not run: its subject skipped, its grid empty, or its cache unavailable."""
    entry = {"subject": subject.name, "kind": subject.kind, "dimension": dimension,
             "grid": [sizes[0], sizes[-1]] if sizes else None, **_kv_fields(subject)}
    if subject.skipped:
        return entry | subject.skipped
    if not sizes:
        return entry | {"status": "skipped", "reason": "the grid is empty: the fixed length does not fit the "
                                                       "model's context"}
    why = kv_cache.unavailable(subject.kv_quant, config)
    return entry | {"status": "unavailable", "reason": why} if why else None


def run(cfg: dict, job: Job) -> dict:
    """Search every subject's largest batch and longest sequence within the budget; write cells.csv."""
    from transformers import AutoConfig

    c, rt, layout = cfg["capacity"], cfg["runtime"], job.layout
    prestart("subprocess")  # the cells' forkserver imports beside this job
    device, dtype = job.device, job.dtype
    limit, positions = budget(c, rt, device), max_positions(layout)
    journal = job.journal({"capacity": c, "runtime": rt, "base": layout.metrics("base_model").read_text(),
                           "budget": limit, "kv_quant_options": kv_settings(cfg)})
    at, model_config = Searching(layout, journal, limit, device, dtype), AutoConfig.from_pretrained(layout.base_model())
    cells, searches = [], []
    for subject in subjects(cfg, layout):
        grids = {dimension: grid(c, subject.kind, dimension, positions) for dimension in subject.dimensions}
        subject_sizes, shared = list(dict.fromkeys(size for sizes in grids.values() for size in sizes)), {}
        for dimension, sizes in grids.items():
            entry = _not_searched(subject, dimension, sizes, model_config)
            if entry is None:
                rows, entry = searched(cfg, at, subject, dimension, sizes, subject_sizes, shared)
                cells += rows
            searches.append(entry)
    with open(job.out / CELLS_CSV, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CELL_COLUMNS)
        writer.writeheader()
        writer.writerows(cells)
    journal.remove()
    shutil.rmtree(layout.out("capacity") / ".trainer", ignore_errors=True)
    return {"dtype": dtype, "budget": limit, "model_context": positions,
            "fixed": {"train_seq_len": c["train_seq_len"], "prompt_len": c["generate"]["prompt_len"],
                      "new_tokens": c["generate"]["new_tokens"]},
            "steps": {"warmup": c["warmup"], "timed": c["timed"]},
            "tensors": {"kind": "cuda_max_allocated" if device.type == "cuda" else CpuTensorPeak.KIND,
                        "over": "the warm-up steps, over the loaded model"},
            **_kv_record(cfg), "searches": context_gain(searches), "environment": environment(device, c)}


def _kv_record(cfg: dict) -> dict:
    caches = cfg["capacity"].get("kv_quant") or []
    if not caches:
        return {}
    options = cfg["bench_inference"].get("kv_quant_options")
    return {"kv_quant": {"caches": caches, "options": options or KV_DEFAULTS,
                         "options_from": "bench_inference.kv_quant_options" if options else
                         "transformers' QuantizedCache defaults (None: the layer's own)",
                         "note": "the longest context at batch 1 with each cache and without (the full-precision "
                                 "one); where a search fits the whole range it decides nothing (on the CPU default "
                                 "the range is short; the GPU profile searches far longer contexts)"}}


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


def _size(size: tuple[int, int], dimension: str) -> int:
    return size[0] if dimension == "batch_size" else size[1]


if __name__ == "__main__":
    cli.main("capacity", run)
