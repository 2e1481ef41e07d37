"""Stage prune: structured pruning of attention heads and whole decoder layers, one job per strategy.

Heads come off the q/k/v and output projections and layers out of the stack for real, and the pruned model is
rebuilt from its smaller config and saved, so that plain transformers loads the folder and parameter count,
footprint and latency shrink (the seed's pruning function only addressed the weights and changed nothing).
Removing layers needs only the family's stack of decoder layers; removing heads needs an attention whose heads
prune can cut and a config that can describe fewer of them (cut_plan), else the strategy is unavailable.
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
import re
import tempfile
from pathlib import Path

import torch

from .. import architecture, cli, quality
from ..config import UserError
from ..layout import NOT_RUN, Job
from ..lora_init import Refused
from ..measure.env import environment
from ..measure.flops import count_parameters
from ..measure.stats import speedup
from ..measure.timing import INTERLEAVE_RECORD, SENTINEL_TOLERANCE, interleave
from ..models.modeling import eval_loss, folder_bytes, forward_batches, load_model, read_split
from ..registry import HEALED
from ..training import batches, training_step

# transformers and peft take seconds to import: they are imported inside the functions that use them.

log = logging.getLogger("efflab")


def attention_shape(config) -> tuple[int, int, int, int]:
    """(layers, query heads, key/value heads, head dim) of any family's config."""
    a = architecture.shape(config)
    return a["layers"], a["heads"], a["kv_heads"], a["head_dim"]


# The attention projections prune recognises, by their module names: separate q/k/v, or one fused q|k|v matrix
# (Phi-3's qkv_proj; Falcon's, Bloom's and GPT-NeoX's query_key_value; GPT-2's Conv1D c_attn), and the output
# projection. Heads are cut from separate q/k/v and from BLOCKED, whose rows are the query heads', then the key heads',
# then the value heads'; the other fused matrices order their rows per head in the family's own way.
SEPARATE, FUSED, BLOCKED = ("q_proj", "k_proj", "v_proj"), ("qkv_proj", "query_key_value", "c_attn"), "qkv_proj"
OUTPUTS = ("o_proj", "out_proj", "dense", "c_proj")


class Unprunable(Exception):
    """The model cannot lose what the strategy removes (its layers, or its heads): the job is unavailable."""


def layer_stack(model) -> str:
    """The qualified name of the model's stack of decoder layers (architecture.decoder_layers)."""
    stack = architecture.decoder_layers(model)
    if stack is None:
        raise Unprunable(f"{type(model).__name__} has no stack of decoder layers (a ModuleList of "
                         f"{attention_shape(model.config)[0]} layers) to remove layers from")
    return next(name for name, module in model.named_modules() if module is stack)


def attention_modules(model) -> dict:
    """Each decoder layer's attention: {"attention": [its qualified name, per layer], "qkv": the names of its q, k
    and v projections (one name where they are fused), "output": its output projection's name}. Raises
    Unprunable naming what the family lacks where a layer's attention has none of the layouts above."""
    stack = layer_stack(model)
    attention, layouts = [], set()
    for i, layer in enumerate(model.get_submodule(stack)):
        for name, module in layer.named_modules():
            children = {k for k, c in module.named_children() if architecture.matmul_shape(c)}
            output = next((o for o in OUTPUTS if o in children), None)
            qkv = SEPARATE if set(SEPARATE) <= children else next(((f,) for f in FUSED if f in children), None)
            if output and qkv:
                attention.append(f"{stack}.{i}" + (f".{name}" if name else ""))
                layouts.add((qkv, output))
                break
        else:
            raise Unprunable(f"{type(model).__name__}'s attention has no q/k/v projections ({'/'.join(SEPARATE)}, or "
                             f"fused as {', '.join(FUSED)}) with an output projection ({', '.join(OUTPUTS)}) to cut "
                             "heads from")
    if len(layouts) != 1:
        raise Unprunable(f"{type(model).__name__}'s layers name their attention projections differently: "
                         f"{sorted(layouts)}")
    (qkv, output), = layouts
    return {"attention": attention, "qkv": qkv, "output": output}


def cut_plan(model, strategy: dict) -> tuple[dict, int]:
    """The heads (head_plan) and the number of layers `strategy` keeps of `model`. Raises Unprunable where the
    model has no stack of layers, or where the strategy removes heads and the family cannot lose them: its
    attention is not one of the layouts above, its config cannot describe fewer heads of the same size (OPT,
    Falcon, Bloom, GPT-NeoX and GPT-2 derive the head size from hidden_size), or its fused q/k/v rows are in an
    order of the family's own."""
    layers, heads, kv, d = attention_shape(model.config)
    layer_stack(model)
    plan, n_layers = head_plan(strategy, heads, kv), layer_count(strategy, layers)
    if plan["heads"] == heads:
        return plan, n_layers
    where, name = attention_modules(model), type(model).__name__
    try:
        smaller = architecture.skeleton(architecture.resized_config(model.config, list(range(layers)),
                                                                    (plan["heads"], plan["kv_heads"], d)))
    except ValueError as err:  # a family that checks its sizes when it builds its attention
        raise Unprunable(f"{name} cannot be built with {plan['heads']} query heads: {err}") from err
    takes = architecture.matmul_shape(smaller.get_submodule(f"{where['attention'][0]}.{where['output']}"))[0]
    if takes != plan["heads"] * d:
        hidden = architecture.shape(model.config)["hidden"]
        raise Unprunable(f"{name}'s config cannot describe fewer heads of the same size: with {plan['heads']} query "
                         f"heads its {where['output']} takes {takes} inputs, not {plan['heads']} x {d}"
                         + (f" (its head size is hidden_size {hidden} / heads)" if takes == hidden else ""))
    projections = [model.get_submodule(f"{where['attention'][0]}.{p}") for p in (*where["qkv"], where["output"])]
    if where["qkv"] not in (SEPARATE, (BLOCKED,)) or not all(isinstance(p, torch.nn.Linear) for p in projections):
        raise Unprunable(f"{name}'s {where['qkv'][0]} holds its heads' q, k and v in an order of the family's own: "
                         f"prune cuts heads from separate {'/'.join(SEPARATE)} or a q|k|v-blocked {BLOCKED}, "
                         "all nn.Linear")
    return plan, n_layers


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


