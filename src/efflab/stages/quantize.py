"""Stage quantize: post-training quantization of the base model, one job per scheme (bitsandbytes, torchao, HQQ).

Each job loads the base folder with the scheme's quantization config (efflab.models.quantization), saves the quantized
folder (safetensors), reloads it and evaluates validation perplexity on the same rows as the baseline scheme
(method none), whose job every other scheme's job waits for, so the change is measured against it. Then it
tries a LoRA adapter on the reloaded model: whether peft trains one and merges it back. A scheme whose library or
kernel this machine lacks records `unavailable` with the reason.
"""
from __future__ import annotations

import logging
import time

import torch

from .. import cli, quality, records
from ..layout import Job
from ..lora import lora_config
from ..measure.device import DTYPES
from ..measure.env import environment
from ..measure.flops import count_parameters
from ..measure.memory import track_memory
from ..models import quantization
from ..models.modeling import batches, eval_loss, folder_bytes, load_model, read_split
from ..schemes import weight_bits

# peft brings accelerate and bitsandbytes with it, 5-10 s of imports on 2 cores, and bitsandbytes asks CUDA for the
# device capability at import, which initialises CUDA: it is imported inside adapter_check, after cli.main has given
# the process its GPU (gpu_slots.assign sets CUDA_VISIBLE_DEVICES, which CUDA reads once, as it initialises).

log = logging.getLogger("efflab")


def run(cfg: dict, job: Job) -> dict:
    """Quantize the base model with one scheme and measure footprint, load time and perplexity."""
    q = cfg["quantize"]
    scheme = q["schemes"][job.name]
    layout = job.layout
    device, dtype, tokenizer = job.device, job.dtype, job.tokenizer
    rows = read_split(layout.split("validation"), q["eval_rows"])
    described = {"scheme": job.name, "method": scheme["method"], "library": quantization.library(scheme),
                 "weight_bits": weight_bits(scheme), "environment": environment(device, q)}

    baseline = cfg["report"]["baseline_scheme"]
    skipped = job.name != baseline and layout.skipped_because([f"quantize/{baseline}"])
    if skipped:  # no reference to measure the change against
        layout.write_not_run("quantize", job.out, skipped["status"], skipped["reason"])
        return {**skipped, **described}
    try:
        quantization.config(scheme, DTYPES[dtype], device)
    except quantization.Unavailable as err:
        log.warning("%s: unavailable: %s", job.name, err)
        layout.write_not_run("quantize", job.out, "unavailable", str(err))
        return {"status": "unavailable", "reason": str(err), **described}
    reference = None if job.name == baseline else records.read(layout, "quantize", baseline)
    return described | measure(cfg, job, scheme, rows, tokenizer, dtype, device, reference)


def calibration(layout, scheme: dict, tokenizer) -> dict | None:
    """The training rows, as text, a scheme that learns from data (gptq) quantizes on; None for the others."""
    if scheme["method"] != "gptq":
        return None
    rows = read_split(layout.split("train"), scheme.get("calibration_rows", 128))
    return {"texts": [tokenizer.decode(r["input_ids"]) for r in rows], "tokenizer": str(layout.base_model())}


