"""Stage claims: every numeric claim of the seed texts, reported vs reproduced.

The registry (workflow/claims.yaml, schema workflow/schemas/claims.schema.yaml) says for each claim what
it would take to check it. analytic claims are computed by efflab.estimate from a shipped model config;
measured claims are read from this pipeline's own results (a small model on this machine: the scale
difference is stated in each row); hardware claims need a GPU and are marked so until run on one. Each
row gets a verdict: reproduced (within tolerance), differs (with the reason found), inconclusive (a measured
figure whose 95% CI crosses an edge of the tolerance band: reproduced needs the whole CI inside it), not
reproducible here (with why) or needs GPU: <which>. A hardware claim whose estimate the registry marks
sufficient (a footprint whose only missing piece is the real weights) gets an analytic verdict, "reproduced
(analytic)" or "differs (analytic)", counted with reproduced / differs, until a GPU measurement replaces it.
Writes claims.csv and claims.md.

Byte figures are compared like with like: a seed's KB/MB/GB are read in the claim's recorded unit convention
(`units` in the registry: binary where the seed's code, the tool that printed the figure, or the arithmetic
shows its GB are GiB, with that evidence), decimal otherwise; a figure that fits only in the other convention
differs, and the row says so.
"""
from __future__ import annotations

import inspect
import json
import logging
import math
from pathlib import Path

import jsonschema
import pandas as pd
import yaml

from . import cli, estimate, records
from .config import REPO_ROOT, UserError, _schema_message

log = logging.getLogger("efflab")

REGISTRY = REPO_ROOT / "workflow" / "claims.yaml"
SCHEMA = REPO_ROOT / "workflow" / "schemas" / "claims.schema.yaml"

# What one reported unit is in the base unit its quantity returns (bytes, parameters, a plain number).
UNIT_SCALE = {"params": 1, "M params": 1e6, "B params": 1e9, "bytes": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9,
              "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TB/s": 1e12, "bytes/param": 1, "bits": 1, "%": 1, "x": 1,
              "count": 1, "cycles": 1, "s": 1}
# Byte units whose prefix a seed may write loosely: the power of the prefix, and the convention the label itself
# names. A claim's `units.convention` (workflow/claims.yaml) says how the seed's label is to be read; without
# one the label is taken at its word (KB/MB/GB decimal, KiB/MiB/GiB binary).
PREFIX_POWER = {"KB": 1, "MB": 2, "GB": 3, "KiB": 1, "MiB": 2, "GiB": 3}
LABEL_CONVENTION = {"KB": "decimal", "MB": "decimal", "GB": "decimal",
                    "KiB": "binary", "MiB": "binary", "GiB": "binary"}
CONVENTION_BASE = {"decimal": 1000, "binary": 1024}
# The unit a label means under the other convention: decimal and binary prefixes are the usual confusion.
OTHER_UNIT = {"KB": "KiB", "MB": "MiB", "GB": "GiB", "KiB": "KB", "MiB": "MB", "GiB": "GB"}
VERDICTS = ("reproduced", "differs", "inconclusive", "not reproducible here", "needs GPU")


# ---------------------------------------------------------------- registry

