"""Measured claims: figures read from this pipeline's own results."""
from __future__ import annotations

import json
from pathlib import Path

from .. import estimate, records
from .verdict import UNIT_SCALE


class NotHere(Exception):
    """The results a measured claim needs are not in this results folder."""


def _read(path: Path) -> dict:
    if not path.is_file():
        raise NotHere(f"no {path} (run the stage that writes it)")
    metrics = json.loads(path.read_text())
    if not records.is_ok(metrics):  # a job that failed or was skipped measured nothing
        raise NotHere(f"{path.parent.name} is {metrics['status']}: {metrics.get('reason', 'no reason given')}")
    return metrics


def scale_note(layout) -> str:
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
    from ..measure import median_ci_order, percentile

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

