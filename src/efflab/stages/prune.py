"""Stage prune: structured pruning of attention heads and whole decoder layers, one job per strategy.

Heads come off the q/k/v and output projections and layers out of the stack for real, and the pruned model is
rebuilt from its smaller config and saved, so that plain transformers loads the folder and parameter count,
footprint and latency shrink (the seed's pruning function only addressed the weights and changed nothing).
Removing layers needs only the family's stack of decoder layers; removing heads needs an attention whose heads
prune can cut and a config that can describe fewer of them (models.pruning.cut_plan), else the strategy is
unavailable.
Grouped-query attention is respected: every layer must keep the same number of key/value heads and of query
heads per key/value head, so the query-head count a strategy asks for is met by the nearest count that
shape allows (both are recorded). Which heads and layers go is decided by `prune.importance`:
`activation_norm` (measured on calibration rows: each query head's mean output norm, the input of the output projection;
each layer's block influence, 1 - cos(hidden in, hidden out), as in ShortGPT) or `seed` (the seed's order:
the last heads of every group, the last layers). Each job measures the base and the pruned model in the
same process: parameters, footprint, validation perplexity, a sample generation, and greedy-generation
latency timed interleaved (measure.timing.interleave), so the speedup has an interval.

Healing (`prune.heal`, off with steps: 0): a short LoRA fine-tune of the pruned model on the training rows
(peft; the step is training.training_step), merged back into its weights and saved as healed/, a folder of the
same smaller shape that plain transformers loads; its validation perplexity and sample sit beside the pruned
model's.
"""
from __future__ import annotations

import copy
import logging
import math
import tempfile
from pathlib import Path

import torch

from .. import cli, quality
from ..layout import NOT_RUN, Job
from ..lora import Refused, lora_config, lora_refusal
from ..measure.env import environment
from ..measure.flops import count_parameters
from ..measure.stats import speedup
from ..measure.timing import INTERLEAVE_RECORD, SENTINEL_TOLERANCE, interleave
from ..models.modeling import eval_loss, folder_bytes, forward_batches, load_model, read_split
from ..models.pruning import Unprunable, attention_modules, attention_shape, cut_plan, layer_stack, prune
from ..registry import HEALED
from ..training import StepRun, batches, training_step

# transformers and peft take seconds to import: they are imported inside the functions that use them.

log = logging.getLogger("efflab")


def importance(model, rows: list[dict], tokenizer, how: str) -> dict:
    """Per layer, each query head's importance, and each layer's: measured on `rows` (activation_norm) or
    the seed's order (earlier heads and layers first). A family whose attention prune does not recognise has
    its layers measured, and no head scores (None)."""
    layers, heads, _, head_dim = attention_shape(model.config)
    if how == "seed":
        return {"heads": [[float(heads - h) for h in range(heads)] for _ in range(layers)],
                "layers": [float(layers - i) for i in range(layers)]}
    head_norm = torch.zeros(layers, heads, dtype=torch.float64)
    influence = torch.zeros(layers, dtype=torch.float64)
    tokens = [0]
    hooks = []
    try:
        where = attention_modules(model)
    except Unprunable:
        where = None

    def on_output(i):
        def hook(module, args):
            x = args[0].detach().float()
            norms = x.reshape(*x.shape[:-1], heads, head_dim).norm(dim=-1)  # [batch, seq, heads]
            head_norm[i] += norms.reshape(-1, heads).sum(0).double()
        return hook

    def on_layer(i):
        def hook(module, args, kwargs, output):
            h_in = (args[0] if args else kwargs["hidden_states"]).detach().float()
            h_out = (output[0] if isinstance(output, tuple) else output).detach().float()
            cos = torch.nn.functional.cosine_similarity(h_in, h_out, dim=-1)
            influence[i] += (1 - cos).sum().double()
            if i == 0:
                tokens[0] += cos.numel()
        return hook

    for i, layer in enumerate(model.get_submodule(layer_stack(model))):
        if where:
            output = model.get_submodule(f"{where['attention'][i]}.{where['output']}")
            hooks.append(output.register_forward_pre_hook(on_output(i)))
        hooks.append(layer.register_forward_hook(on_layer(i), with_kwargs=True))
    try:
        with torch.no_grad():
            for _ in forward_batches(model, rows, 4, tokenizer):
                pass
    finally:
        for h in hooks:
            h.remove()
    # Padding positions are counted alike for every head and layer, so they do not change the order.
    return {"heads": (head_norm / max(tokens[0], 1)).tolist() if where else None,
            "layers": (influence / max(tokens[0], 1)).tolist()}