def load_registry(path: Path = REGISTRY) -> list[dict]:
    """Read and validate the claims registry; UserError names the first bad key."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: claims registry not found")
    doc = yaml.safe_load(path.read_text())
    errors = sorted(jsonschema.Draft202012Validator(yaml.safe_load(SCHEMA.read_text())).iter_errors(doc),
                    key=lambda e: list(map(str, e.absolute_path)))
    if errors:
        raise UserError(f"{path}: {_schema_message(errors[0])}")
    seen = set()
    for claim in doc["claims"]:
        if claim["id"] in seen:
            raise UserError(f"{path}: claim id {claim['id']!r} appears twice")
        seen.add(claim["id"])
        if "quantity" in claim and claim["quantity"] not in QUANTITIES:
            raise UserError(f"{path}: {claim['id']}.quantity: {claim['quantity']!r} is not one of "
                            f"{sorted(QUANTITIES)}")
        if "units" in claim and claim["reported"]["unit"] not in PREFIX_POWER:
            raise UserError(f"{path}: {claim['id']}.units: a unit convention applies to {', '.join(PREFIX_POWER)}, "
                            f"not {claim['reported']['unit']!r}")
    return doc["claims"]


# ---------------------------------------------------------------- analytic quantities
# Each takes the claim's inputs and returns (value in the base unit, the arithmetic as text).

def _n(x: float) -> str:
    return f"{x:,.0f}" if float(x).is_integer() and abs(x) >= 1 else f"{x:.4g}"


def _gb(b: float) -> str:
    return f"{b / 1e9:.3g} GB"


def _overrides(i: dict) -> dict:
    return i.get("overrides") or {}


def _dense_matrix(i):
    return i["d"] * i["k"], f"{i['d']} × {i['k']}"


def _lora_matrix(i):
    return estimate.lora_matrix_parameters(i["d"], i["k"], i["r"]), f"r(d + k) = {i['r']} × ({i['d']} + {i['k']})"


def _lora_matrix_reduction_pct(i):
    lora, full = estimate.lora_matrix_parameters(i["d"], i["k"], i["r"]), i["d"] * i["k"]
    return 100 * (1 - lora / full), f"1 − {_n(lora)} / {_n(full)}"


def _lora_reduction_pct(i):
    n = estimate.parameter_count(i["model"])
    t = estimate.lora_parameters(i["model"], i["rank"], i["targets"])
    return 100 * (1 - t / n), f"1 − {_n(t)} LoRA / {_n(n)} total ({i['model']}, r={i['rank']}, {i['targets']})"


def _parameters(i):
    n = estimate.parameter_count(i["model"], **_overrides(i))
    return n, f"{i['model']} on the meta device: {_n(n)} parameters"


def _largest_layer(i):
    n = estimate.largest_layer_parameters(i["model"])
    return n, f"largest module of {i['model']}: {_n(n)} parameters (the shared embedding)"


def _linear_features(i):
    layer = next((lay for lay in estimate.linear_layers(i["model"], **_overrides(i)) if lay["name"] == i["module"]),
                 None)
    if layer is None:
        raise UserError(f"{i['model']}: no linear layer named {i['module']!r}")
    return layer[i["field"]], f"{i['module']} of {i['model']} with {_overrides(i)}: {layer['in']} -> {layer['out']}"


def _mean(i):
    values = i["values"]
    return sum(values) / len(values), f"mean of {values} = {sum(values) / len(values):.4g}"


def _weights_bytes(i):
    n = estimate.parameter_count(i["model"], **_overrides(i))
    per = estimate.bytes_per_element(i["dtype"])
    extra = f" with {_overrides(i)}" if _overrides(i) else ""
    return n * per, f"{_n(n)} params ({i['model']}{extra}) × {per:g} B = {_n(n * per)} B"


def _bytes_per_param(i):
    component = i["component"]
    if component in ("weights", "gradients"):
        return estimate.bytes_per_element(i["dtype"]), f"{i['dtype']}: {estimate.bytes_per_element(i['dtype']):g} B"
    if component == "adam":
        return estimate.ADAM_MOMENTS_BYTES, "momentum 4 B + variance 4 B (fp32)"
    return estimate.MIXED_PRECISION_ADAM_BYTES, "fp32 master 4 B + momentum 4 B + variance 4 B"


def _model_states(i):
    n = estimate.parameter_count(i["model"])
    trainable = round(n * i.get("trainable_fraction", 1.0))
    states = estimate.model_state_bytes(n, trainable, i.get("weight_bytes", 0), i["grad_bytes"], i["optimizer_bytes"],
                                        trainable_bytes=i.get("trainable_bytes"))
    how = f"{_n(n)} params ({i['model']})"
    if "trainable_fraction" in i:
        how += f", {_n(trainable)} trainable ({100 * i['trainable_fraction']:g}%)"
    if i.get("base_quant") == "nf4":
        fp = estimate.bnb_footprint(i["model"], "nf4", double_quant=True)
        states["weights"] = fp["total"]
        states["total"] = sum(v for k, v in states.items() if k != "total")
        how += "; NF4 base: " + _bnb_text(fp)
    else:
        how += f"; weights {i.get('weight_bytes', 0)} B/param"
    how += (f"; grads {i['grad_bytes']} B, optimizer {i['optimizer_bytes']} B per trainable param → "
            + ", ".join(f"{k} {_gb(v)}" for k, v in states.items() if v))
    return states[i["part"]], how


def _activations(i):
    b = estimate.activation_bytes(i["model"], i["seq_len"], i["batch"], i["bytes"], flash=i.get("flash", False),
                                  checkpointing=i.get("checkpointing", False))
    a = estimate.architecture(i["model"])
    s, bt, h, heads, n, layers = i["seq_len"], i["batch"], a["hidden"], a["heads"], i["bytes"], a["layers"]
    if i.get("checkpointing"):
        how = f"L·N_b·sbh = {layers} × {n} × {s}·{bt}·{h}"
    else:
        how = (f"L((16N_b+2)sbh + (2N_b+1)as²b) = {layers} × ({16 * n + 2}·{s}·{bt}·{h} + "
               f"{2 * n + 1}·{heads}·{s}²·{bt})")
    return b, f"{how} = {_n(b)} B"


def _activation_dtype_ratio(i):
    half = estimate.activation_bytes(i["model"], i["seq_len"], i["batch"], 2)
    full = estimate.activation_bytes(i["model"], i["seq_len"], i["batch"], 4)
    return half / full, f"{_gb(half)} at N_b=2 / {_gb(full)} at N_b=4"


def _activation_exponent(i):
    m, s, flash = i["model"], i["seq_len"], i["flash"]
    ratio = estimate.activation_bytes(m, 2 * s, 1, 2, flash=flash) / estimate.activation_bytes(m, s, 1, 2, flash=flash)
    return math.log2(ratio), f"log2(M({2 * s}) / M({s})) = log2({ratio:.3f}) ({'flash' if flash else 'eager'})"


def _kv_cache(i):
    b = estimate.kv_cache_bytes(i["model"], i["seq_len"], i["batch"], i["bytes"])
    a = estimate.architecture(i["model"])
    return b, (f"2 × {a['layers']} layers × {a['kv_heads']} heads × {a['head_dim']} × {i['seq_len']} tokens × "
               f"{i['batch']} × {i['bytes']} B = {_n(b)} B")


def _checkpointing_extra_compute_pct(i):
    return 100 * (estimate.flops_per_token(1, checkpointing=True) / estimate.flops_per_token(1) - 1), \
        "8N / 6N FLOPs per token (one extra forward)"


def _zero_per_device(i):
    b = estimate.zero_model_state_bytes(i["psi"], i["stage"], i["n_devices"], i["k"])
    return b, f"ZeRO stage {i['stage']}, Ψ={i['psi']:.3g}, K={i['k']}, N_d={i['n_devices']}: {_gb(b)}"


def _deepspeed_zero3(i):
    total = estimate.parameter_count(i["model"])
    largest = estimate.largest_layer_parameters(i["model"])
    est = estimate.deepspeed_zero3_estimate(total, largest, i["gpus_per_node"], i["nodes"], i["offload_param"],
                                            i["offload_optimizer"], i["zero_init"])
    return est[i["side"]], (f"DeepSpeed's formula with {_n(total)} params, largest layer {_n(largest)}: "
                            f"{i['side']} {_n(est[i['side']])} B")


def _bnb_text(fp: dict) -> str:
    return (f"{_n(fp['quantized_params'])} quantized params → {_n(fp['weight_bytes'])} B + constants "
            f"{_n(fp['constant_bytes'])} B + {_n(fp['kept_params'])} params kept 16-bit {_n(fp['kept_bytes'])} B "
            f"= {_n(fp['total'])} B")


def _bnb_bytes(i):
    fp = estimate.bnb_footprint(i["model"], i["method"], double_quant=i.get("double_quant", False),
                                **_overrides(i))
    return fp["total"], f"{i['method']}: " + _bnb_text(fp)


def _bnb_ratio(i):
    fp = estimate.bnb_footprint(i["model"], i["method"], double_quant=i.get("double_quant", False))
    base = estimate.parameter_count(i["model"]) * estimate.bytes_per_element(i["base_dtype"])
    return base / fp["total"], f"{_gb(base)} {i['base_dtype']} / {_gb(fp['total'])} {i['method']} ({_bnb_text(fp)})"


def _float_bits(i):
    f = estimate.float_format(i["dtype"])
    if i["field"] == "bytes":
        return f["bits"] / 8, f"torch.finfo({i['dtype']}).bits = {f['bits']}"
    return f[i["field"]], f"torch.finfo({i['dtype']}): 1 sign + {f['exponent']} exponent + {f['mantissa']} mantissa"


def _library_default(i):
    import importlib

    module, _, attr = i["target"].rpartition(".")
    target = getattr(importlib.import_module(module), attr)
    value = inspect.signature(target).parameters[i["arg"]].default
    return value, f"{i['target']}({i['arg']}={value!r}) in the installed torch"


def _effective_batch(i):
    return i["batch"] * i["accumulation"], f"{i['batch']} × {i['accumulation']}"


def _training_memory(i):
    keys = ("seq_len", "batch", "rank", "targets", "checkpointing", "flash", "compute_dtype")
    m = estimate.training_memory(i["model"], i["method"], **{k: i[k] for k in keys if k in i})
    parts = ", ".join(f"{k} {_gb(v)}" for k, v in m.items() if k != "total" and v)
    return m["total"], f"{i['model']} {i['method']}: {parts}"


def _mixed_precision_saving_pct(i):
    m, s, b = i["model"], i["seq_len"], i["batch"]
    full = estimate.training_memory(m, "full-fp32", s, b)["total"]
    mixed = estimate.training_memory(m, "full-mixed", s, b, compute_dtype="float16")["total"]
    return 100 * (1 - mixed / full), f"1 − {_gb(mixed)} mixed / {_gb(full)} fp32 ({i['model']}, Adam, activations)"


def _dtype_ratio(i):
    return (estimate.bytes_per_element(i["to"]) / estimate.bytes_per_element(i["from"]),
            f"{estimate.bytes_per_element(i['to']):g} B / {estimate.bytes_per_element(i['from']):g} B")


def _adam_memory_multiple(i):
    return (4 + estimate.ADAM_MOMENTS_BYTES) / 4, "(weights 4 B + m 4 B + v 4 B) / weights 4 B"


QUANTITIES = {
    "dense_matrix": _dense_matrix, "lora_matrix": _lora_matrix, "lora_matrix_reduction_pct": _lora_matrix_reduction_pct,
    "lora_reduction_pct": _lora_reduction_pct, "parameters": _parameters, "largest_layer_parameters": _largest_layer,
    "linear_features": _linear_features, "mean": _mean, "weights_bytes": _weights_bytes,
    "bytes_per_param": _bytes_per_param, "model_states": _model_states,
    "activations": _activations, "activation_dtype_ratio": _activation_dtype_ratio,
    "activation_exponent": _activation_exponent, "kv_cache": _kv_cache,
    "checkpointing_extra_compute_pct": _checkpointing_extra_compute_pct, "zero_per_device": _zero_per_device,
    "deepspeed_zero3": _deepspeed_zero3, "bnb_bytes": _bnb_bytes, "bnb_ratio": _bnb_ratio, "float_bits": _float_bits,
    "library_default": _library_default, "effective_batch": _effective_batch, "training_memory": _training_memory,
    "mixed_precision_saving_pct": _mixed_precision_saving_pct, "dtype_ratio": _dtype_ratio,
    "adam_memory_multiple": _adam_memory_multiple,
}


def compute(quantity: str, inputs: dict) -> tuple[float, str]:
    return QUANTITIES[quantity](inputs)


# ---------------------------------------------------------------- measured: this pipeline's results

class NotHere(Exception):
    """The results a measured claim needs are not in this results folder."""


def _read(path: Path) -> dict:
    if not path.is_file():
        raise NotHere(f"no {path} (run the stage that writes it)")
    metrics = json.loads(path.read_text())
    if not records.is_ok(metrics):  # a job that failed or was skipped measured nothing
        raise NotHere(f"{path.parent.name} is {metrics['status']}: {metrics.get('reason', 'no reason given')}")
    return metrics


def _scale_note(layout) -> str:
    path = layout.metrics("base_model")
    if not path.is_file():
        return ""
    base = json.loads(path.read_text())
    env = base.get("environment", {})
    return (f"measured here on {base.get('source')} ({base.get('parameters', 0):,} params, {base.get('dtype')}) "
            f"on {env.get('device', '?')}{', ' + env['gpu'] if env.get('gpu') else ''}; the seed's figure is for "
            f"billion-parameter models on GPUs")


def _quantize_ratio(layout, metric: dict) -> tuple[float, str]:
    m = _read(layout.metrics("quantize", metric["scheme"]))
    dtype = m["compute_dtype"]
    if dtype in ("bfloat16", "float16"):
        return m["footprint_ratio_vs_base"], (f"get_memory_footprint: {m['base_memory_footprint_bytes']:,} B {dtype} / "
                                              f"{m['memory_footprint_bytes']:,} B {metric['scheme']}")
    # A float32 baseline (CPU without fast bf16): re-express the parts bitsandbytes leaves unquantized at
    # 16 bits on both sides, so the ratio answers the seed's question (quantized vs 16-bit weights).
    fp = estimate.bnb_footprint(str(layout.base_model()), "int8")
    width = estimate.bytes_per_element(dtype)
    base16 = m["base_memory_footprint_bytes"] * 2 / width
    quant16 = m["memory_footprint_bytes"] - fp["kept_params"] * (width - 2)
    return base16 / quant16, (f"baseline ran in {dtype}: footprints re-expressed at 16 bits "
                              f"({base16:,.0f} B / {quant16:,.0f} B; measured vs {dtype}: "
                              f"{m['footprint_ratio_vs_base']:.2f}×)")


def _finetune_runs(layout) -> list[dict]:
    folder = layout.out("finetune")
    runs = [json.loads(p.read_text()) for p in sorted(folder.glob("*/metrics.json"))] if folder.is_dir() else []
    return records.ok(runs)  # runs that did not train measured nothing


def _finetune_trainable(layout, metric: dict) -> tuple[float, str]:
    runs = [r for r in _finetune_runs(layout) if r.get("method") == metric["method"]]
    if not runs:
        raise NotHere(f"no {metric['method']} run in {layout.out('finetune')}")
    r = runs[0]
    p = r["parameters"]
    return 100 - p["trainable_pct"], f"run {r['run']}: {p['trainable']:,} trainable of {p['total']:,}"


def _paired_step_ratios(a: dict, b: dict, key: str) -> list[float] | None:
    """Run a's `key` over run b's, step by step, sorted (records.paired_step_times: the same batches in the same
    order). A step's tokens/s ratio is the other run's step time over this one's (the same tokens)."""
    if key not in ("step_s", "tokens_per_s"):
        return None
    ratios = records.paired_step_times(a, b)  # b's step time over a's: a's tokens/s over b's
    if ratios is None or key == "tokens_per_s":
        return ratios
    return sorted(1 / r for r in ratios)


