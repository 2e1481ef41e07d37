"""Stage finetune: full fine-tuning, LoRA or QLoRA with the HF Trainer and peft, one job per named run.

Records trainable/total parameters (4-bit aware), peak memory of training, real-token throughput,
the loss curve and validation loss before and after. Saves the peft adapter or the full model.
"""
from __future__ import annotations

import csv
import logging
import shutil
import time

import torch

from . import cli
from .config import UserError, finetune_run
from .measure import (count_parameters, environment, matmul_ceiling, mfu, pick_device, published_peak_tflops,
                      set_threads, track_memory, training_flops_per_token)
from .modeling import base_dtype, eval_loss, load_model, load_tokenizer, read_split

log = logging.getLogger("efflab")


def mixed_precision(run: dict, dtype: str, device: torch.device) -> str:
    """'bf16', 'fp16' or 'no'; 'auto' follows what the base_model stage measured to be fast."""
    want = run["mixed_precision"]
    if want == "auto":
        if device.type == "cuda":
            return "bf16" if torch.cuda.is_bf16_supported() else "fp16"
        return "bf16" if dtype == "bfloat16" else "no"
    if want == "fp16" and device.type != "cuda":
        raise UserError("finetune.mixed_precision: fp16 with gradient scaling needs a CUDA device")
    return want


def build_model(run: dict, layout, dtype: str, device: torch.device):
    """The model to train: full weights in fp32, or the frozen base (4-bit for QLoRA) with LoRA."""
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

    if run["method"] == "full":
        model = load_model(layout.base_model(), "float32", device)
        if run["gradient_checkpointing"]:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return model
    quant = run["quant"] if run["method"] == "qlora" else None
    model = load_model(layout.base_model(), dtype, device, quant=quant)
    if quant:
        model = prepare_model_for_kbit_training(
            model, use_gradient_checkpointing=run["gradient_checkpointing"],
            gradient_checkpointing_kwargs={"use_reentrant": False})
    elif run["gradient_checkpointing"]:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    lora = run["lora"]
    peft_config = LoraConfig(task_type="CAUSAL_LM", r=lora["r"], lora_alpha=lora["alpha"],
                             lora_dropout=lora["dropout"], target_modules=lora["target_modules"], bias="none")
    try:
        return get_peft_model(model, peft_config)
    except ValueError as err:
        raise UserError(f"finetune.lora.target_modules: {str(err).splitlines()[0]}") from None


def write_loss_curve(history: list[dict], path) -> list[dict]:
    rows = [{"step": h["step"], "loss": h["loss"], "learning_rate": h.get("learning_rate"),
             "grad_norm": h.get("grad_norm")} for h in history if "loss" in h]
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["step", "loss", "learning_rate", "grad_norm"])
        writer.writeheader()
        writer.writerows(rows)
    return rows


