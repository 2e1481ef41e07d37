"""Stage prune: structured pruning of attention heads and whole decoder layers, one job per strategy.

Heads come off the q/k/v/o projections and layers out of the stack for real, and the pruned model is
rebuilt from its smaller config and saved, so that plain transformers loads the folder and parameter count,
footprint and latency shrink (the seed's pruning function only addressed the weights and changed nothing).
Grouped-query attention is respected: every layer must keep the same number of key/value heads and of query
heads per key/value head, so the query-head count a strategy asks for is met by the nearest count that
shape allows (both are recorded). Which heads and layers go is decided by `prune.importance`:
`activation_norm` (measured on calibration rows: each query head's mean output norm, the input of o_proj;
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
import re
import tempfile
from pathlib import Path

import torch

from .. import architecture, cli, quality
from ..config import UserError
from ..layout import NOT_RUN, Job
from ..measure.device import pick_device, set_threads
from ..measure.env import environment
from ..measure.flops import count_parameters
from ..measure.stats import speedup
from ..measure.timing import INTERLEAVE_RECORD, SENTINEL_TOLERANCE, interleave
from ..modeling import base_dtype, eval_loss, folder_bytes, forward_batches, load_model, load_tokenizer, read_split
from ..registry import HEALED
from ..training import batches, training_step

# transformers and peft take seconds to import: they are imported inside the functions that use them.

log = logging.getLogger("efflab")


def attention_shape(config) -> tuple[int, int, int, int]:
    """(layers, query heads, key/value heads, head dim) of any family's config."""
    a = architecture.shape(config)
    return a["layers"], a["heads"], a["kv_heads"], a["head_dim"]


# The attention projections prune can cut, by their module names: separate q/k/v (Llama, Qwen2, Gemma,
# Mistral, Mixtral...) or one fused q|k|v matrix (Phi-3's qkv_proj), and the output projection.
SEPARATE, FUSED, OUTPUT = ("q_proj", "k_proj", "v_proj"), "qkv_proj", "o_proj"


class Unprunable(Exception):
    """The model's architecture is not one whose heads and layers prune can cut: the job is unavailable."""


def attention_modules(model) -> dict:
    """Where the decoder layers and each layer's attention live: {"layers": qualified name of the layer stack,
    "attention": [qualified name of each layer's attention module], "fused": bool}. Raises Unprunable naming
    what the family lacks where its attention is not one of the layouts above (GPT-NeoX's per-head
    interleaved query_key_value, GPT-2's Conv1D c_attn, ...)."""
    stack = architecture.decoder_layers(model)
    if stack is None:
        raise Unprunable(f"{type(model).__name__} has no stack of decoder layers (a ModuleList of "
                         f"{attention_shape(model.config)[0]} layers)")
    names = {m: n for n, m in model.named_modules()}
    attention, fused = [], set()
    for layer in stack:
        found = [(name, FUSED in children) for name, module in layer.named_modules()
                 if (children := {k for k, c in module.named_children() if isinstance(c, torch.nn.Linear)})
                 and OUTPUT in children and (set(SEPARATE) <= children or FUSED in children)]
        if not found:
            raise Unprunable(f"{type(model).__name__}'s attention has no nn.Linear {'/'.join(SEPARATE)} or "
                             f"{FUSED}, with {OUTPUT}, to cut heads from")
        attention.append(f"{names[layer]}.{found[0][0]}")
        fused.add(found[0][1])
    return {"layers": names[stack], "attention": attention, "fused": fused.pop() if len(fused) == 1 else None}


