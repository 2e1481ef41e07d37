"""Stage finetune: full fine-tuning, LoRA or QLoRA with the HF Trainer and peft, one job per named run.

Records trainable/total parameters (4-bit aware), peak memory of training, real-token throughput,
the loss curve and validation loss before and after. Saves the peft adapter or the full model.
"""
from __future__ import annotations

import argparse
import csv
import hashlib
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ... import config, profiling
from ...config import UserError
from ...estimators.memory import compared
from ...estimators.training_memory import longest_micro_batch, training_peak
from ...experiment import finetune_run
from ...layout import LOSS_COLUMNS, Job, Layout
from ...logs import log_file_path, setup_child_logging
from ...lora_init import Refused, lora_init, rewrites_base, save_initial
from ...measure.energy import EnergyMeter, energy_per_token
from ...measure.env import environment
from ...measure.flops import count_parameters, matmul_ceiling, mfu, published_peak_tflops, training_flops_per_token
from ...measure.memory import CpuTensorPeak, track_memory
from ...measure.phases import PHASES_ENV, PhaseClock
from ...measure.stats import summarize
from ...models.modeling import eval_loss, read_split
from ...registry import LOSS_CSV
from ...training import (
    build_model,
    collator,
    low_rank,
    mixed_precision,
    optimizer_cls_and_kwargs,
    optimizer_name,
    unavailable_knobs,
)

# transformers' training modules (trainer_utils, TrainingArguments, set_seed, the Trainer) and .callbacks (its
# TrainerCallbacks) bring accelerate, peft and bitsandbytes with them, 5-10 s of imports on 2 cores, and bitsandbytes
# asks CUDA for the device capability at import, which initialises CUDA: each is imported inside the function that
# uses it, after cli.main has given the process its GPU (gpu_slots.assign sets CUDA_VISIBLE_DEVICES, which CUDA reads
# once, as it initialises); importing this package (the tests do) loads none of them.

log = logging.getLogger("efflab")


def write_loss_curve(history: list[dict], path) -> list[dict]:
    rows = [{"step": h["step"], "loss": h["loss"], "learning_rate": h.get("learning_rate"),
             "grad_norm": h.get("grad_norm")} for h in history if "loss" in h]
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=LOSS_COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    return rows


def run(cfg: dict, job: Job) -> dict:
    """Fine-tune one named run and measure what it cost and bought (DDP when num_processes > 1).
    A run the device cannot do is recorded as unavailable with the reason; one that fails or runs out of
    memory is recorded by cli.main (the grid goes on); bad params still stop with an error."""
    run_cfg = finetune_run(cfg, job.name)
    device = job.device
    missing = unavailable_knobs(run_cfg, device)
    if missing:
        return unavailable(job, run_cfg, "; ".join(missing))
    if run_cfg["num_processes"] * run_cfg["num_machines"] > 1 or run_cfg["accelerate_config"]:
        if "LOCAL_RANK" not in os.environ:
            return launch_distributed(run_cfg, job)
    try:
        return train(cfg, job, run_cfg)
    except Refused as err:  # peft cannot initialise the adapter this way for this model
        return unavailable(job, run_cfg, str(err))


