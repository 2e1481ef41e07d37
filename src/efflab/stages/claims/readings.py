"""Measured claims: figures read from this pipeline's own results, each a Reading (verdict.Reading) with its
95% interval where the record gives one, marked exact where it is a count of this run's tensors, and with the
cause of its value computed from the records (causes.py) where one is. The fine-tuning ones are
finetune_readings.py's.
"""
from __future__ import annotations

from pathlib import Path

from ... import records
from ...estimators import analytic
from ...evaluation import scores
from ...registry import STAGES
from .causes import (
    attention_exponent_expected,
    footprint_at_16_bits,
    kept_in_16_bits,
    kv_heads_held,
    prune_shares,
    serving_alternatives,
)
from .finetune_readings import finetune_pair, finetune_trainable
from .verdict import UNIT_SCALE, NotHere, Reading


def _read(path: Path) -> dict:
    if not path.is_file():  # named from its stage's folder on: the same words wherever the results folder is
        stage = max(i for i, part in enumerate(path.parts) if part in STAGES or i == 0)
        raise NotHere(f"no {'/'.join(path.parts[stage:])} (run the stage that writes it)")
    metrics = records.load(path)
    if not records.is_ok(metrics):  # a job that failed or was skipped measured nothing
        raise NotHere(f"{path.parent.name} is {metrics['status']}: {metrics.get('reason', 'no reason given')}")
    return metrics


def scale_note(layout) -> str:
    path = layout.metrics("base_model")
    if not path.is_file():
        return ""
    base = records.load(path)
    env = base.get("environment", {})
    params = base.get("parameters", 0)
    model = (f"a random-init model of the run's config with {base.get('source')}'s tokenizer" if base.get("random_init")
             else base.get("source"))
    note = (f"measured here on {model} ({params:,} params, {base.get('dtype')}) "
            f"on {env.get('device', '?')}{', ' + env['gpu'] if env.get('gpu') else ''}")
    at_scale = params >= 1e9 and env.get("device") == "cuda"  # the seeds' own scale: no caveat to add
    return note if at_scale else note + "; the seed's figure is for billion-parameter models on GPUs"


def _quantize_ratio(layout, metric: dict) -> Reading:
    """The base model's footprint over the quantized one's (weights and quantization state, efflab.models.quantization):
    a count of bytes (exact), with which parameters the scheme kept unquantized as the cause."""
    m = _read(layout.metrics("quantize", metric["scheme"]))
    dtype, cause = m["compute_dtype"], kept_in_16_bits(layout, m)
    if dtype in ("bfloat16", "float16"):
        return Reading(m["footprint_ratio_vs_base"],
                       f"weights and quantization state: {m['base_memory_footprint_bytes']:,} B {dtype} / "
                       f"{m['memory_footprint_bytes']:,} B {metric['scheme']}", exact=True, cause=cause)
    # A float32 baseline (CPU without fast bf16): re-express what the scheme stores in the compute dtype (the
    # parameters it leaves unquantized, its scales where they follow that dtype) at 16 bits on both sides, so
    # the ratio answers the seed's question (quantized vs 16-bit weights).
    quant16 = footprint_at_16_bits(layout, m)
    if quant16 is None:
        raise NotHere(f"quantize {metric['scheme']} ran with a {dtype} baseline, and the estimator has no model of "
                      f"{m['method']}'s bytes to re-express it at 16 bits")
    base16 = m["base_memory_footprint_bytes"] * 2 / analytic.bytes_per_element(dtype)
    return Reading(base16 / quant16, f"baseline ran in {dtype}: footprints re-expressed at 16 bits ({base16:,.0f} B / "
                                     f"{quant16:,.0f} B; measured vs {dtype}: {m['footprint_ratio_vs_base']:.2f}×)",
                   exact=True, cause=cause)


def _first_ran(layout, impls, ran) -> tuple[str, dict]:
    """The first attention implementation of `impls` (one name or a list, in order of preference) whose
    bench_attention record passes `ran`; NotHere naming why each did not."""
    reasons = []
    for name in [impls] if isinstance(impls, str) else impls:
        path = layout.metrics("bench_attention", name)
        impl = records.load_if_there(path) or {"reason": f"no {path}"}
        why = ran(impl) if records.is_ok(impl) and "status" in impl else impl.get("reason") or impl.get("status")
        if why is None:
            return name, impl
        reasons.append(f"{name}: {why}")
    raise NotHere("; ".join(reasons))


