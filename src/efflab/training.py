"""Fine-tuning shared by the stages that train (the model a run trains is models.build's): its collator, its mixed
precision and the knobs a device cannot honour; and one optimizer step written out, for stages that train several
models in one process (bench_finetune, capacity, prune's healing, qat).

The finetune stage trains with the HF Trainer, one run per process. Where several models train in one
process, a Trainer each would share accelerate's one mixed-precision state, so the step is written out here,
on one screen: forward and backward over the step's micro-batches, gradient clipping, optimizer and learning
rate scheduler step. The optimizer and scheduler are the Trainer's own (create_optimizer, create_scheduler),
built from the same run settings as the finetune stage's; mixed precision is torch.autocast, with a
GradScaler for fp16, as accelerate does.
"""
from __future__ import annotations

import functools
import importlib.util
from contextlib import nullcontext
from dataclasses import dataclass, fields

import torch

from .experiment import FinetuneRun
from .models.build import mixed_precision

# transformers, peft and bitsandbytes take seconds to import: they are imported inside the functions that use them.


@dataclass(frozen=True)
class StepRun:
    """What the written-out step (training_step) and its batches read of a run, for the stages that train a model of
    their own in one process (prune's healing, qat) from a section of their own params. An experiment.FinetuneRun
    has every one of these settings, so bench_finetune and capacity hand theirs over as it is."""
    steps: int
    batch_size: int
    learning_rate: float
    seed: int = 0
    optimizer: str = "adamw_torch"
    lr_scheduler: str = "cosine"
    warmup_steps: int = 0
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    mixed_precision: str = "auto"
    gradient_accumulation_steps: int = 1
    packing: bool = True
    bf16_weights: bool = False
    tf32: bool = False
    torch_compile: bool = False

    @classmethod
    def of(cls, section: dict) -> StepRun:
        """The step settings of a params section (qat.train, prune.heal): its keys that are settings of a step."""
        return cls(**{f.name: section[f.name] for f in fields(cls) if f.name in section})


Run = FinetuneRun | StepRun  # what the shared training functions take


# transformers' low-rank optimizers (config.LOW_RANK_OPTIMIZERS): the package each needs, by prefix
LOW_RANK = {"galore_": ("galore_torch", "galore-torch"), "apollo_": ("apollo_torch", "apollo-torch")}


def low_rank(optimizer: str) -> tuple[str, str] | None:
    """(module, pip name) of a GaLore-class optimizer's package; None for the others."""
    return next((package for prefix, package in LOW_RANK.items() if optimizer.startswith(prefix)), None)


def unavailable_knobs(run: Run, device: torch.device) -> list[str]:
    """The knobs of a run that this device cannot honour. Such a run is recorded as unavailable with these
    reasons rather than trained without them: a row labelled tf32 that ran without TF32 would be a lie."""
    reasons = []
    package = low_rank(run.optimizer)
    if package and importlib.util.find_spec(package[0]) is None:
        reasons.append(f"optimizer {run.optimizer} needs the {package[1]} package, which is not installed "
                       f"(pip install {package[1]})")
    if device.type != "cuda":
        if run.mixed_precision == "fp16":
            reasons.append("mixed_precision fp16 (with gradient scaling) needs a CUDA GPU")
        if run.tf32:
            reasons.append("tf32 needs an NVIDIA GPU of compute capability 8.0 (Ampere) or newer")
        if run.pin_memory is True:
            reasons.append("pin_memory: page-locked host memory only speeds up copies to a CUDA GPU")
        if run.liger_kernel:
            reasons.append("liger_kernel: Liger's kernels are Triton kernels for CUDA GPUs")
        if run.attn_implementation == "flash_attention_2":
            reasons.append("attn_implementation flash_attention_2: FlashAttention-2 is CUDA kernels")
    elif run.attn_implementation == "flash_attention_2" and importlib.util.find_spec("flash_attn") is None:
        reasons.append("attn_implementation flash_attention_2 needs the flash-attn package, which is not installed "
                       "(pip install flash-attn)")
    if device.type == "cuda" and run.liger_kernel and importlib.util.find_spec("liger_kernel") is None:
        reasons.append("liger_kernel needs the liger-kernel package, which is not installed (pip install liger-kernel)")
    if device.type == "cuda" and run.tf32 and torch.cuda.get_device_capability(device)[0] < 8:
        reasons.append(f"tf32 needs compute capability 8.0 or newer; {torch.cuda.get_device_name(device)} has "
                       f"{'.'.join(map(str, torch.cuda.get_device_capability(device)))}")
    return reasons


def collator(run: Run, tokenizer):
    """Padding-free batches when packing: the batch's rows laid end to end in one row with position ids
    restarting at every row, which transformers turns into a block-diagonal causal mask (eager, sdpa) or
    variable-length kernels (flash_attention_2). Same rows and label tokens per step as padded batches,
    so the loss is the same; only the pad tokens' compute is gone."""
    from transformers import DataCollatorForSeq2Seq, DataCollatorWithFlattening

    if run.packing:
        return DataCollatorWithFlattening(return_position_ids=True, separator_id=-100)
    return DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=-100)