def measure(cfg: dict, job: Job, scheme: dict, rows: list[dict], tokenizer, dtype: str, device, reference) -> dict:
    """Quantize, save, reload, then the footprint, the perplexity against the baseline's, and the adapter check."""
    q = cfg["quantize"]
    with track_memory(device) as load_mem:
        t0 = time.perf_counter()
        model = load_model(job.layout.base_model(), dtype, device, quant=scheme,
                           calibration=calibration(job.layout, scheme, tokenizer))
        quantize_s = time.perf_counter() - t0
    folder = job.out / "model"
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    del model

    t0 = time.perf_counter()
    model = load_model(folder, dtype, device)
    load_s = time.perf_counter() - t0
    parts = quantization.quantized_parts(model)
    with track_memory(device) as eval_mem:
        scheme_eval = eval_loss(model, rows, q["batch_size"], tokenizer)
    footprint = quantization.footprint_bytes(model)
    base_eval = reference["validation"] if reference else scheme_eval
    base_footprint = reference["memory_footprint_bytes"] if reference else footprint
    log.info("%s: footprint %.1f MiB (%.2fx smaller), perplexity %.3f vs %.3f base",
             job.name, footprint / 2**20, base_footprint / footprint,
             scheme_eval["perplexity"], base_eval["perplexity"])
    parameters = count_parameters(model)["total"]
    del model  # the check trains on a fresh copy (adapter_check: never run in eval mode before its step)
    adapter = adapter_check(load_model(folder, dtype, device), rows, tokenizer, cfg["finetune"]["defaults"]["lora"])
    log.info("%s: a LoRA adapter %s on it%s", job.name, "trains" if adapter["trains"] else "does not train",
             "" if not adapter["trains"] else " and merges back" if adapter["merges"] else " but does not merge back")
    return {
        "double_quant": scheme.get("double_quant", False), "group_size": scheme.get("group_size"),
        "compute_dtype": dtype, "quantized_parts": parts,
        "bnb_layer_types": sorted(k for k in parts if k.startswith("Linear")),
        "parameters": parameters,
        "memory_footprint_bytes": footprint, "base_memory_footprint_bytes": base_footprint,
        "footprint_ratio_vs_base": base_footprint / footprint,
        "bytes_on_disk": folder_bytes(folder), "quantize_s": quantize_s, "load_s": load_s,
        "quantize_memory": load_mem, "eval_memory": eval_mem,
        "validation": scheme_eval, "base_validation": base_eval,
        "perplexity_change_pct": 100.0 * (scheme_eval["perplexity"] / base_eval["perplexity"] - 1.0),
        "perplexity_change": quality.paired_change(base_eval["per_row"], scheme_eval["per_row"]),
        "adapter": adapter,
    }


def adapter_check(model, rows: list[dict], tokenizer, lora: dict) -> dict:
    """Whether peft trains a LoRA adapter on the quantized model and merges it back into it, both tried, not assumed:
    one Adam step on a batch moves the adapter off its zero start, then `merge_and_unload`. The merge holds when
    the merged model's logits are nearer the adapter's than the model's own were (a re-quantized merge rounds
    the update, so it is not exact). `model`: freshly loaded, never run in eval mode, for the step runs first, in
    training mode: on a CPU with AVX512-BF16, bitsandbytes repacks a 4-bit layer for an inference-only kernel
    (gemv_4bit, no autograd: the gradient through the frozen layers would be wrong) at its first eval-mode forward.
    Leaves `model` merged."""
    from peft import get_peft_model

    batch = {k: v.to(model.device) for k, v in next(batches(rows[:2], 2, tokenizer)).items()}
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    adapter = lora_config(model.config, lora, model)  # the adapter fine-tuning would train
    settings = {"r": adapter.r, "lora_alpha": adapter.lora_alpha,
                "target_modules": sorted(adapter.target_modules) if isinstance(adapter.target_modules, set)
                else adapter.target_modules}
    try:
        adapted = get_peft_model(model, adapter).train()
        trainable = [p for p in adapted.parameters() if p.requires_grad]
        adapted(**inputs, labels=batch["labels"]).loss.backward()
        grads = [p.grad for p in trainable if p.grad is not None]
        if not grads or not all(torch.isfinite(g).all() for g in grads) or not any(g.abs().sum() > 0 for g in grads):
            return {"trains": False, "reason": "the adapter's gradients are missing, zero or not finite"}
        torch.optim.Adam(trainable, lr=1e-2).step()
    except Exception as err:  # peft's message is the reason: an unsupported layer type, a frozen dtype
        return {"trains": False, "reason": f"{type(err).__name__}: {err}"[:300]}
    adapted.eval()  # LoRA dropout would make these logits noise
    with torch.no_grad():
        with adapted.disable_adapter():
            own = adapted(**inputs).logits.float()
        tuned = adapted(**inputs).logits.float()
        try:
            merged = adapted.merge_and_unload()(**inputs).logits.float()
        except Exception as err:
            return {"trains": True, "merges": False, "reason": f"merge: {type(err).__name__}: {err}"[:300]}
    effect, error = (tuned - own).abs().max().item(), (merged - tuned).abs().max().item()
    return {"trains": True, "merges": error < effect, "adapter_effect_max_abs_logit": effect,
            "merge_error_max_abs_logit": error, "max_abs_logit": tuned.abs().max().item(), "lora": settings}


if __name__ == "__main__":
    cli.main("quantize", run)