def _attention_speedup(layout, metric: dict) -> Reading:
    """The baseline's median latency over the first implementation of `impl` that ran on a CUDA GPU, at the
    longest sequence both measured: timed interleaved with eager in one cell (a median and its interval), else
    the ratio of the two cells' medians (no interval)."""
    name, impl = _first_ran(layout, metric["impl"], lambda m: None if m.get("environment", {}).get("device") == "cuda"
                            else "not run on a CUDA GPU")
    ok = lambda m: {r["seq_len"]: r for r in m["rows"] if records.is_ok(r)}  # noqa: E731
    a = ok(impl)
    paired = {s: r["vs_eager"]["speedup"] for s, r in a.items()
              if metric["baseline"] == "eager" and ((r.get("vs_eager") or {}).get("speedup") or {}).get("ci95")}
    if paired:
        s = max(paired)
        speedup = paired[s]
        return Reading(speedup["median"], f"eager's latency over {name}'s at seq {s}, {speedup['rounds']} interleaved "
                                          f"rounds in one cell: median {speedup['median']:.3g}, 95% interval "
                                          f"[{speedup['ci95'][0]:.3g}, {speedup['ci95'][1]:.3g}]",
                       tuple(speedup["ci95"]))
    b = ok(_read(layout.metrics("bench_attention", metric["baseline"])))
    if not set(a) & set(b):
        raise NotHere(f"{name} and {metric['baseline']} have no sequence length measured by both")
    s = max(set(a) & set(b))
    return Reading(b[s]["latency"]["median"] / a[s]["latency"]["median"],
                   f"median latency at seq {s}: {metric['baseline']} / {name}, timed in separate cells")


def _attention_memory_exponent(layout, metric: dict) -> Reading:
    """bench_attention's fitted exponent of peak memory in sequence length (batch 1, `mode`) for the first
    implementation of `impl` that measured one: a least-squares slope through a few lengths, no interval."""
    def fit_of(m):
        return next((f for f in m.get("memory_exponents", []) if f["mode"] == metric["mode"]
                     and f["batch_size"] == 1 and f.get("exponent") is not None), None)
    name, impl = _first_ran(layout, metric["impl"], lambda m: None if fit_of(m) else
                            f"no {metric['mode']} memory exponent at batch 1")
    fit = fit_of(impl)
    seqs = sorted(r["seq_len"] for r in impl["rows"] if r["mode"] == metric["mode"] and r["batch_size"] == 1
                  and records.is_ok(r))
    stand_in = (" (sdpa stands in for FlashAttention: torch picks its fused kernel, and the record does not say "
                "which)") if name == "sdpa" else ""
    return Reading(fit["exponent"], f"bench_attention {name}{stand_in}, {metric['mode']}: slope of log peak memory "
                                    f"({fit['memory_kind']}) on log sequence length through {fit['points']} lengths "
                                    f"{seqs[0]}-{seqs[-1]}: {fit['exponent']:.3f} (r² {fit['r2']:.4f})",
                   cause=attention_exponent_expected(layout, name, seqs))


def _prune_ratio(layout, metric: dict) -> Reading:
    """A pruning strategy's figure against the base model it was cut from, measured in the same job:
    `footprint_ratio` (pruned / base get_memory_footprint, exact) or `generation_speedup` (base time / pruned
    time over interleaved rounds, with its interval where the rounds give one)."""
    m = _read(layout.metrics("prune", metric["strategy"]))
    kept = f"{m['kept']['layers']} layers x {m['kept']['heads']} query heads ({m['kept']['kv_heads']} kv)"
    if metric["key"] == "generation_speedup":
        s = m["generation_speedup"]
        if s.get("median") is None:
            raise NotHere(f"prune {metric['strategy']}: {s['verdict']}")
        spread = "" if s.get("ci95") else f": {s['verdict']}"
        return Reading(s["median"], f"prune {metric['strategy']} ({kept}): base generation time over the pruned "
                                    f"model's, {s['rounds']} interleaved rounds of {m['new_tokens']} tokens{spread}",
                       tuple(s["ci95"]) if s.get("ci95") else None)
    return Reading(m["footprint_ratio"], f"prune {metric['strategy']} ({kept}): get_memory_footprint "
                                         f"{m['pruned']['memory_footprint_bytes']:,} B / base "
                                         f"{m['base']['memory_footprint_bytes']:,} B", exact=True,
                   cause=prune_shares(layout, m))