def _interleaved_ratio(layout, a: dict, b: dict, key: str) -> tuple[float, float, float, dict] | None:
    """Run a's `key` over run b's from bench_finetune's interleaved steps of the pair: (median, CI low, CI high,
    the pair), or None where bench_finetune did not measure the pair. NotHere when it measured it on a
    machine whose speed kept changing."""
    path = layout.metrics("bench_finetune")
    if key not in ("step_s", "tokens_per_s") or not path.is_file():
        return None
    bench = [json.loads(path.read_text())]
    for x, y in ((a, b), (b, a)):
        pair = records.interleaved_pair(bench, x["run"], y["run"])
        if pair is None:
            continue
        ratio = pair["step_time_ratio"]  # step time of y over x
        if not ratio.get("ci95"):
            raise NotHere(f"bench_finetune measured {y['run']} vs {x['run']} but gave {ratio['verdict']}")
        med, lo, hi = ratio["median"], *ratio["ci95"]
        if (x is a) == (key == "step_s"):  # a's step time over b's is 1/ratio when x is a; tokens/s inverts it
            med, lo, hi = 1 / med, 1 / hi, 1 / lo
        return med, lo, hi, pair
    return None


def _finetune_pair(layout, metric: dict) -> tuple:
    """The claim's statistic of run a's `key` over run b's, for the runs that differ only in `differ`: from
    bench_finetune's interleaved steps where it measured the pair (median of the per-round ratios, its 95%
    interval from order statistics), else the median of the paired steps' ratios with that interval where the runs
    can be paired step by step and are 6 or more, else the ratio of the two runs' figures (no interval)."""
    from .measure import median_ci_order, percentile

    key, differ = metric["key"], metric["differ"]
    stat = (lambda r: 100 * (1 - r)) if metric["stat"] == "drop_pct" else (lambda r: 100 * (r - 1))
    for knob, value_a, value_b, a, b in records.knob_pairs(_finetune_runs(layout)):
        if knob != differ:
            continue
        if (value_a, value_b) == (metric["b"], metric["a"]):  # the pair in the claim's order
            value_a, value_b, a, b = value_b, value_a, b, a
        if (value_a, value_b) == (metric["a"], metric["b"]):
            whole = f"{key}: run {a['run']} {a[key]:.4g} vs run {b['run']} {b[key]:.4g}"
            interleaved = _interleaved_ratio(layout, a, b, key)
            if interleaved:
                median, lo, hi, pair = interleaved
                return stat(median), (f"{key} of run {a['run']} over run {b['run']}: {median:.4g}, 95% interval "
                                      f"[{lo:.4g}, {hi:.4g}] from order statistics over bench_finetune's "
                                      f"{pair['step_time_ratio']['rounds']} interleaved rounds of both runs' steps "
                                      f"over the same batches; the runs' own whole-run figures: {whole}"), \
                    sorted([stat(lo), stat(hi)])
            ratios = _paired_step_ratios(a, b, key)
            if ratios is None:
                return stat(a[key] / b[key]), whole
            median, interval = percentile(ratios, 0.5), median_ci_order(sorted(ratios))
            per_step = ("step time" if key == "step_s"
                        else f"tokens/s (run {b['run']}'s step time over run {a['run']}'s)")
            said = (f"{key} of run {a['run']} over run {b['run']}: median of {len(ratios)} paired steps' {per_step} "
                    f"ratios {median:.4g}")
            if interval is None:  # no interval: the claim is judged on the median alone, and says so
                return stat(median), (f"{said}, range [{min(ratios):.4g}, {max(ratios):.4g}] ({len(ratios)} steps give "
                                      f"no 95% interval; 6 needed); over whole runs, {whole}")
            (lo, hi), coverage = interval
            return stat(median), (f"{said}, {coverage:.1%} interval [{lo:.4g}, {hi:.4g}] from order statistics (the "
                                  f"same {a['tokens_seen']:,} tokens in the same order); over whole runs, {whole}"), \
                sorted([stat(lo), stat(hi)])
    raise NotHere(f"no pair of finetune runs that differ only in {differ} ({metric['a']} vs {metric['b']}) in "
                  f"{layout.out('finetune')}; add one to finetune.runs")


