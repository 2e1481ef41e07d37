"""Analytic estimates from a model's architecture config: parameters, memory, FLOPs. No weights, no GPU.

The architectures are the small HF config files in workflow/models/<name>.json. Parameter counts are not
formulas: the architecture is instantiated on the meta device (accelerate's init_empty_weights), so the
counts are the ones transformers itself builds, tied embeddings counted once. Everything else is a short
formula of those counts and the config's shapes; each one names its source. Sizes are in bytes.
"""
from __future__ import annotations

import functools
import json
import math
from pathlib import Path

from ..architecture import matmul_layers, shape
from ..config import REPO_ROOT, UserError
from ..schemes import SCHEMES

# transformers, accelerate and torch take seconds to import: only the estimates that need them import them.

MODELS_DIR = REPO_ROOT / "workflow" / "models"

BYTES_PER_ELEMENT = {"float32": 4, "tf32": 4, "float16": 2, "bfloat16": 2, "fp8": 1, "int8": 1, "nf4": 0.5, "fp4": 0.5}
DTYPE_ALIASES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}

# Adam keeps two moments (exp_avg, exp_avg_sq) per trainable parameter, in fp32 (Kingma & Ba 2015; torch.optim.AdamW).
ADAM_MOMENTS_BYTES = 8
# Mixed precision adds the fp32 master copy of the weights the optimizer updates (Micikevicius et al. 2018):
# master 4 + momentum 4 + variance 4. ZeRO's K = 12 (Rajbhandari et al. 2020, section 3.1).
MIXED_PRECISION_ADAM_BYTES = 12
# bitsandbytes 4-bit: one absmax per block of 64 weights (Linear4bit's default blocksize), fp32, or with
# double quantization an 8-bit absmax plus one fp32 second-level absmax per 256 blocks (Dettmers et al. 2023, 3).
NF4_BLOCKSIZE = 64
DOUBLE_QUANT_BLOCKSIZE = 256


def dtype_name(dtype: str) -> str:
    name = DTYPE_ALIASES.get(dtype, dtype)
    if name not in BYTES_PER_ELEMENT:
        raise UserError(f"dtype {dtype!r}: expected one of {sorted(BYTES_PER_ELEMENT) + sorted(DTYPE_ALIASES)}")
    return name


def bytes_per_element(dtype: str) -> float:
    return BYTES_PER_ELEMENT[dtype_name(dtype)]


def model_names() -> list[str]:
    return sorted(p.stem for p in MODELS_DIR.glob("*.json"))


def load_config(name: str) -> dict:
    """The config dict of a shipped model (with its `_efflab` block: source, auto class, published count),
    or of a local HF model folder given by path, e.g. the pipeline's results/base_model/model."""
    folder = Path(name)
    if (folder / "config.json").is_file():
        return {"_efflab": {"source": name, "auto_class": "AutoModelForCausalLM", "published_parameters": None},
                **json.loads((folder / "config.json").read_text())}
    path = MODELS_DIR / f"{name}.json"
    if not path.is_file():
        raise UserError(f"model {name!r}: no {path.relative_to(REPO_ROOT)} (shipped: {', '.join(model_names())})")
    return json.loads(path.read_text())


def hf_config(name: str, **overrides):
    from transformers import AutoConfig

    fields = {k: v for k, v in load_config(name).items() if not k.startswith("_")}
    return AutoConfig.for_model(**{**fields, **overrides})


def meta_model(name: str, **overrides):
    """The model built from its config on the meta device: shapes without storage, tied weights tied."""
    return _meta_model(name, json.dumps(overrides, sort_keys=True))