def generate(model, inputs: dict, new_tokens: int, pad_token_id: int) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(**inputs, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                              num_beams=1, pad_token_id=pad_token_id)


def heal(pruned, h: dict, tokenizer, rows: list[dict], dtype: str, device: torch.device, scratch: str):
    """A LoRA fine-tune of a copy of `pruned` for h["steps"] steps, merged back: (healed model, its record)."""
    from peft import get_peft_model
    from transformers import set_seed

    set_seed(h["seed"])
    lora = h["lora"]
    model = copy.deepcopy(pruned)
    try:
        model = get_peft_model(model, lora_config(pruned.config, lora, model))
    except ValueError as err:  # peft's refusal of the targets, or of dropout on fused expert weights
        raise Refused(lora_refusal(model, err)) from None
    run = StepRun.of(h)
    step, precision = training_step(run, model, dtype, device, batches(run, tokenizer, rows, run.steps, device),
                                    scratch)
    losses = [step(i).item() for i in range(h["steps"])]
    healed = model.merge_and_unload().eval()
    healed.config.use_cache = True
    return healed, {"steps": h["steps"], "first_loss": losses[0], "last_loss": losses[-1], "losses": losses,
                    "mixed_precision": precision, "lora": lora, "learning_rate": h["learning_rate"]}


def healed_model(p: dict, pruned, tokenizer, layout, dtype: str, device: torch.device, folder: Path):
    """The healed model saved to `folder` and its record; with prune.heal.steps 0, a folder saying so."""
    if not p["heal"]["steps"]:
        folder.mkdir()
        (folder / NOT_RUN).write_text("disabled: prune.heal.steps is 0\n")
        return None, {"status": "disabled", "reason": "prune.heal.steps is 0"}
    try:
        with tempfile.TemporaryDirectory() as scratch:
            healed, healing = heal(pruned, p["heal"], tokenizer, read_split(layout.split("train")), dtype, device,
                                   scratch)
    except Refused as err:  # peft cannot adapt the pruned model with prune.heal.lora: the pruned figures stand
        folder.mkdir()
        (folder / NOT_RUN).write_text(f"unavailable: {err}\n")
        return None, {"status": "unavailable", "reason": f"prune.heal.lora: {err}"}
    healed.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    return healed, healing


def timed_generation(p: dict, base, pruned, tokenizer, device: torch.device, figures: dict):
    """The seed's prompt generated by the pruned and the base model, interleaved: the timing, the speedup and a
    function giving any model's greedy answer. Each model's times and answer go into `figures`."""
    chat = tokenizer.apply_chat_template([{"role": "user", "content": p["prompt"]}], add_generation_prompt=True,
                                         tokenize=False)
    inputs = tokenizer(chat, return_tensors="pt", add_special_tokens=False).to(device)
    n, pad = p["max_new_tokens"], tokenizer.pad_token_id or tokenizer.eos_token_id
    timed = interleave({"pruned": lambda r: generate(pruned, inputs, n, pad),
                        "base": lambda r: generate(base, inputs, n, pad)}, p["repeats"], device, warmup=1,
                       tolerance=SENTINEL_TOLERANCE)
    prompt_len = inputs["input_ids"].shape[1]

    def sample(model) -> str:
        return tokenizer.decode(generate(model, inputs, n, pad)[0, prompt_len:], skip_special_tokens=True)
    for which, model in (("base", base), ("pruned", pruned)):
        figures[which]["generation_s"] = timed["variants"][which]
        figures[which]["sample"] = sample(model)
    return timed, speedup(timed, "pruned", "base"), sample