def _task_change(layout, metric: dict) -> Reading:
    """The change of an lm-eval metric from model `against` (default: the model's own reference in its evaluate
    record) to `model`, paired document by document, with its 95% interval (evaluation.scores.change)."""
    m = _read(layout.metrics("evaluate", metric["model"]))
    against = metric.get("against") or m["reference"]
    ref = _read(layout.metrics("evaluate", against))
    task, name = metric["task"], metric["metric"]
    if m["tasks"].get(task, {}).get("status") != "ok" or ref["tasks"].get(task, {}).get("status") != "ok":
        raise NotHere(f"evaluate: {task} did not run on {metric['model']} and {against}")
    chg = scores.change(ref["tasks"][task], m["tasks"][task], name)
    if chg is None:
        raise NotHere(f"evaluate: no {name} on the same documents for {metric['model']} and {against}")
    return Reading(chg["change"], f"evaluate: {name} of {metric['model']} minus {against}'s on the same {chg['n']} "
                                  f"documents of {task} ({chg['method']})",
                   tuple(chg["ci95"]) if chg.get("ci95") else None)


def _serving_ratio(layout, metric: dict) -> Reading:
    """bench_serving's output tokens/s of `method` over the naive server's, at the highest concurrency it ran,
    paired burst round by burst round, with its 95% interval where the rounds give one (a record of one burst has
    none: inconclusive); whether continuous batching beat static batching, and what the other batching methods
    reached, is the cause said."""
    m = _read(layout.metrics("bench_serving"))
    cells = [c for c in m["cells"] if c["method"] == metric["method"] and records.is_ok(c)]
    if not cells or not any(c["method"] == "naive" and records.is_ok(c) for c in m["cells"]):
        reasons = [c.get("reason", "") for c in m["cells"] if c["method"] in (metric["method"], "naive")]
        raise NotHere(f"bench_serving has no {metric['method']} and naive results to compare: {'; '.join(reasons)}")
    best = max(cells, key=lambda c: c["concurrency"])
    ratio = records.serving_ratio(best, "throughput_vs_naive")
    if not ratio or ratio.get("median") is None:
        raise NotHere(f"bench_serving has no {metric['method']} throughput over naive at concurrency "
                      f"{best['concurrency']}")
    spread = "" if ratio.get("ci95") else f": {ratio['verdict']}"
    return Reading(ratio["median"],
                   f"bench_serving, {ratio['rounds']} burst round(s) of {m['requests']} requests: {metric['method']} "
                   f"at concurrency {best['concurrency']}, its output tokens/s over naive's in the same round{spread}",
                   tuple(ratio["ci95"]) if ratio.get("ci95") else None,
                   cause=serving_alternatives(m, metric["method"], best))


def _inference_speedup(layout, metric: dict) -> Reading:
    """bench_inference's generation speedup of `variant` over the base model (the base's time over the
    variant's, interleaved rounds), in its cell with the KV cache at batch 1, with its interval where the
    rounds give one."""
    m = _read(layout.metrics("bench_inference", metric["variant"]))
    cell = records.reference_cell(m)
    if cell and not (cell.get("vs_base") or {}).get("generation_speedup"):
        cell = None
    if cell is None:
        raise NotHere(f"bench_inference {metric['variant']} has no cell against the base model at batch 1 with "
                      f"the KV cache")
    s, rounds = cell["vs_base"]["generation_speedup"], cell["vs_base"].get("rounds", [])
    if s.get("median") is None:  # the speed sentinel set aside every round: a busy machine, no speedup measured
        raise NotHere(f"bench_inference {metric['variant']} measured no speedup over the base model: "
                      f"{s.get('verdict') or 'no stable round'}")
    per_round = [r["seconds"]["base"] / r["seconds"][metric["variant"]] for r in rounds
                 if {"base", metric["variant"]} <= set(r.get("seconds", {}))]
    spread = "" if s.get("ci95") else f" ({s['verdict']}; per round: {', '.join(f'{r:.3g}' for r in per_round)})"
    return Reading(s["median"], f"bench_inference {metric['variant']} ({m.get('dtype')} base, batch 1, KV cache, "
                                f"{m.get('new_tokens')} new tokens): the base model's generation time over "
                                f"{metric['variant']}'s, median of {s['rounds']} interleaved rounds {s['median']:.3g}"
                                f"{spread}", tuple(s["ci95"]) if s.get("ci95") else None)