def _attention_speedup(layout, metric: dict) -> tuple[float, str]:
    """The baseline's median latency over the first implementation of `impl` (one name or a list, in order of
    preference) that ran on a CUDA GPU, at the longest sequence both measured."""
    reasons = []
    for name in [metric["impl"]] if isinstance(metric["impl"], str) else metric["impl"]:
        path = layout.metrics("bench_attention", name)
        impl = json.loads(path.read_text()) if path.is_file() else {"reason": f"no {path}"}
        if records.is_ok(impl) and "status" in impl and impl.get("environment", {}).get("device") == "cuda":
            break
        reasons.append(f"{name} did not run here: {impl.get('reason') or 'not on a CUDA GPU'}")
    else:
        raise NotHere("; ".join(reasons))
    ok = lambda m: {r["seq_len"]: r for r in m["rows"] if records.is_ok(r)}  # noqa: E731
    a = ok(impl)
    paired = {s: r["vs_eager"]["speedup"] for s, r in a.items()
              if metric["baseline"] == "eager" and ((r.get("vs_eager") or {}).get("speedup") or {}).get("ci95")}
    if paired:  # timed interleaved with eager in the same cell: a median with its interval
        s = max(paired)
        speedup = paired[s]
        return (speedup["median"], f"eager's latency over {name}'s at seq {s}, {speedup['rounds']} interleaved "
                                   f"rounds in one cell: median {speedup['median']:.3g}, 95% interval "
                                   f"[{speedup['ci95'][0]:.3g}, {speedup['ci95'][1]:.3g}]", speedup["ci95"])
    b = ok(_read(layout.metrics("bench_attention", metric["baseline"])))
    if not set(a) & set(b):
        raise NotHere(f"{name} and {metric['baseline']} have no sequence length measured by both")
    s = max(set(a) & set(b))
    return (b[s]["latency"]["median"] / a[s]["latency"]["median"],
            f"median latency at seq {s}: {metric['baseline']} / {name}")


