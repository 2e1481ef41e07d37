"""Stage report: gather every stage's metrics.json with pandas into tables, plots and one CSV."""
from __future__ import annotations

import json
import logging
from pathlib import Path

import matplotlib
import matplotlib.ticker

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

from . import cli, config, glance, provenance, records  # noqa: E402
from .config import UserError  # noqa: E402
from .measure import (SENTINEL_TOLERANCE, FINGERPRINT_KEYS, fingerprint, format_ratio, median_ci_order,
                      percentile)  # noqa: E402

log = logging.getLogger("efflab")
MiB = 2**20


def _fp(metrics: dict) -> str:
    """The environment fingerprint of a result (computed for results written before it was stored)."""
    env = metrics["environment"]
    return env.get("fingerprint") or fingerprint(env)


def _pct(x: float | None) -> float | None:
    return None if x is None else 100 * x


def _mem(m: dict | None) -> float | None:
    return None if not m else m.get("peak_mib")


def quantize_table(rows: list[dict]) -> pd.DataFrame:
    return pd.DataFrame([{
        "scheme": r["scheme"], "method": r["method"], "double quant": r["double_quant"],
        "bnb layers": ", ".join(r["bnb_layer_types"]) or "-",
        "footprint (MiB)": r["memory_footprint_bytes"] / MiB, "x smaller than baseline": r["footprint_ratio_vs_base"],
        "on disk (MiB)": r["bytes_on_disk"] / MiB, "load (s)": r["load_s"],
        "val perplexity": r["validation"]["perplexity"], "perplexity change (%)": r["perplexity_change_pct"],
        "env": _fp(r),
    } for r in records.ok(rows)], columns=["scheme", "method", "double quant", "bnb layers", "footprint (MiB)",
                                           "x smaller than baseline", "on disk (MiB)", "load (s)", "val perplexity",
                                           "perplexity change (%)", "env"])


PRUNE_COLUMNS = ["strategy", "layers", "query heads (kv)", "heads asked", "parameters", "parameters kept (%)",
                 "footprint (MiB)", "val perplexity", "base perplexity", "perplexity change (%)",
                 "generation (ms)", "speedup vs base [95% CI]", "verdict vs base", "sample", "healed perplexity",
                 "healed change (%)", "healed sample", "env"]


def prune_table(rows: list[dict]) -> pd.DataFrame:
    return pd.DataFrame([{
        "strategy": r["strategy"], "layers": r["kept"]["layers"],
        "query heads (kv)": f"{r['kept']['heads']} ({r['kept']['kv_heads']})",
        "heads asked": f"{r['kept']['target_heads']:g}",
        "parameters": r["pruned"]["parameters"], "parameters kept (%)": 100 * r["parameter_ratio"],
        "footprint (MiB)": r["pruned"]["memory_footprint_bytes"] / MiB,
        "val perplexity": r["pruned"]["validation"]["perplexity"],
        "base perplexity": r["base"]["validation"]["perplexity"],
        "perplexity change (%)": r["perplexity_change_pct"],
        "generation (ms)": 1000 * r["pruned"]["generation_s"]["median"],
        "speedup vs base [95% CI]": _speedup(r, "generation_speedup"),
        "verdict vs base": _speedup_verdict(r, "generation_speedup"),
        "sample": " ".join(r["pruned"]["sample"].split())[:80], **_healed(r), "env": _fp(r),
    } for r in records.ok(rows)], columns=PRUNE_COLUMNS)


def _healed(r: dict) -> dict:
    h = r.get("healing") or {}
    if not records.is_ok(h):
        return {"healed perplexity": None, "healed change (%)": None, "healed sample": h.get("status", "-")}
    ppl = h["validation"]["perplexity"]
    return {"healed perplexity": ppl, "healed change (%)": 100 * (ppl / r["base"]["validation"]["perplexity"] - 1),
            "healed sample": " ".join(h["sample"].split())[:80]}


