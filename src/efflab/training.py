"""One optimizer step written out, for stages that train several models in one process (bench_finetune, qat).

The finetune stage trains with the HF Trainer, one run per process. Where several models train in one
process, a Trainer each would share accelerate's one mixed-precision state, so the step is written out here,
on one screen: forward and backward over the step's micro-batches, gradient clipping, optimizer and learning
rate scheduler step. The optimizer and scheduler are the Trainer's own (create_optimizer, create_scheduler),
built from the same run settings as the finetune stage's; mixed precision is torch.autocast, with a
GradScaler for fp16, as accelerate does.
"""
from __future__ import annotations

from contextlib import nullcontext

import torch

from .finetune import collator, mixed_precision


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


def training_step(run_cfg: dict, model, dtype: str, device: torch.device, steps: list[list[dict]],
                  output_dir: str, total_steps: int | None = None):
    """A function doing `model`'s optimizer step `i` on steps[i % len(steps)] and returning its loss (a
    detached tensor: reading it is the caller's choice, and a synchronisation), and the mixed precision used.
    The learning rate follows run_cfg's schedule over `total_steps` (default: len(steps))."""
    from transformers import Trainer, TrainingArguments

    model.config.use_cache = False
    model.train()
    if run_cfg.get("torch_compile"):
        model = torch.compile(model)
    precision = mixed_precision(run_cfg, dtype, device)
    args = TrainingArguments(output_dir=output_dir, optim=run_cfg["optimizer"],
                             learning_rate=run_cfg["learning_rate"], weight_decay=run_cfg["weight_decay"],
                             lr_scheduler_type=run_cfg["lr_scheduler"], warmup_steps=run_cfg["warmup_steps"],
                             use_cpu=device.type == "cpu", report_to=[])
    trainer = Trainer(model=model, args=args)
    optimizer = trainer.create_optimizer()
    scheduler = trainer.create_scheduler(total_steps or len(steps), optimizer)
    autocast_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    scaler = torch.amp.GradScaler(device.type) if precision == "fp16" else None
    params = [p for p in model.parameters() if p.requires_grad]

    def step(i: int) -> torch.Tensor:
        if device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = bool(run_cfg.get("tf32"))
        micros = steps[i % len(steps)]
        total = torch.zeros((), device=device)
        for batch in micros:
            with torch.autocast(device.type, dtype=autocast_dtype) if autocast_dtype else nullcontext():
                loss = model(**batch).loss / len(micros)
            (scaler.scale(loss) if scaler else loss).backward()
            total += loss.detach()
        if scaler:
            scaler.unscale_(optimizer)
        if run_cfg["max_grad_norm"] > 0:  # 0: no clipping, as in the Trainer (clipping to 0 would zero every step)
            torch.nn.utils.clip_grad_norm_(params, run_cfg["max_grad_norm"])
        if scaler:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        return total

    return step, precision