def _prune_ratio(layout, metric: dict) -> tuple:
    """A pruning strategy's figure against the base model it was cut from, measured in the same job:
    `footprint_ratio` (pruned / base) or `generation_speedup` (base time / pruned time, with its interval)."""
    m = _read(layout.metrics("prune", metric["strategy"]))
    kept = f"{m['kept']['layers']} layers x {m['kept']['heads']} query heads ({m['kept']['kv_heads']} kv)"
    if metric["key"] == "generation_speedup":
        s = m["generation_speedup"]
        if not s.get("ci95"):
            raise NotHere(f"prune {metric['strategy']}: {s['verdict']}")
        return s["median"], (f"prune {metric['strategy']} ({kept}): base generation time over the pruned model's, "
                             f"{s['rounds']} interleaved rounds of {m['new_tokens']} tokens"), s["ci95"]
    return m["footprint_ratio"], (f"prune {metric['strategy']} ({kept}): get_memory_footprint "
                                  f"{m['pruned']['memory_footprint_bytes']:,} B / base "
                                  f"{m['base']['memory_footprint_bytes']:,} B")


def _serving_ratio(layout, metric: dict) -> tuple:
    """bench_serving's output tokens/s of `method` over the naive server's, at the highest concurrency it ran."""
    m = _read(layout.metrics("bench_serving"))
    cells = [c for c in m["cells"] if c["method"] == metric["method"] and records.is_ok(c)]
    if not cells or not any(c["method"] == "naive" and records.is_ok(c) for c in m["cells"]):
        reasons = [c.get("reason", "") for c in m["cells"] if c["method"] in (metric["method"], "naive")]
        raise NotHere(f"bench_serving has no {metric['method']} and naive results to compare: {'; '.join(reasons)}")
    best = max(cells, key=lambda c: c["concurrency"])
    return best["throughput_vs_naive"], (f"bench_serving, {m['requests']} requests at once: {metric['method']} at "
                                         f"concurrency {best['concurrency']} {best['output_tokens_per_s']:.1f} "
                                         f"output tokens/s over naive's (from requests.csv)")


def _gpu_base_model(layout) -> dict:
    base = _read(layout.metrics("base_model"))
    if base.get("environment", {}).get("device") != "cuda":
        raise NotHere("the results are from a CPU run (base_model measures the GPU's matmul rates and CUDA "
                      "context on CUDA runs)")
    return base


