"""Why a measured figure is what it is, computed from the records and the base model's shapes, never guessed:
which parameters bitsandbytes left in 16 bits, which parameters pruning cannot cut, what the activation formula
predicts at the lengths bench_attention measured, what the other batching methods reached, which heads a KV cache
holds."""
from __future__ import annotations

import json
import math
import re

from ... import records
from ...estimators import analytic
from ...measure.stats import EQUIVALENCE_MARGIN, ratio_words
from .verdict import fmt

# A decoder layer's parameters, in the families' module names (model.layers.3., transformer.h.3., ...).
IN_LAYER = re.compile(r"\.(layers|h|blocks|layer)\.\d+\.")


NO_SHAPES = "no cause computed: the base model's config.json is not in this results folder"


def _named(layout) -> tuple[str, list[tuple[str, int]]] | None:
    """The base model's parameters by name (tied tensors once), from its config on the meta device; None where
    the results folder holds no model (a reference run keeps no weights or configs)."""
    name = str(layout.base_model())
    if not (layout.base_model() / "config.json").is_file():
        return None
    return name, [(n, p.numel()) for n, p in analytic.meta_model(name).named_parameters()]


def _recorded_config(layout) -> dict:
    """The model sizes the base_model stage recorded (its metrics.json `config`), for a kept run without the folder."""
    path = layout.metrics("base_model")
    return (json.loads(path.read_text()).get("config") or {}) if path.is_file() else {}


def _listed(params: list[tuple[str, int]], total: int) -> str:
    """The large tensors by name (1% of the model or more), the rest counted with their kinds."""
    big = [(n, k) for n, k in params if k >= total / 100]
    rest = [(n, k) for n, k in params if k < total / 100]
    kinds = sorted({"norms" if "norm" in n else "biases" if n.endswith("bias") else "others" for n, _ in rest})
    said = [f"{n} ({k:,} params)" for n, k in big]
    if rest:
        said.append(f"{len(rest)} smaller tensor{'s' if len(rest) > 1 else ''} ({sum(k for _, k in rest):,} params: "
                    f"{', '.join(kinds)})")
    return ", ".join(said)


def kept_in_16_bits(layout, m: dict) -> str:
    """Which parameters a quantization scheme left unquantized, their bytes and share of the quantized model's
    footprint, and the ratio of the quantized layers alone; the computed footprint (the estimator's, for every
    scheme it covers) is set beside the measured one, so that the decomposition is checked, not assumed."""
    if m.get("method") in (None, "none"):
        return ""
    if _named(layout) is None:
        return NO_SHAPES
    fp = _scheme_footprint(layout, m, m["compute_dtype"])
    if fp is None:
        return ""
    name, params = _named(layout)
    quantized = {f"{lay['name']}.weight" for lay in analytic.linear_layers(name) if not lay["head"]}
    kept = [(n, k) for n, k in params if n not in quantized]
    computed, measured = fp["total"], m["memory_footprint_bytes"]
    layers16 = 2 * fp["quantized_params"]
    tied = getattr(analytic.meta_model(name).config, "tie_word_embeddings", False)
    return (f"{m.get('library') or 'bitsandbytes'} kept in {m['compute_dtype']}: "
            f"{_listed(kept, sum(k for _, k in params))}"
            f"{' (the embedding is tied with lm_head, which stays unquantized)' if tied else ''}, "
            f"{fp['kept_bytes']:,.0f} B = {fp['kept_bytes'] / measured:.1%} of the quantized footprint; the "
            f"{len(quantized)} quantized linear layers alone shrink {layers16 / fp['weight_bytes']:.2f}x from 16 bits "
            f"({layers16:,} B to {fp['weight_bytes']:,} B); computed from the base model's shapes, their weights and "
            f"the kept tensors and the quantization constants come to {computed:,.0f} B against the measured "
            f"{measured:,} B")


