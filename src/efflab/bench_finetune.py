"""Stage bench_finetune: what each fine-tuning knob costs in step time, measured so that the verdict holds.

The finetune stage trains each run in its own process, at its own time: a comparison of two runs' step
times also compares whatever else the machine was doing while each ran (another job took a core during
one of them, and checkpointing read 2x faster). Here, for every pair of configured runs that differ in
exactly one knob (records.knob_pairs), both runs' models, optimizers, precision and batches are built in
one process and their training steps (forward, backward, gradient clipping, optimizer step) are timed
interleaved, A B then B A, over the same batches, with a speed probe between rounds (measure.interleave).
Each pair's verdict comes from the per-round ratios: median, bootstrap 95% interval, and `slower`,
`faster` or `no significant difference`; rounds in which the machine's speed changed are set aside and
measured again, and a pair that never gets enough stable rounds says so instead of giving a verdict.
Every pair is a cell (runtime.isolation), journalled as it ends.

The step is written out here rather than run by a Trainer: accelerate keeps one mixed-precision state per
process, so two Trainers in one process would share it. The optimizer is the Trainer's own
(Trainer.create_optimizer); mixed precision is torch.autocast, with a GradScaler for fp16, as accelerate does.
"""
from __future__ import annotations

import logging
from contextlib import nullcontext
from pathlib import Path

import torch

from . import cli, records
from .config import finetune_run
from .finetune import build_model, collator, mixed_precision, unavailable_knobs
from .layout import Layout
from .measure import (CellJournal, environment, format_ratio, interleave, paired_ratio, pick_device, run_cell, set_threads,
                      synchronize)
from .modeling import base_dtype, load_tokenizer, read_split

log = logging.getLogger("efflab")

# Knobs whose effect a pair of models in one process cannot show: they are process-wide (deterministic
# kernels), belong to the data loader this benchmark does not use (it feeds pre-built batches), or spread
# the step over processes.
NOT_INTERLEAVED = {
    "deterministic": "deterministic algorithms are a process-wide torch setting",
    "dataloader_num_workers": "a data-loader knob: this benchmark feeds pre-built batches",
    "pin_memory": "a data-loader knob: this benchmark feeds pre-built batches",
    "num_processes": "a multi-process (DDP) knob: one process cannot run both sides",
}


def _knob_reason(knob: str) -> str | None:
    return NOT_INTERLEAVED.get(knob.split(".")[0])


def batches(run_cfg: dict, tokenizer, rows: list[dict], count: int, device: torch.device) -> list[list[dict]]:
    """`count` optimizer steps' micro-batches, drawn in a seeded order and collated as the run collates them
    (packed or padded), already on the device."""
    gen = torch.Generator().manual_seed(run_cfg["seed"])
    order = torch.randperm(len(rows), generator=gen).tolist()
    micro, accumulate = run_cfg["batch_size"], run_cfg["gradient_accumulation_steps"]
    collate = collator(run_cfg, tokenizer)
    steps = []
    for step in range(count):
        micros = []
        for m in range(accumulate):
            start = (step * accumulate + m) * micro
            picked = [rows[order[(start + i) % len(rows)]] for i in range(micro)]
            micros.append({k: v.to(device) for k, v in collate(picked).items()})
        steps.append(micros)
    return steps


def real_tokens(micros: list[dict]) -> int:
    """Non-padding input tokens of one step, as the finetune stage counts them."""
    return sum(int(b["attention_mask"].sum()) if "attention_mask" in b else b["input_ids"].numel() for b in micros)


def training_step(run_cfg: dict, layout, dtype: str, device: torch.device, steps: list[list[dict]]):
    """The run's model and optimizer, and a function doing its optimizer step `i` on steps[i % len(steps)]."""
    from transformers import Trainer, TrainingArguments

    model = build_model(run_cfg, layout, dtype, device)
    model.config.use_cache = False
    model.train()
    if run_cfg["torch_compile"]:
        model = torch.compile(model)
    precision = mixed_precision(run_cfg, dtype, device)
    args = TrainingArguments(output_dir=str(layout.out("bench_finetune")), optim=run_cfg["optimizer"],
                             learning_rate=run_cfg["learning_rate"], weight_decay=run_cfg["weight_decay"],
                             use_cpu=device.type == "cpu", report_to=[])
    optimizer = Trainer(model=model, args=args).create_optimizer()
    autocast_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    scaler = torch.amp.GradScaler(device.type) if precision == "fp16" else None
    params = [p for p in model.parameters() if p.requires_grad]

    def step(i: int) -> None:
        torch.backends.cuda.matmul.allow_tf32 = bool(run_cfg["tf32"])
        micros = steps[i % len(steps)]
        for batch in micros:
            with torch.autocast(device.type, dtype=autocast_dtype) if autocast_dtype else nullcontext():
                loss = model(**batch).loss / len(micros)
            (scaler.scale(loss) if scaler else loss).backward()
        if scaler:
            scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(params, run_cfg["max_grad_norm"])
        if scaler:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step, precision