def _matmul_ratio(layout, metric: dict) -> tuple[float, str]:
    base = _gpu_base_model(layout)
    rates = base["gpu_matmul_tflops"]
    fast, slow = rates[metric["fast"]], rates[metric["slow"]]
    return (fast["tflops"] / slow["tflops"],
            f"{base['environment'].get('gpu')}: {fast['size']}^3 matmul {metric['fast']} {fast['tflops']:.1f} vs "
            f"{metric['slow']} {slow['tflops']:.1f} TFLOP/s (measured by base_model; a matmul, not a training step)")


def _cuda_context(layout, metric: dict) -> tuple[float, str]:
    base = _gpu_base_model(layout)
    context = base["cuda_context"]
    if context.get("mib") is None:
        raise NotHere(f"NVML could not say: {context.get('unavailable')}")
    return (context["mib"] * UNIT_SCALE["MiB"],
            f"{base['environment'].get('gpu')}: NVML process {context['nvml_process_mib']:.0f} MiB - torch reserved "
            f"{context['torch_reserved_mib']:.0f} MiB = {context['mib']:.0f} MiB")


# Each takes the results layout and the claim's metric and returns (value in the base unit, how it was read) or
# (value, how, [lo, hi]: the 95% CI of the value, same base unit), or raises NotHere.
METRICS = {"quantize_ratio": _quantize_ratio, "finetune_trainable": _finetune_trainable,
           "finetune_pair": _finetune_pair, "attention_speedup": _attention_speedup,
           "matmul_ratio": _matmul_ratio, "cuda_context": _cuda_context, "prune_ratio": _prune_ratio,
           "serving_ratio": _serving_ratio}


# ---------------------------------------------------------------- verdicts

def _fmt(x: float) -> str:
    if isinstance(x, (list, tuple)):
        return "–".join(_fmt(v) for v in x)
    return f"{x:,.0f}" if abs(x) >= 1000 else f"{x:.4g}"


def _reported(value) -> str:
    return "–".join(f"{v:,}" for v in value) if isinstance(value, list) else f"{value:,}"


def convention(claim: dict) -> str | None:
    """How the claim's byte unit is read: its registry `units.convention`, else what the label says; None for a
    unit without a decimal/binary prefix."""
    unit = claim["reported"]["unit"]
    if unit not in PREFIX_POWER:
        return None
    return (claim.get("units") or {}).get("convention", LABEL_CONVENTION[unit])


def unit_scale(unit: str, conv: str | None) -> float:
    """One `unit` in its base unit, the prefix read in convention `conv` (decimal 1000^n, binary 1024^n)."""
    return CONVENTION_BASE[conv] ** PREFIX_POWER[unit] if conv else UNIT_SCALE[unit]


def _meant(unit: str, conv: str) -> str:
    """The unambiguous unit a label stands for under a convention: GB read as binary is GiB."""
    return unit if conv == LABEL_CONVENTION[unit] else OTHER_UNIT[unit]


def _shown(x: float, unit: str, conv: str | None, interval: list[float] | None = None) -> str:
    meant = _meant(unit, conv) if conv else unit
    return (f"{_fmt(x)} {unit}" + (f" [{_fmt(interval[0])}, {_fmt(interval[1])}]" if interval else "")
            + (f" ({conv}: {meant})" if meant != unit else ""))


def units_label(claim: dict) -> str:
    """The claims.csv `units` column: the convention a byte claim is read in and what it rests on (source or
    arithmetic evidence recorded in the registry, or the default: the label taken at its word)."""
    conv = convention(claim)
    if not conv:
        return ""
    return f"{conv} ({claim['units']['evidence_kind'] if claim.get('units') else 'default'})"


def _units_note(claim: dict, conv: str) -> str:
    """The recorded convention and its evidence, as the row's reason states it."""
    units, unit = claim.get("units"), claim["reported"]["unit"]
    if not units:
        return ""
    return (f"the seed's {unit} are {_meant(unit, conv)} ({conv}, {units['evidence_kind']} evidence: "
            f"{units['evidence']})")


def _band(claim: dict) -> tuple[float, float]:
    """The values that reproduce the claim: its tolerance band around the reported value (or range, or bound)."""
    value, tol = claim["reported"]["value"], claim["tolerance"]
    if isinstance(value, list):
        return value[0] * (1 - tol), value[1] * (1 + tol)
    compare = claim.get("compare", "equal")
    if compare == "at_least":
        return value * (1 - tol), math.inf
    if compare == "at_most":
        return -math.inf, value * (1 + tol)
    return value - tol * abs(value) - 1e-12, value + tol * abs(value) + 1e-12


def _band_text(claim: dict) -> str:
    lo, hi = _band(claim)
    unit = claim["reported"]["unit"]
    if math.isinf(hi):
        return f"≥ {_fmt(lo)} {unit}"
    if math.isinf(lo):
        return f"≤ {_fmt(hi)} {unit}"
    return f"{_fmt(lo)}–{_fmt(hi)} {unit}"


def _holds(x: float, claim: dict) -> bool:
    lo, hi = _band(claim)
    return lo <= x <= hi


def _ratio(x: float, claim: dict):
    value = claim["reported"]["value"]
    return None if isinstance(value, list) or value == 0 else x / value