def _scheme_footprint(layout, m: dict, compute_dtype: str) -> dict | None:
    """The estimator's bytes of a quantize record's scheme at `compute_dtype` (None: no base model shapes here, or a
    scheme the estimator does not cover)."""
    if _named(layout) is None or m.get("method") in (None, "none"):
        return None
    quant = {"method": m["method"], "double_quant": m.get("double_quant", False), "group_size": m.get("group_size")}
    return analytic.quant_footprint(str(layout.base_model()), quant, compute_dtype)


def footprint_at_16_bits(layout, m: dict) -> float | None:
    """A quantize record's measured footprint with what its compute dtype stores in it (the kept parameters, and
    the scales a scheme keeps in that dtype) re-expressed at 16 bits, by the estimator's difference between the
    two dtypes; None where the estimator has no model of the scheme."""
    wide, narrow = _scheme_footprint(layout, m, m["compute_dtype"]), _scheme_footprint(layout, m, "float16")
    if wide is None:
        return None
    return m["memory_footprint_bytes"] - (wide["total"] - narrow["total"])


def prune_shares(layout, m: dict) -> str:
    """What a pruning strategy can cut: the parameters inside the decoder layers against those outside them
    (embeddings, final norm), from the base model's shapes, beside the parameters the record says it kept."""
    if _named(layout) is None:  # a kept run: what a strategy that removed whole layers alone says of a layer
        return _prune_shares_recorded(_recorded_config(layout), m)
    _, params = _named(layout)
    total = sum(k for _, k in params)
    outside = [(n, k) for n, k in params if not IN_LAYER.search(n)]
    cut_off = sum(k for _, k in outside)
    base, pruned = m["base"]["parameters"], m["pruned"]["parameters"]
    return (f"pruning cuts only inside the decoder layers: outside them sit {_listed(outside, total)}, "
            f"{cut_off / total:.1%} of the base's {total:,} parameters, which every strategy keeps; this one kept "
            f"{pruned:,} of {base:,} parameters ({pruned / base:.3f})")


def _prune_shares_recorded(config: dict, m: dict) -> str:
    """prune_shares from the records alone (`config`: the sizes the base_model record names): a strategy that
    removed whole layers and kept every head says what one decoder layer holds (the parameters it removed over the
    layers it removed), so the base's parameters outside the layers are what all its layers leave."""
    kept, base, pruned = m["kept"], m["base"]["parameters"], m["pruned"]["parameters"]
    layers = config.get("num_hidden_layers") or 0
    removed = layers - kept["layers"]
    if removed <= 0 or kept["heads"] != config.get("num_attention_heads"):
        return NO_SHAPES
    per_layer = (base - pruned) / removed
    outside = base - per_layer * layers
    return (f"pruning cuts only inside the decoder layers: outside them sit {outside:,.0f} parameters, "
            f"{outside / base:.1%} of the base's {base:,} (from the records: {base - pruned:,} parameters removed "
            f"with {removed} of {layers} layers), which every strategy keeps; this one kept {pruned:,} of {base:,} "
            f"parameters ({pruned / base:.3f})")


def attention_exponent_expected(layout, impl: str, seqs: list[int]) -> str:
    """The exponent the activation formula (efflab.estimators.analytic, Korthikanti et al.) gives this model between the
    shortest and longest sequence bench_attention measured: the asymptote is not reached at short lengths."""
    if len(seqs) < 2 or seqs[0] == seqs[-1]:
        return ""
    if _named(layout) is None:  # a kept run: the sizes its base_model record names, by the report's own law
        config = _recorded_config(layout)
        k = analytic.attention_exponent(config, seqs[0], seqs[-1], squared=impl == "eager")
        return NO_SHAPES if k is None else (
            f"by the crossover law (the L² scores overtake the linear activations at "
            f"{analytic.attention_crossover(config):,.0f} tokens, from the base_model record's sizes), this model's "
            f"exponent between {seqs[0]} and {seqs[-1]} tokens is {k:.3f}")
    name, flash = str(layout.base_model()), impl != "eager"
    ratio = (analytic.activation_bytes(name, seqs[-1], 1, 2, flash=flash)
             / analytic.activation_bytes(name, seqs[0], 1, 2, flash=flash))
    return (f"by the activation formula, this model's exponent between {seqs[0]} and {seqs[-1]} tokens is "
            f"{math.log(ratio) / math.log(seqs[-1] / seqs[0]):.3f} ({'without' if flash else 'with'} the s² "
            f"attention term)")