def unavailable(job: Job, run_cfg: dict, reason: str) -> dict:
    """The record of a run this device or model cannot do as asked, with the reason."""
    job.layout.write_not_run("finetune", job.out, "unavailable", reason)
    log.warning("%s: unavailable: %s", job.name, reason)
    return {"status": "unavailable", "reason": reason, "run": job.name, "method": run_cfg["method"],
            "settings": run_cfg, "environment": environment(job.device, run_cfg)}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch_distributed(run_cfg: dict, job: Job) -> dict:
    """Run this stage's training as `accelerate launch` DDP workers (gloo on CPU, NCCL on GPU); rank 0
    writes the outputs into this job's folder and hands its metrics back through a file."""
    log_file = log_file_path()
    config = run_cfg["accelerate_config"]
    if config and not Path(config).is_file():
        raise UserError(f"finetune.accelerate_config: {config!r} does not exist (expected an accelerate config file)")
    kind = ["--config_file", config] if config else ["--multi_gpu"]  # multi_gpu: gloo DDP on a CPU-only machine
    cmd = [sys.executable, "-m", "accelerate.commands.launch", *kind,
           "--num_processes", str(run_cfg["num_processes"] * run_cfg["num_machines"]),
           "--num_machines", str(run_cfg["num_machines"]), "--main_process_port", str(_free_port()),
           "--mixed_precision", "no", "--dynamo_backend", "no", "-m", "efflab.stages.finetune", WORKER_FLAG,
           "--params", str(job.params), "--name", job.name, "--results", str(job.layout.root),
           "--out", str(job.out)] + (["--log", log_file] if log_file else [])
    log.info("%s: launching %d DDP processes: %s", job.name, run_cfg["num_processes"], " ".join(cmd))
    proc = subprocess.run(cmd)
    handoff = job.out / "rank0_metrics.json"
    if proc.returncode != 0 or not handoff.is_file():
        raise RuntimeError(f"accelerate launch exited with code {proc.returncode}; see the log above")
    metrics = json.loads(handoff.read_text())
    handoff.unlink()
    return metrics


def checkpoints(layout, name: str, run_cfg: dict, rank: int) -> tuple[Path, str | None]:
    """The run's step-checkpoint folder (a hidden sibling of its outputs, which Snakemake does not own and
    so does not delete when a killed job's outputs are cleaned up) and the checkpoint to resume from.
    Checkpoints written with different settings are discarded, never resumed."""
    from transformers.trainer_utils import get_last_checkpoint

    folder = layout.out("finetune").joinpath(f".{name}.checkpoints")
    stamp = folder / "settings.json"
    wanted = json.dumps({"settings": run_cfg, "base": layout.metrics("base_model").read_text(),
                         "train": layout.split("train").stat().st_size}, sort_keys=True)
    if rank == 0:
        if folder.is_dir() and (not stamp.is_file() or stamp.read_text() != wanted):
            log.info("%s: discarding checkpoints written with other settings: %s", name, folder)
            shutil.rmtree(folder)
        folder.mkdir(parents=True, exist_ok=True)
        stamp.write_text(wanted)
    last = get_last_checkpoint(str(folder)) if folder.is_dir() and run_cfg["checkpoint_every"] else None
    return folder, last


def _checkpoint_state(checkpoint: str | None) -> dict:
    if not checkpoint:
        return {"global_step": 0, "num_input_tokens_seen": 0}
    state = json.loads((Path(checkpoint) / "trainer_state.json").read_text())
    return {"global_step": state["global_step"], "num_input_tokens_seen": state.get("num_input_tokens_seen", 0)}


def steady_steps(step_times, warmup: int) -> dict:
    """Step time (median and spread) and throughput of the steady steps: the first `warmup` steps (lazy
    initialisation, allocator warm-up, kernel autotuning) are left out while later steps remain. Without a step
    timer (instruments: false), none."""
    if step_times is None:
        return {"step_time": None, "steps": 0, "excluded_steps": 0, "tokens": 0, "seconds": 0.0,
                "tokens_per_s": None, "unavailable": "instruments: false (no step timer)"}
    durations, tokens = step_times.durations, step_times.tokens
    skip = warmup if len(durations) > warmup else 0
    steady_s, steady_tokens = durations[skip:], tokens[skip:]
    return {"step_time": summarize(steady_s) | {
                "first_step_s": durations[0] if durations else None, "warmup_steps_s": durations[:skip],
                "excluded": f"the first {skip} step(s) (timing_warmup_steps)" if skip else None},
            "steps": len(steady_s), "excluded_steps": skip, "tokens": sum(steady_tokens),
            "seconds": sum(steady_s),
            "tokens_per_s": sum(steady_tokens) / sum(steady_s) if sum(steady_s) > 0 else None}