def _qat_recovered(layout, metric: dict) -> Reading:
    """The share of PTQ's perplexity gap QAT recovers (torchao's measure, the qat record's recovered_share), at the
    lowest width where PTQ left a decided gap, in %, with its bootstrap interval over the paired rows."""
    m = _read(layout.metrics("qat"))
    shares = sorted((v["bits"], v["recovered_share"]) for v in m.get("variants", [])
                    if v.get("method") == "qat" and (v.get("recovered_share") or {}).get("share") is not None)
    if not shares:
        raise NotHere("qat: PTQ left no decided perplexity gap at any width, so QAT had nothing to recover")
    bits, s = shares[0]
    return Reading(100 * s["share"], f"qat, {bits} bits: (PTQ's perplexity change {s['ptq_change_pct']:+.1f}% − "
                                     f"QAT's {s['qat_change_pct']:+.1f}%) / PTQ's, over {s['n_rows']} validation rows "
                                     f"({s['method']})", tuple(100 * x for x in s["ci95"]) if s.get("ci95") else None)


def _base_shape(layout) -> dict:
    """The base model's shape (efflab.architecture.shape) from the config.json base_model leaves."""
    if not (layout.base_model() / "config.json").is_file():
        raise NotHere("no base_model/model/config.json (the base model's shapes: a reference run keeps no configs)")
    return analytic.architecture(str(layout.base_model()))


def _kv_cache_memory(layout, metric: dict) -> Reading:
    """The full-precision KV cache bench_inference measured (generate()'s DynamicCache after a prefill, batch 1,
    at the longest context a quantized-cache cell measured: the bytes left allocated, exact) over the seed's
    formula batch × heads × seq_len × dim × layers × 2 in the record's dtype; the cause: which heads it holds."""
    m = _read(layout.metrics("bench_inference", metric["variant"]))
    rows = [r for c in records.ok(m.get("cells", [])) for r in (c.get("quantized_cache") or {}).get(
        "memory_by_context", []) if r.get("full_mib")]
    if not rows:
        raise NotHere(f"bench_inference {metric['variant']} measured no full-precision KV cache memory (a "
                      f"quantized-cache cell measures it: bench_inference.variants.{metric['variant']}.kv_quant)")
    row, a = max(rows, key=lambda r: r["context"]), _base_shape(layout)
    el, measured = analytic.bytes_per_element(m["dtype"]), row["full_mib"] * 2**20
    formula = 1 * a["heads"] * row["context"] * a["head_dim"] * a["layers"] * 2 * el
    return Reading(measured / formula, f"bench_inference {metric['variant']}: generate()'s full-precision cache after "
                                       f"a prefill of {row['context']} tokens holds {measured:,.0f} B ({row['kind']});"
                                       f" the seed's formula, 1 × {a['heads']} heads × {row['context']} × "
                                       f"{a['head_dim']} × {a['layers']} layers × 2 × {el:g} bytes ({m['dtype']}) = "
                                       f"{formula:,.0f} B", exact=True,
                   cause=kv_heads_held(a, row["context"], el, measured))


def _decode_cells(layout, variants: list[str]) -> tuple[dict | None, dict | None, list[str]]:
    """The base model's batch-1 cells with generate()'s dynamic KV cache and without one, from the first of the
    bench_inference records `variants` that has each, and why each record that is not there gave none."""
    on = off = None
    why = []
    for v in variants:
        job = records.load_if_there(layout.metrics("bench_inference", v))
        if not job or not records.is_ok(job):
            why.append(f"{v}: {(job or {}).get('reason') or 'no record'}")
            continue
        on = on or records.reference_cell(job)
        off = off or next((c for c in records.ok(job.get("cells", [])) if not c["kv_cache"]
                           and c["batch_size"] == 1), None)
    return on, off, why


