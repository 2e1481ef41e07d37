"""Stage merge: fold a LoRA/QLoRA adapter into its base and check that the merge keeps the fine-tune.

The reference is the adapter on the base it was trained against: the full-precision base for LoRA,
the 4-bit base for QLoRA. The merge target is the base in merge.dtype; for QLoRA it is the
dequantized 4-bit base (the weights the adapter actually saw), not the original weights.
Fidelity: max |logit difference| between reference and merged on validation rows, and both
validation perplexities; the same again for the merged folder as saved (in the base dtype).
"""
from __future__ import annotations

import logging
from functools import partial

import torch

from .. import cli, quality
from ..experiment import finetune_run
from ..layout import Job
from ..measure.env import environment
from ..models.modeling import forward_batches, load_model, read_split, row_nll, rows_summary
from ..registry import built_on

# peft takes seconds to import: it is imported inside the functions that use it.

log = logging.getLogger("efflab")


def kl_per_token(ref: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """KL(reference || model) of the next-token distributions, one value per position."""
    ref_logp, logp = torch.log_softmax(ref.float(), -1), torch.log_softmax(logits.float(), -1)
    return (ref_logp.exp() * (ref_logp - logp)).sum(-1)


def reference_logits(model, rows, batch_size, tokenizer) -> tuple[list[torch.Tensor], dict]:
    kept, per_row = [], []
    for batch, logits in forward_batches(model, rows, batch_size, tokenizer):
        per_row += row_nll(logits, batch["labels"])
        kept.append(logits[batch["attention_mask"].bool()].float())
    return kept, rows_summary(per_row)


def compare(model, reference: list[torch.Tensor], reference_eval: dict, rows, batch_size, tokenizer) -> dict:
    """Max |logit difference| and mean KL vs the reference over every real token (with the reference's largest |logit|,
    the scale a rounding difference is relative to), the perplexity, and its change over the reference's paired row
    by row (quality.paired_change)."""
    worst, kl_sum, positions, per_row = 0.0, 0.0, 0, []
    scale = max(r.abs().max().item() for r in reference)  # what a difference from rounding is relative to
    for (batch, logits), ref in zip(forward_batches(model, rows, batch_size, tokenizer), reference):
        per_row += row_nll(logits, batch["labels"])
        mine = logits[batch["attention_mask"].bool()].float()
        worst = max(worst, (mine - ref).abs().max().item())
        kl_sum, positions = kl_sum + kl_per_token(ref, mine).sum().item(), positions + len(ref)
    return {"max_abs_logit_diff": worst, "reference_max_abs_logit": scale, "kl_mean": kl_sum / positions,
            "validation": rows_summary(per_row),
            "perplexity_change": quality.paired_change(reference_eval["per_row"], per_row)}


def round_trip_base(folder, dtype: str, device, quant: dict) -> tuple[torch.nn.Module, int]:
    """The base as the QLoRA adapter saw it, in `dtype`, and how many layers went through the 4-bit round trip.

    Each layer that the 4-bit base holds as a bitsandbytes Linear4bit gets bitsandbytes' dequantize_4bit of that
    layer's own 4-bit weight, with the QuantState (quant type, blocksize, double quant) it was stored with: the
    quantize half of the round trip is the one loading did (bitsandbytes' quantize_4bit with the scheme's settings),
    so these are exactly the weights the adapter trained against. Layers that loading left in full precision stay
    as they are.

    Not transformers' dequantize(): in transformers 5.23 its dequantize_and_replace (integrations/bitsandbytes.py)
    sets `has_been_replaced` only inside its loop, so a model without a Linear4bit raises UnboundLocalError. Falcon
    is one: replace_with_bnb_linear converts only modules whose type is exactly nn.Linear (or Conv1D), and
    Falcon's FalconLinear subclasses it, so its QLoRA base is not 4-bit at all. dequantize() also turns GPT-2's
    Conv1D layers into nn.Linear, which their class cannot load; writing into the base as loaded keeps them."""
    import bitsandbytes as bnb
    from transformers.pytorch_utils import Conv1D

    target = load_model(folder, dtype, device)
    four_bit = load_model(folder, dtype, device, quant=quant)
    replayed = 0
    with torch.no_grad():
        for name, module in four_bit.named_modules():
            if isinstance(module, bnb.nn.Linear4bit):
                weight = bnb.functional.dequantize_4bit(module.weight.data, module.weight.quant_state)
                layer = target.get_submodule(name)
                layer.weight.copy_(weight.T if isinstance(layer, Conv1D) else weight)  # Conv1D stores in x out
                replayed += 1
    return target, replayed


def merged_into(target, adapter, merge_dtype: str):
    """The adapter merged into `target` (a base model) in merge_dtype."""
    from peft import PeftModel

    target = target.to(getattr(torch, merge_dtype))
    return PeftModel.from_pretrained(target, adapter).merge_and_unload().eval()


def merge_targets(job: Job, quant: dict, adapter, merge_dtype: str, check, in_memory: dict) -> dict:
    """Which merge keeps the fine-tune? The QLoRA adapter merged into the original base, into the 4-bit round-trip
    base (`in_memory`, the saved folder's merge), and that merge re-quantized, each compared by `check`."""
    dtype, device, folder = job.dtype, job.device, job.out / "model"
    targets = {}
    naive = merged_into(load_model(job.layout.base_model(), dtype, device), adapter, merge_dtype)
    targets["original base"] = check(naive)
    del naive
    targets[f"{quant['method']} round-trip base"] = in_memory
    requantized = load_model(folder, dtype, device, quant=quant)
    targets[f"round-trip merge re-quantized to {quant['method']}"] = check(requantized)
    del requantized
    for target, result in targets.items():
        log.info("%s: merged into the %s: max |logit diff| %.3e, KL %.3e, perplexity %.3f", job.name, target,
                 result["max_abs_logit_diff"], result["kl_mean"], result["validation"]["perplexity"])
    return targets


def run(cfg: dict, job: Job) -> dict:
    """Merge one adapter run and measure the fidelity of the merged model."""
    from peft import PeftModel

    name, layout, m = job.name, job.layout, cfg["merge"]
    run_cfg = finetune_run(cfg, name)
    device = job.device
    skipped = layout.skipped_because(built_on(cfg, "merge", name))
    if skipped:
        layout.write_not_run("merge", job.out, skipped["status"], skipped["reason"])
        return {**skipped, "run": name, "method": run_cfg.method, "environment": environment(device, m)}
    dtype, tokenizer = job.dtype, job.tokenizer
    rows = read_split(layout.split("validation"), m["eval_rows"])
    batch_size = run_cfg.batch_size
    adapter = layout.model("finetune", name)

    quant = run_cfg.base_quant
    base = load_model(layout.base_model(), m["dtype"] if quant is None else dtype, device, quant=quant)
    reference = PeftModel.from_pretrained(base, adapter).eval()
    ref_logits, ref_eval = reference_logits(reference, rows, batch_size, tokenizer)
    del reference, base

    if quant is None:
        target, replayed = load_model(layout.base_model(), m["dtype"], device), None
    else:
        target, replayed = round_trip_base(layout.base_model(), dtype, device, quant)
        if not replayed:
            log.warning("%s: the %s base has no 4-bit layer (transformers gives bitsandbytes only plain nn.Linear "
                        "and Conv1D layers): the adapter was trained on full-precision weights, and they are the "
                        "merge target", name, quant["method"])
    merged = merged_into(target, adapter, m["dtype"])
    check = partial(compare, reference=ref_logits, reference_eval=ref_eval, rows=rows, batch_size=batch_size,
                    tokenizer=tokenizer)
    in_memory = check(merged)

    folder = job.out / "model"
    merged.to(getattr(torch, dtype)).save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    del merged
    saved = check(load_model(folder, dtype, device))
    targets = merge_targets(job, quant, adapter, m["dtype"], check, in_memory) if quant is not None else {}
    log.info("%s: merged max |logit diff| %.2e (%s), saved in %s %.2e; perplexity %.3f adapter vs %.3f merged",
             name, in_memory["max_abs_logit_diff"], m["dtype"], dtype, saved["max_abs_logit_diff"],
             ref_eval["perplexity"], in_memory["validation"]["perplexity"])
    return {
        "run": name, "method": run_cfg.method,
        "reference": "adapter on the 4-bit base it was trained on" if quant else "adapter on the base",
        "merge_target": f"dequantized {quant['method']} base" if quant else "full-precision base",
        "merge_dtype": m["dtype"], "saved_dtype": dtype, "round_trip_layers": replayed,
        "adapter_validation": ref_eval, "merged": in_memory, "merged_saved": saved,
        "targets": targets, "closest_target": min(targets, key=lambda t: targets[t]["kl_mean"]) if targets else None,
        "environment": environment(device, m),
    }


if __name__ == "__main__":
    cli.main("merge", run)
