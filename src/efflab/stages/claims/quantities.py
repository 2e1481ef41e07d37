"""Analytic quantities: each takes a claim's inputs and returns (value in the base unit, the arithmetic as text)."""
from __future__ import annotations

import importlib
import inspect

from ...config import UserError
from ...estimators import analytic


def _n(x: float) -> str:
    return f"{x:,.0f}" if float(x).is_integer() and abs(x) >= 1 else f"{x:.4g}"


def _gb(b: float) -> str:
    return f"{b / 1e9:.3g} GB"


def _overrides(i: dict) -> dict:
    return i.get("overrides") or {}


def _dense_matrix(i):
    return i["d"] * i["k"], f"{i['d']} × {i['k']}"


def _lora_matrix(i):
    return analytic.lora_matrix_parameters(i["d"], i["k"], i["r"]), f"r(d + k) = {i['r']} × ({i['d']} + {i['k']})"


def _lora_matrix_reduction_pct(i):
    lora, full = analytic.lora_matrix_parameters(i["d"], i["k"], i["r"]), i["d"] * i["k"]
    return 100 * (1 - lora / full), f"1 − {_n(lora)} / {_n(full)}"


def _lora_reduction_pct(i):
    n = analytic.parameter_count(i["model"])
    t = analytic.lora_parameters(i["model"], i["rank"], i["targets"])
    return 100 * (1 - t / n), f"1 − {_n(t)} LoRA / {_n(n)} total ({i['model']}, r={i['rank']}, {i['targets']})"


def _parameters(i):
    n = analytic.parameter_count(i["model"], **_overrides(i))
    return n, f"{i['model']} on the meta device: {_n(n)} parameters"


def _largest_layer(i):
    n = analytic.largest_layer_parameters(i["model"])
    return n, f"largest module of {i['model']}: {_n(n)} parameters (the shared embedding)"


def _linear_features(i):
    layer = next((lay for lay in analytic.linear_layers(i["model"], **_overrides(i)) if lay["name"] == i["module"]),
                 None)
    if layer is None:
        raise UserError(f"{i['model']}: no linear layer named {i['module']!r}")
    return layer[i["field"]], f"{i['module']} of {i['model']} with {_overrides(i)}: {layer['in']} -> {layer['out']}"


def _config_value(i):
    value = getattr(analytic.hf_config(i["model"]), i["key"])
    return value, f"{i['model']}'s config: {i['key']} = {value}"


def _mean(i):
    values = i["values"]
    return sum(values) / len(values), f"mean of {values} = {sum(values) / len(values):.4g}"


def _weights_bytes(i):
    n = analytic.parameter_count(i["model"], **_overrides(i))
    per = analytic.bytes_per_element(i["dtype"])
    extra = f" with {_overrides(i)}" if _overrides(i) else ""
    return n * per, f"{_n(n)} params ({i['model']}{extra}) × {per:g} B = {_n(n * per)} B"


def _bytes_per_param(i):
    component = i["component"]
    if component in ("weights", "gradients"):
        return analytic.bytes_per_element(i["dtype"]), f"{i['dtype']}: {analytic.bytes_per_element(i['dtype']):g} B"
    if component == "adam":
        return analytic.ADAM_MOMENTS_BYTES, "momentum 4 B + variance 4 B (fp32)"
    return analytic.MIXED_PRECISION_ADAM_BYTES, "fp32 master 4 B + momentum 4 B + variance 4 B"


def _model_states(i):
    n = analytic.parameter_count(i["model"])
    trainable = round(n * i.get("trainable_fraction", 1.0))
    states = analytic.model_state_bytes(n, trainable, i.get("weight_bytes", 0), i["grad_bytes"], i["optimizer_bytes"],
                                        trainable_bytes=i.get("trainable_bytes"))
    how = f"{_n(n)} params ({i['model']})"
    if "trainable_fraction" in i:
        how += f", {_n(trainable)} trainable ({100 * i['trainable_fraction']:g}%)"
    if i.get("base_quant") == "nf4":
        fp = analytic.bnb_footprint(i["model"], "nf4", double_quant=True)
        states["weights"] = fp["total"]
        states["total"] = sum(v for k, v in states.items() if k != "total")
        how += "; NF4 base: " + _bnb_text(fp)
    else:
        how += f"; weights {i.get('weight_bytes', 0)} B/param"
    how += (f"; grads {i['grad_bytes']} B, optimizer {i['optimizer_bytes']} B per trainable param → "
            + ", ".join(f"{k} {_gb(v)}" for k, v in states.items() if v))
    return states[i["part"]], how