def _kv_cache_speedup(layout, metric: dict) -> Reading:
    """The base model's decode tokens/s with generate()'s KV cache over without it (batch 1), the two cells' own
    medians (timed in cells of their own, not interleaved), the interval from the far ends of their intervals."""
    on, off, why = _decode_cells(layout, metric["variants"])
    if on is None or off is None:
        missing = "with" if on is None else "without"
        raise NotHere(f"no batch-1 cell of the base model {missing} the KV cache in bench_inference "
                      f"{', '.join(metric['variants'])}{' (' + '; '.join(why) + ')' if why else ''}")
    a, b = on["decode_tokens_per_s"], off["decode_tokens_per_s"]
    ci = (a["ci95_median"][0] / b["ci95_median"][1], a["ci95_median"][1] / b["ci95_median"][0]) \
        if a.get("ci95_median") and b.get("ci95_median") else None
    spread = "the interval from the far ends of the two cells' own" if ci else "no interval (a cell has no 95%"
    return Reading(a["median"] / b["median"], f"bench_inference, base model, batch 1: decode {a['median']:.4g} "
                                              f"tokens/s with the KV cache over {b['median']:.4g} without, medians of "
                                              f"{a['n']} and {b['n']} generations timed in separate cells; {spread} "
                                              f"95% intervals of the median{'' if ci else ')'}", ci)


def _gpu_base_model(layout) -> dict:
    base = _read(layout.metrics("base_model"))
    if base.get("environment", {}).get("device") != "cuda":
        raise NotHere("the results are from a CPU run (base_model measures the GPU's matmul rates and CUDA "
                      "context on CUDA runs)")
    return base


def _matmul_ratio(layout, metric: dict) -> Reading:
    """The ratio of two precisions' matmul ceilings (the best of base_model's timed repeats each): no interval."""
    base = _gpu_base_model(layout)
    rates = base["gpu_matmul_tflops"]
    fast, slow = rates[metric["fast"]], rates[metric["slow"]]
    return Reading(fast["tflops"] / slow["tflops"],
                   f"{base['environment'].get('gpu')}: {fast['size']}^3 matmul ceiling {metric['fast']} "
                   f"{fast['tflops']:.1f} vs {metric['slow']} {slow['tflops']:.1f} TFLOP/s (measured by base_model; a "
                   f"matmul, not a training step)")


def _cuda_context(layout, metric: dict) -> Reading:
    """What the process holds on the GPU outside torch's allocator, read once: no interval."""
    base = _gpu_base_model(layout)
    context = base["cuda_context"]
    if context.get("mib") is None:
        raise NotHere(f"NVML could not say: {context.get('unavailable')}")
    return Reading(context["mib"] * UNIT_SCALE["MiB"],
                   f"{base['environment'].get('gpu')}: NVML process {context['nvml_process_mib']:.0f} MiB - torch "
                   f"reserved {context['torch_reserved_mib']:.0f} MiB = {context['mib']:.0f} MiB")


# Metrics whose figure is a definition (a parameter count of this run's model), not a measurement.
DEFINITION_METRICS = frozenset({"finetune_trainable"})
# Each takes the results layout and the claim's metric and returns a Reading (value in the claim's base unit), or
# raises NotHere.
METRICS = {"quantize_ratio": _quantize_ratio, "attention_speedup": _attention_speedup,
           "attention_memory_exponent": _attention_memory_exponent, "matmul_ratio": _matmul_ratio,
           "cuda_context": _cuda_context, "prune_ratio": _prune_ratio, "serving_ratio": _serving_ratio,
           "inference_speedup": _inference_speedup, "task_change": _task_change,
           "kv_cache_memory": _kv_cache_memory, "kv_cache_speedup": _kv_cache_speedup,
           "qat_recovered": _qat_recovered}
# The fine-tuning ones take the fine-tuning jobs' names as well (registry.names(cfg, "finetune")).
FINETUNE_METRICS = {"finetune_trainable": finetune_trainable, "finetune_pair": finetune_pair}


def read(layout, metric: dict, finetune: list[str]) -> Reading:
    """A measured claim's Reading of `metric` from the results in `layout`, the fine-tuning runs being the jobs
    `finetune` of the grid; NotHere where the results it needs are not there."""
    if metric["kind"] in FINETUNE_METRICS:
        return FINETUNE_METRICS[metric["kind"]](layout, metric, finetune)
    return METRICS[metric["kind"]](layout, metric)