def _select_heads(scores: list[float], plan: dict, group: int) -> tuple[list[int], list[int]]:
    """The key/value heads and (grouped by them, in order) the query heads one layer keeps."""
    groups = sorted(range(len(scores) // group), key=lambda g: -sum(scores[g * group:(g + 1) * group]))
    kept_kv = sorted(groups[:plan["kv_heads"]])
    kept_q = []
    for g in kept_kv:
        members = sorted(range(g * group, (g + 1) * group), key=lambda h: -scores[h])[:plan["heads_per_kv"]]
        kept_q += sorted(members)
    return kept_kv, kept_q


def _kept_rows(name: str, qkv: tuple[str, ...], kept_kv: list[int], kept_q: list[int], heads: int, kv: int,
               d: int) -> torch.Tensor | None:
    """The output rows of projection `name` that the kept heads own (None: not a q/k/v projection). A blocked
    q|k|v matrix holds the query heads' rows, then the key heads', then the value heads'."""
    rows = lambda heads_, offset=0: torch.cat([torch.arange(offset + h * d, offset + (h + 1) * d)  # noqa: E731
                                               for h in heads_])
    if name not in qkv:
        return None
    if len(qkv) == 1:
        return torch.cat([rows(kept_q), rows(kept_kv, heads * d), rows(kept_kv, (heads + kv) * d)])
    return rows(kept_q) if name == qkv[0] else rows(kept_kv)


def pruned_state(model, keep_layers: list[int], heads_kept: dict[int, tuple[list[int], list[int]]] | None) -> dict:
    """The state dict of the pruned model: layers renumbered and, where heads are cut (heads_kept), the q/k/v (or
    fused qkv) rows and the output projection's columns of the kept heads (and the projections' biases where the
    model has them)."""
    _, heads, kv, d = attention_shape(model.config)
    stack = layer_stack(model)
    where = attention_modules(model) if heads_kept else None
    renumber = {old: new for new, old in enumerate(keep_layers)}
    layer_key = re.compile(rf"{re.escape(stack)}\.(\d+)\.(.*)")
    out = {}
    for key, tensor in model.state_dict().items():
        match = layer_key.fullmatch(key)
        if not match:
            out[key] = tensor
            continue
        index, rest = int(match.group(1)), match.group(2)
        if index not in renumber:
            continue
        if where and key.startswith(attention := f"{where['attention'][index]}."):
            tensor = _heads_cut(tensor, key.removeprefix(attention), where, heads_kept[index], (heads, kv, d))
        out[f"{stack}.{renumber[index]}.{rest}"] = tensor.contiguous()
    return out


def _heads_cut(tensor: torch.Tensor, name: str, where: dict, kept: tuple[list[int], list[int]],
               sizes: tuple[int, int, int]) -> torch.Tensor:
    """The attention's parameter `name` (e.g. q_proj.weight) with only the kept heads' rows, or for the output
    projection's weight, columns."""
    module, _, kind = name.rpartition(".")
    kept_kv, kept_q = kept
    rows = _kept_rows(module, where["qkv"], kept_kv, kept_q, *sizes)
    if rows is not None:
        return tensor.index_select(0, rows)
    if module == where["output"] and kind == "weight":
        return tensor.index_select(1, _kept_rows(SEPARATE[0], SEPARATE, kept_kv, kept_q, *sizes))
    return tensor


def prune(model, strategy: dict, scores: dict):
    """A new model of the smaller config holding the kept weights, and what was kept. Raises Unprunable
    (cut_plan) where the model cannot lose what the strategy removes."""
    from transformers import AutoModelForCausalLM

    layers, heads, kv, d = attention_shape(model.config)
    plan, n_layers = cut_plan(model, strategy)
    keep_layers = sorted(sorted(range(layers), key=lambda i: -scores["layers"][i])[:n_layers])
    heads_kept = None
    if plan["heads"] < heads:
        heads_kept = {i: _select_heads(scores["heads"][i], plan, heads // kv) for i in keep_layers}
    config = architecture.resized_config(model.config, keep_layers,
                                         (plan["heads"], plan["kv_heads"], d) if heads_kept else None)
    pruned = AutoModelForCausalLM.from_config(config, dtype=model.dtype)
    pruned.load_state_dict(pruned_state(model, keep_layers, heads_kept), strict=True)
    pruned.tie_weights()
    return pruned.to(model.device).eval(), {
        **plan, "layers": n_layers, "kept_layers": keep_layers,
        "kept_heads": {i: heads_kept[i][1] if heads_kept else list(range(heads)) for i in keep_layers}}


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
        model = get_peft_model(model, architecture.lora_config(pruned.config, lora, model))
    except ValueError as err:  # peft's refusal of the targets, or of dropout on fused expert weights
        raise Refused(architecture.lora_refusal(model, err)) from None
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