def plot_prune(df: pd.DataFrame, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.scatter(df["parameters kept (%)"], df["perplexity change (%)"], color="tab:purple", label="pruned")
    for name, kept, change in zip(df["strategy"], df["parameters kept (%)"], df["perplexity change (%)"]):
        ax.annotate(name, (kept, change), textcoords="offset points", xytext=(4, 4), fontsize=8)
    healed = df.dropna(subset=["healed change (%)"])
    if not healed.empty:
        ax.scatter(healed["parameters kept (%)"], healed["healed change (%)"], color="tab:green", marker="v",
                   label="after LoRA healing")
        for kept, before, after in zip(healed["parameters kept (%)"], healed["perplexity change (%)"],
                                       healed["healed change (%)"]):
            ax.annotate("", (kept, after), (kept, before), arrowprops={"arrowstyle": "->", "color": "tab:green"})
        _legend(ax, fontsize=8)
    ax.axhline(0, color="grey", lw=0.8)
    ax.set_yscale("symlog")
    ax.set_xlabel("parameters kept (%)")
    ax.set_ylabel("validation perplexity change vs base (%, symlog)")
    ax.set_title("Structured pruning: parameters removed vs perplexity paid")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


QAT_COLUMNS = ["bits", "PTQ perplexity", "PTQ x full precision", "PTQ passes", "QAT perplexity",
               "QAT x full precision", "QAT passes", "packed weights (MiB)", "env"]


def qat_table(jobs: list[dict]) -> pd.DataFrame:
    """One row per bit width: PTQ and QAT validation perplexity, over the full-precision fine-tune's, and
    whether the width passes the precision range test's threshold."""
    out = []
    for job in records.ok(jobs):
        reference, threshold = job["reference_perplexity"], job["threshold"]
        for bits in job["bits"]:
            row = {"bits": bits, "env": _fp(job)}
            for method in ("ptq", "qat"):
                v = next(v for v in job["variants"] if (v["method"], v["bits"]) == (method, bits))
                label = method.upper()
                if records.is_ok(v):
                    ratio = v["perplexity"] / reference
                    row |= {f"{label} perplexity": v["perplexity"], f"{label} x full precision": ratio,
                            f"{label} passes": "yes" if ratio <= threshold else "no",
                            "packed weights (MiB)": v["weight_bytes"]["packed_bytes"] / MiB}
                else:
                    row[f"{label} passes"] = _status(v)
            out.append(row)
    return pd.DataFrame(out, columns=QAT_COLUMNS)


def plot_qat(df: pd.DataFrame, job: dict | None, path: Path) -> None:
    """Perplexity vs bits for PTQ and QAT (log scale), the full-precision reference and the threshold line."""
    fig, ax = plt.subplots(figsize=(7, 4))
    for label, color in (("PTQ", "tab:red"), ("QAT", "tab:blue")):
        ok = df.dropna(subset=[f"{label} perplexity"])
        ax.plot(ok["bits"], ok[f"{label} perplexity"], "o-", color=color, label=label)
    if job and job.get("reference_perplexity"):
        reference = job["reference_perplexity"]
        ax.axhline(reference, color="grey", lw=0.8, label="full precision (fine-tuned)")
        ax.axhline(job["threshold"] * reference, color="grey", lw=0.8, ls="--",
                   label=f"threshold ({job['threshold']:g}x)")
    ax.set_yscale("log")
    ax.set_xticks(sorted(df["bits"].unique()) if not df.empty else [])
    ax.set_xlabel("weight bits (per-group symmetric, round to nearest)")
    ax.set_ylabel("validation perplexity (log)")
    ax.set_title("Precision range test: post-training vs quantization-aware training")
    _legend(ax, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def qat_lines(job: dict) -> list[str]:
    """What the table rests on, and each method's B_min."""
    if not records.is_ok(job):
        return [f"_qat did not run: {job['status']}: {job.get('reason', '')}_"]
    tests = job["precision_range_test"]

    def b_min(method: str) -> str:
        t = tests[method]
        said = f"**{t['b_min']} bits**" if t["b_min"] else f"none of {job['bits']} bits"
        return said + (f" (but {', '.join(map(str, t['fail_above_b_min']))} bits fail again)"
                       if t["fail_above_b_min"] else "")

    return [f"Validation perplexity of the base model {job['base_perplexity']:.2f}; fine-tuned in full precision "
            f"{job['reference_perplexity']:.2f}, so a width passes at {job['threshold']:g} x that = "
            f"{job['threshold'] * job['reference_perplexity']:.2f} or less. B_min: PTQ {b_min('ptq')}, "
            f"QAT {b_min('qat')}.", ""]


SERVING_COLUMNS = ["method", "concurrency", "status", "requests/s", "output tokens/s", "x naive",
                   "TTFT p50 (s)", "TTFT p90 (s)", "TTFT p99 (s)", "latency p50 (s)", "latency p90 (s)",
                   "latency p99 (s)", "env"]


def serving_table(jobs: list[dict]) -> pd.DataFrame:
    out = []
    for job in records.ok(jobs):
        for c in job["cells"]:
            ok = records.is_ok(c)
            ttft, lat = (c.get("ttft_s") or {}), (c.get("latency_s") or {})
            out.append({"method": c["method"], "concurrency": c["concurrency"], "status": _status(c),
                        "requests/s": c.get("requests_per_s"), "output tokens/s": c.get("output_tokens_per_s"),
                        "x naive": c.get("throughput_vs_naive"),
                        **{f"TTFT {q} (s)": ttft.get(q) for q in ("p50", "p90", "p99")},
                        **{f"latency {q} (s)": lat.get(q) for q in ("p50", "p90", "p99")},
                        "env": _fp(job)} if ok else {"method": c["method"], "concurrency": c["concurrency"],
                                                     "status": _status(c), "env": _fp(job)})
    return pd.DataFrame(out, columns=SERVING_COLUMNS)


def plot_serving(df: pd.DataFrame, path: Path) -> None:
    ok = records.ok_rows(df)
    fig, ax = plt.subplots(figsize=(7, 4))
    labels = [f"{m}\n@{c}" for m, c in zip(ok["method"], ok["concurrency"])]
    ax.bar(labels, ok["output tokens/s"], color="tab:green", alpha=0.8)
    ax.set_ylabel("output tokens/s (whole burst)")
    ax.set_title("Serving a burst of requests: naive vs static vs continuous batching")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


CAPACITY_COLUMNS = ["subject", "work", "largest", "predicted max", "measured max", "first that fails",
                    "peak at max (MiB)", "tokens/s at max", "cells", "status", "env"]


def capacity_table(jobs: list[dict]) -> pd.DataFrame:
    out = []
    for job in records.ok(jobs):
        fixed = job["fixed"]
        for s in job["searches"]:
            work = "training" if s["kind"] == "train" else "generation"
            if s["dimension"] == "batch_size":
                largest = f"batch ({fixed['train_seq_len'] if s['kind'] == 'train' else fixed['prompt_len']} tokens)"
            else:
                largest = "sequence (batch 1)"
            measured = s.get("measured_max")
            out.append({"subject": s["subject"], "work": work, "largest": largest,
                        "predicted max": s.get("predicted_max"),
                        "measured max": ("none fits" if measured is None else
                                         f">= {measured} (whole range)" if s.get("whole_range_fits") else measured)
                        if records.is_ok(s) else None,
                        "first that fails": s.get("first_failing"), "peak at max (MiB)": s.get("peak_mib_at_max"),
                        "tokens/s at max": s.get("tokens_per_s_at_max"), "cells": s.get("cells"),
                        "status": _status(s), "env": _fp(job)})
    return pd.DataFrame(out, columns=CAPACITY_COLUMNS)


def plot_capacity(jobs: list[dict], path: Path) -> None:
    searches = [s for job in records.ok(jobs) for s in job["searches"] if records.is_ok(s)]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, dimension, label in zip(axes, ("batch_size", "seq_len"), ("largest batch", "longest sequence (batch 1)")):
        rows = [s for s in searches if s["dimension"] == dimension]
        names = [f"{s['subject']}\n({'train' if s['kind'] == 'train' else 'generate'})" for s in rows]
        x = range(len(rows))
        ax.bar([i - 0.2 for i in x], [s.get("predicted_max") or 0 for s in rows], width=0.4, color="tab:gray",
               label="predicted (estimator)")
        ax.bar([i + 0.2 for i in x], [s.get("measured_max") or 0 for s in rows], width=0.4, color="tab:blue",
               label="measured (passes; the next size fails)")
        for i, s in zip(x, rows):
            if s.get("whole_range_fits"):
                ax.annotate("whole range", (i + 0.2, s["measured_max"]), ha="center", va="bottom", fontsize=7)
            elif s.get("measured_max") is None:
                ax.annotate("none fits", (i + 0.2, 0), ha="center", va="bottom", fontsize=7)
        ax.set_xticks(list(x), names, fontsize=8)
        ax.set_ylabel(label)
        ax.set_title(label)
        if rows:
            _legend(ax, fontsize=7)
    budget = next((j["budget"] for j in records.ok(jobs)), None)
    fig.suptitle("What fits" + (f" in {budget['mib']:.0f} MiB ({budget['source']})" if budget else ""))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def capacity_lines(jobs: list[dict], table: str) -> list[str]:
    job = next(iter(records.ok(jobs)), None)
    if job is None:
        return ["## Capacity: the largest batch and sequence that fit", "",
                f"_capacity did not run: {jobs[0]['status'] if jobs else 'no metrics'}_", ""]
    b = job["budget"]
    return ["## Capacity: the largest batch and sequence that fit", "",
            f"Budget: {b['mib']:.0f} MiB ({b['source']}); memory held against it: {b['memory']}. For each training "
            "run and inference variant the estimator predicts the largest size (from the memory measured with the "
            "model loaded, at the smallest size); isolated cells then confirm it: the measured maximum ran "
            f"{job['steps']['warmup']} + {job['steps']['timed']} steps within the budget and the next size ran out "
            "of memory (a recorded result, not a crash). Tokens/s at the maximum are over its timed steps. Every "
            "cell is in `results/capacity/cells.csv`.", "", table, "", "![capacity](capacity.png)", ""]


def profile_lines(metrics: dict) -> list[str]:
    """Each profiled job's trace, linked, and its 10 operators with the most self time."""
    found = [(f"finetune {m['run']}", f"../finetune/{m['name']}", m["profile"])
             for m in records.ok(metrics["finetune"]) if m.get("profile")]
    found += [(f"bench_inference {m['name']}, KV cache {c['kv_cache']}, batch {c['batch_size']}",
               f"../bench_inference/{m['name']}", c["profile"])
              for m in records.ok(metrics["bench_inference"]) for c in records.ok(m.get("cells", []))
              if c.get("profile")]
    if not found:
        return []
    lines = ["## Where the time goes: profiler traces", "",
             "Traces recorded on demand (`profile.stages`), phases labelled (data, forward, backward, optimizer step; "
             "generate): open a trace in Perfetto (ui.perfetto.dev) or chrome://tracing. A profiled run's own times "
             "include the profiler's cost.", ""]
    for title, folder, prof in found:
        if "unavailable" in prof:
            lines += [f"### {title}", "", f"_unavailable: {prof['unavailable']}_", ""]
            continue
        top = pd.DataFrame(prof["top10"]).rename(columns={
            "self_cpu_ms": "self CPU (ms)", "cpu_total_ms": "CPU total (ms)", "self_device_ms": "self GPU (ms)",
            "device_total_ms": "GPU total (ms)"})
        if not top.get("GPU total (ms)", pd.Series(dtype=float)).any():
            top = top.drop(columns=["self GPU (ms)", "GPU total (ms)"], errors="ignore")
        lines += [f"### {title}", "", f"[trace]({folder}/{prof['trace']}) ({prof['steps']} steps), "
                  f"[every operator]({folder}/{prof['top_ops']}); the top 10 by {prof['sorted_by']}:", "",
                  _md(top), ""]
    return lines


def _tokens_per_s(run: dict) -> float:
    """A run's real-token throughput over its steady steps, the rate its MFU is computed from (the whole run's,
    first steps included, for runs recorded before throughput was measured steady)."""
    return run.get("throughput", {}).get("tokens_per_s", run["tokens_per_s"])


def finetune_table(rows: list[dict]) -> pd.DataFrame:
    return pd.DataFrame([{
        "run": r["run"], "method": r["method"], "precision": r["mixed_precision"],
        "effective batch": r.get("effective_batch"),
        "pad tokens computed (%)": _pct(r.get("pad_fraction")),
        "trainable params": r["parameters"]["trainable"], "trainable (%)": r["parameters"]["trainable_pct"],
        "total params": r["parameters"]["total"], "steps": r["steps"], "step (s)": r["step_s"],
        "tokens/s": _tokens_per_s(r), "samples/s": r["samples_per_s"],
        "MFU (% of measured matmul)": _pct(r.get("throughput", {}).get("mfu_vs_measured_ceiling")),
        "matmul ceiling (TFLOP/s)": r.get("throughput", {}).get("matmul_ceiling", {}).get("tflops"),
        "MFU (% of published peak)": _pct(r.get("throughput", {}).get("mfu_vs_published_peak")),
        f"peak memory (MiB, {r['train_memory']['kind']})": _mem(r["train_memory"]),
        "val loss before": r["validation_before"]["loss"], "val loss after": r["validation_after"]["loss"],
        "val perplexity after": r["validation_after"]["perplexity"],
        "energy (J/token)": (r.get("energy") or {}).get("joules_per_token"), "env": _fp(r),
    } for r in records.ok(rows)])


def energy_note(jobs: list[dict]) -> str:
    """Where the J/token figures come from, or why there are none: one line under the table."""
    found = [e for e in jobs if e and "joules_per_token" in e]
    if found:
        return f"Energy: {found[0]['source']}, over the measured work, per token."
    reasons = sorted({e.get("unavailable", "not measured") for e in jobs if e})
    return f"Energy: unavailable here: {'; '.join(reasons) or 'not measured'}."


def _show(value) -> str:
    """A setting as params.yaml spells it: false, 1e-05, [q_proj, v_proj], lora."""
    return value if isinstance(value, str) else json.dumps(value)


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or not a else b / a


def step_time_ratio(a: dict, b: dict) -> dict | None:
    """Run b's step time over run a's, with the 95% interval of the median from order statistics (none under 6
    steps: then no verdict) and a verdict at that level:
    `slower` / `faster` only when the interval lies above / below 1, else `no significant difference`.

    Runs that drew the same batches in the same order (same seed and rows, so the same real tokens) are
    compared step by step: the ratio of each step to the same step of the other run, which takes the batches'
    different lengths out of the spread. Otherwise the two runs' median steps and their intervals are compared,
    and the verdict needs the intervals apart. Runs recorded without per-step times have none."""
    sa, sb = a.get("step_time"), b.get("step_time")
    if not sa or not sb or sa.get("n", 0) < 2 or sb.get("n", 0) < 2:
        return None
    ratios = records.paired_step_times(a, b)
    if ratios:
        interval = median_ci_order(ratios)
        if interval is None:
            return {"median": percentile(ratios, 0.5), "ci95": None, "paired": True,
                    "verdict": f"not a verdict: {len(ratios)} paired steps cannot give a 95% interval (6 needed)"}
        (lo, hi), _ = interval
        verdict = "slower" if lo > 1 else "faster" if hi < 1 else "no significant difference"
        return {"median": percentile(ratios, 0.5), "ci95": [lo, hi], "paired": True, "verdict": verdict}
    if sa.get("ci95_median") is None or sb.get("ci95_median") is None:
        return {"median": sb["median"] / sa["median"], "ci95": None, "paired": False,
                "verdict": "not a verdict: too few steps for a 95% interval of either median (6 needed)"}
    (lo_a, hi_a), (lo_b, hi_b) = sa["ci95_median"], sb["ci95_median"]
    verdict = "slower" if lo_b > hi_a else "faster" if hi_b < lo_a else "no significant difference"
    return {"median": sb["median"] / sa["median"], "ci95": None, "paired": False, "verdict": verdict}


def _median_ci(stats: dict | None) -> str:
    """The median with its 95% interval, or with the range of its n values where n gives no interval."""
    if not stats:
        return "-"
    if stats.get("ci95_median") is None:
        return f"{stats['median']:.2f} (range {stats['min']:.2f}–{stats['max']:.2f}, n={stats['n']})"
    lo, hi = stats["ci95_median"]
    return f"{stats['median']:.2f} [{lo:.2f}, {hi:.2f}]"


def _tensor_peaks(a: dict, b: dict) -> str:
    """The CPU live-tensor peaks of two runs (cpu_tensor_peak: counted from the allocator's events, the same
    for the same params on a rerun, so any difference is the knob's)."""
    peaks = [(r["train_memory"].get("tensors") or {}).get("delta_mib") for r in (a, b)]
    return "-" if None in peaks else f"{peaks[0]:.0f} → {peaks[1]:.0f}"


def _ratio_ci(ratio: dict | None) -> str:
    if not ratio or ratio.get("median") is None:
        return "-"
    if ratio.get("interleaved"):
        return f"{format_ratio(ratio)} (interleaved, {ratio['rounds']} rounds)"
    if not ratio["paired"]:
        return f"{ratio['median']:.2f} (runs' intervals)"
    lo, hi = ratio["ci95"]
    return f"{ratio['median']:.2f} [{lo:.2f}, {hi:.2f}] (paired steps)"


def speed_changed(a: dict, b: dict, tolerance: float = SENTINEL_TOLERANCE) -> str | None:
    """Why two runs' own step times cannot be compared, when the matmul ceilings their processes measured
    differ by more than `tolerance`: the machine ran at another speed for one of them."""
    ca, cb = (r.get("throughput", {}).get("matmul_ceiling", {}).get("tflops") for r in (a, b))
    if ca and cb and abs(cb / ca - 1) > tolerance:
        return (f"not a verdict: the machine's speed changed between the runs (matmul ceiling {1000 * ca:.0f} vs "
                f"{1000 * cb:.0f} GFLOP/s)")
    return None


def knob_timing(a: dict, b: dict, bench_finetune: list[dict]) -> tuple[dict | None, float | None]:
    """A knob pair's step-time ratio and tokens/s ratio: from bench_finetune's interleaved steps where it
    measured the pair, else from the two runs' own steps, unless the machine's speed changed between them."""
    pair = records.interleaved_pair(bench_finetune, a["run"], b["run"])
    if pair:
        rates = [pair["runs"][r]["tokens_per_s"] for r in (a["run"], b["run"])]
        return pair["step_time_ratio"] | {"interleaved": True}, _ratio(*rates)
    ratio = step_time_ratio(a, b)
    changed = speed_changed(a, b)
    if ratio and changed:
        ratio = ratio | {"verdict": changed}
    return ratio, _ratio(a["tokens_per_s"], b["tokens_per_s"])


def knob_table(rows: list[dict], bench_finetune: list[dict] = ()) -> pd.DataFrame:
    out = []
    for knob, value_a, value_b, a, b in records.knob_pairs(rows):
        value_a, value_b = _show(value_a), _show(value_b)
        mem_a, mem_b = _mem(a["train_memory"]), _mem(b["train_memory"])
        delta_a, delta_b = a["train_memory"].get("delta_mib"), b["train_memory"].get("delta_mib")
        memory_ratio = _ratio(delta_a, delta_b)
        ratio, tokens_ratio = knob_timing(a, b, bench_finetune)
        out.append({
            "knob": knob, "from → to": f"{value_a} → {value_b}",
            "runs": f"{a['run']} → {b['run']}",
            "peak memory (MiB)": f"{mem_a:.0f} → {mem_b:.0f}" if mem_a and mem_b else "-",
            "training memory over baseline (MiB)": f"{delta_a:.0f} → {delta_b:.0f}" if delta_a and delta_b else "-",
            "memory change (%)": _pct(memory_ratio - 1) if memory_ratio else None,
            "memory kind": a["train_memory"]["kind"],
            "live tensor peak (MiB)": _tensor_peaks(a, b),
            "step time change (%)": _pct(_ratio(a["step_s"], b["step_s"]) - 1),
            "median step (s) [95% CI]": f"{_median_ci(a.get('step_time'))} → {_median_ci(b.get('step_time'))}",
            "step time ratio [95% CI]": _ratio_ci(ratio),
            "step time verdict": ratio["verdict"] if ratio else "-",
            "tokens/s ratio": tokens_ratio,
            "val loss after": f"{a['validation_after']['loss']:.4f} → {b['validation_after']['loss']:.4f}",
            "env": _fp(a) if _fp(a) == _fp(b) else f"{_fp(a)} / {_fp(b)}",
        })
    return pd.DataFrame(out)


def prompt_count(cfg: dict, metrics: dict) -> int:
    """How many prompts bench_inference asked (as it recorded; else as configured)."""
    done = [m["prompts"] for m in records.ok(metrics["bench_inference"]) if "prompts" in m]
    chosen = cfg["bench_inference"]["prompts"]
    return done[0] if done else len(chosen) if isinstance(chosen, list) else chosen["validation_rows"]


def _one_line(text: str | None, limit: int = 240) -> str:
    text = " ".join((text or "").split())
    return (text[:limit] + "…" if len(text) > limit else text).replace("|", "\\|")


def sample_lines(jobs: list[dict]) -> list[str]:
    """Each question bench_inference asked, its reference answer when it came from the user's data, and every
    variant's greedy answer (first cell of each variant), as a table per question."""
    answers: dict[str, dict] = {}
    for m in jobs:
        cell = next(iter(records.ok(m.get("cells", []))), None)
        for s in (cell or {}).get("samples", []):
            entry = answers.setdefault(s["prompt"], {"reference": s.get("reference"), "by": {}})
            entry["by"][m["variant"]] = s["answer"]
    if not answers:
        return []
    lines = ["### Sample answers", "",
             "Greedy answers of each variant (first cell; cut at the benchmark's fixed length) to the questions "
             "asked, with the data's own answer where the question is one of its validation rows.", ""]
    for i, (question, entry) in enumerate(answers.items(), 1):
        lines += [f"**Q{i}.** {_one_line(question)}", ""]
        if entry["reference"]:
            lines += [f"_Reference answer:_ {_one_line(entry['reference'])}", ""]
        lines += ["| variant | answer |", "|---|---|"] + [f"| {v} | {_one_line(a)} |" for v, a in entry["by"].items()]
        lines.append("")
    return lines


def not_run_table(metrics: dict[str, list[dict]]) -> pd.DataFrame:
    """Every job of the grid that did not produce numbers, and why: nothing disappears silently."""
    return pd.DataFrame(records.not_run(metrics), columns=["stage", "name", "status", "reason"])


# Why a GPU rerun is not bitwise identical by default, and what finetune.deterministic does about it.
GPU_DETERMINISM = [
    "cuBLAS picks reduction orders per workspace: bitwise repeats need `CUBLAS_WORKSPACE_CONFIG=:4096:8`, "
    "which `deterministic: true` sets (transformers' `enable_full_determinism`).",
    "Atomic adds in backward kernels (index_add/scatter in embedding backward, SDPA's memory-efficient and "
    "FlashAttention-2 backward) sum in a run-dependent order; `deterministic: true` makes PyTorch use "
    "deterministic kernels where they exist (`torch.use_deterministic_algorithms`, "
    "`FLASH_ATTENTION_DETERMINISTIC=1`) and raise an error where none exists, rather than drift silently.",
    "cuDNN / cuBLAS autotuning (`torch.backends.cudnn.benchmark`) and `torch_compile`'s max-autotune choose "
    "kernels by timing, so two runs can pick different kernels.",
    "`tf32: true` and bf16/fp16 mixed precision change the rounding, not the determinism: reruns agree with "
    "each other but not with an fp32 run.",
    "bitsandbytes 4-bit/8-bit kernels (QLoRA, 8-bit optimizers) and `dataloader_num_workers > 0` with "
    "unseeded worker RNGs are further sources; efflab seeds the workers through the Trainer's `seed`/`data_seed`.",
]


def plot_finetune(rows: list[dict], path: Path) -> None:
    """Peak memory and throughput per run, side by side: what each method and knob costs and buys."""
    ok = records.ok(rows)
    fig, (mem_ax, tps_ax) = plt.subplots(1, 2, figsize=(10, 0.5 * len(ok) + 1.8), sharey=True)
    names = [r["run"] for r in ok]
    kind = ok[0]["train_memory"]["kind"] if ok else ""
    mem_ax.barh(names, [_mem(r["train_memory"]) or 0 for r in ok], color="tab:blue")
    mem_ax.set_xlabel(f"peak memory (MiB, {kind})")
    tps_ax.barh(names, [_tokens_per_s(r) for r in ok], color="tab:green")
    tps_ax.set_xlabel("training tokens/s (real tokens)")
    mem_ax.invert_yaxis()
    fig.suptitle("Fine-tuning runs: memory and throughput")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def dominated(points: list[dict], better: dict[str, str]) -> list[bool]:
    """For each point, whether another is at least as good on every criterion and better on one. `better` maps
    a key to "min" or "max"; a criterion a point lacks (None) is left out of the comparisons it is in."""
    def as_good(a: dict, b: dict, key: str) -> bool:
        return a[key] <= b[key] if better[key] == "min" else a[key] >= b[key]

    out = []
    for p in points:
        beaten = False
        for q in points:
            keys = [k for k in better if p.get(k) is not None and q.get(k) is not None]
            if q is p or not keys:
                continue
            if all(as_good(q, p, k) for k in keys) and any(q[k] != p[k] for k in keys):
                beaten = True
                break
        out.append(beaten)
    return out


def _plot_pareto(points: list[dict], x: str, y: str, xlabel: str, ylabel: str, title: str, path: Path,
                 note=lambda p: "") -> None:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    front = sorted((p for p in points if not p["dominated"]), key=lambda p: p[x])
    ax.plot([p[x] for p in front], [p[y] for p in front], "-", color="tab:green", alpha=0.5, zorder=1)
    for p in points:
        colour = "lightgrey" if p["dominated"] else "tab:green"
        ax.scatter(p[x], p[y], color=colour, edgecolor="black" if not p["dominated"] else "grey", zorder=2)
        ax.annotate(p["name"] + note(p), (p[x], p[y]), textcoords="offset points", xytext=(5, 4), fontsize=8,
                    color="grey" if p["dominated"] else "black")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title + "\n(green: the Pareto frontier; grey: dominated, another config is better on every axis)",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def finetune_pareto(rows: list[dict]) -> list[dict]:
    points = [{"name": r["run"], "memory": _mem(r["train_memory"]), "tokens_per_s": _tokens_per_s(r),
               "kind": r["train_memory"]["kind"]} for r in records.ok(rows) if _mem(r["train_memory"]) is not None]
    for p, beaten in zip(points, dominated(points, {"memory": "min", "tokens_per_s": "max"})):
        p["dominated"] = beaten
    return points


def plot_finetune_pareto(points: list[dict], path: Path) -> None:
    kind = points[0]["kind"] if points else ""
    _plot_pareto(points, "memory", "tokens_per_s", f"peak training memory (MiB, {kind})",
                 "training tokens/s (real tokens, steady steps)", "Fine-tuning: memory vs throughput", path)


def inference_pareto(inference_rows: list[dict], quantize_rows: list[dict]) -> list[dict]:
    """One point per inference variant (its KV-cache, batch-1 cell): footprint, decode tokens/s and the
    perplexity change its quantization costs (quantized variants; 0 for the base model; fine-tuned variants
    have no comparable figure)."""
    ppl = {r["scheme"]: r["perplexity_change_pct"] for r in records.ok(quantize_rows)}
    points = []
    for r in records.ok(inference_rows):
        cell = next((c for c in r.get("cells", []) if records.is_ok(c) and c["kv_cache"] and c["batch_size"] == 1),
                    None)
        if cell is None:
            continue
        delta = 0.0 if r["kind"] == "base" else ppl.get(r["of"]) if r["kind"] == "quantized" else None
        points.append({"name": r["variant"], "footprint": cell["memory_footprint_bytes"] / MiB,
                       "decode": cell["decode_tokens_per_s"]["median"], "perplexity_change_pct": delta})
    for p, beaten in zip(points, dominated(points, {"footprint": "min", "decode": "max",
                                                   "perplexity_change_pct": "min"})):
        p["dominated"] = beaten
    return points


def plot_inference_pareto(points: list[dict], path: Path) -> None:
    def note(p):
        d = p["perplexity_change_pct"]
        return "" if d is None else f" ({d:+.1f}% ppl)"
    _plot_pareto(points, "footprint", "decode", "model footprint (MiB)", "decode tokens/s (median, KV cache, batch 1)",
                 "Inference: memory vs speed vs perplexity change", path, note)


def merge_table(rows: list[dict]) -> pd.DataFrame:
    rows = records.ok(rows)
    return pd.DataFrame([{
        "run": r["run"], "reference": r["reference"], "merged into": r["merge_target"],
        f"max |logit diff| (merge dtype)": r["merged"]["max_abs_logit_diff"],
        "max |logit diff| (saved folder)": r["merged_saved"]["max_abs_logit_diff"], "saved dtype": r["saved_dtype"],
        "perplexity adapter": r["adapter_validation"]["perplexity"],
        "perplexity merged": r["merged"]["validation"]["perplexity"],
        "perplexity saved": r["merged_saved"]["validation"]["perplexity"], "env": _fp(r),
    } for r in rows])


def _status(row: dict) -> str:
    return "ok" if records.is_ok(row) else f"{row['status']}: {row.get('reason', '')}"


def _ci(stats: dict, scale: float = 1.0) -> str:
    """The 95% interval of the median as lo–hi; where n gives none, the range of the n values, named so."""
    if "ci95_median" not in stats:
        return "-"
    if stats["ci95_median"] is None:
        return f"{scale * stats['min']:.4g}–{scale * stats['max']:.4g} (range, n={stats['n']})"
    lo, hi = stats["ci95_median"]
    return f"{scale * lo:.4g}–{scale * hi:.4g}"


def merge_targets_table(rows: list[dict]) -> pd.DataFrame:
    rows = records.ok(rows)
    return pd.DataFrame([{
        "run": r["run"], "merged into": target, "max |logit diff| vs adapter on 4-bit base": t["max_abs_logit_diff"],
        "mean KL vs adapter": t["kl_mean"], "perplexity": t["validation"]["perplexity"],
        "perplexity adapter": r["adapter_validation"]["perplexity"],
        "closest to the adapter (lowest KL)": "yes" if target == r.get("closest_target") else "", "env": _fp(r),
    } for r in rows for target, t in r.get("targets", {}).items()])


def merge_route_lines(rows: list[dict]) -> list[str]:
    """Fidelity and quality of the merge routes, said apart: the route closest to the adapter is not
    necessarily the one with the lowest perplexity, and the reader is told when they differ."""
    out = []
    for r in records.ok(rows):
        targets = r.get("targets") or {}
        if len(targets) < 2:
            continue
        closest = r["closest_target"]
        lowest = min(targets, key=lambda t: targets[t]["validation"]["perplexity"])
        ppl = {t: v["validation"]["perplexity"] for t, v in targets.items()}
        rows_n = targets[lowest]["validation"].get("rows")
        if lowest == closest:
            out.append(f"- {r['run']}: merging into the {closest} is both closest to the adapter (KL "
                       f"{targets[closest]['kl_mean']:.3g}) and lowest in perplexity ({ppl[closest]:.2f}).")
        else:
            out.append(f"- {r['run']}: merging into the {closest} is closest to the adapter that was trained (KL "
                       f"{targets[closest]['kl_mean']:.3g}, perplexity {ppl[closest]:.2f}), but merging into the "
                       f"{lowest} has the lower perplexity ({ppl[lowest]:.2f}): fidelity to the adapter is not "
                       "quality. " + (f"On {rows_n} validation rows, without an interval, this run cannot say "
                                      "the difference would hold." if rows_n else ""))
    return out + [""] if out else []


def attention_table(rows: list[dict]) -> pd.DataFrame:
    out = []
    for r in rows:
        if not records.is_ok(r):  # the whole implementation did not run: one row, not one per cell
            out.append({"implementation": r.get("implementation") or r.get("name"), "status": _status(r),
                        "env": _fp(r) if "environment" in r else None})
            continue
        for row in r["rows"]:
            ok = records.is_ok(row)
            lat = row.get("latency", {})
            out.append({
                "implementation": row["implementation"], "mode": row.get("mode", "forward"),
                "seq len": row["seq_len"], "batch": row["batch_size"], "status": _status(row),
                "median (ms)": 1000 * lat["median"] if ok else None,
                "95% CI or range of median (ms)": _ci(lat, 1000) if ok else "-",
                "p90 (ms)": 1000 * lat["p90"] if ok else None,
                "p99 (ms)": 1000 * lat["p99"] if ok and "p99" in lat else None,
                "tokens/s": row["tokens_per_s"] if ok else None,
                "peak delta (MiB)": row["memory"].get("delta_mib") if ok else None,
                "memory kind": row["memory"]["kind"] if ok else None,
                "max |diff| vs eager": row["max_abs_diff_vs_eager"] if ok else None,
                "speedup vs eager [95% CI]": _speedup(row.get("vs_eager"), "speedup") if ok else "-",
                "verdict vs eager": _speedup_verdict(row.get("vs_eager"), "speedup") if ok else "-",
                "env": _fp(r),
            })
    return pd.DataFrame(out, columns=ATTENTION_COLUMNS)


ATTENTION_COLUMNS = ["implementation", "mode", "seq len", "batch", "status", "median (ms)", "95% CI or range of median (ms)",
                     "p90 (ms)", "p99 (ms)", "tokens/s", "peak delta (MiB)", "memory kind", "max |diff| vs eager",
                     "speedup vs eager [95% CI]", "verdict vs eager", "env"]


def _speedup(pair: dict | None, key: str) -> str:
    """An interleaved comparison's speedup with its interval: '1.31 [1.22, 1.40]'."""
    ratio = (pair or {}).get(key) or {}
    if ratio.get("median") is None:
        return (pair or {}).get("unavailable", "-")
    return format_ratio(ratio)


def _speedup_verdict(pair: dict | None, key: str) -> str:
    return ((pair or {}).get(key) or {}).get("verdict", "-")


def exponent_table(rows: list[dict]) -> pd.DataFrame:
    return pd.DataFrame([{
        "implementation": f["implementation"], "mode": f["mode"], "batch": f["batch_size"],
        "memory ~ seq^k: k": f["exponent"], "R²": f.get("r2"), "points": f["points"],
        "memory kind": f["memory_kind"], "env": _fp(r),
    } for r in rows for f in r.get("memory_exponents", [])])


def inference_table(rows: list[dict]) -> pd.DataFrame:
    out = []
    for r in rows:
        for c in r.get("cells", []):  # a job that failed outside its cells has none (table of jobs not run)
            ok = records.is_ok(c)
            out.append({
                "variant": r["variant"], "kind": r["kind"], "of": r["of"] or "-",
                "KV cache": "on" if c["kv_cache"] else "off", "batch": c["batch_size"], "status": _status(c),
                "TTFT median (ms)": 1000 * c["ttft"]["median"] if ok else None,
                "TTFT p90 (ms)": 1000 * c["ttft"]["p90"] if ok else None,
                "decode tokens/s median": c["decode_tokens_per_s"]["median"] if ok else None,
                "decode tokens/s 95% CI or range": _ci(c["decode_tokens_per_s"]) if ok else "-",
                "per-token p50 (ms)": 1000 * c["per_token_latency"]["median"] if ok else None,
                "per-token p90 (ms)": 1000 * c["per_token_latency"]["p90"] if ok else None,
                "per-token p99 (ms)": 1000 * c["per_token_latency"]["p99"] if ok else None,
                "per-token p99/p50": c["per_token_latency"].get("p99_over_p50") if ok else None,
                "tail cause (p99/p50 > 1.5)": (c["per_token_latency"].get("tail_cause") or "") if ok else "",
                "peak delta (MiB)": c["memory"].get("delta_mib") if ok else None,
                "memory kind": c["memory"]["kind"] if ok else None,
                "footprint (MiB)": c["memory_footprint_bytes"] / MiB if ok else None,
                "energy (J/token)": (c.get("energy") or {}).get("joules_per_token") if ok else None,
                "speedup vs base [95% CI]": _speedup(c.get("vs_base"), "generation_speedup") if ok else "-",
                "verdict vs base": _speedup_verdict(c.get("vs_base"), "generation_speedup") if ok else "-",
                "env": _fp(r),
            })
    return pd.DataFrame(out, columns=INFERENCE_COLUMNS)


INFERENCE_COLUMNS = ["variant", "kind", "of", "KV cache", "batch", "status", "TTFT median (ms)", "TTFT p90 (ms)",
                     "decode tokens/s median", "decode tokens/s 95% CI or range", "per-token p50 (ms)", "per-token p90 (ms)",
                     "per-token p99 (ms)", "per-token p99/p50", "tail cause (p99/p50 > 1.5)", "peak delta (MiB)",
                     "memory kind", "footprint (MiB)", "energy (J/token)", "speedup vs base [95% CI]", "verdict vs base",
                     "env"]


MEMORY_TARGET = 0.15  # issue 5: the estimator within ±15% of the measurement on the embedded default


def _main_terms(terms: dict, top: int = 3) -> str:
    ranked = sorted(((v, k) for k, v in terms.items() if v >= 0.5), reverse=True)[:top]
    return ", ".join(f"{k.replace('_', ' ')} {v:.0f}" for v, k in ranked) or "-"


def memory_prediction_table(finetune_rows: list[dict], inference_rows: list[dict]) -> pd.DataFrame:
    """Each run's and cell's predicted peak (made before it ran) next to its measured peak."""
    def row(what: str, p: dict, env: str) -> dict:
        ratio, predicted = p.get("ratio"), p.get("total_mib")
        return {"run / cell": what, "memory": f"{p.get('measured_kind') or '?'} delta", "predicted (MiB)": predicted,
                "main terms (MiB)": _main_terms(p["terms_mib"]) if predicted else p.get("unavailable"),
                "measured (MiB)": p.get("measured_mib"), "measured / predicted": ratio,
                "within ±15%": None if ratio is None else ("yes" if abs(ratio - 1) <= MEMORY_TARGET else "no"),
                "RSS delta (MiB)": p.get("rss_delta_mib"), "RSS / predicted": p.get("rss_ratio"), "env": env}

    out = [row(f"finetune {r['run']}" + (f" (longest batch {p['batch']['rows']}x{p['batch']['padded_length']})"
                                         if p.get("batch") else f" ({p['phase']})" if p.get("phase") else ""), p, _fp(r))
           for r in finetune_rows if (p := r.get("memory_prediction"))]
    out += [row(f"inference {r['variant']} (KV {'on' if c['kv_cache'] else 'off'}, batch {c['batch_size']})",
                c["memory_prediction"], _fp(r))
            for r in inference_rows for c in r.get("cells", []) if records.is_ok(c) and "memory_prediction" in c]
    return pd.DataFrame(out)


def memory_prediction_section(finetune_rows: list[dict], inference_rows: list[dict], environments: dict,
                              allow_mixed: bool) -> list[str]:
    return [
        "## Predicted vs measured memory", "",
        "Before each fine-tuning run and each inference cell starts, `efflab.memory_estimate` predicts the memory "
        "it will add to what is already resident, from the base model's config and the run's settings alone "
        "(method, dtypes, mixed precision, batch, the padded lengths of the batches the Trainer will draw, LoRA "
        "rank and targets, optimizer). It predicts tensor bytes: fine-tuning peaks at the start of the backward "
        "pass of its longest batch (optimizer states + autocast weight copies + saved activations + three fp32 "
        "vocabulary-sized loss tensors), at the optimizer step, or, with gradient checkpointing (which keeps only "
        "each layer's input), when the last layer is recomputed; generation adds the KV cache and transients "
        "to the loaded model. It is compared with the measured peak of the same kind: live tensor bytes over "
        "those at the start (`cpu_tensor_peak` on CPU, counted from the CPU allocator's events through "
        "torch.profiler: the counterpart of `cuda_max_allocated`, which is what it is compared with on GPU). "
        f"Target: within ±{100 * MEMORY_TARGET:.0f}%. On CPU the resident-memory delta (`cpu_peak_rss`) is shown "
        "too: it is what the OS charges, and it also holds what glibc malloc keeps after tensors are freed, which "
        "grows each time a batch is longer than any before it, so its ratio is above the tensor ratio by the "
        "allocator's share, not by a tensor the estimate misses.", "",
        comparison(memory_prediction_table(finetune_rows, inference_rows), environments, allow_mixed), ""]


def plot_quantize(df: pd.DataFrame, path: Path) -> None:
    fig, ax1 = plt.subplots(figsize=(7, 4))
    ax1.bar(df["scheme"], df["footprint (MiB)"], color="tab:blue", alpha=0.7, label="footprint")
    ax1.set_ylabel("model footprint (MiB)")
    ax2 = ax1.twinx()
    ax2.plot(df["scheme"], df["val perplexity"], "o-", color="tab:red", label="perplexity")
    ax2.set_ylabel("validation perplexity", color="tab:red")
    ax1.set_title("Quantization: memory bought vs perplexity paid")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_loss(layout, runs: list[str], path: Path, identical: list[list[str]] = ()) -> None:
    """Every run's training loss; runs that make the same updates (`identical`) get distinct line styles and
    shrinking markers, so that curves lying exactly on top of each other all stay visible."""
    fig, ax = plt.subplots(figsize=(7, 4))
    twin = {run: group[0] for group in identical for run in group[1:]}
    styles = ["-", "--", ":", "-."]
    for i, run in enumerate(runs):
        curve = pd.read_csv(layout.out("finetune", run) / "loss.csv")
        if curve.empty:  # the run did not train
            continue
        ax.plot(curve["step"], curve["loss"], ls=styles[i % len(styles)], marker="os^D"[i % 4],
                markersize=max(3, 9 - 2 * i), fillstyle="none", lw=1.5,
                label=f"{run} (same as {twin[run]})" if run in twin else run)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("training loss (response tokens)")
    ax.set_title("Fine-tuning loss curves")
    _legend(ax)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _legend(ax, **kwargs) -> None:
    """The axes' legend, or, where nothing was measured (every cell failed or was unavailable), a note saying so
    instead of an empty legend."""
    if ax.get_legend_handles_labels()[0]:
        ax.legend(**kwargs)
    else:
        ax.text(0.5, 0.5, "nothing measured: see the table for why", ha="center", va="center",
                transform=ax.transAxes, color="grey")


def _ci_bars(part: pd.DataFrame, median: str, ci: str) -> list[list[float]]:
    bounds = part[ci].str.extract(r"^([-+\d.e]+)–([-+\d.e]+)").astype(float)  # an interval, or a range
    return [(part[median] - bounds[0]).clip(lower=0).tolist(), (bounds[1] - part[median]).clip(lower=0).tolist()]


def _seq_axis(ax, df: pd.DataFrame) -> None:
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(sorted(df["seq len"].unique()))
    ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.set_xlabel("sequence length (tokens)")


def plot_attention(df: pd.DataFrame, path: Path) -> None:
    ok = records.ok_rows(df)
    modes = sorted(ok["mode"].unique()) or ["forward"]
    fig, axes = plt.subplots(1, len(modes), figsize=(6 * len(modes), 4), squeeze=False)
    for ax, mode in zip(axes[0], modes):
        for (impl, batch), part in ok[ok["mode"] == mode].groupby(["implementation", "batch"]):
            ax.errorbar(part["seq len"], part["median (ms)"], yerr=_ci_bars(part, "median (ms)", "95% CI or range of median (ms)"),
                        marker="o", capsize=3, label=f"{impl} (batch {int(batch)})")
        _seq_axis(ax, ok)
        ax.set_ylabel("latency (ms, median; bars: 95% CI)")
        ax.set_title(f"Attention implementations: {mode.replace('_', '+')}")
        _legend(ax, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_attention_memory(df: pd.DataFrame, exponents: pd.DataFrame, path: Path) -> None:
    ok = records.ok_rows(df)
    ok = ok[ok["peak delta (MiB)"] > 0]
    modes = sorted(ok["mode"].unique()) or ["forward"]
    fig, axes = plt.subplots(1, len(modes), figsize=(6 * len(modes), 4), squeeze=False)
    for ax, mode in zip(axes[0], modes):
        for (impl, batch), part in ok[ok["mode"] == mode].groupby(["implementation", "batch"]):
            fit = exponents[(exponents["implementation"] == impl) & (exponents["mode"] == mode)
                            & (exponents["batch"] == batch)]["memory ~ seq^k: k"]
            k = f", k={fit.iloc[0]:.2f}" if len(fit) and pd.notna(fit.iloc[0]) else ""
            ax.plot(part["seq len"], part["peak delta (MiB)"], marker="o", label=f"{impl} (batch {int(batch)}{k})")
        _seq_axis(ax, ok)
        ax.set_ylabel(f"peak memory over baseline (MiB, {ok['memory kind'].iloc[0] if len(ok) else ''})")
        ax.set_title(f"Attention memory vs length: {mode.replace('_', '+')}")
        _legend(ax, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_inference(df: pd.DataFrame, path: Path) -> None:
    ok = records.ok_rows(df).copy()
    ok["cell"] = ok["variant"] + ok.apply(
        lambda r: "" if r["KV cache"] == "on" and r["batch"] == 1 else f" (KV {r['KV cache']}, b{r['batch']})", axis=1)
    fig, ax = plt.subplots(figsize=(max(7, 0.9 * len(ok)), 4))
    ax.bar(ok["cell"], ok["decode tokens/s median"], yerr=_ci_bars(ok, "decode tokens/s median", "decode tokens/s 95% CI or range"),
           capsize=4, color=["tab:green" if c == "on" else "tab:orange" for c in ok["KV cache"]], alpha=0.8)
    ax.set_ylabel("decode tokens/s (median; bars: 95% CI)")
    ax.set_title("Greedy generation by variant (orange: KV cache off)")
    plt.setp(ax.get_xticklabels(), rotation=25, ha="right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_size_lines(cfg: dict, metrics: dict[str, list[dict]]) -> list[str]:
    """What this run measured over, and why that size: the numbers of a short run say less than a long one's,
    and the reader should see the size next to them, not only in params.yaml."""
    ft, q, a, i = cfg["finetune"]["defaults"], cfg["quantize"], cfg["bench_attention"], cfg["bench_inference"]
    stage_s = sum(m.get("wall_s") or 0 for ms in metrics.values() for m in ms)
    return [
        "## Run size", "",
        f"This run's sizes (params.yaml): fine-tuning {ft['max_steps']} optimizer steps of {ft['batch_size']}"
        f"×{ft['gradient_accumulation_steps']} rows per run (runs may override), validation loss on "
        f"{ft['eval_rows']} rows before and after; quantization perplexity on {q['eval_rows']} rows; attention "
        f"{a['warmup']} warm-up + {a['repeats']} timed calls per cell at {', '.join(map(str, a['seq_lens']))} "
        f"tokens; inference {prompt_count(cfg, metrics)} prompts × {i['repeats']} repeats of exactly {i['max_new_tokens']} "
        f"new tokens per cell after {i['warmup']} warm-up generation(s). The stages took {stage_s / 60:.1f} "
        "minutes in all (their own wall times, process start-up not included).",
        "",
        "The shipped defaults are sized so that `make run` stays within 15 minutes on a 2-core CPU without "
        "native bf16 (fp32 only, where every step costs about three times what it costs with AVX512-BF16): few "
        "steps, few rows, few repeats. What such a run shows holds for what it measured — memory, the cost of a "
        "step, the direction of the loss — and its confidence intervals say how far; a long fine-tune's final "
        "quality does not follow from it. On a GPU, or for tighter intervals, raise `finetune.defaults.max_steps`, "
        "the `eval_rows` and the `repeats`.", "",
    ]


def _md(df: pd.DataFrame) -> str:
    """A markdown table; cells with no value (a failed or unavailable row) print as '-', not 'nan'."""
    clean = df.astype(object).where(df.notna(), None)
    return clean.to_markdown(index=False, floatfmt=".4g", missingval="-")


def _flat(env: dict) -> dict:
    flat = {k: env.get(k) for k in FINGERPRINT_KEYS if k != "packages"}
    flat |= {pkg: ver for pkg, ver in (env.get("packages") or {}).items()}
    return flat


def env_differences(environments: dict[str, dict], fps: list[str]) -> str:
    """'torch: 2.13.0 / 2.12.0; cpu: A / B' — what differs between the given fingerprints."""
    flats = [_flat(environments[fp]) for fp in fps]
    keys = [k for k in flats[0] if len({json.dumps(f.get(k)) for f in flats}) > 1]
    return "; ".join(f"{k}: {' / '.join(str(f.get(k)) for f in flats)}" for k in keys) or "fingerprints differ"


def comparison(df: pd.DataFrame, environments: dict[str, dict], allow_mixed: bool) -> str:
    """One comparison table, or, when its rows were measured in different environments and mixing was not
    asked for, one table per environment and the reason."""
    if df.empty:
        return "_no rows_"
    fps = list(dict.fromkeys(df["env"]))
    if len(fps) == 1:
        return _md(df.drop(columns="env"))
    diff = env_differences(environments, fps)
    if allow_mixed:
        return (f"> Rows from {len(fps)} environments ({diff}) are combined because "
                "`report.allow_mixed_environments` is true; the env column says which is which.\n\n" + _md(df))
    parts = [f"> **Not compared in one table:** these rows were measured in {len(fps)} different environments "
             f"({diff}). Each environment gets its own table; set `report.allow_mixed_environments: true` "
             "to combine them.", ""]
    for fp in fps:
        parts += [f"Environment `{fp}`:", "", _md(df[df["env"] == fp].drop(columns="env")), ""]
    return "\n".join(parts)


def environment_table(environments: dict[str, dict]) -> pd.DataFrame:
    return pd.DataFrame([{"env": fp, **_flat(env)} for fp, env in environments.items()]).dropna(axis=1, how="all")


def provenance_table(jobs: dict[str, dict]) -> pd.DataFrame:
    return pd.DataFrame([{
        "job": job, "wrote (sha256)": (m.get("provenance", {}).get("outputs_sha256") or "-")[:12],
        "measured on": "; ".join(provenance.chain(m.get("provenance", {}))) or "-",
    } for job, m in jobs.items()], columns=["job", "wrote (sha256)", "measured on"])


# Which stage's results each plot draws: a stage left out or without numbers gets a plot that says so.
PLOT_STAGES = {"quantize.png": "quantize", "prune.png": "prune", "qat.png": "qat", "finetune_loss.png": "finetune",
               "finetune.png": "finetune", "bench_attention.png": "bench_attention",
               "bench_attention_memory.png": "bench_attention", "bench_inference.png": "bench_inference",
               "bench_serving.png": "bench_serving", "capacity.png": "capacity", "finetune_pareto.png": "finetune",
               "inference_pareto.png": "bench_inference"}


def read_results(cfg: dict, layout) -> dict[str, list[dict]]:
    """Every stage's records, in grid order; [] for a stage this experiment leaves out (config.not_asked)."""
    return {s: [] if config.not_asked(cfg, s) else records.read_stage(layout, s, cli.stage_names(cfg, s))
            for s in cli.STAGES if s != "report"}


def absent(cfg: dict, metrics: dict, stage: str) -> str | None:
    """Why a stage's section or plot has nothing to show: left out of the experiment, or no job produced numbers."""
    why = config.not_asked(cfg, stage)
    if why:
        return f"not asked for: {why}"
    return None if records.ok(metrics[stage]) else "no job of this stage produced numbers (see *Did not run*)"


def section(cfg: dict, metrics: dict, stage: str, title: str, body) -> list[str]:
    """A report section: its body, or one line saying why it has none."""
    why = absent(cfg, metrics, stage)
    if why:
        return [title, "", f"_{why[0].upper()}{why[1:]}._", ""]
    return [title, "", *body(), ""]


def placeholder_plot(path: Path, why: str) -> None:
    fig, ax = plt.subplots(figsize=(7, 2))
    ax.axis("off")
    ax.text(0.5, 0.5, why, ha="center", va="center", wrap=True, fontsize=10)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def build_tables(metrics: dict) -> dict[str, pd.DataFrame]:
    return {
        "quantize": quantize_table(metrics["quantize"]),
        "prune": prune_table(metrics["prune"]),
        "qat": qat_table(metrics["qat"]),
        "finetune": finetune_table(metrics["finetune"]),
        "finetune_knobs": knob_table(metrics["finetune"], metrics["bench_finetune"]),
        "merge": merge_table(metrics["merge"]),
        "merge_targets": merge_targets_table(metrics["merge"]),
        "bench_attention": attention_table(metrics["bench_attention"]),
        "attention_memory_exponent": exponent_table(metrics["bench_attention"]),
        "bench_inference": inference_table(metrics["bench_inference"]),
        "bench_serving": serving_table(metrics["bench_serving"]),
        "capacity": capacity_table(metrics["capacity"]),
    }


def draw_plots(cfg: dict, metrics: dict, tables: dict, fronts: dict, layout, out: Path) -> list[str]:
    names = cli.stage_names(cfg, "finetune") or []
    plots = {"quantize.png": lambda p: plot_quantize(tables["quantize"], p),
             "prune.png": lambda p: plot_prune(tables["prune"], p),
             "qat.png": lambda p: plot_qat(tables["qat"], next(iter(records.ok(metrics["qat"])), None), p),
             "finetune_loss.png": lambda p: plot_loss(layout, names, p, glance.same_updates(metrics["finetune"])),
             "finetune.png": lambda p: plot_finetune(metrics["finetune"], p),
             "bench_attention.png": lambda p: plot_attention(tables["bench_attention"], p),
             "bench_attention_memory.png": lambda p: plot_attention_memory(
                 tables["bench_attention"], tables["attention_memory_exponent"], p),
             "bench_inference.png": lambda p: plot_inference(tables["bench_inference"], p),
             "bench_serving.png": lambda p: plot_serving(tables["bench_serving"], p),
             "capacity.png": lambda p: plot_capacity(metrics["capacity"], p),
             "finetune_pareto.png": lambda p: plot_finetune_pareto(fronts["finetune"], p),
             "inference_pareto.png": lambda p: plot_inference_pareto(fronts["inference"], p)}
    for file, draw in plots.items():
        why = absent(cfg, metrics, PLOT_STAGES[file])
        placeholder_plot(out / file, f"{PLOT_STAGES[file]}: {why}") if why else draw(out / file)
    return sorted(plots)


def write_fronts(fronts: dict, out: Path) -> None:
    """The frontiers' points as data too: `dvc plots show` draws them from these (dvc.yaml, scatter template)."""
    pd.DataFrame([{"config": p["name"], "peak_memory_mib": p["memory"], "tokens_per_s": p["tokens_per_s"],
                   "memory_kind": p["kind"], "dominated": p["dominated"]} for p in fronts["finetune"]],
                 columns=["config", "peak_memory_mib", "tokens_per_s", "memory_kind", "dominated"]
                 ).to_csv(out / "finetune_pareto.csv", index=False)
    pd.DataFrame([{"config": p["name"], "footprint_mib": p["footprint"], "decode_tokens_per_s": p["decode"],
                   "perplexity_change_pct": p["perplexity_change_pct"], "dominated": p["dominated"]}
                  for p in fronts["inference"]],
                 columns=["config", "footprint_mib", "decode_tokens_per_s", "perplexity_change_pct", "dominated"]
                 ).to_csv(out / "inference_pareto.csv", index=False)


def header_lines(base: dict, data: dict) -> list[str]:
    env = base["environment"]
    dtype_note = base.get("dtype_choice", {}).get("reason", f"{base['dtype']} as configured")
    return [
        "# efflab report", "",
        f"Model: `{base['source']}` ({base['model_type']}, {base['parameters']:,} parameters"
        f"{', random init' if base['random_init'] else ''}), compute dtype **{base['dtype']}** — {dtype_note}.",
        f"Data: `{data['source']}` — {data['train']['rows']} train / {data['validation']['rows']} validation rows, "
        f"template {data['template']}, loss on {'response tokens only' if data['mask_prompt'] else 'all tokens'}."
        + (f" {data['attribution']}" if data["attribution"] else ""),
        f"Measured on: {env['device']} — {env['cpu']} ({env['cpu_cores']} cores)"
        + (f", {env['gpu']}" if env.get("gpu") else "") + f"; torch {env['packages']['torch']}, "
        f"transformers {env['packages']['transformers']}, peft {env['packages']['peft']}, "
        f"bitsandbytes {env['packages']['bitsandbytes']}; commit {env['git_commit']}.", ""]


HOW_TO_READ = (
    "**How to read the numbers.** Latencies are medians of repeats after warmup (perf_counter on CPU, CUDA "
    "events on GPU) with the p90/p99 and the distribution-free 95% interval of the median from order statistics "
    "where n gives one (6 values or more); with fewer, the range of the n values, named so. Plots show that "
    "interval or range as error bars. Memory names its kind: `cpu_peak_rss` is the resident-memory high-water mark "
    "of the measured work (reset at its start; 'delta' is over the resident memory just before it), "
    "`cuda_max_allocated` the allocator's peak of live tensors. Benchmark cells run {isolation} "
    "(`runtime.isolation`); a cell that fails, runs out of memory or times out is a row with its status.")


def quantize_body(cfg: dict, metrics: dict, table) -> list[str]:
    rows = records.ok(metrics["quantize"])[0]["validation"]["rows"]
    return ["Footprint is `get_memory_footprint()` (parameters and buffers as loaded); perplexity on "
            f"{rows} validation rows; change is against the baseline scheme.", "",
            table("quantize"), "", "![quantization](quantize.png)"]


def prune_body(cfg: dict, metrics: dict, table) -> list[str]:
    pr = cfg["prune"]
    healing = (f"Healing: LoRA ({pr['heal']['lora']['target_modules']}, r {pr['heal']['lora']['r']}) fine-tuned "
               f"{pr['heal']['steps']} steps on the training rows and merged back, a model of the pruned shape "
               "(results/prune/<strategy>/healed)." if pr["heal"]["steps"] else "Healing is off (prune.heal.steps: 0).")
    return [f"Heads removed from every layer's attention projections and whole layers removed (importance: "
            f"`{pr['importance']}`), the model rebuilt from its smaller config: parameters, footprint and "
            "time really shrink, and the folder loads in plain transformers. Grouped-query attention keeps the same "
            "number of key/value heads and of query heads per key/value head in every layer, so the heads asked for "
            f"are met by the nearest count that allows. Perplexity on {pr['eval_rows']} validation rows, base and "
            f"pruned in the same process; generation of {pr['max_new_tokens']} greedy tokens, the pruned and the base "
            f"model timed interleaved. {healing}", "", table("prune"), "", "![pruning](prune.png)"]


def qat_body(cfg: dict, metrics: dict, table) -> list[str]:
    job = records.ok(metrics["qat"])[0]
    return [f"The base model fine-tuned {cfg['qat']['train']['steps']} steps in full precision, then its weights "
            "quantized (PTQ), against the base fine-tuned on the same batches with the weights fake-quantized in "
            "every forward pass and quantized at the end (QAT): the two differ only in whether training saw the "
            f"quantization. torchao, symmetric int weights with one scale per {cfg['qat']['group_size']} weights, "
            "round to nearest; quantized: " + (job.get("quantized") or "") + ". Perplexity on "
            f"{cfg['qat']['eval_rows']} validation rows; packed weights is bits/8 per weight plus a bf16 scale per "
            "group (torchao holds each code in an int8 here). The precision range test scans from the lowest width "
            "up: B_min is the first that passes. Every figure is recomputed from `results/qat/evals.csv`.", "",
            *qat_lines(job), table("qat"), "", "![precision range test](qat.png)"]


def finetune_body(cfg: dict, metrics: dict, table) -> list[str]:
    return [
        "Tokens/s counts real (non-padding) tokens. MFU = model FLOPs per token (PaLM's 6N + 12·L·d·T for full "
        "fine-tuning; 4N + 2·N_trainable + 12·L·d·T with frozen weights) × tokens/s, over the matmul throughput "
        "measured on this machine in the training dtype at the start of the run (and over the published peak "
        "on known GPUs). Peak memory is of the training loop, kind named in the column.",
        "", table("finetune"), "", energy_note([r.get("energy") for r in records.ok(metrics["finetune"])]), "",
        "![memory and throughput](finetune.png)", "",
        "![memory vs throughput: Pareto frontier](finetune_pareto.png)", "", "![loss curves](finetune_loss.png)",
        "", "### What each knob costs and buys", "",
        "Every pair of trained runs whose settings differ in exactly one knob, everything else equal (add runs "
        "to `finetune.runs` to sweep a knob). Memory change is of the training memory over the process's "
        "resident memory before training; step time change is of the mean wall time per optimizer step; the median "
        "step and its 95% interval (or its range, where too few steps give no interval) leave out the first "
        "(warm-up) step. The step time ratio and its "
        "verdict come from `bench_finetune`, which builds both runs of the pair in one process and times their "
        "training steps interleaved (A B, then B A) over the same batches, "
        f"{cfg['bench_finetune']['rounds']} stable rounds, with a matmul speed probe before and after each round: a "
        f"round in which the machine's speed moved by more than {cfg['bench_finetune']['sentinel_tolerance']:.0%} "
        "is set aside and run again, and a pair left without enough stable rounds gets no verdict. The ratio is "
        "the median of the per-round ratios with its distribution-free 95% interval (order statistics); the verdict "
        "says slower or faster only when that interval excludes 1, else no significant difference. A pair "
        "bench_finetune did not measure falls back to the runs' own steps (step by step where they drew the same "
        "batches), and gets no verdict when the matmul ceilings the two runs measured differ by more than "
        f"{SENTINEL_TOLERANCE:.0%}.", "",
        table("finetune_knobs"), "",
        "### Determinism", "",
        "On CPU the same params give a bitwise-identical loss curve and adapter weights on a rerun (tested). "
        "On a GPU these break bitwise reruns:", "",
        *[f"- {line}" for line in GPU_DETERMINISM]]


def merge_body(cfg: dict, metrics: dict, table) -> list[str]:
    return ["Reference: the adapter on the base it was trained against. Differences are max |logit| over "
            "every real token of the validation rows.", "", table("merge"), "",
            "### Which merge keeps a QLoRA fine-tune", "",
            "The QLoRA adapter learned corrections to the 4-bit weights. Merged into the original base it corrects "
            "errors that are not there; merged into the base after the same NF4 quantize→dequantize round trip "
            "it reproduces what was trained; re-quantizing that merge adds fresh rounding. KL is the mean "
            "KL(adapter ‖ merged) per token.", "", table("merge_targets"), "", *merge_route_lines(metrics["merge"])]


def attention_body(cfg: dict, metrics: dict, table) -> list[str]:
    measured = records.ok(metrics["bench_attention"])[0].get("measured", "model forward")
    return [f"{measured}; `forward_backward` freezes the weights "
            "and back-propagates into the input embeddings, so its memory is the activations training keeps. "
            "Agreement vs eager: max |difference| of the output (forward) or of the input gradient (forward+backward). "
            "Each implementation's cell also runs eager on the same inputs, the two timed interleaved (A B, then B A) "
            "with a speed probe around each round: the speedup is the median of eager's time over the "
            "implementation's per round, with its distribution-free 95% interval; the verdict (of the implementation) "
            "says faster or slower only when that interval excludes 1.",
            "", table("bench_attention"), "", "![attention latency](bench_attention.png)", "",
            "### Memory vs sequence length", "",
            "Least-squares exponent k of peak memory delta ∝ seq_len^k (k ≈ 2: quadratic, k ≈ 1: linear).", "",
            table("attention_memory_exponent"), "", "![attention memory](bench_attention_memory.png)"]


def inference_body(cfg: dict, metrics: dict, table) -> list[str]:
    inf = cfg["bench_inference"]
    return [f"Exactly {inf['max_new_tokens']} new tokens per sequence, {prompt_count(cfg, metrics)} prompts × "
            f"{inf['repeats']} repeats after warmup, per cell (KV cache on/off × batch size). TTFT = prefill; decode "
            "tokens/s counts every sequence of the batch and excludes the first token; per-token latencies are the "
            "gaps between consecutive tokens. Every variant but the base model is timed interleaved with the base "
            "model on the same prompts, round by round (A B, then B A, with a speed probe around each round): the "
            "speedup is the median of the base's generation time over the variant's per round, with its "
            "distribution-free 95% interval and a verdict said of the variant.", "",
            table("bench_inference"), "",
            energy_note([c.get("energy") for m in records.ok(metrics["bench_inference"])
                         for c in records.ok(m.get("cells", []))]),
            "", "![inference](bench_inference.png)", "",
            "![memory vs decode speed vs perplexity: Pareto frontier](inference_pareto.png)"]


def serving_body(cfg: dict, metrics: dict, table) -> list[str]:
    bs = cfg["bench_serving"]
    return [f"{bs['requests']} requests (prompts of the data's own lengths, outputs of "
            f"{bs['max_new_tokens'][0]}-{bs['max_new_tokens'][1]} tokens, forced) arrive at once; naive serves one at "
            "a time, static batching `concurrency` at a time (a batch returns when its longest request is done), "
            "continuous batching (transformers' paged scheduler) lets a finished request leave and a waiting one "
            "join. Latency is from arrival, queueing included. Every figure is recomputed from "
            "`results/bench_serving/requests.csv`.", "", table("bench_serving"), "", "![serving](bench_serving.png)"]


def not_run_lines(not_run: pd.DataFrame) -> list[str]:
    return ["## Did not run", "",
            "Jobs and grid cells that failed, ran out of memory, were unavailable for this model or device, or "
            "were skipped because what they build on did not run; the rest ran. A failed job's log is "
            "results/logs/<stage>/<name>.log.", "",
            _md(not_run) if not not_run.empty else "_none: every job ran_", ""]


def run(cfg: dict, paths: dict) -> dict:
    """Write summary.csv, report.md and the plots from every stage's metrics."""
    layout, out = paths["layout"], paths["out"]
    allow_mixed = cfg["report"]["allow_mixed_environments"]
    metrics = read_results(cfg, layout)
    base, data = metrics["base_model"][0], metrics["prepare_data"][0]
    jobs = {f"{s}/{m['name']}" if m.get("name") else s: m for s, ms in metrics.items() for m in ms}
    stale = provenance.check(layout, jobs)
    if stale:
        raise UserError(f"results mix artifacts: {stale[0]}" + (f" (and {len(stale) - 1} more)" if len(stale) > 1
                                                              else "") + "; rerun it (snakemake reruns what changed)")
    tables = build_tables(metrics)
    fronts = {"finetune": finetune_pareto(metrics["finetune"]),
              "inference": inference_pareto(metrics["bench_inference"], metrics["quantize"])}
    plots = draw_plots(cfg, metrics, tables, fronts, layout, out)
    write_fronts(fronts, out)
    frames = [df.assign(stage=stage) for stage, df in tables.items()]
    pd.concat(frames, ignore_index=True).to_csv(out / "summary.csv", index=False)
    environments = {_fp(m): m["environment"] for ms in metrics.values() for m in ms if "environment" in m}

    def table(key: str) -> str:
        return comparison(tables[key], environments, allow_mixed)

    def part(stage: str, title: str, body) -> list[str]:
        return section(cfg, metrics, stage, title, lambda: body(cfg, metrics, table))

    not_run = not_run_table(metrics)
    isolation = "each in a fresh process" if cfg["runtime"]["isolation"] == "subprocess" else "in the stage process"
    lines = [
        *header_lines(base, data), *glance.lines(tables, metrics),
        *glance.claims_lines(metrics["claims"], "../claims/claims.md"),
        "## In detail", "", HOW_TO_READ.format(isolation=isolation), "",
        *part("quantize", "## Quantization (post-training, bitsandbytes)", quantize_body),
        *part("prune", "## Structured pruning", prune_body),
        *part("qat", "## Quantization-aware training and the precision range test", qat_body),
        *part("finetune", "## Fine-tuning: full vs LoRA vs QLoRA", finetune_body),
        *part("merge", "## Merging adapters", merge_body),
        *part("bench_attention", "## Attention implementations", attention_body),
        *part("bench_inference", "## Inference variants (greedy, fixed length)", inference_body),
        *part("bench_serving", "## Serving: naive vs static vs continuous batching", serving_body),
        *(capacity_lines(metrics["capacity"], table("capacity")) if not absent(cfg, metrics, "capacity") else
          section(cfg, metrics, "capacity", "## Capacity: the largest batch and sequence that fit", list)),
        *profile_lines(metrics), *sample_lines(metrics["bench_inference"]),
        *not_run_lines(not_run), *run_size_lines(cfg, metrics),
        *memory_prediction_section(metrics["finetune"], metrics["bench_inference"], environments, allow_mixed),
        "", "## Provenance", "",
        "What each job wrote (SHA-256 of its model folder or splits) and the chain of artifacts its numbers were "
        "measured on, nearest first; every link was checked against what the upstream job records now.", "",
        _md(provenance_table(jobs)), "",
        "", "## Environments", "",
        "Results are compared in one table only when their fingerprints (machine and library versions) agree.",
        "", _md(environment_table(environments)), "",
    ]
    (out / "report.md").write_text("\n".join(lines))
    log.info("report: %s", paths["final"] / "report.md")
    return {"tables": {k: len(v) for k, v in tables.items()}, "plots": plots, "not_run": len(not_run),
            "environments": len(environments)}


if __name__ == "__main__":
    cli.main("report", run)