def pair_cell(cfg: dict, results: str, a: str, b: str, dtype: str, device: str) -> dict:
    """Time runs a and b's training steps interleaved; b's step time over a's with its interval and verdict."""
    from transformers import set_seed

    bf, layout, device = cfg["bench_finetune"], Layout(Path(results)), torch.device(device)
    tokenizer = load_tokenizer(layout.base_model())
    rows = read_split(layout.split("train"))
    count = bf["warmup_rounds"] + 2 * bf["rounds"]  # enough batches for every round, set-aside ones included
    variants, tokens, precision = {}, {}, {}
    for name in (a, b):
        run_cfg = finetune_run(cfg, name)
        set_seed(run_cfg["seed"])
        steps = batches(run_cfg, tokenizer, rows, count, device)
        variants[name], precision[name] = training_step(run_cfg, layout, dtype, device, steps)
        tokens[name] = [real_tokens(s) for s in steps]
    synchronize(device)
    timed = interleave(variants, bf["rounds"], device, warmup=bf["warmup_rounds"],
                       tolerance=bf["sentinel_tolerance"])
    ratio = paired_ratio(timed, a, b)
    per_run = {}
    for name in (a, b):
        kept = [(r["seconds"][name], tokens[name][i % count]) for i, r in enumerate(timed["rounds"], bf["warmup_rounds"])
                if r["stable"]]
        seconds = sum(s for s, _ in kept)
        per_run[name] = {"step_time": timed["variants"][name], "mixed_precision": precision[name],
                         "tokens_per_s": sum(t for _, t in kept) / seconds if seconds else None}
    log.info("%s vs %s: step time ratio %s %s (%d stable rounds, %d set aside)", b, a,
             format_ratio(ratio, 3),
             ratio["verdict"], timed["stable_rounds"], timed["set_aside"])
    return {"runs": per_run, "step_time_ratio": ratio, "interleaved": timed}


def run(cfg: dict, paths: dict) -> dict:
    """Every knob pair of finetune.runs, timed interleaved."""
    bf, rt, layout = cfg["bench_finetune"], cfg["runtime"], paths["layout"]
    set_threads(rt)
    device = pick_device(rt)
    dtype = base_dtype(layout)
    configured = [{"run": name, "settings": finetune_run(cfg, name)} for name in cfg["finetune"]["runs"]]
    journal = CellJournal(layout.out("bench_finetune") / ".pairs.jsonl",
                          {"bench_finetune": bf, "finetune": cfg["finetune"], "runtime": rt,
                           "base": layout.metrics("base_model").read_text()})
    pairs = []
    for knob, value_a, value_b, a, b in records.knob_pairs(configured):
        cell = {"knob": knob, "from": value_a, "to": value_b, "a": a["run"], "b": b["run"]}
        reason = _knob_reason(knob) or "; ".join(unavailable_knobs(a["settings"], device)
                                                 + unavailable_knobs(b["settings"], device)) or None
        if reason:
            pairs.append(cell | {"status": "unavailable", "reason": reason})
            continue
        result = journal.result(cell, lambda: run_cell(
            pair_cell, dict(cfg=cfg, results=str(layout.root), a=a["run"], b=b["run"], dtype=dtype,
                            device=str(device)),
            isolation=rt["isolation"], timeout_s=rt["cell_timeout_s"], memory_cap_mib=rt["cell_memory_cap_mib"]))
        if not records.is_ok(result):
            log.warning("%s vs %s: %s: %s", b["run"], a["run"], result["status"], result.get("reason"))
        pairs.append(cell | result)
    journal.remove()
    return {"status": "ok", "dtype": dtype, "rounds": bf["rounds"], "warmup_rounds": bf["warmup_rounds"],
            "sentinel_tolerance": bf["sentinel_tolerance"],
            "measured": "training steps (forward, backward, clipping, optimizer step) of both runs of a pair in "
                        "one process, interleaved over the same batches",
            "pairs": pairs, "environment": environment(device, bf)}


if __name__ == "__main__":
    cli.main("bench_finetune", run)