def _lora_scaling(model) -> float | None:
    """The scale peft applies to B·A (alpha/r, or alpha/sqrt(r) with rsLoRA), read from a LoRA layer."""
    for module in model.modules():
        scaling = getattr(module, "scaling", None)
        if isinstance(scaling, dict) and scaling:
            return float(next(iter(scaling.values())))
    return None


def _weights_sha256(model) -> str:
    digest = hashlib.sha256()
    for name, p in sorted(model.named_parameters()):
        if p.requires_grad:
            digest.update(name.encode())
            digest.update(p.detach().float().cpu().numpy().tobytes())
    return digest.hexdigest()[:16]


def _ranks_and_threads(job: Job) -> tuple[int, int, int]:
    """(world size, rank, torch threads): a job's threads are shared by the DDP ranks on its machine."""
    world, rank = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0))
    threads = job.threads
    if world > 1:
        threads = max(1, threads // int(os.environ.get("LOCAL_WORLD_SIZE", world)))
        torch.set_num_threads(threads)
    return world, rank, threads


def training_arguments(run_cfg: dict, scratch: Path, precision: str, device: torch.device, rank: int):
    """The HF TrainingArguments of a run: its schedule, precision and data loading, no evaluation, log every step."""
    from transformers import TrainingArguments
    every = run_cfg["checkpoint_every"]
    return TrainingArguments(
        output_dir=str(scratch), max_steps=run_cfg["max_steps"],
        save_strategy="steps" if every else "no", save_steps=every or 500, save_total_limit=2,
        per_device_train_batch_size=run_cfg["batch_size"],
        gradient_accumulation_steps=run_cfg["gradient_accumulation_steps"],
        learning_rate=run_cfg["learning_rate"], lr_scheduler_type=run_cfg["lr_scheduler"],
        warmup_steps=run_cfg["warmup_steps"], weight_decay=run_cfg["weight_decay"],
        max_grad_norm=run_cfg["max_grad_norm"], optim=run_cfg["optimizer"], bf16=precision == "bf16", fp16=precision == "fp16",
        optim_target_modules="all-linear" if low_rank(run_cfg["optimizer"]) else None,
        tf32=run_cfg["tf32"] if device.type == "cuda" else None, torch_compile=run_cfg["torch_compile"],
        full_determinism=run_cfg["deterministic"],
        logging_steps=1, eval_strategy="no", report_to=[], seed=run_cfg["seed"],
        data_seed=run_cfg["seed"], use_cpu=device.type == "cpu",
        dataloader_num_workers=run_cfg["dataloader_num_workers"],
        dataloader_pin_memory=device.type == "cuda" and run_cfg["pin_memory"] in ("auto", True),
        include_num_input_tokens_seen="non_padding", remove_unused_columns=False,
        ddp_find_unused_parameters=False, disable_tqdm=rank != 0,
    )


COUNTED_STEPS = ("the first step, from the start of training, and each later step with more token positions in a "
                 "micro-batch than any counted step's and at least the run's longest micro-batch as its batch order "
                 "foretold (where the peak can be); the others were not counted")


def fit(cfg: dict, job: Job, trainer, tensors, device: torch.device, resume: str | None, profiled: bool,
        evals=None) -> dict:
    """trainer.train() with its memory tracked and its energy counted at the ends (and profiled where asked):
    the train result, seconds (without the validations `evals` took between steps), memory, energy and profile."""
    with track_memory(device, tensors) as memory:
        profiler = None
        if profiled:
            profiler = profiling.Profiler(cfg["profile"], job.out / profiling.FOLDER, device)
            profiling.trainer_hooks(trainer, profiler)
        meter = EnergyMeter(device).start()  # two counter reads, at the ends: nothing in between
        t0 = time.perf_counter()
        result = trainer.train(resume_from_checkpoint=resume)
        # the tensor count's pauses and the validations between steps are not training
        seconds = time.perf_counter() - t0 - tensors.overhead_s - (evals.seconds if evals else 0.0)
        energy = meter.stop()
        profile = profiler.close() if profiler else None
    return {"result": result, "train_s": seconds, "memory": memory, "energy": energy, "profile": profile}


def save_model(model, tokenizer, run_cfg: dict, dtype: str, folder: Path, initial: str | None = None) -> None:
    """The full model in the base's dtype, or the peft adapter (its target modules sorted: a stable file); an
    adapter whose init left the base a residual (PiSSA, OLoRA, CorDA), converted against its `initial` state to one
    on the original base, which every later stage loads."""
    if run_cfg["method"] == "full":
        model.to(getattr(torch, dtype)).save_pretrained(folder, safe_serialization=True)
    else:
        model.save_pretrained(folder, safe_serialization=True,
                              **({"path_initial_model_for_weight_conversion": initial} if initial else {}))
        _sort_target_modules(folder / "adapter_config.json")
    tokenizer.save_pretrained(folder)


def throughput(r: Prepared, t: Trained, ceiling: dict, step_times, processed) -> dict:
    """Steady-state tokens/s, FLOPs per token and MFU against the measured ceiling and the published peak."""
    model, run_cfg, device, matmul_dtype = r.model, r.run_cfg, r.device, r.matmul_dtype
    tokens, samples, train_s = t.tokens, t.samples, t.done["train_s"]
    # Attention FLOPs per token over each sequence's own length (token-weighted), as the model computed them.
    attention_len = processed.attention_length() or tokens / samples
    flops = training_flops_per_token(model, attention_len, run_cfg["gradient_checkpointing"])
    published = published_peak_tflops(device, matmul_dtype)
    steady = steady_steps(step_times, run_cfg["timing_warmup_steps"])
    rate = steady["tokens_per_s"] or tokens / train_s
    return {
        "tokens_per_s": rate, "samples_per_s": samples / train_s, "whole_run_tokens_per_s": tokens / train_s,
        "measured_over": (f"{steady['steps']} steady steps ({steady['excluded_steps']} warm-up step(s) left out)"
                          if steady["tokens_per_s"] else "the whole run (no step timer)"),
        "tokens": "real (non-padding) input tokens", "flops": flops, "matmul_ceiling": ceiling,
        "mfu_vs_measured_ceiling": mfu(rate, flops["model_flops_per_token"], ceiling["tflops"]),
        "published_peak": published,
        "mfu_vs_published_peak": mfu(rate, flops["model_flops_per_token"], published["tflops"]),
    }, steady


@dataclass
class Prepared:
    """A run ready to train: its settings, process layout, precision, data and model."""
    run_cfg: dict
    world: int
    rank: int
    threads: int
    device: torch.device
    dtype: str
    precision: str
    tokenizer: object
    train_rows: list
    val_rows: list
    model: object
    params: dict
    matmul_dtype: str


def prepare(job: Job, run_cfg: dict) -> Prepared:
    """Threads, device, precision, seed, tokenizer, rows and the model to train (without a KV cache) of the run
    whose settings are `run_cfg`."""
    from transformers import set_seed

    world, rank, threads = _ranks_and_threads(job)
    device, dtype = job.device, job.dtype
    precision = mixed_precision(run_cfg, dtype, device)
    set_seed(run_cfg["seed"], deterministic=run_cfg["deterministic"])
    model = build_model(run_cfg, job.layout, dtype, device)
    # Training needs no KV cache, and with one transformers would not see packed rows' boundaries (it reads
    # them from the position ids only when there is no cache) and would let them attend to each other.
    model.config.use_cache = False
    params = count_parameters(model)
    log.info("%s: %s trainable of %s parameters (%.3f%%), precision %s", job.name, f"{params['trainable']:,}",
             f"{params['total']:,}", params["trainable_pct"], precision)
    return Prepared(run_cfg, world, rank, threads, device, dtype, precision, job.tokenizer,
                    read_split(job.layout.split("train")),
                    read_split(job.layout.split("validation"), run_cfg["eval_rows"]), model, params,
                    "bfloat16" if run_cfg["bf16_weights"] else {"bf16": "bfloat16", "fp16": "float16"}.get(
                        precision, "float32" if run_cfg["method"] == "full" else dtype))


def train(cfg: dict, job: Job, run_cfg: dict) -> dict:
    """The training itself, in this process (one DDP rank when launched by accelerate), of the run whose settings
    (finetune_run, resolved once a process) are `run_cfg`."""
    from transformers import Trainer

    from .callbacks import (
        KILL_ENV,
        CountLongestSteps,
        KillAfterCheckpoint,
        SequenceLengths,
        StepTimes,
        ValidationEvery,
        quiet_progress,
    )

    r = prepare(job, run_cfg)
    run_cfg, model, device = r.run_cfg, r.model, r.device
    if r.rank == 0:  # only rank 0 reports: the other ranks need neither the start loss nor the ceiling
        before = eval_loss(model, r.val_rows, run_cfg["batch_size"], r.tokenizer)
        ceiling = matmul_ceiling(r.matmul_dtype, device)
        log.info("%s: matmul ceiling %.3f TFLOP/s (%s, measured in this process)", job.name, ceiling["tflops"],
                 r.matmul_dtype)
    scratch, resume = checkpoints(job.layout, job.name, run_cfg, r.rank)
    initial = save_initial(model, scratch / "initial") if r.rank == 0 and run_cfg["method"] != "full" and \
        rewrites_base(lora_init(run_cfg["lora"])) else None
    profiled = r.rank == 0 and profiling.wanted(cfg, "finetune")
    on = run_cfg["instruments"]
    tensors = CpuTensorPeak(unavailable=profiling.REPLACES_TENSOR_PEAK if profiled else
                            None if on else "instruments: false (no live-tensor count)")
    step_times = StepTimes(device) if on else None
    callbacks = ([step_times] if on else []) + ([KillAfterCheckpoint()] if os.environ.get(KILL_ENV) else [])
    args = training_arguments(run_cfg, scratch, r.precision, device, r.rank)
    trainer = Trainer(model=model, args=args, optimizer_cls_and_kwargs=optimizer_cls_and_kwargs(run_cfg, args),
                      train_dataset=r.train_rows, data_collator=collator(run_cfg, r.tokenizer),
                      callbacks=callbacks)
    quiet_progress(trainer)
    lengths = [len(row["input_ids"]) for row in r.train_rows]
    counted = CountLongestSteps(tensors, trainer, None if r.world > 1 else longest_micro_batch(lengths, run_cfg)) \
        if on else None
    if counted:
        trainer.add_callback(counted)  # after StepTimes: it pauses once the step is timed
    phases = PhaseClock(device).attach(trainer, model) if os.environ.get(PHASES_ENV) and r.rank == 0 else None
    if phases and counted:  # the count's own starts and stops are its phase, not the loop's data or between
        phases.watch(tensors, "pause", "resume")
    resumed = _checkpoint_state(resume)
    if resume:
        log.info("%s: resuming from %s (step %d)", job.name, resume, resumed["global_step"])
    processed = SequenceLengths(model)
    target = cfg["finetune"].get("target")
    evals = ValidationEvery(target["every"], lambda m: eval_loss(m, r.val_rows, run_cfg["batch_size"], r.tokenizer),
                            step_times, processed, tensors) if target and r.rank == 0 else None
    if evals:
        trainer.add_callback(evals)  # after the step timer and the count: the validation is in neither
    prediction = training_peak(job.layout.base_model(), run_cfg, r.dtype, r.precision,  # from config and data only
                               lengths, device.type)
    done = fit(cfg, job, trainer, tensors, device, resume, profiled, evals)
    if counted and counted.steps:  # none where the count did not run (a GPU, a profiled run)
        done["memory"]["tensors"] |= counted.record() | {"counted": COUNTED_STEPS}
    processed.remove()
    if phases:  # the benchmark's phase clock (benchmarks/finetune_throughput.py)
        Path(os.environ[PHASES_ENV]).write_text(json.dumps({"steps": phases.steps()}))
    model.eval()
    after = eval_loss(model, r.val_rows, run_cfg["batch_size"], r.tokenizer)
    ranks = [{"rank": r.rank, "weights_sha256": _weights_sha256(model), "validation_after": after["loss"]}]
    if r.world > 1:
        gathered = [None] * r.world
        torch.distributed.all_gather_object(gathered, ranks[0])
        ranks = gathered
        if r.rank != 0:  # only rank 0 writes outputs and metrics
            return {}
    curve = write_loss_curve(trainer.state.log_history, job.out / LOSS_CSV)
    save_model(model, r.tokenizer, run_cfg, r.dtype, job.out / "model", initial)
    shutil.rmtree(scratch, ignore_errors=True)  # the run is complete: its step checkpoints are not needed
    steps = done["result"].global_step - resumed["global_step"]  # what this process trained (and timed)
    t = Trained(done, resumed, ranks, steps, trainer.state.num_input_tokens_seen - resumed["num_input_tokens_seen"],
                steps * run_cfg["batch_size"] * run_cfg["gradient_accumulation_steps"] * r.world, curve, before, after)
    rates, steady = throughput(r, t, ceiling, step_times, processed)
    log.info("%s: validation loss %.3f -> %.3f in %d steps, %.0f tokens/s (steady), MFU %.1f%% of the measured "
             "ceiling, peak %s MiB (%s)", job.name, before["loss"], after["loss"], steps, rates["tokens_per_s"],
             100 * rates["mfu_vs_measured_ceiling"], _fmt(done["memory"]["peak_mib"]), done["memory"]["kind"])
    return record(job.name, r, t, trainer, processed, rates, steady, prediction) | {
        "validation_curve": validation_curve(t, evals, step_times, target, run_cfg), "lora_init": _init_cost(model)}


# lora.init modes whose adapter starts as a no-op (B = 0) on the unchanged base: the model before training is the base
NO_OP_INITS = ("default", "gaussian", "eva")


def validation_curve(t: "Trained", evals, step_times, target: dict | None, run_cfg: dict) -> dict | None:
    """The validation loss at step 0, every `every` steps and the last step, each with the training seconds so far
    (time to quality: the report finds the first point at or below finetune.target). None without a target."""
    if evals is None:
        return None
    resumed = t.resumed["global_step"]
    last = {"step": resumed + t.steps, "loss": t.after["loss"],
            "train_s": sum(step_times.durations) if step_times else None}
    start = [] if resumed else [{"step": 0, "loss": t.before["loss"], "train_s": 0.0}]
    return {"every": target["every"], "points": start + evals.curve + [last],
            "counts": "training time: the timed steps' sum up to the point (validation outside it)",
            "validation_s": evals.seconds,
            # its step-0 loss is the base model's (auto targets are read from such a run)
            "starts_from_base": not resumed and not run_cfg.get("bf16_weights") and (
                run_cfg["method"] == "full" or run_cfg["method"] == "lora" and not run_cfg["lora"].get("use_dora")
                and (run_cfg["lora"].get("init") or "default") in NO_OP_INITS)}


def _init_cost(model) -> dict | None:
    """How the adapter was initialised and what it cost (lora_init.adapt); None for a full fine-tune."""
    return getattr(model, "efflab_init", None)


@dataclass
class Trained:
    """What a finished run did in this process: fit()'s result, where it resumed from, each rank's weights and
    loss, the steps, real tokens and samples it trained, its loss curve and the validation loss before and after."""
    done: dict
    resumed: dict
    ranks: list
    steps: int
    tokens: int
    samples: int
    curve: list
    before: dict
    after: dict


def record(name: str, r: Prepared, t: Trained, trainer, processed, rates: dict, steady: dict,
           prediction: dict) -> dict:
    """The run's metrics record."""
    run_cfg, done, train_s = r.run_cfg, t.done, t.done["train_s"]
    resumed, ranks, steps, tokens, samples = t.resumed, t.ranks, t.steps, t.tokens, t.samples
    curve, before, after = t.curve, t.before, t.after
    return {
        "run": name, "method": run_cfg["method"], "settings": run_cfg, "compute_dtype": r.dtype,
        "mixed_precision": r.precision, "threads": r.threads, "parameters": r.params,
        "processes": r.world, "ranks": ranks, "total_steps": done["result"].global_step,
        "effective_batch": run_cfg["batch_size"] * run_cfg["gradient_accumulation_steps"] * r.world,
        "padding_free": run_cfg["packing"], "tokens_processed": processed.positions,
        "pad_fraction": 1 - tokens / processed.positions if processed.positions else None,
        "resumed_from": resumed["global_step"] or None,
        "optimizer": optimizer_name(run_cfg),
        "attn_implementation": getattr(r.model.config, "_attn_implementation", None),
        "trainable_dtype": str(next(p.dtype for p in r.model.parameters() if p.requires_grad)).replace("torch.", ""),
        "optimizer_state_bytes": sum(t.numel() * t.element_size() for state in trainer.optimizer.state.values()
                                     for t in state.values() if torch.is_tensor(t)),
        "lora_scaling": _lora_scaling(r.model),
        "steps": steps, "train_s": train_s, "step_s": train_s / steps,
        "step_time": steady["step_time"], "steady": {k: v for k, v in steady.items() if k != "step_time"},
        "tokens_seen": tokens, "tokens_per_s": tokens / train_s, "samples_per_s": samples / train_s,
        "throughput": rates,
        "memory_prediction": compared(prediction, done["memory"]),
        "train_memory": done["memory"],
        "energy": energy_per_token(done["energy"], tokens) | {
            "counts": "the whole training loop, warm-up steps and the validations between steps included"},
        "profile": done["profile"],
        "first_loss": curve[0]["loss"], "last_loss": curve[-1]["loss"],
        "validation_before": before, "validation_after": after,
        "validation_loss_drop": before["loss"] - after["loss"],
        "environment": environment(r.device, run_cfg),
    }


def _sort_target_modules(path: Path) -> None:
    """peft keeps target_modules as a set and writes it in the set's order, which changes with Python's hash
    seed: sorted, two identical runs write identical adapter folders (and their provenance hashes agree)."""
    config = json.loads(path.read_text())
    if isinstance(config.get("target_modules"), list):
        config["target_modules"] = sorted(config["target_modules"])
        path.write_text(json.dumps(config, indent=2, sort_keys=True))


def _fmt(value) -> str:
    return "n/a" if value is None else f"{value:.0f}"


WORKER_FLAG = "--ddp-worker"


def worker_main(argv: list[str]) -> None:
    """Entry point of one `accelerate launch` rank: train, and on rank 0 hand the metrics back."""
    parser = argparse.ArgumentParser()
    for flag in ("--params", "--name", "--results", "--out", "--log"):
        parser.add_argument(flag)
    args = parser.parse_args(argv)
    rank = int(os.environ.get("RANK", 0))
    setup_child_logging(args.log, f"rank {rank}")
    cfg = config.load(args.params)
    out = Path(args.out)
    metrics = train(cfg, Job(Layout(Path(args.results)), args.name, out, out, args.params, "finetune",
                             cfg["runtime"]), finetune_run(cfg, args.name))
    if rank == 0:
        (out / "rank0_metrics.json").write_text(json.dumps(metrics, default=str))