def _ratio_said(ratio: dict) -> str:
    """'4.427x [4.102, 4.6]', or '3.185x (1 round: no 95% interval)'."""
    if ratio.get("ci95"):
        return f"{fmt(ratio['median'])}x [{fmt(ratio['ci95'][0])}, {fmt(ratio['ci95'][1])}]"
    return f"{fmt(ratio['median'])}x ({ratio['rounds']} round(s): no 95% interval)"


def _versus_static(concurrency: int, ratio: dict) -> str:
    """Whether continuous batching beat static batching at one concurrency, by the interval of their paired ratio."""
    said, verdict = _ratio_said(ratio), ratio_words(ratio)
    if verdict == "faster":
        return f"continuous batching beat static batching at concurrency {concurrency}: {said} its output tokens/s"
    if verdict == "slower":
        return (f"static batching beat continuous batching at concurrency {concurrency} (continuous reached {said} "
                f"static's output tokens/s), so the batching, not its continuous scheduling, earned the speedup here")
    if verdict.startswith("same within"):
        return (f"continuous and static batching were within {EQUIVALENCE_MARGIN:.0%} of each other at concurrency "
                f"{concurrency} ({said}): the batching, not its continuous scheduling, earned the speedup here")
    return f"this run cannot tell continuous from static batching at concurrency {concurrency} ({said}: {verdict})"


def serving_alternatives(m: dict, method: str, best: dict) -> str:
    """What the other batching methods of the same bursts reached over naive, at their highest concurrency, and
    whether continuous batching beat static batching at each concurrency, by the interval of their ratio paired
    burst round by burst round (a record of one burst has none)."""
    others = {}
    for c in m["cells"]:
        if c["method"] not in (method, "naive") and records.is_ok(c):
            if c["method"] not in others or c["concurrency"] > others[c["method"]]["concurrency"]:
                others[c["method"]] = c
    said = [f"{k} {_ratio_said(records.serving_ratio(c, 'throughput_vs_naive'))} at concurrency {c['concurrency']}"
            for k, c in others.items() if records.serving_ratio(c, "throughput_vs_naive")]
    continuous = [c for c in m["cells"] if method == "continuous" == c["method"] and records.is_ok(c)]
    versus = [_versus_static(c["concurrency"], ratio) for c in continuous
              if (ratio := records.serving_ratio(c, "continuous_vs_static"))]
    unpaired = [str(c["concurrency"]) for c in continuous if not records.serving_ratio(c, "continuous_vs_static")]
    return "; ".join(filter(None, [
        said and "over naive in the same bursts: " + ", ".join(said), *versus,
        unpaired and f"continuous batching was not paired with static batching at concurrency {', '.join(unpaired)} "
                     f"(a record of one burst, or no static cell), so this run does not tell continuous batching "
                     f"from batching as such",
        "vllm" not in others and method != "vllm" and "the seed credits vLLM (PagedAttention with continuous "
        "batching), which did not run here"]))


def kv_heads_held(shape: dict, context: int, el: float, measured: float) -> str:
    """What a full-precision KV cache holds by the model's shapes: K and V of its key/value heads, fewer than its
    query heads under grouped-query (or multi-query) attention, set beside the measured bytes."""
    heads, kv = shape["heads"], shape["kv_heads"]
    held = 2 * shape["layers"] * kv * shape["head_dim"] * context * el
    said = (f"the cache holds K and V of the key/value heads: 2 × {shape['layers']} layers × {kv} kv heads × "
            f"{shape['head_dim']} × {context} tokens × {el:g} bytes = {held:,.0f} B against the measured "
            f"{measured:,.0f} B ({measured / held:.4g}x)")
    if kv == heads:
        return f"this model has as many key/value heads as query heads ({heads}): {said}"
    return (f"grouped-query attention: this model's {heads} query heads share {kv} key/value heads, and {said}; the "
            f"seed's heads (the query heads) over-state the cache {heads / kv:.4g}x")