def head_plan(strategy: dict, heads: int, kv: int) -> dict:
    """How many key/value heads and query heads per key/value head each layer keeps: the shape
    grouped-query attention allows whose query-head count is nearest the strategy's target (ties keep more)."""
    if "keep_heads" in strategy:
        target = strategy["keep_heads"]
    else:
        remove = strategy.get("remove_heads", 0)
        target = heads - (remove * heads if isinstance(remove, float) else remove)
    if not 1 <= target <= heads:
        raise UserError(f"prune.strategies: keeps {target:g} of {heads} query heads (expected 1 to {heads})")
    group = heads // kv
    shapes = [(k * q, k, q) for k in range(1, kv + 1) for q in range(1, group + 1)]
    # nearest count; then more heads; then more key/value heads (a layer keeps more of its distinct keys)
    total, keep_kv, per_group = min(shapes, key=lambda s: (abs(s[0] - target), -s[0], -s[1]))
    return {"target_heads": target, "heads": total, "kv_heads": keep_kv, "heads_per_kv": per_group}


def layer_count(strategy: dict, layers: int) -> int:
    remove = strategy.get("remove_layers", 0)
    n = round(remove * layers) if isinstance(remove, float) else remove
    if not 0 <= n < layers:
        raise UserError(f"prune.strategies: removes {n} of {layers} layers (expected 0 to {layers - 1})")
    return layers - n


def importance(model, rows: list[dict], tokenizer, how: str) -> dict:
    """Per layer, each query head's importance, and each layer's: measured on `rows` (activation_norm) or
    the seed's order (earlier heads and layers first)."""
    layers, heads, _, head_dim = attention_shape(model.config)
    if how == "seed":
        return {"heads": [[float(heads - h) for h in range(heads)] for _ in range(layers)],
                "layers": [float(layers - i) for i in range(layers)]}
    head_norm = torch.zeros(layers, heads, dtype=torch.float64)
    influence = torch.zeros(layers, dtype=torch.float64)
    tokens = [0]
    hooks = []
    where = attention_modules(model)
    decoder_layers = model.get_submodule(where["layers"])

    def on_o_proj(i):
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

    for i, layer in enumerate(decoder_layers):
        output = model.get_submodule(f"{where['attention'][i]}.{OUTPUT}")
        hooks.append(output.register_forward_pre_hook(on_o_proj(i)))
        hooks.append(layer.register_forward_hook(on_layer(i), with_kwargs=True))
    try:
        with torch.no_grad():
            for _ in forward_batches(model, rows, 4, tokenizer):
                pass
    finally:
        for h in hooks:
            h.remove()
    # Padding positions are counted alike for every head and layer, so they do not change the order.
    return {"heads": (head_norm / max(tokens[0], 1)).tolist(), "layers": (influence / max(tokens[0], 1)).tolist()}


