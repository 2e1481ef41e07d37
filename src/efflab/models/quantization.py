"""Post-training quantization schemes, one place for every library efflab quantizes with: a scheme (params
`quant`) becomes the transformers quantization config that loads a model with it (bitsandbytes, torchao, HQQ,
GPTQ through gptqmodel),
or `Unavailable` saying why it cannot run here. Also what every stage reads off a quantized model: which of its
parts are quantized, and how many bytes its weights take.

transformers, torchao and hqq take seconds to import: they are imported inside the functions that use them.
"""
from __future__ import annotations

import importlib.util

import torch

from ..schemes import DEFAULT_BITS, scheme

DEFAULT_GROUP_SIZE = 64


class Unavailable(Exception):
    """The scheme cannot run on this machine; the message says why (recorded as `unavailable: <message>`)."""


def library(quant: dict | None) -> str | None:
    """The library a scheme quantizes with; None for full precision."""
    row = scheme(quant)
    return None if row is None else row.library


def config(quant: dict | None, compute_dtype: torch.dtype, device: torch.device, calibration: dict | None = None):
    """The transformers quantization config that loads a model with `quant` (its builder, schemes.SCHEMES); None for
    full precision. Raises Unavailable where the scheme's library or kernels are missing on `device`. A scheme that
    learns from data (gptq) quantizes on `calibration`: {"texts": [...], "tokenizer": folder}."""
    row = scheme(quant)
    return None if row is None else globals()[row.builder](quant, compute_dtype, device, calibration)


def loading(quant: dict | None, compute_dtype: torch.dtype, device: torch.device, calibration: dict | None = None) -> dict:
    """What from_pretrained takes to load a model with `quant`: its quantization config (`config`) and the device map
    that places it; nothing for full precision."""
    row = scheme(quant)
    if row is None:
        return {}
    # (HQQ refuses a device map naming the CPU; the plain device is the same placement)
    placed = {"": device.index or 0} if device.type == "cuda" else "cpu" if row.library == "hqq" else {"": "cpu"}
    return {"quantization_config": config(quant, compute_dtype, device, calibration), "device_map": placed}


def check_loaded(model, quant: dict | None) -> None:
    """A model loaded with a bitsandbytes scheme runs quantized: NotImplementedError saying why where transformers
    quantized none of its layers (unquantized_reason) or bitsandbytes cannot run one of them (runs_quantized)."""
    if library(quant) != "bitsandbytes":
        return
    if not quantized_parts(model):
        raise NotImplementedError(unquantized_reason(model, quant))
    runs_quantized(model, quant)


def runs_quantized(model, quant: dict) -> None:
    """One two-token forward of the quantized model: where bitsandbytes' kernel cannot run one of its layers as the
    family calls it (DeepSeek-V3's kv_b_proj takes a 4-D latent, which the CPU int8 kernel's row scales do not
    broadcast over), NotImplementedError naming the layer, so the scheme is unavailable, never a crash later."""
    import traceback

    ids = torch.tensor([[model.config.bos_token_id or 0] * 2], device=model.device)
    # 4-bit in training mode: an eval-mode forward would repack its weights for inference only (adapter_check); int8
    # in eval mode, the path its inference takes (training mode's differs)
    model.train(scheme(quant).bits == 4)
    try:
        with torch.no_grad():
            model(input_ids=ids)
    except (RuntimeError, AssertionError, ValueError) as err:
        frames = [f for f, _ in traceback.walk_tb(err.__traceback__) if "bitsandbytes" in f.f_code.co_filename
                  and isinstance(f.f_locals.get("self"), torch.nn.Module)]
        if not frames:
            raise
        layer = frames[-1].f_locals["self"]
        name = next((n for n, m in model.named_modules() if m is layer), type(layer).__name__)
        raise NotImplementedError(f"{quant['method']}: bitsandbytes' {type(layer).__name__} cannot run "
                                  f"{type(model).__name__}'s {name}: {str(err).splitlines()[0]}") from None


def unquantized_reason(model, quant: dict) -> str:
    """Why a bitsandbytes scheme left every layer in full precision: transformers converts modules whose type is
    exactly nn.Linear, and some families subclass it (Falcon's FalconLinear). A model that ran unquantized must
    never be recorded as quantized."""
    linear = sorted({type(m).__name__ for m in model.modules()
                     if isinstance(m, torch.nn.Linear) and type(m) is not torch.nn.Linear})
    kinds = f"its linear layers are {', '.join(linear)}, subclasses of nn.Linear, which" if linear else "it has no " \
        "nn.Linear layer, and"
    return (f"{quant['method']}: transformers' bitsandbytes integration quantized no layer of "
            f"{type(model).__name__}: {kinds} it converts only exact nn.Linear modules")


def bnb_config(quant: dict, compute_dtype: torch.dtype, device=None, calibration=None):
    """A transformers BitsAndBytesConfig for a bitsandbytes scheme."""
    from transformers import BitsAndBytesConfig

    if quant["method"] == "int8":
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=quant["method"],
                              bnb_4bit_use_double_quant=bool(quant.get("double_quant", False)),
                              bnb_4bit_compute_dtype=compute_dtype)


