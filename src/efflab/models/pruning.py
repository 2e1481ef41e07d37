"""Structured pruning of a transformers model: attention heads and whole decoder layers removed for real.

Heads come off the q/k/v and output projections and layers out of the stack, and `prune` rebuilds the model from
its smaller config (architecture.resized_config), so that plain transformers loads the saved folder. Removing
layers needs only the family's stack of decoder layers; removing heads needs an attention whose heads can be cut
and a config that can describe fewer of them (cut_plan), else Unprunable says why. Grouped-query attention is
respected: every layer keeps the same number of key/value heads and of query heads per key/value head
(head_plan). The model is read only through efflab.architecture. Which heads and layers go is the caller's:
`prune` takes their importance scores.
"""
from __future__ import annotations

import re

import torch

from .. import architecture
from ..config import UserError

# transformers takes seconds to import: it is imported inside the function that uses it (prune).

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