def run(cfg: dict, paths: dict) -> dict:
    """Fine-tune one named run and measure what it cost and bought."""
    from datasets import Dataset
    from transformers import DataCollatorForSeq2Seq, Trainer, TrainingArguments, set_seed

    name, layout = paths["name"], paths["layout"]
    run_cfg = finetune_run(cfg, name)
    threads = set_threads(cfg["runtime"])
    device = pick_device(cfg["runtime"])
    dtype = base_dtype(layout)
    precision = mixed_precision(run_cfg, dtype, device)
    set_seed(run_cfg["seed"])
    tokenizer = load_tokenizer(layout.base_model())
    train_rows = read_split(layout.split("train"))
    val_rows = read_split(layout.split("validation"), run_cfg["eval_rows"])

    model = build_model(run_cfg, layout, dtype, device)
    params = count_parameters(model)
    log.info("%s: %s trainable of %s parameters (%.3f%%), precision %s", name, f"{params['trainable']:,}",
             f"{params['total']:,}", params["trainable_pct"], precision)
    before = eval_loss(model, val_rows, run_cfg["batch_size"], tokenizer)
    matmul_dtype = {"bf16": "bfloat16", "fp16": "float16"}.get(
        precision, "float32" if run_cfg["method"] == "full" else dtype)
    ceiling = matmul_ceiling(matmul_dtype, device)
    log.info("%s: matmul ceiling %.3f TFLOP/s (%s, measured now)", name, ceiling["tflops"], matmul_dtype)

    scratch = paths["out"] / "trainer"
    args = TrainingArguments(
        output_dir=str(scratch), max_steps=run_cfg["max_steps"],
        per_device_train_batch_size=run_cfg["batch_size"],
        gradient_accumulation_steps=run_cfg["gradient_accumulation_steps"],
        learning_rate=run_cfg["learning_rate"], lr_scheduler_type=run_cfg["lr_scheduler"],
        warmup_steps=run_cfg["warmup_steps"], weight_decay=run_cfg["weight_decay"],
        max_grad_norm=run_cfg["max_grad_norm"], bf16=precision == "bf16", fp16=precision == "fp16",
        logging_steps=1, save_strategy="no", eval_strategy="no", report_to=[], seed=run_cfg["seed"],
        data_seed=run_cfg["seed"], use_cpu=device.type == "cpu", dataloader_num_workers=0,
        include_num_input_tokens_seen="non_padding", remove_unused_columns=False,
    )
    trainer = Trainer(model=model, args=args, train_dataset=Dataset.from_list(train_rows),
                      data_collator=DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=-100))
    with track_memory(device) as train_mem:
        t0 = time.perf_counter()
        result = trainer.train()
        train_s = time.perf_counter() - t0
    shutil.rmtree(scratch, ignore_errors=True)
    model.eval()
    after = eval_loss(model, val_rows, run_cfg["batch_size"], tokenizer)
    curve = write_loss_curve(trainer.state.log_history, paths["out"] / "loss.csv")

    folder = paths["out"] / "model"
    if run_cfg["method"] == "full":
        model.to(getattr(torch, dtype)).save_pretrained(folder, safe_serialization=True)
    else:
        model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    steps = result.global_step
    tokens = trainer.state.num_input_tokens_seen
    samples = steps * run_cfg["batch_size"] * run_cfg["gradient_accumulation_steps"]
    flops = training_flops_per_token(model, tokens / samples, run_cfg["gradient_checkpointing"])
    published = published_peak_tflops(device, matmul_dtype)
    throughput = {
        "tokens_per_s": tokens / train_s, "samples_per_s": samples / train_s,
        "tokens": "real (non-padding) input tokens", "flops": flops, "matmul_ceiling": ceiling,
        "mfu_vs_measured_ceiling": mfu(tokens / train_s, flops["model_flops_per_token"], ceiling["tflops"]),
        "published_peak": published,
        "mfu_vs_published_peak": mfu(tokens / train_s, flops["model_flops_per_token"], published["tflops"]),
    }
    log.info("%s: validation loss %.3f -> %.3f in %d steps, %.0f tokens/s, MFU %.1f%% of the measured ceiling, "
             "peak %s MiB (%s)", name, before["loss"], after["loss"], steps, tokens / train_s,
             100 * throughput["mfu_vs_measured_ceiling"], _fmt(train_mem["peak_mib"]), train_mem["kind"])
    return {
        "run": name, "method": run_cfg["method"], "settings": run_cfg, "compute_dtype": dtype,
        "mixed_precision": precision, "threads": threads, "parameters": params,
        "steps": steps, "train_s": train_s, "step_s": train_s / steps,
        "tokens_seen": tokens, "tokens_per_s": tokens / train_s, "samples_per_s": samples / train_s,
        "throughput": throughput,
        "train_memory": train_mem, "first_loss": curve[0]["loss"], "last_loss": curve[-1]["loss"],
        "validation_before": before, "validation_after": after,
        "validation_loss_drop": before["loss"] - after["loss"],
        "environment": environment(device, run_cfg),
    }


def _fmt(value) -> str:
    return "n/a" if value is None else f"{value:.0f}"


if __name__ == "__main__":
    cli.main("finetune", run)