def _select_heads(scores: list[float], plan: dict, group: int) -> tuple[list[int], list[int]]:
    """The key/value heads and (grouped by them, in order) the query heads one layer keeps."""
    groups = sorted(range(len(scores) // group), key=lambda g: -sum(scores[g * group:(g + 1) * group]))
    kept_kv = sorted(groups[:plan["kv_heads"]])
    kept_q = []
    for g in kept_kv:
        members = sorted(range(g * group, (g + 1) * group), key=lambda h: -scores[h])[:plan["heads_per_kv"]]
        kept_q += sorted(members)
    return kept_kv, kept_q


def _kept_rows(name: str, kept_kv: list[int], kept_q: list[int], heads: int, kv: int, d: int) -> torch.Tensor | None:
    """The output rows of projection `name` that the kept heads own (None: not a q/k/v projection). A fused
    q|k|v matrix holds the query heads' rows, then the key heads', then the value heads'."""
    rows = lambda heads_, offset=0: torch.cat([torch.arange(offset + h * d, offset + (h + 1) * d)  # noqa: E731
                                               for h in heads_])
    if name == "q_proj":
        return rows(kept_q)
    if name in ("k_proj", "v_proj"):
        return rows(kept_kv)
    if name == FUSED:
        return torch.cat([rows(kept_q), rows(kept_kv, heads * d), rows(kept_kv, (heads + kv) * d)])
    return None


def pruned_state(model, keep_layers: list[int], heads_kept: dict[int, tuple[list[int], list[int]]]) -> dict:
    """The state dict of the pruned model: layers renumbered, the q/k/v (or fused qkv) rows and the output
    projection's columns of the kept heads (and the projections' biases where the model has them)."""
    _, heads, kv, d = attention_shape(model.config)
    where = attention_modules(model)
    renumber = {old: new for new, old in enumerate(keep_layers)}
    layer_key = re.compile(rf"{re.escape(where['layers'])}\.(\d+)\.(.*)")
    out = {}
    for key, tensor in model.state_dict().items():
        match = layer_key.fullmatch(key)
        if not match:
            out[key] = tensor
            continue
        index, rest = int(match.group(1)), match.group(2)
        if index not in renumber:
            continue
        attention = where["attention"][index].removeprefix(f"{where['layers']}.{index}.")
        module, _, kind = rest.removeprefix(f"{attention}.").rpartition(".")
        if rest.startswith(f"{attention}.") and "." not in module:
            kept_kv, kept_q = heads_kept[index]
            rows = _kept_rows(module, kept_kv, kept_q, heads, kv, d)
            if rows is not None:
                tensor = tensor.index_select(0, rows)
            elif module == OUTPUT and kind == "weight":
                tensor = tensor.index_select(1, _kept_rows("q_proj", kept_kv, kept_q, heads, kv, d))
        out[f"{where['layers']}.{renumber[index]}.{rest}"] = tensor.contiguous()
    return out


def prune(model, strategy: dict, scores: dict):
    """A new model of the smaller config holding the kept weights, and what was kept."""
    from transformers import AutoModelForCausalLM

    layers, heads, kv, d = attention_shape(model.config)
    plan = head_plan(strategy, heads, kv)
    n_layers = layer_count(strategy, layers)
    keep_layers = sorted(sorted(range(layers), key=lambda i: -scores["layers"][i])[:n_layers])
    heads_kept = {i: _select_heads(scores["heads"][i], plan, heads // kv) for i in keep_layers}
    config = model.config.__class__.from_dict(model.config.to_dict())
    config.num_hidden_layers, config.num_attention_heads = n_layers, plan["heads"]
    config.num_key_value_heads, config.head_dim = plan["kv_heads"], d
    if isinstance(getattr(config, "layer_types", None), list):
        config.layer_types = [config.layer_types[i] for i in keep_layers]
    pruned = AutoModelForCausalLM.from_config(config, dtype=model.dtype)
    pruned.load_state_dict(pruned_state(model, keep_layers, heads_kept), strict=True)
    pruned.tie_weights()
    return pruned.to(model.device).eval(), {
        **plan, "layers": n_layers, "kept_layers": keep_layers,
        "kept_heads": {i: heads_kept[i][1] for i in keep_layers}}


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
    model = get_peft_model(copy.deepcopy(pruned), architecture.lora_config(pruned.config, lora))
    run_cfg = h | {"gradient_accumulation_steps": 1, "packing": True, "optimizer": "adamw_torch", "weight_decay": 0.0,
                   "lr_scheduler": "cosine", "warmup_steps": 0, "max_grad_norm": 1.0, "mixed_precision": "auto",
                   "tf32": False, "torch_compile": False}
    step, precision = training_step(run_cfg, model, dtype, device, batches(run_cfg, tokenizer, rows, h["steps"], device),
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
    with tempfile.TemporaryDirectory() as scratch:
        healed, healing = heal(pruned, p["heal"], tokenizer, read_split(layout.split("train")), dtype, device,
                               scratch)
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
    set_threads(cfg["runtime"])
    device = pick_device(cfg["runtime"])
    dtype = base_dtype(layout)
    tokenizer = load_tokenizer(layout.base_model())
    rows = read_split(layout.split("validation"), p["eval_rows"])
    calibration = read_split(layout.split("train"), p["calibration_rows"])
    base = load_model(layout.base_model(), dtype, device)
    try:
        attention_modules(base)
    except Unprunable as why:
        reason = f"prune cannot cut this family's attention: {why}"
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
