"""A finetune run prepared to train in this process: its settings, this process's place among the DDP ranks, its
numerics, its data and its model, and the HF Trainer that trains it."""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from ...experiment import FinetuneRun
from ...layout import Job
from ...measure.flops import count_parameters
from ...models.build import build, mixed_precision
from ...models.modeling import eval_loss, read_split
from ...training import collator, low_rank, optimizer_cls_and_kwargs

log = logging.getLogger("efflab")


@dataclass(frozen=True)
class Processes:
    """This process's place in the run: the world size, its rank and its torch threads."""
    world: int
    rank: int
    threads: int

    @classmethod
    def of(cls, job: Job) -> Processes:
        """A job's threads are shared by the DDP ranks on its machine."""
        world, rank = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0))
        threads = job.threads
        if world > 1:
            threads = max(1, threads // int(os.environ.get("LOCAL_WORLD_SIZE", world)))
            torch.set_num_threads(threads)
        return cls(world, rank, threads)

    @property
    def main(self) -> bool:
        """Rank 0, the one that reports and writes the outputs."""
        return self.rank == 0


@dataclass
class PreparedRun:
    """A run ready to train: its settings (finetune_run), processes, device, compute dtype and mixed precision,
    tokenizer, training and validation rows, and the model to train with its parameter counts."""
    run_cfg: FinetuneRun
    processes: Processes
    device: torch.device
    dtype: str
    precision: str
    tokenizer: object
    train_rows: list
    val_rows: list
    model: object
    params: dict

    @classmethod
    def prepare(cls, job: Job, run_cfg: FinetuneRun) -> PreparedRun:
        """Threads, device, precision, seed, tokenizer, rows and the model to train (without a KV cache) of the run
        whose settings are `run_cfg`."""
        from transformers import set_seed

        processes = Processes.of(job)
        device, dtype = job.device, job.dtype
        precision = mixed_precision(run_cfg, dtype, device)
        set_seed(run_cfg.seed, deterministic=run_cfg.deterministic)
        model = build(run_cfg, job.layout, dtype, device)
        # Training needs no KV cache, and with one transformers would not see packed rows' boundaries (it reads
        # them from the position ids only when there is no cache) and would let them attend to each other.
        model.config.use_cache = False
        params = count_parameters(model)
        log.info("%s: %s trainable of %s parameters (%.3f%%), precision %s", job.name, f"{params['trainable']:,}",
                 f"{params['total']:,}", params["trainable_pct"], precision)
        return cls(run_cfg, processes, device, dtype, precision, job.tokenizer, read_split(job.layout.split("train")),
                   read_split(job.layout.split("validation"), run_cfg.eval_rows), model, params)

    @property
    def matmul_dtype(self) -> str:
        """The dtype the training's matmuls run in: the one its matmul ceiling and published peak are taken for."""
        if self.run_cfg.bf16_weights:
            return "bfloat16"
        return {"bf16": "bfloat16", "fp16": "float16"}.get(
            self.precision, "float32" if self.run_cfg.method == "full" else self.dtype)

    @property
    def effective_batch(self) -> int:
        return self.run_cfg.batch_size * self.run_cfg.gradient_accumulation_steps * self.processes.world

    @property
    def train_lengths(self) -> list[int]:
        return [len(row["input_ids"]) for row in self.train_rows]

    def validation_loss(self, model) -> dict:
        """`model`'s loss on the run's validation rows."""
        return eval_loss(model, self.val_rows, self.run_cfg.batch_size, self.tokenizer)

    def trainer(self, scratch: Path, callbacks: list):
        """The HF Trainer of the run (its step checkpoints in `scratch`), with its progress bar quiet."""
        from transformers import Trainer

        from .callbacks import quiet_progress

        args = self.training_arguments(scratch)
        trainer = Trainer(model=self.model, args=args,
                          optimizer_cls_and_kwargs=optimizer_cls_and_kwargs(self.run_cfg, args),
                          train_dataset=self.train_rows, data_collator=collator(self.run_cfg, self.tokenizer),
                          callbacks=callbacks)
        quiet_progress(trainer)
        return trainer

    def training_arguments(self, scratch: Path):
        """The HF TrainingArguments of a run: its schedule, precision and data loading, no evaluation, log every step."""
        from transformers import TrainingArguments
        run_cfg, precision, device = self.run_cfg, self.precision, self.device
        every = run_cfg.checkpoint_every
        return TrainingArguments(
            output_dir=str(scratch), max_steps=run_cfg.max_steps,
            save_strategy="steps" if every else "no", save_steps=every or 500, save_total_limit=2,
            per_device_train_batch_size=run_cfg.batch_size,
            gradient_accumulation_steps=run_cfg.gradient_accumulation_steps,
            learning_rate=run_cfg.learning_rate, lr_scheduler_type=run_cfg.lr_scheduler,
            warmup_steps=run_cfg.warmup_steps, weight_decay=run_cfg.weight_decay,
            max_grad_norm=run_cfg.max_grad_norm, optim=run_cfg.optimizer, bf16=precision == "bf16",
            fp16=precision == "fp16", optim_target_modules="all-linear" if low_rank(run_cfg.optimizer) else None,
            tf32=run_cfg.tf32 if device.type == "cuda" else None, torch_compile=run_cfg.torch_compile,
            full_determinism=run_cfg.deterministic,
            logging_steps=1, eval_strategy="no", report_to=[], seed=run_cfg.seed,
            data_seed=run_cfg.seed, use_cpu=device.type == "cpu",
            dataloader_num_workers=run_cfg.dataloader_num_workers,
            dataloader_pin_memory=device.type == "cuda" and run_cfg.pin_memory in ("auto", True),
            include_num_input_tokens_seen="non_padding", remove_unused_columns=False,
            ddp_find_unused_parameters=False, disable_tqdm=self.processes.rank != 0,
        )