@functools.lru_cache(maxsize=32)
def _meta_model(name: str, overrides_json: str):
    import transformers
    from accelerate import init_empty_weights
    from transformers.initialization import no_init_weights

    config = hf_config(name, **json.loads(overrides_json))
    auto = getattr(transformers, load_config(name)["_efflab"]["auto_class"])
    # Meta tensors hold no values: running the initializers on them only costs time (half a second a model).
    with init_empty_weights(), no_init_weights():
        model = auto.from_config(config)
    model.tie_weights()  # from_config on meta leaves tied embeddings as separate tensors
    return model


def architecture(name: str, **overrides) -> dict:
    """The shape of a shipped or local model config (efflab.architecture.shape: any family's field names)."""
    return shape(hf_config(name, **overrides))


def parameter_count(name: str, **overrides) -> int:
    """Parameters of the model as transformers builds it; tied tensors count once, buffers not at all."""
    return sum(p.numel() for p in meta_model(name, **overrides).parameters())


def largest_layer_parameters(name: str, **overrides) -> int:
    """DeepSpeed's `largest_layer_params`: the most parameters any single module holds directly."""
    return max(sum(p.numel() for p in m.parameters(recurse=False)) for m in meta_model(name, **overrides).modules())


def linear_layers(name: str, **overrides) -> list[dict]:
    """Every matrix-multiply layer (nn.Linear, GPT-2's Conv1D: architecture.matmul_shape): name, in/out features,
    and whether it is the output head."""
    model = meta_model(name, **overrides)
    head = model.get_output_embeddings()
    return [{"name": n, "in": fan_in, "out": fan_out, "head": model.get_submodule(n) is head}
            for n, (fan_in, fan_out) in matmul_layers(model).items()]


def lora_matrix_parameters(d: int, k: int, r: int) -> int:
    """B (d x r) plus A (r x k): Hu et al. 2021, eq. 3."""
    return r * (d + k)


def _targeted(layer: dict, targets) -> bool:
    # peft's matching: a module is targeted if its name equals a target or ends with "." + target;
    # "all-linear" is every linear layer except the output head.
    if targets == "all-linear":
        return not layer["head"]
    return any(layer["name"] == t or layer["name"].endswith("." + t) for t in targets)


def targeted_layers(name: str, targets, **overrides) -> list[dict]:
    """The linear layers (see `linear_layers`) that LoRA `targets` select, as peft matches them."""
    hits = [lay for lay in linear_layers(name, **overrides) if _targeted(lay, targets)]
    if not hits:
        raise UserError(f"LoRA targets {targets!r} match no linear layer of {name}")
    return hits


def lora_parameters(name: str, r: int, targets, **overrides) -> int:
    """Trainable LoRA parameters for rank r on the targeted linear layers of the meta model."""
    return sum(lora_matrix_parameters(lay["out"], lay["in"], r) for lay in targeted_layers(name, targets, **overrides))


def attention_crossover(config: dict) -> float | None:
    """The sequence length at which eager attention's scores and softmax (2 × heads × L² floats a layer) reach the
    activations that grow with L (about (4 × hidden + 3 × intermediate) × L a layer), from the sizes a config names;
    None where it names them not."""
    heads, hidden, inter = (config.get(k) for k in ("num_attention_heads", "hidden_size", "intermediate_size"))
    return (4 * hidden + 3 * inter) / (2 * heads) if heads and hidden and inter else None


def attention_exponent(config: dict, short: int, long: int, squared: bool = True) -> float | None:
    """The exponent k of memory ~ L^k between two lengths that the crossover's law gives (L × (1 + L / crossover),
    the L² term `squared`: eager; without it, flash and SDPA's memory-efficient kernels: 1)."""
    crossover = attention_crossover(config)
    if crossover is None or short == long:
        return None
    grow = (lambda n: n * (1 + n / crossover)) if squared else (lambda n: n)  # noqa: E731
    return math.log(grow(long) / grow(short)) / math.log(long / short)


