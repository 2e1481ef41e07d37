"""The finetune stage's statistics and its record (metrics.json): step times over the steady steps, throughput and
MFU, the validation curve, and the record assembled from the prepared run, what it trained and what measured it."""
from __future__ import annotations

from ...estimators.memory import compared
from ...experiment import FinetuneRun
from ...measure.energy import energy_per_token
from ...measure.env import environment
from ...measure.flops import mfu, published_peak_tflops, training_flops_per_token
from ...measure.stats import summarize
from ...training import optimizer_name
from .instruments import Instruments, Trained
from .prepared import PreparedRun

# lora.init modes whose adapter starts as a no-op (B = 0) on the unchanged base: the model before training is the base
NO_OP_INITS = ("default", "gaussian", "eva")


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


def throughput(run: PreparedRun, trained: Trained, gauges: Instruments) -> tuple[dict, dict]:
    """Steady-state tokens/s, FLOPs per token and MFU against the measured ceiling and the published peak."""
    tokens, samples, train_s = trained.tokens, trained.steps * run.effective_batch, trained.train_s
    # Attention FLOPs per token over each sequence's own length (token-weighted), as the model computed them.
    attention_len = gauges.processed.attention_length() or tokens / samples
    flops = training_flops_per_token(run.model, attention_len, run.run_cfg.gradient_checkpointing)
    published = published_peak_tflops(run.device, run.matmul_dtype)
    steady = steady_steps(gauges.step_times, run.run_cfg.timing_warmup_steps)
    rate = steady["tokens_per_s"] or tokens / train_s
    return {
        "tokens_per_s": rate, "samples_per_s": samples / train_s, "whole_run_tokens_per_s": tokens / train_s,
        "measured_over": (f"{steady['steps']} steady steps ({steady['excluded_steps']} warm-up step(s) left out)"
                          if steady["tokens_per_s"] else "the whole run (no step timer)"),
        "tokens": "real (non-padding) input tokens", "flops": flops, "matmul_ceiling": gauges.ceiling,
        "mfu_vs_measured_ceiling": mfu(rate, flops["model_flops_per_token"], gauges.ceiling["tflops"]),
        "published_peak": published,
        "mfu_vs_published_peak": mfu(rate, flops["model_flops_per_token"], published["tflops"]),
    }, steady


def validation_curve(gauges: Instruments, trained: Trained, after: dict, run_cfg: FinetuneRun) -> dict | None:
    """The validation loss at step 0, every `every` steps and the last step, each with the training seconds so far
    (time to quality: the report finds the first point at or below finetune.target). None without a target."""
    if gauges.evals is None:
        return None
    resumed = trained.resumed["global_step"]
    last = {"step": resumed + trained.steps, "loss": after["loss"],
            "train_s": sum(gauges.step_times.durations) if gauges.step_times else None}
    start = [] if resumed else [{"step": 0, "loss": gauges.before["loss"], "train_s": 0.0}]
    return {"every": gauges.target["every"], "points": start + gauges.evals.curve + [last],
            "counts": "training time: the timed steps' sum up to the point (validation outside it)",
            "validation_s": gauges.evals.seconds,
            # its step-0 loss is the base model's (auto targets are read from such a run)
            "starts_from_base": not resumed and not run_cfg.bf16_weights and (
                run_cfg.method == "full" or run_cfg.method == "lora" and not run_cfg.lora.get("use_dora")
                and run_cfg.lora_init in NO_OP_INITS)}


def _lora_scaling(model) -> float | None:
    """The scale peft applies to B·A (alpha/r, or alpha/sqrt(r) with rsLoRA), read from a LoRA layer."""
    for module in model.modules():
        scaling = getattr(module, "scaling", None)
        if isinstance(scaling, dict) and scaling:
            return float(next(iter(scaling.values())))
    return None


def _init_cost(model) -> dict | None:
    """How the adapter was initialised and what it cost (lora.adapt); None for a full fine-tune."""
    return getattr(model, "efflab_init", None)


def record(name: str, run: PreparedRun, trained: Trained, gauges: Instruments, after: dict, ranks: list) -> dict:
    """The run's metrics record: `after` is its validation loss after training, `ranks` each rank's weights and loss."""
    run_cfg, model, processed, before = run.run_cfg, run.model, gauges.processed, gauges.before
    steps, tokens, train_s, curve = trained.steps, trained.tokens, trained.train_s, trained.loss_curve
    rates, steady = throughput(run, trained, gauges)
    return {
        "run": name, "method": run_cfg.method, "settings": run_cfg.settings, "compute_dtype": run.dtype,
        "mixed_precision": run.precision, "threads": run.processes.threads, "parameters": run.params,
        "processes": run.processes.world, "ranks": ranks, "total_steps": trained.result.global_step,
        "effective_batch": run.effective_batch,
        "padding_free": run_cfg.packing, "tokens_processed": processed.positions,
        "pad_fraction": 1 - tokens / processed.positions if processed.positions else None,
        "resumed_from": trained.resumed["global_step"] or None,
        "optimizer": optimizer_name(run_cfg),
        "attn_implementation": getattr(model.config, "_attn_implementation", None),
        "trainable_dtype": str(next(p.dtype for p in model.parameters() if p.requires_grad)).replace("torch.", ""),
        "optimizer_state_bytes": trained.optimizer_state_bytes,
        "lora_scaling": _lora_scaling(model),
        "steps": steps, "train_s": train_s, "step_s": train_s / steps,
        "step_time": steady["step_time"], "steady": {k: v for k, v in steady.items() if k != "step_time"},
        "tokens_seen": tokens, "tokens_per_s": tokens / train_s, "samples_per_s": steps * run.effective_batch / train_s,
        "throughput": rates,
        "memory_prediction": compared(gauges.prediction, trained.memory),
        "train_memory": trained.memory,
        "energy": energy_per_token(trained.energy, tokens) | {
            "counts": "the whole training loop, warm-up steps and the validations between steps included"},
        "profile": trained.profile,
        "first_loss": curve[0]["loss"], "last_loss": curve[-1]["loss"],
        "validation_before": before, "validation_after": after,
        "validation_loss_drop": before["loss"] - after["loss"],
        "environment": environment(run.device, run_cfg.settings),
        "validation_curve": validation_curve(gauges, trained, after, run_cfg), "lora_init": _init_cost(model),
    }
