"""What efflab reads of a causal LM's architecture, through one adapter for every transformers family.

Families name their sizes differently (GPT-2's n_embd and n_inner, Mixtral's num_local_experts, Gemma-3's
text sub-config), and some build their projections from other layer types (GPT-2's Conv1D). Stages and
estimators read a model's shape and its matrix-multiply weights only through here, never a family's own
config field or module name.
"""
from __future__ import annotations

import copy

import torch

# transformers and peft take seconds to import: they are imported inside the functions that use them.

# The MLP width under each family's name; absent in all of them (GPT-2's n_inner: null), 4 x hidden.
INTERMEDIATE_FIELDS = ("intermediate_size", "n_inner", "ffn_dim", "ffn_hidden_size", "d_ff")
EXPERT_FIELDS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")


def text_config(config):
    """The language model's own config (a multimodal model's text part; the config itself otherwise)."""
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config


def _first(config, fields: tuple[str, ...]):
    return next((getattr(config, f) for f in fields if getattr(config, f, None)), None)


def shape(config) -> dict:
    """Layers, hidden size, MLP width, query and key/value heads, head dim, vocabulary, tied embeddings and
    experts of any family's config (read through its attribute map, so GPT-2's n_layer is num_hidden_layers)."""
    c = text_config(config)
    hidden, heads = c.hidden_size, c.num_attention_heads
    experts = _first(c, EXPERT_FIELDS) or 0
    return {"model_type": c.model_type, "layers": c.num_hidden_layers, "hidden": hidden,
            "intermediate": _first(c, INTERMEDIATE_FIELDS) or 4 * hidden, "heads": heads,
            "kv_heads": getattr(c, "num_key_value_heads", None) or heads,
            "head_dim": getattr(c, "head_dim", None) or getattr(c, "d_kv", None) or hidden // heads,
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
    """The stack of decoder layers, wherever the family keeps it (model.layers, transformer.h,
    gpt_neox.layers, ...): the ModuleList with one entry per config layer; None where there is none."""
    count = shape(model.config)["layers"]
    stacks = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) == count]
    return stacks[0] if stacks else None


def lora_targets(config, targets: str | list[str] | None) -> str | list[str]:
    """The modules LoRA adapts: the user's names or peft's all-linear as given; for null, what peft itself
    chooses for the family (its per-architecture default, e.g. q_proj and v_proj for Llama, query_key_value
    for GPT-NeoX, c_attn for GPT-2), and all-linear for a family peft has no default for."""
    if targets is not None:
        return targets
    from peft.utils import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as PEFT_DEFAULTS

    return sorted(PEFT_DEFAULTS.get(text_config(config).model_type) or []) or "all-linear"


def restore_conv1d(model) -> int:
    """Put back the Conv1D layers a dequantized model lost: transformers' dequantize() turns every 4-bit layer
    into an nn.Linear, so a GPT-2-style model's projections would save with transposed weights that its own
    class cannot load. Returns how many layers it restored (0 for a family without Conv1D)."""
    from transformers.pytorch_utils import Conv1D

    config = copy.deepcopy(model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    restored = 0
    for name, module in skeleton(config).named_modules():
        current = model.get_submodule(name) if name else model
        if isinstance(module, Conv1D) and type(current) is torch.nn.Linear:
            layer = Conv1D(current.out_features, current.in_features).to(current.weight.device, current.weight.dtype)
            with torch.no_grad():
                layer.weight.copy_(current.weight.T)
                if current.bias is not None:
                    layer.bias.copy_(current.bias)
            model.set_submodule(name, layer)
            restored += 1
    return restored


def lora_config(config, lora: dict):
    """peft's LoraConfig for the settings `lora` (r, alpha, dropout, target_modules, use_dora, use_rslora) on a
    model of `config`: one construction for fine-tuning, healing and the dry-run check."""
    from peft import LoraConfig

    return LoraConfig(task_type="CAUSAL_LM", r=lora["r"], lora_alpha=lora["alpha"], lora_dropout=lora["dropout"],
                      bias="none", target_modules=lora_targets(config, lora["target_modules"]),
                      use_dora=lora.get("use_dora", False), use_rslora=lora.get("use_rslora", False))