def four_bit_kernel_dtype(compute_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype bitsandbytes' 4-bit matmul computes in: its `bnb_4bit_compute_dtype`, except on a CPU with
    AVX512-BF16, where an eval-mode layer repacks its weights for a fused kernel that takes bf16 inputs only (the
    layer's output is then bf16-rounded whatever the compute dtype)."""
    if device.type != "cpu":
        return compute_dtype
    from bitsandbytes.functional import has_avx512bf16

    return torch.bfloat16 if has_avx512bf16() else compute_dtype


def torchao_config(quant: dict, compute_dtype: torch.dtype, device: torch.device, calibration=None):
    """A torchao scheme whose config class takes no settings (its row's `config`): int8 weight-only, dynamic int8
    activations with int8 weights."""
    import torchao.quantization
    from transformers import TorchAoConfig

    return TorchAoConfig(getattr(torchao.quantization, scheme(quant).config)())


def torchao_int4_config(quant: dict, compute_dtype: torch.dtype, device: torch.device, calibration=None):
    """torchao's int4 weight-only, packed for CUDA's tinygemm kernel at the scheme's group size."""
    from torchao.quantization import Int4WeightOnlyConfig
    from transformers import TorchAoConfig

    if device.type != "cuda":
        raise Unavailable("torchao's int4 weight-only packs for CUDA's tinygemm kernel (or XPU/NPU); on a CPU "
                          "torchao keeps int4 values unpacked in int8, no smaller than torchao-int8")
    return TorchAoConfig(Int4WeightOnlyConfig(group_size=quant.get("group_size", DEFAULT_GROUP_SIZE),
                                              int4_packing_format="tile_packed_to_4d"))


def hqq_config(quant: dict, compute_dtype=None, device=None, calibration=None):
    """HQQ (half-quadratic quantization, no calibration data) at the scheme's bits and group size, through
    transformers' HqqConfig: where this transformers' HQQ quantizer cannot load weights, or the hqq package is
    missing, Unavailable says which."""
    import transformers
    from transformers import HqqConfig
    from transformers.quantizers.base import HfQuantizer
    from transformers.quantizers.quantizer_hqq import HqqHfQuantizer

    if HqqHfQuantizer.get_quantize_ops is HfQuantizer.get_quantize_ops:
        raise Unavailable(f"transformers {transformers.__version__}'s HQQ quantizer has no weight-loading operations "
                          "(its get_quantize_ops is the base class's 'HQQ is not available yet')")
    if importlib.util.find_spec("hqq") is None:
        raise Unavailable("hqq needs the hqq package, which is not installed (DISABLE_CUDA=1 pip install hqq on a CPU)")
    return HqqConfig(nbits=quant.get("bits", DEFAULT_BITS), group_size=quant.get("group_size", DEFAULT_GROUP_SIZE))


def gptq_config(quant: dict, compute_dtype, device, calibration: dict | None):
    """GPTQ (Frantar et al. 2022: each layer's weights rounded to minimise its output error on calibration data)
    through transformers' GPTQConfig and the gptqmodel package, at the scheme's bits and group size."""
    if importlib.util.find_spec("gptqmodel") is None:
        raise Unavailable("gptq needs the gptqmodel package, which is not installed (pip install gptqmodel: it "
                          "builds its kernels from source; docs/stages/quantize.md says which versions match efflab's "
                          "torch and transformers)")
    from transformers import GPTQConfig

    calibration = calibration or {}
    return GPTQConfig(bits=quant.get("bits", DEFAULT_BITS), group_size=quant.get("group_size", GPTQ_GROUP_SIZE),
                      dataset=calibration.get("texts"), tokenizer=calibration.get("tokenizer"))


GPTQ_GROUP_SIZE = 128  # GPTQ's and gptqmodel's usual group


def quantized_kind(module) -> str | None:
    """The class that makes `module` a quantized layer: its own (bitsandbytes' Linear8bitLt and Linear4bit, HQQ's
    HQQLinear, gptqmodel's QuantLinear kernels) or its weight's (torchao's quantized tensors in an nn.Linear); None for any other module."""
    if type(module).__module__.split(".")[0] in ("bitsandbytes", "hqq", "gptqmodel") and hasattr(module, "in_features"):
        return type(module).__name__
    weight = getattr(module, "weight", None)
    if isinstance(weight, torch.Tensor) and type(weight).__module__.split(".")[0] == "torchao":
        return type(weight).__name__
    return None


def quantized_parts(model) -> dict[str, int]:
    """The quantized layer classes the model holds (`quantized_kind`), with their counts: evidence that it runs
    quantized, not de-quantized or reloaded in full precision."""
    counts: dict[str, int] = {}
    for module in model.modules():
        kind = quantized_kind(module)
        if kind:
            counts[kind] = counts.get(kind, 0) + 1
    return counts


def tensor_bytes(tensor: torch.Tensor) -> int:
    """Bytes a tensor holds: a tensor subclass (torchao's quantized weights) counts its inner tensors (data,
    scales, zero points), not its logical shape at its nominal dtype."""
    if hasattr(tensor, "__tensor_flatten__"):
        names, _ = tensor.__tensor_flatten__()
        return sum(tensor_bytes(getattr(tensor, name)) for name in names)
    return tensor.nelement() * tensor.element_size()


# State-dict entries bitsandbytes builds only to serialize (a format byte, a packed copy of the 4-bit metadata):
# not held in memory.
SERIALIZED_ONLY = (".weight_format", ".quant_state.bitsandbytes__")


def footprint_bytes(model) -> int:
    """Bytes of the model's weights and quantization state (scales, zero points, code books), each held tensor once
    (a tied head, a code book shared by layers): what its state dict holds, torchao's quantized weights unpacked
    into their inner tensors."""
    seen, total = set(), 0
    for name, value in model.state_dict(keep_vars=True).items():
        if not isinstance(value, torch.Tensor) or any(part in name for part in SERIALIZED_ONLY):
            continue
        key = id(value) if hasattr(value, "__tensor_flatten__") else value.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += tensor_bytes(value)
    return total