def activation_bytes(name: str, seq_len: int, batch: int, bytes_per_el: float = 2, flash: bool = False,
                     checkpointing: bool = False, **overrides) -> float:
    """Activations a training step keeps for the backward pass, all layers.

    Per layer, Korthikanti et al. 2022 (eq. 1), as the seed 002 slides write it:
    attention (4N)sbh + (2N+1)as^2b + N sbh + sbh, MLP N sbh + 2 N sb(4h) + sbh, two LayerNorms 2 N sbh,
    total (16N + 2)sbh + (2N + 1)as^2b; N bytes per element, 1 byte per dropout-mask element.
    FlashAttention keeps no s^2 tensor (scores, softmax, dropout mask are recomputed in the backward) but
    stores the fp32 row log-sum-exp, 4 a s b bytes (FlashAttention-2, Dao 2023, algorithm 1).
    Checkpointing per decoder layer (what HF's gradient_checkpointing does) keeps only each layer's input,
    N sbh per layer; the backward then rebuilds one layer at a time (see `layer_activation_bytes`).
    The MLP term assumes a 4h MLP; embeddings and the logits are not included.
    """
    arch = architecture(name, **overrides)
    s, b, h, a, n = seq_len, batch, arch["hidden"], arch["heads"], bytes_per_el
    if checkpointing:
        return arch["layers"] * n * s * b * h
    return arch["layers"] * layer_activation_bytes(s, b, h, a, n, flash)


def layer_activation_bytes(s: int, b: int, h: int, a: int, n: float, flash: bool = False) -> float:
    attention_scores = 4 * a * s * b if flash else (2 * n + 1) * a * s * s * b
    return (16 * n + 2) * s * b * h + attention_scores


def kv_cache_bytes(name: str, seq_len: int, batch: int = 1, bytes_per_el: float = 2, **overrides) -> float:
    """K and V for every layer and KV head: 2 L n_kv d_head s b N (grouped-query models cache n_kv heads only)."""
    arch = architecture(name, **overrides)
    return 2 * arch["layers"] * arch["kv_heads"] * arch["head_dim"] * seq_len * batch * bytes_per_el


def flops_per_token(n_params: int, training: bool = True, checkpointing: bool = False) -> float:
    """2N forward; training 6N (forward + backward at twice the forward, Kaplan et al. 2020);
    full activation recomputation adds a second forward: 8N (Narayanan et al. 2021, section 5.1;
    Korthikanti et al. 2022)."""
    if not training:
        return 2 * n_params
    return (8 if checkpointing else 6) * n_params


def model_state_bytes(n_params: int, trainable: int, weight_bytes: float, grad_bytes: float,
                      optimizer_bytes: float, trainable_bytes: float | None = None) -> dict:
    """Weights of the whole model, plus each trainable parameter's own copy (if separate, e.g. LoRA),
    gradient and optimizer state."""
    parts = {"weights": n_params * weight_bytes,
             "trainable_weights": trainable * (trainable_bytes or 0),
             "gradients": trainable * grad_bytes, "optimizer": trainable * optimizer_bytes}
    return {**parts, "total": sum(parts.values())}


def zero_model_state_bytes(psi: float, stage: int, n_devices: int, k: float = MIXED_PRECISION_ADAM_BYTES) -> float:
    """Per-device model states of mixed-precision Adam under ZeRO (Rajbhandari et al. 2020, figure 1):
    fp16 weights 2Ψ, fp16 gradients 2Ψ, optimizer KΨ; stage 1 shards the optimizer, 2 also the gradients,
    3 also the weights, over N devices."""
    shard = {0: (2 + 2 + k, 0), 1: (2 + 2, k), 2: (2, 2 + k), 3: (0, 2 + 2 + k)}
    if stage not in shard:
        raise UserError(f"ZeRO stage {stage!r}: expected 0, 1, 2 or 3")
    replicated, sharded = shard[stage]
    return replicated * psi + sharded * psi / n_devices