def optimizer_cls_and_kwargs(run: Run, args) -> tuple | None:
    """The optimizer of a run with bf16_weights, for the Trainer's `optimizer_cls_and_kwargs` (the Trainer still
    makes the weight-decay groups): torchao's AdamW, which computes each update in fp32 and rounds it to bf16
    stochastically (round to nearest would drop most updates smaller than half a bf16 step), with its two moments
    kept in fp32. None otherwise: the Trainer builds run.optimizer. `args` are the run's TrainingArguments."""
    if not run.bf16_weights:
        return None
    return _adamw_fp32_moments(), {"lr": args.learning_rate, "betas": (args.adam_beta1, args.adam_beta2),
                                   "eps": args.adam_epsilon, "bf16_stochastic_round": True}


def optimizer_name(run: Run) -> str:
    """The optimizer a run trains with, as its records name it."""
    return "torchao AdamW (fp32 moments, bf16 stochastic rounding)" if run.bf16_weights else run.optimizer


@functools.cache
def _adamw_fp32_moments() -> type:
    from torchao.optim import _AdamW  # AdamW whose update rounds stochastically to bf16; its moments in p's dtype

    class AdamWFp32Moments(_AdamW):
        """torchao's AdamW with its moments in fp32 whatever the weights' dtype."""

        def _new_buffer(self, p: torch.Tensor, signed: bool) -> torch.Tensor:
            return torch.zeros_like(p, dtype=torch.float32)

        def load_state_dict(self, state_dict: dict) -> None:
            """As torch loads it (a resumed run), then the moments put back in fp32: torch casts every floating
            state but `step` to its weight's dtype, which would round them to bf16."""
            super().load_state_dict(state_dict)
            ids = [i for group in state_dict["param_groups"] for i in group["params"]]
            for p, i in zip([p for group in self.param_groups for p in group["params"]], ids):
                for key, saved in state_dict["state"].get(i, {}).items():
                    if key != "step" and torch.is_tensor(saved):
                        self.state[p][key] = saved.to(p.device, torch.float32)

    return AdamWFp32Moments


def batches(run_cfg: Run, tokenizer, rows: list[dict], count: int, device: torch.device) -> list[list[dict]]:
    """`count` optimizer steps' micro-batches, drawn in a seeded order and collated as the run collates them
    (packed or padded), already on the device."""
    gen = torch.Generator().manual_seed(run_cfg.seed)
    order = torch.randperm(len(rows), generator=gen).tolist()
    micro, accumulate = run_cfg.batch_size, run_cfg.gradient_accumulation_steps
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


def training_step(run_cfg: Run, model, dtype: str, device: torch.device, steps: list[list[dict]],
                  output_dir: str, total_steps: int | None = None):
    """A function doing `model`'s optimizer step `i` on steps[i % len(steps)] and returning its loss (a
    detached tensor: reading it is the caller's choice, and a synchronisation), and the mixed precision used.
    The learning rate follows run_cfg's schedule over `total_steps` (default: len(steps))."""
    from transformers import Trainer, TrainingArguments

    model.config.use_cache = False
    model.train()
    if run_cfg.torch_compile:
        model = torch.compile(model)
    precision = mixed_precision(run_cfg, dtype, device)
    args = TrainingArguments(output_dir=output_dir, optim=run_cfg.optimizer,
                             learning_rate=run_cfg.learning_rate, weight_decay=run_cfg.weight_decay,
                             lr_scheduler_type=run_cfg.lr_scheduler, warmup_steps=run_cfg.warmup_steps,
                             use_cpu=device.type == "cpu", report_to=[])
    trainer = Trainer(model=model, args=args, optimizer_cls_and_kwargs=optimizer_cls_and_kwargs(run_cfg, args))
    optimizer = trainer.create_optimizer()
    scheduler = trainer.create_scheduler(total_steps or len(steps), optimizer)
    autocast_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    scaler = torch.amp.GradScaler(device.type) if precision == "fp16" else None
    params = [p for p in model.parameters() if p.requires_grad]

    def step(i: int) -> torch.Tensor:
        if device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = bool(run_cfg.tf32)
        micros = steps[i % len(steps)]
        total = torch.zeros((), device=device)
        for batch in micros:
            with torch.autocast(device.type, dtype=autocast_dtype) if autocast_dtype else nullcontext():
                loss = model(**batch).loss / len(micros)
            (scaler.scale(loss) if scaler else loss).backward()
            total += loss.detach()
        if scaler:
            scaler.unscale_(optimizer)
        if run_cfg.max_grad_norm > 0:  # 0: no clipping, as in the Trainer (clipping to 0 would zero every step)
            torch.nn.utils.clip_grad_norm_(params, run_cfg.max_grad_norm)
        if scaler:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        return total

    return step, precision