def _activations(i):
    b = analytic.activation_bytes(i["model"], i["seq_len"], i["batch"], i["bytes"], flash=i.get("flash", False),
                                  checkpointing=i.get("checkpointing", False))
    a = analytic.architecture(i["model"])
    s, bt, h, heads, n, layers = i["seq_len"], i["batch"], a["hidden"], a["heads"], i["bytes"], a["layers"]
    if i.get("checkpointing"):
        how = f"L·N_b·sbh = {layers} × {n} × {s}·{bt}·{h}"
    else:
        how = (f"L((16N_b+2)sbh + (2N_b+1)as²b) = {layers} × ({16 * n + 2}·{s}·{bt}·{h} + "
               f"{2 * n + 1}·{heads}·{s}²·{bt})")
    return b, f"{how} = {_n(b)} B"


def _activation_dtype_ratio(i):
    half = analytic.activation_bytes(i["model"], i["seq_len"], i["batch"], 2)
    full = analytic.activation_bytes(i["model"], i["seq_len"], i["batch"], 4)
    return half / full, f"{_gb(half)} at N_b=2 / {_gb(full)} at N_b=4"


def _kv_cache(i):
    b = analytic.kv_cache_bytes(i["model"], i["seq_len"], i["batch"], i["bytes"])
    a = analytic.architecture(i["model"])
    return b, (f"2 × {a['layers']} layers × {a['kv_heads']} heads × {a['head_dim']} × {i['seq_len']} tokens × "
               f"{i['batch']} × {i['bytes']} B = {_n(b)} B")


def _checkpointing_extra_compute_pct(i):
    return 100 * (analytic.flops_per_token(1, checkpointing=True) / analytic.flops_per_token(1) - 1), \
        "8N / 6N FLOPs per token (one extra forward)"


def _zero_per_device(i):
    b = analytic.zero_model_state_bytes(i["psi"], i["stage"], i["n_devices"], i["k"])
    return b, f"ZeRO stage {i['stage']}, Ψ={i['psi']:.3g}, K={i['k']}, N_d={i['n_devices']}: {_gb(b)}"


def _deepspeed_zero3(i):
    total = analytic.parameter_count(i["model"])
    largest = analytic.largest_layer_parameters(i["model"])
    est = analytic.deepspeed_zero3_estimate(total, largest, i["gpus_per_node"], i["nodes"], i["offload_param"],
                                            i["offload_optimizer"], i["zero_init"])
    return est[i["side"]], (f"DeepSpeed's formula with {_n(total)} params, largest layer {_n(largest)}: "
                            f"{i['side']} {_n(est[i['side']])} B")


def _bnb_text(fp: dict) -> str:
    return (f"{_n(fp['quantized_params'])} quantized params → {_n(fp['weight_bytes'])} B + constants "
            f"{_n(fp['constant_bytes'])} B + {_n(fp['kept_params'])} params kept 16-bit {_n(fp['kept_bytes'])} B "
            f"= {_n(fp['total'])} B")


def _bnb_bytes(i):
    fp = analytic.bnb_footprint(i["model"], i["method"], double_quant=i.get("double_quant", False),
                                **_overrides(i))
    return fp["total"], f"{i['method']}: " + _bnb_text(fp)


def _bnb_ratio(i):
    fp = analytic.bnb_footprint(i["model"], i["method"], double_quant=i.get("double_quant", False))
    base = analytic.parameter_count(i["model"]) * analytic.bytes_per_element(i["base_dtype"])
    return base / fp["total"], f"{_gb(base)} {i['base_dtype']} / {_gb(fp['total'])} {i['method']} ({_bnb_text(fp)})"


