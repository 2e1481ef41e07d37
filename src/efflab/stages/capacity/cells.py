"""The capacity stage's cells: a worker that loads a subject and runs its steps at one size (training or
generating), in a fresh process each, and the runner that starts each cell under the budget and journals it."""
from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path

import torch

from ... import records
from ...estimators.generation_memory import Generation, generation_peak, quantized_layer_transient
from ...estimators.training_memory import training_peak
from ...experiment import finetune_run, model_ref
from ...layout import Layout
from ...measure.isolation import run_cell
from ...measure.memory import CpuTensorPeak, cap_cuda_memory, file_pages_mib, held_mib, held_peak_mib, run_steps
from ...models import kv_cache
from ...models.build import build, mixed_precision
from ...models.modeling import load_tokenizer, read_split
from ...training import training_step
from .subjects import Subject, kv_settings

# transformers takes seconds to import: it is imported inside the function that uses it.


def token_rows(layout, batch_size: int, seq_len: int) -> torch.Tensor:
    """batch_size rows of exactly seq_len real tokens: the training split's rows laid end to end, cycled."""
    stream = [t for row in read_split(layout.split("train")) for t in row["input_ids"]]
    needed = batch_size * seq_len
    stream = (stream * (needed // len(stream) + 1))[:needed]
    return torch.tensor(stream, dtype=torch.long).view(batch_size, seq_len)


def _train_work(cfg: dict, subject: str, layout, dtype: str, device: torch.device, batch_size: int, seq_len: int):
    run_cfg = finetune_run(cfg, subject)
    model = build(run_cfg, layout, dtype, device)
    ids = token_rows(layout, batch_size, seq_len).to(device)
    batch = {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids)}
    precision = mixed_precision(run_cfg, dtype, device)

    def predicted(b: int, n: int) -> float | None:
        shape = {"batch_size": b, "max_steps": 2, "gradient_accumulation_steps": 1, "packing": False}
        return training_peak(layout.base_model(), run_cfg.but(**shape), dtype, precision, [n] * b,
                             device.type)["total_mib"]
    step, _ = training_step(run_cfg, model, dtype, device, [[batch]],
                            str(layout.out("capacity") / ".trainer"), total_steps=10**6)
    return (lambda: step(0).item()), batch_size * seq_len, predicted


def _generate_work(cfg: dict, variant: dict, layout, dtype: str, device: torch.device, batch_size: int,
                   seq_len: int, kv: str = kv_cache.NONE):
    cache = kv_cache.generate_kwargs(kv, kv_settings(cfg))
    new_tokens = cfg["capacity"]["generate"]["new_tokens"]
    tokenizer = load_tokenizer(layout.base_model())
    ref = model_ref(cfg, variant)  # the spec carries the params entry: it is the journal's key, in JSON
    model = build(ref, layout, dtype, device)
    ids = token_rows(layout, batch_size, seq_len).to(device)
    frozen = not any(p.requires_grad for p in model.get_output_embeddings().parameters())
    transient = quantized_layer_transient(model, dtype) if device.type == "cpu" else 0

    def predicted(b: int, n: int) -> float | None:
        return generation_peak(layout.base_model(), dtype, ref.quant, Generation(b, n, new_tokens),
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
    context = cap_cuda_memory(device, budget_mib) if device.type == "cuda" else 0.0
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
    loaded, files = held_mib(device, context), file_pages_mib()
    ran = run_steps(work, device, c["warmup"][kind], timed,
                    fits=lambda tensors: (held_peak_mib(device, context, tensors) or 0) <= budget_mib)
    tensors, step_s, files_after = ran["tensors"], ran["step_s"], file_pages_mib()
    return {"loaded_mib": loaded, "peak_mib": held_peak_mib(device, context, tensors), "context_mib": context,
            "tensor_growth_mib": tensors.get("delta_mib"),
            **({"tensor_unavailable": tensors["unavailable"]} if "unavailable" in tensors else {}),
            "file_growth_mib": None if device.type == "cuda" or None in (files, files_after) else files_after - files,
            "tokens": tokens, "step_s": step_s,
            # the median of the steps' rates: the one figure the record's speed() states too (tokens over the median
            # step differs from it wherever the steps are even in number)
            "tokens_per_s": statistics.median(tokens / s for s in step_s["samples"]) if step_s else None,
            "predicted_growth_mib": [predicted(b, n) for b, n in spec["sizes"]]}


def judged(result: dict, budget_mib: float) -> dict:
    """A cell that ran but whose peak passed the budget between two polls is out of memory all the same."""
    if records.is_ok(result) and result.get("peak_mib") is not None and result["peak_mib"] > budget_mib:
        return result | {"status": "oom", "reason": f"peak memory {result['peak_mib']:.0f} MiB passed the budget of "
                                                    f"{budget_mib:.0f} MiB"}
    return result


@dataclass(frozen=True)
class CellRunner:
    """The job's cells: each runs `cell` in a fresh process under the budget (`limit`; on a CPU also the process's
    memory cap), its result judged against the budget and journaled (measure.isolation.CellJournal), so a job run
    again takes a finished cell's result from the journal. Every cell of the job shares its device and dtype."""
    cfg: dict
    layout: Layout
    journal: object  # measure.isolation.CellJournal
    limit: dict
    device: torch.device
    dtype: str

    def run(self, subject: Subject, dimension: str, size: tuple[int, int], role: str, timed: int,
            predicts_over: list) -> dict:
        """One cell of `subject`'s `dimension` search at `size`, with `timed` timed steps; a first cell predicts
        over `predicts_over` (the subject's sizes; empty for the other cells)."""
        (batch_size, seq_len), kind, budget_mib = size, subject.kind, self.limit["mib"]
        key = {"kind": kind, "subject": subject.name, "dimension": dimension, "batch_size": batch_size,
               "seq_len": seq_len, "role": role, "timed": timed, "predicts_over": predicts_over}
        spec = {"kind": kind, "subject": subject.name, "variant": subject.variant, "kv_quant": subject.kv_quant,
                "batch_size": batch_size, "seq_len": seq_len, "dtype": self.dtype, "device": str(self.device),
                "budget_mib": budget_mib, "sizes": predicts_over}
        return self.journal.result(key, lambda: judged(run_cell(
            cell, dict(cfg=self.cfg, results=str(self.layout.root), spec=spec, timed=timed),
            isolation="subprocess", timeout_s=self.cfg["runtime"]["cell_timeout_s"],
            memory_cap_mib=budget_mib if self.device.type == "cpu" else None), budget_mib))