def deepspeed_zero3_estimate(total_params: int, largest_layer_params: int, gpus_per_node: int = 1, nodes: int = 1,
                             offload_param: bool = True, offload_optimizer: bool = True, zero_init: bool = True,
                             additional_buffer_factor: float = 1.5) -> dict:
    """DeepSpeed's `estimate_zero3_model_states_mem_needs` (deepspeed/runtime/zero/stage3.py), bytes per CPU
    and per GPU; the same arithmetic, so its printed table can be checked without DeepSpeed installed."""
    total_gpus = nodes * gpus_per_node
    gpus_factor = 1 / nodes
    largest_layer_memory = 4 * largest_layer_params
    if offload_optimizer:
        if offload_param:
            gpu = largest_layer_memory
            per_param = 18 * gpus_factor if zero_init else max(4 * gpus_per_node, 18 * gpus_factor)
        else:
            gpu = largest_layer_memory + int(2 * total_params / total_gpus)
            per_param = 16 * gpus_factor if zero_init else max(4 * gpus_per_node, 16 * gpus_factor)
        cpu = total_params * per_param * additional_buffer_factor
    else:
        gpu = largest_layer_memory + int(18 * total_params / total_gpus)
        cpu = (largest_layer_params if zero_init else total_params) * 4 * gpus_per_node * additional_buffer_factor
    return {"cpu": int(cpu), "gpu": int(gpu)}


def bnb_footprint(name: str, method: str, double_quant: bool = False, compute_dtype: str = "float16",
                  **overrides) -> dict:
    """Bytes a model occupies loaded with bitsandbytes through transformers.

    Quantized: the weight of every nn.Linear / Conv1D except the output head (transformers'
    get_keys_to_not_convert keeps the output embedding, tied weights and the last module in full precision;
    a tied lm_head is the input embedding, counted once). Everything else (embeddings, norms, biases, the
    head) stays in the compute dtype. INT8 (LLM.int8, Dettmers et al. 2022): 1 byte per weight plus one fp32
    scale per output row (Int8Params.SCB). NF4/FP4: 0.5 byte per weight plus the block constants (see
    NF4_BLOCKSIZE). transformers' get_memory_footprint() counts only the stored weights, not these constants.
    """
    if method not in ("int8", "nf4", "fp4"):
        raise UserError(f"bnb method {method!r}: expected int8, nf4 or fp4")
    model = meta_model(name, **overrides)
    quantized = [lay for lay in linear_layers(name, **overrides) if not lay["head"]]
    q_params = sum(lay["in"] * lay["out"] for lay in quantized)
    kept = sum(p.numel() for p in model.parameters()) - q_params
    code_books = 0
    if method == "int8":
        weight_bytes = q_params
        constants = 4 * sum(lay["out"] for lay in quantized)
    else:
        weight_bytes = sum(math.ceil(lay["in"] * lay["out"] / 2) for lay in quantized)
        constants = sum(_four_bit_constants(lay["in"] * lay["out"], double_quant) for lay in quantized)
        # each layer's quant state holds its 16-value fp32 code (and the 256-value 8-bit code of the nested absmax)
        code_books = len(quantized) * 4 * (16 + (256 if double_quant else 0))
    kept_bytes = kept * bytes_per_element(compute_dtype)
    return {"quantized_params": q_params, "kept_params": kept, "weight_bytes": weight_bytes,
            "constant_bytes": constants, "code_book_bytes": code_books, "kept_bytes": kept_bytes,
            "total": weight_bytes + constants + code_books + kept_bytes}


def quant_footprint(name: str, quant: dict, compute_dtype: str = "float16", **overrides) -> dict | None:
    """Bytes a model occupies loaded with a quantization scheme: its row's footprint (schemes.SCHEMES). None for a
    scheme with no model here (torchao-int4, hqq, gptq)."""
    row = SCHEMES[quant["method"]]
    return None if row.footprint is None else globals()[row.footprint](name, quant, compute_dtype, **overrides)