def run(cfg: dict, job: Job) -> dict:
    """Prune the base model with one strategy; measure the pruned model against the base in this process."""
    p, layout = cfg["prune"], job.layout
    strategy = p["strategies"][job.name]
    device, dtype, tokenizer = job.device, job.dtype, job.tokenizer
    rows = read_split(layout.split("validation"), p["eval_rows"])
    calibration = read_split(layout.split("train"), p["calibration_rows"])
    base = load_model(layout.base_model(), dtype, device)
    try:
        cut_plan(base, strategy)
    except Unprunable as why:
        reason = str(why)
        log.warning("%s: unavailable: %s", job.name, reason)
        layout.write_not_run("prune", job.out, "unavailable", reason)
        return {"status": "unavailable", "reason": reason, "strategy": job.name, "settings": strategy,
                "environment": environment(device, p)}
    scores = importance(base, calibration, tokenizer, p["importance"])
    pruned, kept = prune(base, strategy, scores)
    if kept["heads"] != kept["target_heads"]:
        log.info("%s: %g query heads asked for, %d kept: grouped-query attention allows %d key/value heads x "
                 "1..%d query heads each", job.name, kept["target_heads"], kept["heads"],
                 attention_shape(base.config)[2], attention_shape(base.config)[1] // attention_shape(base.config)[2])
    folder = job.out / "model"
    pruned.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    healed, healing = healed_model(p, pruned, tokenizer, layout, dtype, device, job.out / HEALED)
    figures = {}
    for which, model in (("base", base), ("pruned", pruned)):
        figures[which] = {"parameters": count_parameters(model)["total"],
                          "memory_footprint_bytes": model.get_memory_footprint(),
                          "validation": eval_loss(model, rows, 4, tokenizer)}
    timed, faster, sample = timed_generation(p, base, pruned, tokenizer, device, figures)
    if healed is not None:
        healing |= {"status": "ok", "parameters": count_parameters(healed)["total"],
                    "validation": (healed_eval := eval_loss(healed, rows, 4, tokenizer)),
                    "perplexity_change": quality.paired_change(figures["base"]["validation"]["per_row"],
                                                               healed_eval["per_row"]),
                    "sample": sample(healed)}
    b, q = figures["base"], figures["pruned"]
    ppl_change = 100 * (q["validation"]["perplexity"] / b["validation"]["perplexity"] - 1)
    q["perplexity_change"] = quality.paired_change(b["validation"]["per_row"], q["validation"]["per_row"])
    log.info("%s: %d layers x %d heads (%d kv): %s -> %s parameters, perplexity %.2f -> %.2f (%+.0f%%), "
             "generation %.2fx the base's speed", job.name, kept["layers"], kept["heads"], kept["kv_heads"],
             f"{b['parameters']:,}", f"{q['parameters']:,}", b["validation"]["perplexity"],
             q["validation"]["perplexity"], ppl_change, faster["median"] or math.nan)
    return {
        "strategy": job.name, "settings": strategy, "importance": p["importance"], "dtype": dtype,
        "kept": kept, "base": b, "pruned": q, "parameter_ratio": q["parameters"] / b["parameters"],
        "footprint_ratio": q["memory_footprint_bytes"] / b["memory_footprint_bytes"],
        "perplexity_change_pct": ppl_change, "generation_speedup": faster, "new_tokens": p["max_new_tokens"],
        "healing": healing,
        "interleaved": {k: timed[k] for k in INTERLEAVE_RECORD},
        "bytes_on_disk": folder_bytes(folder), "environment": environment(device, p),
    }


if __name__ == "__main__":
    cli.main("prune", run)
