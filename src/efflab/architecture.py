"""What efflab reads of a causal LM's architecture, through one adapter for every transformers family.

Families name their sizes differently (GPT-2's n_embd and n_inner, Mixtral's num_local_experts, Gemma-3's
text sub-config), and some build their projections from other layer types (GPT-2's Conv1D). Stages and
estimators read a model's shape and its matrix-multiply weights, and models.pruning writes a smaller model's
config, only through here, never a family's own config field or module name.
"""
from __future__ import annotations

import torch

# transformers and peft take seconds to import: they are imported inside the functions that use them.

# The MLP width under each family's name; absent in all of them (GPT-2's n_inner: null), 4 x hidden.
INTERMEDIATE_FIELDS = ("intermediate_size", "n_inner", "ffn_dim", "ffn_hidden_size", "d_ff")
EXPERT_FIELDS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
# The decoder-layer count under each family's name (GPT-2's and Bloom's n_layer are also mapped to num_hidden_layers).
LAYER_FIELDS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")


def text_config(config):
    """The language model's own config (a multimodal model's text part; the config itself otherwise)."""
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config


def _first(config, fields: tuple[str, ...]):
    return next((getattr(config, f) for f in fields if getattr(config, f, None)), None)


def _kv_heads(c, heads: int) -> int:
    """Key/value heads: num_key_value_heads; Falcon's and GPT-BigCode's multi-query attention has one (Falcon's
    new decoder architecture, num_kv_heads)."""
    if getattr(c, "num_key_value_heads", None):
        return c.num_key_value_heads
    if getattr(c, "new_decoder_architecture", False):
        return c.num_kv_heads
    return 1 if getattr(c, "multi_query", False) else heads


def _head_dim(c, default: int) -> int:
    """A query/key head's width: multi-head latent attention's (DeepSeek-V2/V3) is its position-free part and its
    rotary part together, where its head_dim names the rotary part alone."""
    if getattr(c, "qk_nope_head_dim", None) and getattr(c, "qk_rope_head_dim", None):
        return c.qk_nope_head_dim + c.qk_rope_head_dim
    return getattr(c, "head_dim", None) or getattr(c, "d_kv", None) or default


def shape(config) -> dict:
    """Layers, hidden size, MLP width, query and key/value heads, head dim, vocabulary, tied embeddings and
    experts of any family's config (read through its attribute map, so GPT-2's n_layer is num_hidden_layers)."""
    c = text_config(config)
    hidden, heads = c.hidden_size, c.num_attention_heads
    experts = _first(c, EXPERT_FIELDS) or 0
    return {"model_type": c.model_type, "layers": _first(c, LAYER_FIELDS), "hidden": hidden,
            "intermediate": _first(c, INTERMEDIATE_FIELDS) or 4 * hidden, "heads": heads,
            "kv_heads": _kv_heads(c, heads),
            "head_dim": _head_dim(c, hidden // heads),
            "vocab": c.vocab_size,
            "tied_embeddings": bool(getattr(config, "tie_word_embeddings", getattr(c, "tie_word_embeddings", False))),
            "experts": experts, "experts_per_token": (getattr(c, "num_experts_per_tok", None) or 1) if experts else 0}


def matmul_shape(module) -> tuple[int, int] | None:
    """(in features, out features) of a layer that multiplies its input by a weight matrix: nn.Linear and
    its subclasses (bitsandbytes' included, at their full shape) and transformers' Conv1D (GPT-2 style,
    weight stored transposed); None for any other module."""
    from transformers.pytorch_utils import Conv1D

    if isinstance(module, torch.nn.Linear):
        return module.in_features, module.out_features
    if isinstance(module, Conv1D):
        return module.weight.shape[0], module.nf
    return None


def skeleton(config, trust_remote_code: bool = False):
    """The model built from its config on the meta device: its module tree, with no weights, instantly."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)


def linear_layers(model) -> dict[str, torch.nn.Linear]:
    """Every nn.Linear but the output embedding (the LM head), by qualified name: what QAT quantizes."""
    head = model.get_output_embeddings()
    return {name: m for name, m in model.named_modules() if isinstance(m, torch.nn.Linear) and m is not head}


def undivided_layer(model, group_size: int) -> tuple[str, int] | None:
    """The first of linear_layers whose input size `group_size` does not divide: (name, input features)."""
    return next(((n, m.in_features) for n, m in linear_layers(model).items() if m.in_features % group_size), None)


def matmul_layers(model) -> dict[str, tuple[int, int]]:
    """Every matrix-multiply layer of the model by its qualified name, with (in, out) features."""
    return {name: s for name, module in model.named_modules() if (s := matmul_shape(module))}


def expert_weights(model) -> list[torch.nn.Parameter]:
    """A mixture of experts' stacked expert weights (experts x out x in, e.g. Mixtral's gate_up_proj and
    down_proj), which are parameters, not layers; [] for a dense model."""
    experts = shape(model.config)["experts"]
    return [p for m in model.modules() for p in m.parameters(recurse=False)
            if experts and p.dim() == 3 and p.shape[0] == experts]


def decoder_layers(model) -> torch.nn.ModuleList | None:
    """The stack of decoder layers, wherever the family keeps it (model.layers, model.decoder.layers,
    transformer.h, gpt_neox.layers, ...): the outermost ModuleList with one entry per config layer; without a layer
    count in the config, the longest ModuleList of blocks of one class; None where there is none."""
    count = shape(model.config)["layers"]
    stacks = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m)]
    exact = [m for m in stacks if len(m) == count]
    if count is None:
        exact = sorted((m for m in stacks if len({type(block) for block in m}) == 1), key=len, reverse=True)
    return exact[0] if exact else None


def resized_config(config, keep_layers: list[int], heads: tuple[int, int, int] | None = None):
    """A copy of `config` for a model that keeps the layers `keep_layers` (in order) and, given heads =
    (query heads, key/value heads, head dim), that many heads of that size in every layer. The layer count is
    written under whichever of LAYER_FIELDS the family uses, and each per-layer list (Gemma-2's layer_types, ...)
    keeps the kept layers' entries."""
    config = config.__class__.from_dict(config.to_dict())
    c, layers = text_config(config), shape(config)["layers"]
    fields = c.to_dict()
    for field in [f for f in LAYER_FIELDS if f in fields] or ["num_hidden_layers"]:
        setattr(c, field, len(keep_layers))
    for field, value in fields.items():
        if isinstance(value, list) and len(value) == layers and not field.endswith(("token_id", "token_ids")):
            setattr(c, field, [value[i] for i in keep_layers])
    if heads is not None:
        c.num_attention_heads, c.num_key_value_heads = heads[0], heads[1]
        if not isinstance(getattr(type(c), "head_dim", None), property):  # Falcon's is hidden_size / heads
            c.head_dim = heads[2]
    return config


def own_projections(model) -> list[str]:
    """The leaf names of the model's own matrix-multiply layers but the LM head (an attention's q_a_proj and
    o_proj, an MLP's or shared expert's gate_proj, GPT-2's c_attn): what a target_modules list can name. peft's
    wrappers of a model it adapted, or began to adapt before it refused, are read through (base_layer, lora_A)."""
    head = model.get_output_embeddings()
    names = set()
    for name, module in model.named_modules():
        if module is head or matmul_shape(module) is None or ".lora_" in name:
            continue
        names.add(name.replace(".base_layer", "").rsplit(".", 1)[-1])
    return sorted(names)