def judge(base_value: float, claim: dict,
          unexplained: str = "the seed's figure does not follow from its stated inputs",
          ci: list[float] | None = None) -> dict:
    """Compare a value in the base unit with the reported one, like with like: a byte unit is read in the
    claim's convention (decimal unless the registry records binary with its evidence). Reproduced, or differs
    with a reason; a figure that fits only in the other convention still differs, and says so.

    A measured value may come with `ci`, the 95% CI [lo, hi] of its median in the same base unit. Then the
    claim is judged by equivalence against its tolerance band: the whole CI inside the band is reproduced, the
    whole CI outside it differs, and a CI across either edge of the band is inconclusive, wherever its median
    lies."""
    unit = claim["reported"]["unit"]
    conv = convention(claim)
    scale = unit_scale(unit, conv)
    x = base_value / scale
    interval = sorted(v / scale for v in ci) if ci is not None else None
    recorded = claim.get("units")
    out = {"reproduced": _shown(x, unit, conv, interval), "ratio": _ratio(x, claim)}
    ci_text = f"95% CI [{_fmt(interval[0])}, {_fmt(interval[1])}] {unit}" if interval else ""
    other = {"decimal": "binary", "binary": "decimal"}.get(conv)
    alt = base_value / unit_scale(unit, other) if other else None
    note = _units_note(claim, conv) if conv else ""
    band_lo, band_hi = _band(claim)
    if interval and not band_lo <= interval[0] <= interval[1] <= band_hi and \
            interval[1] >= band_lo and interval[0] <= band_hi:
        return {**out, "verdict": "inconclusive",
                "why": "; ".join(filter(None, [f"the {ci_text} crosses an edge of the tolerance band "
                                               f"{_band_text(claim)} (median {_fmt(x)} {unit})", note]))}
    if _holds(x, claim):
        r, r_alt = _ratio(x, claim), (_ratio(alt, claim) if other else None)
        if r_alt is not None and abs(r_alt - 1) < 0.002 < abs(r - 1):
            note = "; ".join(filter(None, [note, f"closer in {other}: {_fmt(alt)} {_meant(unit, other)} "
                                                 f"(within {abs(r_alt - 1):.2%})"]))
        if interval:
            note = "; ".join(filter(None, [f"the {ci_text} lies inside the tolerance band {_band_text(claim)}",
                                           note]))
        return {**out, "verdict": "reproduced", "why": note}
    # A diagnosis in the registry is the reason found by reading the seed; a figure that fits only in the other
    # convention is reported as such, against the convention recorded (or the label, where none is).
    mismatch = ""
    if other and _holds(alt, claim):
        mismatch = (f"fits only in {other}: {_fmt(x)} {_meant(unit, conv)} = {_fmt(alt)} {_meant(unit, other)}, "
                    + (f"but the seed's {unit} are recorded as {conv} ({recorded['evidence_kind']} evidence: "
                       f"{recorded['evidence']})" if recorded else
                       f"but nothing in the seed says its {unit} are {_meant(unit, other)} (record units: "
                       f"{other} with the evidence, if the seed gives any)"))
    reasons = [claim.get("diagnosis") or ("" if mismatch else unexplained), mismatch or note,
               interval and f"the whole {ci_text} lies outside the tolerance band {_band_text(claim)}"]
    return {**out, "verdict": "differs", "why": "; ".join(filter(None, reasons))}


def evaluate(claim: dict, layout) -> dict:
    row = {"id": claim["id"], "source": claim["source"], "quote": claim["quote"], "kind": claim["kind"],
           "reported": f"{_reported(claim['reported']['value'])} {claim['reported']['unit']}"
                       + {"at_least": " (at least)", "at_most": " (at most)"}.get(claim.get("compare"), ""),
           "units": units_label(claim)}
    notes = [claim["assumption"]] if claim.get("assumption") else []
    if claim.get("unreproducible"):
        return {**row, "reproduced": "", "ratio": None, "verdict": "not reproducible here",
                "reason": claim["unreproducible"]}
    kind = claim["kind"]
    if kind == "analytic":
        value, how = compute(claim["quantity"], claim["inputs"])
        j = judge(value, claim)
        return {**row, **_row_result(j), "reason": "; ".join(filter(None, [j["why"], how, *notes])),
                "finding": j["why"]}
    if "metric" in claim:
        try:  # (value, how) or (value, how, 95% CI of the value)
            value, how, *ci = METRICS[claim["metric"]["kind"]](layout, claim["metric"])
        except NotHere as why:
            if kind == "hardware":
                return _needs_gpu(row, claim, notes)
            return {**row, "reproduced": "", "ratio": None, "verdict": "not reproducible here", "reason": str(why)}
        j = judge(value, claim, unexplained="outside the tolerance at this pipeline's scale",
                  ci=ci[0] if ci else None)
        return {**row, **_row_result(j), "reason": "; ".join(filter(None, [j["why"], how, _scale_note(layout)])),
                "finding": j["why"]}
    return _needs_gpu(row, claim, notes)


def _row_result(j: dict) -> dict:
    return {"reproduced": j["reproduced"], "ratio": j["ratio"], "verdict": j["verdict"]}