def _float_bits(i):
    f = analytic.float_format(i["dtype"])
    if i["field"] == "bytes":
        return f["bits"] / 8, f"torch.finfo({i['dtype']}).bits = {f['bits']}"
    return f[i["field"]], f"torch.finfo({i['dtype']}): 1 sign + {f['exponent']} exponent + {f['mantissa']} mantissa"


def _library_default(i):
    module, _, attr = i["target"].rpartition(".")
    target = getattr(importlib.import_module(module), attr)
    value = inspect.signature(target).parameters[i["arg"]].default
    return value, f"{i['target']}({i['arg']}={value!r}) in the installed torch"


def _effective_batch(i):
    return i["batch"] * i["accumulation"], f"{i['batch']} × {i['accumulation']}"


def _training_memory(i):
    keys = ("seq_len", "batch", "checkpointing", "flash", "compute_dtype")
    lora = (i.get("rank", 8), i.get("targets", "all-linear"))
    m = analytic.training_memory(i["model"], i["method"], lora=lora, **{k: i[k] for k in keys if k in i})
    parts = ", ".join(f"{k} {_gb(v)}" for k, v in m.items() if k != "total" and v)
    return m["total"], f"{i['model']} {i['method']}: {parts}"


def _mixed_precision_saving_pct(i):
    m, s, b = i["model"], i["seq_len"], i["batch"]
    full = analytic.training_memory(m, "full-fp32", s, b)["total"]
    mixed = analytic.training_memory(m, "full-mixed", s, b, compute_dtype="float16")["total"]
    return 100 * (1 - mixed / full), f"1 − {_gb(mixed)} mixed / {_gb(full)} fp32 ({i['model']}, Adam, activations)"


def _dtype_ratio(i):
    return (analytic.bytes_per_element(i["to"]) / analytic.bytes_per_element(i["from"]),
            f"{analytic.bytes_per_element(i['to']):g} B / {analytic.bytes_per_element(i['from']):g} B")


def _adam_memory_multiple(i):
    return (4 + analytic.ADAM_MOMENTS_BYTES) / 4, "(weights 4 B + m 4 B + v 4 B) / weights 4 B"


QUANTITIES = {
    "dense_matrix": _dense_matrix, "lora_matrix": _lora_matrix, "lora_matrix_reduction_pct": _lora_matrix_reduction_pct,
    "lora_reduction_pct": _lora_reduction_pct, "parameters": _parameters, "largest_layer_parameters": _largest_layer,
    "linear_features": _linear_features, "mean": _mean, "weights_bytes": _weights_bytes,
    "bytes_per_param": _bytes_per_param, "model_states": _model_states,
    "activations": _activations, "activation_dtype_ratio": _activation_dtype_ratio,
    "kv_cache": _kv_cache,
    "checkpointing_extra_compute_pct": _checkpointing_extra_compute_pct, "zero_per_device": _zero_per_device,
    "deepspeed_zero3": _deepspeed_zero3, "bnb_bytes": _bnb_bytes, "bnb_ratio": _bnb_ratio, "float_bits": _float_bits,
    "library_default": _library_default, "effective_batch": _effective_batch, "training_memory": _training_memory,
    "mixed_precision_saving_pct": _mixed_precision_saving_pct, "dtype_ratio": _dtype_ratio,
    "adam_memory_multiple": _adam_memory_multiple, "config_value": _config_value,
}
# Quantities that are a definition (a parameter count, a shape, a format, a library default or another identity)
# rather than arithmetic on the seed's own inputs: the evidence they give is of that kind.
DEFINITIONS = frozenset({"dense_matrix", "lora_matrix", "lora_matrix_reduction_pct", "lora_reduction_pct", "parameters",
                         "largest_layer_parameters", "linear_features", "float_bits", "library_default",
                         "bytes_per_param", "effective_batch", "dtype_ratio", "adam_memory_multiple", "config_value"})


def compute(quantity: str, inputs: dict) -> tuple[float, str]:
    return QUANTITIES[quantity](inputs)