def bnb_scheme_footprint(name: str, quant: dict, compute_dtype: str, **overrides) -> dict:
    """A bitsandbytes scheme's bytes (bnb_footprint, above)."""
    return bnb_footprint(name, quant["method"], bool(quant.get("double_quant")), compute_dtype, **overrides)


def torchao_int8_footprint(name: str, quant: dict, compute_dtype: str, **overrides) -> dict:
    """torchao's int8 weights: the same layers quantized as bitsandbytes' int8; per output row an fp32 scale, whatever
    the compute dtype, and an int8 zero point (torchao's Int8Tensor)."""
    int8 = bnb_footprint(name, "int8", False, compute_dtype, **overrides)
    rows = sum(lay["out"] for lay in linear_layers(name, **overrides) if not lay["head"])
    constants = rows * (4 + 1)
    return int8 | {"constant_bytes": constants, "total": int8["weight_bytes"] + constants + int8["kept_bytes"]}


def _four_bit_constants(numel: int, double_quant: bool) -> int:
    blocks = math.ceil(numel / NF4_BLOCKSIZE)
    if not double_quant:
        return 4 * blocks
    # 8-bit absmax per block, one fp32 absmax per 256 of them, one fp32 offset per tensor
    return blocks + 4 * math.ceil(blocks / DOUBLE_QUANT_BLOCKSIZE) + 4


def float_format(dtype: str) -> dict:
    """Sign, exponent and mantissa (stored fraction) bits of a torch floating dtype, from torch.finfo."""
    import torch

    info = torch.finfo(getattr(torch, dtype))
    mantissa = round(-math.log2(info.eps))
    return {"bits": info.bits, "sign": 1, "exponent": info.bits - 1 - mantissa, "mantissa": mantissa}


def training_memory(name: str, method: str, seq_len: int, batch: int, lora: tuple = (8, "all-linear"),
                    checkpointing: bool = False, flash: bool = False, compute_dtype: str = "bfloat16") -> dict:
    """Weights + gradients + optimizer + activations of one training step, single device, Adam; `lora`: the
    adapters' (rank, targets).

    full-fp32: 4 + 4 + 8 bytes/param. full-mixed: 16-bit weights and gradients, fp32 master + moments
    (2 + 2 + 12, ZeRO's 16Ψ). lora: 16-bit frozen base; adapters in fp32 (peft upcasts them) with fp32
    gradients and moments, 16 bytes per adapter parameter. qlora: the same on an NF4 double-quant base.
    Activations at the compute dtype's width; CUDA context, allocator slack and logits not included.
    """
    n = parameter_count(name)
    if method == "full-fp32":
        states = model_state_bytes(n, n, 4, 4, ADAM_MOMENTS_BYTES)
        width = 4
    elif method == "full-mixed":
        states = model_state_bytes(n, n, 2, 2, MIXED_PRECISION_ADAM_BYTES)
        width = bytes_per_element(compute_dtype)
    elif method in ("lora", "qlora"):
        t = lora_parameters(name, *lora)  # (rank, targets)
        states = model_state_bytes(n, t, 2, 4, ADAM_MOMENTS_BYTES, trainable_bytes=4)
        if method == "qlora":
            states["weights"] = bnb_footprint(name, "nf4", double_quant=True, compute_dtype=compute_dtype)["total"]
            states["total"] = sum(v for k, v in states.items() if k != "total")
        width = bytes_per_element(compute_dtype)
    else:
        raise UserError(f"training method {method!r}: expected full-fp32, full-mixed, lora or qlora")
    act = activation_bytes(name, seq_len, batch, width, flash=flash, checkpointing=checkpointing)
    if checkpointing:
        arch = architecture(name)
        act += layer_activation_bytes(seq_len, batch, arch["hidden"], arch["heads"], width, flash)
    return {**{k: v for k, v in states.items() if k != "total"}, "activations": act, "total": states["total"] + act}
