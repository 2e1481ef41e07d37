"""Stage finetune: full fine-tuning, LoRA or QLoRA with the HF Trainer and peft, one job per named run.

Records trainable/total parameters (4-bit aware), peak memory of training, real-token throughput,
the loss curve and validation loss before and after. Saves the peft adapter or the full model.
"""
from __future__ import annotations

import hashlib
import logging
import os
import shutil

import torch

from ...estimators.fit import assess, budget, finetune_prediction, measured_error, refusal, try_anyway
from ...experiment import FinetuneRun, finetune_run
from ...layout import Job
from ...lora import Refused
from ...measure.env import environment
from ...models.build import mixed_precision
from ...models.modeling import read_split
from ...registry import LOSS_CSV
from ...training import unavailable_knobs
from .instruments import Instruments
from .launch import launch_distributed
from .outputs import checkpoints, initial_adapter, save_model, write_loss_curve
from .prepared import PreparedRun
from .record import record

# transformers' training modules (trainer_utils, TrainingArguments, set_seed, the Trainer) and .callbacks (its
# TrainerCallbacks) bring accelerate, peft and bitsandbytes with them, 5-10 s of imports on 2 cores, and bitsandbytes
# asks CUDA for the device capability at import, which initialises CUDA: each is imported inside the function that
# uses it (in this package's modules), after cli.main has given the process its GPU (gpu_slots.assign sets
# CUDA_VISIBLE_DEVICES, which CUDA reads once, as it initialises); importing this package (the tests do) loads none
# of them.

log = logging.getLogger("efflab")


def run(cfg: dict, job: Job) -> dict:
    """Fine-tune one named run and measure what it cost and bought (DDP when num_processes > 1).
    A run the device cannot do is recorded as unavailable with the reason; one that fails or runs out of
    memory is recorded by cli.main (the grid goes on); bad params still stop with an error."""
    run_cfg = finetune_run(cfg, job.name)
    device = job.device
    missing = unavailable_knobs(run_cfg, device)
    if missing:
        return unavailable(job, run_cfg, "; ".join(missing))
    if run_cfg.num_processes * run_cfg.num_machines > 1 or run_cfg.accelerate_config:
        if "LOCAL_RANK" not in os.environ:
            return launch_distributed(run_cfg, job)
    fit = memory_fit(cfg, job, run_cfg)
    if (why := refusal(fit)) and not try_anyway(cfg):
        return unavailable(job, run_cfg, why) | {"memory_fit": fit}
    try:
        trained = train(cfg, job, run_cfg)
    except Refused as err:  # peft cannot initialise the adapter this way for this model
        return unavailable(job, run_cfg, str(err))
    return trained and trained | {"memory_fit": fit}


def memory_fit(cfg: dict, job: Job, run_cfg: FinetuneRun) -> dict:
    """The run's predicted peak against the device's memory (estimators.fit, as the dry run said it), on its rows,
    before its model loads."""
    device, folder = job.device, job.layout.base_model()
    lengths = [len(row["input_ids"]) for row in read_split(job.layout.split("train"))]
    prediction = finetune_prediction(folder, run_cfg, job.dtype, mixed_precision(run_cfg, job.dtype, device), lengths,
                                     device.type)
    return assess(prediction, budget(cfg["runtime"], device.type), measured_error(job.layout.root))


def unavailable(job: Job, run_cfg: FinetuneRun, reason: str) -> dict:
    """The record of a run this device or model cannot do as asked, with the reason."""
    job.layout.write_not_run("finetune", job.out, "unavailable", reason)
    log.warning("%s: unavailable: %s", job.name, reason)
    return {"status": "unavailable", "reason": reason, "run": job.name, "method": run_cfg.method,
            "settings": run_cfg.settings, "environment": environment(job.device, run_cfg.settings)}


def train(cfg: dict, job: Job, run_cfg: FinetuneRun) -> dict:
    """The training itself, in this process (one DDP rank when launched by accelerate), of the run whose settings
    (finetune_run, resolved once a process) are `run_cfg`."""
    prepared = PreparedRun.prepare(job, run_cfg)
    main, model = prepared.processes.main, prepared.model
    gauges = Instruments(cfg, job, prepared)
    scratch, resume = checkpoints(job.layout, job.name, run_cfg, prepared.processes.rank)
    initial = initial_adapter(model, run_cfg, scratch / "initial") if main else None
    trainer = prepared.trainer(scratch, gauges.callbacks())
    gauges.attach(trainer)
    trained = gauges.fit(trainer, resume)
    model.eval()
    after = prepared.validation_loss(model)
    ranks = _ranks(prepared, after)
    if not main:  # only rank 0 writes outputs and metrics
        return {}
    write_loss_curve(trained.loss_curve, job.out / LOSS_CSV)
    save_model(model, prepared.tokenizer, run_cfg, prepared.dtype, job.out / "model", initial)
    shutil.rmtree(scratch, ignore_errors=True)  # the run is complete: its step checkpoints are not needed
    metrics = record(job.name, prepared, trained, gauges, after, ranks)
    rates, memory = metrics["throughput"], metrics["train_memory"]
    log.info("%s: validation loss %.3f -> %.3f in %d steps, %.0f tokens/s (steady), MFU %.1f%% of the measured "
             "ceiling, peak %s MiB (%s)", job.name, gauges.before["loss"], after["loss"], trained.steps,
             rates["tokens_per_s"], 100 * rates["mfu_vs_measured_ceiling"], _fmt(memory["peak_mib"]), memory["kind"])
    return metrics


def _ranks(prepared: PreparedRun, after: dict) -> list[dict]:
    """Each rank's trained weights (a hash) and validation loss after training, gathered from every rank."""
    ranks = [{"rank": prepared.processes.rank, "weights_sha256": _weights_sha256(prepared.model),
              "validation_after": after["loss"]}]
    if prepared.processes.world > 1:
        gathered = [None] * prepared.processes.world
        torch.distributed.all_gather_object(gathered, ranks[0])
        ranks = gathered
    return ranks


def _weights_sha256(model) -> str:
    digest = hashlib.sha256()
    for name, p in sorted(model.named_parameters()):
        if p.requires_grad:
            digest.update(name.encode())
            digest.update(p.detach().float().cpu().numpy().tobytes())
    return digest.hexdigest()[:16]


def _fmt(value) -> str:
    return "n/a" if value is None else f"{value:.0f}"