def _needs_gpu(row: dict, claim: dict, notes: list[str]) -> dict:
    """A hardware claim without a GPU measurement: needs its GPU; an analytic cross-check, where the registry gives
    one, is shown. Where the registry says the estimate is sufficient (a footprint whose only missing piece is
    the real weights), the cross-check is the verdict, labelled analytic."""
    out = {**row, "reproduced": "", "ratio": None, "verdict": f"needs GPU: {claim['gpu']}", "reason": ""}
    if "estimate" in claim:
        value, how = compute(claim["estimate"]["quantity"], claim["estimate"]["inputs"])
        j = judge(value, claim)
        if claim["estimate"].get("sufficient"):
            label = (f"analytic verdict (no GPU measurement here; one on {claim['gpu']} would take precedence): "
                     f"{claim['estimate']['sufficient']}")
            return {**row, **_row_result(j), "verdict": f"{j['verdict']} (analytic)",
                    "reason": "; ".join(filter(None, [j["why"], how, label, *notes])), "finding": j["why"]}
        agrees = "agrees" if j["verdict"] == "reproduced" else "does not agree"
        out.update(reproduced=f"{j['reproduced']} (analytic)", ratio=j["ratio"],
                   reason="; ".join(filter(None, [f"analytic cross-check {agrees} within {claim['tolerance']:.1%}",
                                                  j["why"], how, *notes])))
    else:
        out["reason"] = "; ".join(notes)
    return out


def verdict_class(verdict: str) -> str:
    return next(v for v in VERDICTS if verdict.startswith(v))


def evaluate_all(claims: list[dict], layout) -> pd.DataFrame:
    columns = ["id", "source", "quote", "kind", "reported", "units", "reproduced", "ratio", "verdict", "reason",
               "finding"]
    return pd.DataFrame([evaluate(c, layout) for c in claims], columns=columns).fillna({"finding": ""})


# The texts efflab grew from (the `source` of each claim), by title, so that a reader can look them up.
SOURCES = {
    "000_965e890cecb00a0b.txt": "\"Chapter 12: Efficient Training and Inference at Scale\" (a book chapter: LoRA, "
                                "QLoRA, post-training quantization, FlashAttention, serving)",
    "001_d5371e57926c34be.txt": "CS 696 Applied Large Language Models, Spring 2025, \"Assignment 2, Performance "
                                "Issues\" (a course deck: KV cache, quantization, pruning, attention)",
    "002_80b60e9b2efd77d3.txt": "\"Efficient Finetuning of LLMs\" (Sumanth R Hegde; a talk with the memory arithmetic of "
                                "full, LoRA and QLoRA fine-tuning)",
    "003_6740d5587871bfd4.txt": "a blog guide to scaling transformers in production (mixed precision, checkpointing, ZeRO)",
    "004_a8bbd29d2539a3ab.txt": "Quantization-aware training notes, with a \"GPU RAM usage\" appendix",
}


def markdown(df: pd.DataFrame) -> str:
    counts = df["verdict"].map(verdict_class).value_counts()
    used = [s for s in SOURCES if s in set(df["source"])]
    lines = ["# Published numbers: reported vs reproduced", "",
             "The texts these claims come from:", "", *[f"- `{s}`: {SOURCES[s]}" for s in used], "",
             f"{len(df)} numeric claims from the seed texts (workflow/claims.yaml): "
             + ", ".join(f"{counts.get(v, 0)} {v}" for v in VERDICTS) + ". Analytic values come from "
             "efflab.estimate on the shipped model configs (parameter counts from the meta-device model); "
             "ratio is reproduced / reported. A measured figure shown with its 95% CI [lo, hi] is judged by "
             "equivalence: reproduced only when the whole CI lies inside the claim's tolerance band, differs only "
             "when it lies wholly outside, inconclusive when it crosses an edge.", ""]
    wrong = df[df["verdict"].map(verdict_class) == "differs"]
    if len(wrong):
        lines += ["Where the seeds' figures do not reproduce:", ""]
        lines += [f"- **{r.id}** ({r.source}): reported {r.reported}, reproduced {r.reproduced}"
                  f"{' (analytic)' if r.verdict.endswith('(analytic)') else ''} — {r.finding}"
                  for r in wrong.itertuples()]
        lines.append("")
    undecided = df[df["verdict"] == "inconclusive"]
    if len(undecided):
        lines += ["Where the measurement cannot decide at 95%:", ""]
        lines += [f"- **{r.id}** ({r.source}): reported {r.reported}, reproduced {r.reproduced} — {r.finding}"
                  for r in undecided.itertuples()]
        lines.append("")
    table = df.assign(claim=df["id"] + ": “" + df["quote"].str.replace("\t", " ") + "”",
                      ratio=df["ratio"].map(lambda r: "" if r is None or pd.isna(r) else f"{r:.3g}"))
    table = table[["claim", "source", "reported", "reproduced", "ratio", "verdict", "reason"]]
    table = table.apply(lambda col: col.astype(str).str.replace("|", "\\|", regex=False))
    return "\n".join(lines) + table.to_markdown(index=False) + "\n"


def run(cfg: dict, paths: dict) -> dict:
    """Evaluate every registered claim against the estimator and this pipeline's results."""
    registry = (cfg.get("claims") or {}).get("registry") if isinstance(cfg, dict) else None
    claims = load_registry(REPO_ROOT / registry if registry else REGISTRY)
    df = evaluate_all(claims, paths["layout"])
    out = Path(paths["out"])
    out.mkdir(parents=True, exist_ok=True)
    df.to_csv(out / "claims.csv", index=False)
    (out / "claims.md").write_text(markdown(df))
    by_verdict = df["verdict"].map(verdict_class).value_counts()
    log.info("claims: %s", ", ".join(f"{by_verdict.get(v, 0)} {v}" for v in VERDICTS))
    return {"claims": len(df), "by_kind": df["kind"].value_counts().to_dict(),
            "by_verdict": {v: int(by_verdict.get(v, 0)) for v in VERDICTS},
            "differs": df.loc[df["verdict"].map(verdict_class) == "differs", "id"].tolist(),
            "inconclusive": df.loc[df["verdict"] == "inconclusive", "id"].tolist()}


if __name__ == "__main__":
    cli.main("claims", run)
