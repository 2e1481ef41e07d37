"""One DataFrame per stage, built from its records: what the report's tables and plots show."""
from __future__ import annotations

import pandas as pd

from ... import records
from ...measure.memory import allocated_delta
from ...measure.stats import NOT_DECIDED, format_ratio, ratio_words
from . import spread
from .fmt import (
    MiB,
    env_of,
    interval_text,
    median_text,
    pct,
    peak_mib,
    percent,
    speedup_text,
    speedup_verdict,
    status_text,
)
from .knobs import knob_table
from .spread import of_median, text


def quantize_table(rows: list[dict]) -> pd.DataFrame:
    return pd.DataFrame([{
        "scheme": r["scheme"], "method": r["method"], "double quant": r["double_quant"],
        "quantized as": quantized_as(r),
        "footprint (MiB)": r["memory_footprint_bytes"] / MiB, "x smaller than baseline": r["footprint_ratio_vs_base"],
        "on disk (MiB)": r["bytes_on_disk"] / MiB, "load (s)": r["load_s"],
        "val perplexity": r["validation"]["perplexity"], "perplexity change (%) [95% CI]": change_text(r),
        "LoRA on it": adapter_text(r.get("adapter")), "env": env_of(r),
    } for r in records.ok(rows)], columns=["scheme", "method", "double quant", "quantized as", "footprint (MiB)",
                                           "x smaller than baseline", "on disk (MiB)", "load (s)", "val perplexity",
                                           "perplexity change (%) [95% CI]", "LoRA on it", "env"])


def quantized_as(record: dict) -> str:
    """The quantized module or weight classes and their counts (a record before efflab.quantization: its bnb layers)."""
    parts = record.get("quantized_parts")
    if parts is None:
        return ", ".join(record["bnb_layer_types"]) or "-"
    return ", ".join(f"{kind} x{n}" for kind, n in parts.items()) or "-"


def adapter_text(adapter: dict | None) -> str:
    """Whether peft trained a LoRA adapter on the scheme and merged it back, with the check's bound (the quantize
    job tried one Adam step: finite, non-zero gradients; then the merge's change of the logits against the step's)."""
    if adapter is None:
        return "not checked"
    if not adapter["trains"]:
        return f"does not train: {adapter['reason']}"
    if adapter.get("merges") is False and "merge_error_max_abs_logit" not in adapter:
        return f"one step trains; merge: {adapter['reason']}"
    if "merge_error_max_abs_logit" not in adapter:
        return "one step trains, merges back"
    error, effect = adapter["merge_error_max_abs_logit"], adapter["adapter_effect_max_abs_logit"]
    said = "merges back" if adapter.get("merges") else "does not merge back"
    return (f"one step trains; {said}: merging moves the logits {error:.3g}, "
            f"{'less' if error < effect else 'more'} than the step did ({effect:.3g}; max |logit| change)")


def change_text(record: dict | None, point_key: str = "perplexity_change_pct") -> str:
    """A perplexity change paired row by row, with its 95% interval where its rows give one; a record written
    before per-row pairing gives its point value alone."""
    record = record or {}
    paired = spread.of_change(record.get("perplexity_change"))
    return spread.text(paired or spread.spread(record.get(point_key)), percent)


PRUNE_COLUMNS = ["strategy", "layers", "query heads (kv)", "heads asked", "parameters", "parameters kept (%)",
                 "footprint (MiB)", "val perplexity", "base perplexity", "perplexity change (%) [95% CI]",
                 "generation (ms)", "speedup vs base [95% CI]", "verdict vs base", "sample", "healed perplexity",
                 "healed change (%) [95% CI]", "healed sample", "env"]


def prune_table(rows: list[dict]) -> pd.DataFrame:
    return pd.DataFrame([{
        "strategy": r["strategy"], "layers": r["kept"]["layers"],
        "query heads (kv)": f"{r['kept']['heads']} ({r['kept']['kv_heads']})",
        "heads asked": f"{r['kept']['target_heads']:g}",
        "parameters": r["pruned"]["parameters"], "parameters kept (%)": 100 * r["parameter_ratio"],
        "footprint (MiB)": r["pruned"]["memory_footprint_bytes"] / MiB,
        "val perplexity": r["pruned"]["validation"]["perplexity"],
        "base perplexity": r["base"]["validation"]["perplexity"],
        "perplexity change (%) [95% CI]": change_text(r["pruned"] | {k: r[k] for k in ["perplexity_change_pct"]}),
        "generation (ms)": 1000 * r["pruned"]["generation_s"]["median"],
        "speedup vs base [95% CI]": speedup_text(r, "generation_speedup"),
        "verdict vs base": speedup_verdict(r, "generation_speedup"),
        "sample": " ".join(r["pruned"]["sample"].split())[:48], **healed_columns(r), "env": env_of(r),
    } for r in records.ok(rows)], columns=PRUNE_COLUMNS)


def healed_columns(r: dict) -> dict:
    h = r.get("healing") or {}
    if not records.is_ok(h):
        return {"healed perplexity": None, "healed change (%) [95% CI]": None, "healed sample": h.get("status", "-")}
    ppl = h["validation"]["perplexity"]
    point = 100 * (ppl / r["base"]["validation"]["perplexity"] - 1)
    return {"healed perplexity": ppl, "healed change (%) [95% CI]": change_text(h | {"perplexity_change_pct": point}),
            "healed sample": " ".join(h["sample"].split())[:48]}


QAT_COLUMNS = ["bits", "PTQ perplexity", "PTQ change vs full precision (%)", "PTQ verdict", "QAT perplexity",
               "QAT change vs full precision (%)", "QAT verdict", "packed weights (MiB)", "env"]


def qat_table(jobs: list[dict]) -> pd.DataFrame:
    """One row per bit width: PTQ and QAT validation perplexity, its change over the full-precision fine-tune
    paired row by row (95% interval where the rows give one), and the precision range test's verdict at that
    width, decided by that interval."""
    out = []
    for job in records.ok(jobs):
        tests = job["precision_range_test"]
        for bits in job["bits"]:
            row = {"bits": bits, "env": env_of(job)}
            for method in ("ptq", "qat"):
                v = next(v for v in job["variants"] if (v["method"], v["bits"]) == (method, bits))
                label = method.upper()
                if records.is_ok(v):
                    row |= {f"{label} perplexity": v["perplexity"],
                            f"{label} change vs full precision (%)": spread.text(
                                spread.of_change(v.get("perplexity_change")), "{:+.1f}"),
                            f"{label} verdict": verdict_of(tests[method], bits),
                            "packed weights (MiB)": v["weight_bytes"]["packed_bytes"] / MiB}
                else:
                    row[f"{label} verdict"] = status_text(v)
            out.append(row)
    return pd.DataFrame(out, columns=QAT_COLUMNS)


def verdict_of(test: dict | None, bits: int) -> str:
    """A width's verdict in the precision range test; a record from before intervals has none to give."""
    verdicts = (test or {}).get("verdicts") or {}  # JSON keys: the width as a string
    said = verdicts.get(str(bits), verdicts.get(bits, "undecided"))  # the stage's words, in the vocabulary
    return {"passes": "within", "fails": "beyond", "undecided": NOT_DECIDED}.get(said, said)


SERVING_COLUMNS = ["method", "concurrency", "status", "requests/s", "output tokens/s", "x naive [95% CI]",
                   "verdict vs naive", "x static [95% CI]", "verdict vs static", "env"]


def _serving_ratio(cell: dict, key: str) -> tuple[str, str]:
    ratio = records.serving_ratio(cell, key)
    return (format_ratio(ratio), ratio_words(ratio)) if ratio else ("-", "-")


def serving_table(jobs: list[dict]) -> pd.DataFrame:
    """Per (method, concurrency): the median over the bursts of requests/s and output tokens/s with their 95%
    interval (or range), and the paired per-round throughput ratios over naive and, for continuous batching,
    over static batching at the same concurrency, each with its verdict."""
    out = []
    for job in records.ok(jobs):
        for c in job["cells"]:
            row = {"method": c["method"], "concurrency": c["concurrency"], "status": status_text(c), "env": env_of(job)}
            if records.is_ok(c):
                naive, static = _serving_ratio(c, "throughput_vs_naive"), _serving_ratio(c, "continuous_vs_static")
                row |= {"requests/s": text(of_median(c["requests_per_s"])),
                        "output tokens/s": text(of_median(c["output_tokens_per_s"])),
                        "x naive [95% CI]": naive[0], "verdict vs naive": naive[1],
                        "x static [95% CI]": static[0], "verdict vs static": static[1]}
            out.append(row)
    return pd.DataFrame(out, columns=SERVING_COLUMNS)


SERVING_LATENCY_COLUMNS = ["method", "concurrency", "TTFT p50 (s)", "TTFT p90 (s)", "TTFT p99 (s)", "latency p50 (s)",
                           "latency p90 (s)", "latency p99 (s)", "env"]


def serving_latency_table(jobs: list[dict]) -> pd.DataFrame:
    """Per measured (method, concurrency): TTFT and latency percentiles over the requests of all its bursts."""
    out = []
    for job in records.ok(jobs):
        for c in records.ok(job["cells"]):
            ttft, lat = (c.get("ttft_s") or {}), (c.get("latency_s") or {})
            out.append({"method": c["method"], "concurrency": c["concurrency"],
                        **{f"TTFT {q} (s)": ttft.get(q) for q in ("p50", "p90", "p99")},
                        **{f"latency {q} (s)": lat.get(q) for q in ("p50", "p90", "p99")}, "env": env_of(job)})
    return pd.DataFrame(out, columns=SERVING_LATENCY_COLUMNS)


def capacity_held(jobs: list[dict]) -> str:
    """The memory the capacity budget holds, in two words: the allocator's reservation on a GPU, else RSS."""
    return "reserved memory" if any(j["budget"]["memory"].startswith("cuda") for j in records.ok(jobs)) else "RSS"


def capacity_columns(jobs: list[dict]) -> list[str]:
    return ["subject", "largest", "predicted max", "measured max", "tensors predicted (MiB)", "tensors measured (MiB)",
            f"{capacity_held(jobs)} growth (MiB)", "tokens/s at max", "status", "env"]


def capacity_largest(search: dict, fixed: dict) -> str:
    work = "training" if search["kind"] == "train" else "generation"
    if search["dimension"] == "seq_len":
        return f"{work} sequence (batch 1)"
    return f"{work} batch ({fixed['train_seq_len'] if search['kind'] == 'train' else fixed['prompt_len']} tokens)"


def capacity_measured(search: dict) -> str | None:
    if not records.is_ok(search):
        return None
    top, failing = search.get("measured_max"), search.get("first_failing")
    if top is None:
        return f"none fits ({failing} fails)"
    return f">= {top} (whole range)" if search.get("whole_range_fits") else f"{top} ({failing} fails)"


def capacity_table(jobs: list[dict]) -> pd.DataFrame:
    """Each search's predicted and measured maximum and, at the measured maximum, the estimator's tensor growth
    beside the measured one and beside the growth of the memory the budget holds (all over the loaded model)."""
    columns, out = capacity_columns(jobs), []
    for job in records.ok(jobs):
        for s in job["searches"]:
            m = s.get("at_max") or {}
            out.append(dict(zip(columns, [s["subject"], capacity_largest(s, job["fixed"]), s.get("predicted_max"),
                                          capacity_measured(s), m.get("predicted_growth_mib"),
                                          m.get("tensor_growth_mib"), m.get("held_growth_mib"),
                                          _rate_text(s.get("tokens_per_s_at_max")), status_text(s), env_of(job)])))
    return pd.DataFrame(out, columns=columns)


def _rate_text(stats: dict | None) -> str:
    """tokens/s at a maximum: one timed step is a value alone; more, the median with their interval or range."""
    return f"{stats['median']:.2f} (n=1)" if stats and stats["n"] == 1 else median_text(stats)


def capacity_cause(search: dict) -> str | None:
    """What the memory at a search's measured maximum says of its prediction, like with like. The peak measured
    there is the predicted one plus three parts: 'loaded', how much more the loaded model held than in the first
    cell, where the prediction starts; 'estimator', the live tensors measured minus those predicted; 'gap', the
    memory the budget holds beyond the live tensors, which the estimator does not model. The cause is the part
    that moved the peak most in the direction of the whole difference, the estimator's only where its tensors
    are off by more than ±MEMORY_TARGET (else it is right, and never named); 'none' where no part moved it that
    way; 'gap_short' where the gap moved it down (the held memory grew by less than the live tensors). None where
    the maximum's tensors were not measured."""
    m = search.get("at_max") or {}
    if m.get("ratio") is None or m.get("gap_mib") is None:
        return None
    miss = m["tensor_growth_mib"] - m["predicted_growth_mib"]
    parts = {"gap": m["gap_mib"], "loaded": m.get("loaded_shift_mib") or 0.0}
    direction = 1 if sum(parts.values()) + miss >= 0 else -1
    if capacity_estimator_off(m):
        parts["estimator"] = miss
    cause = max(parts, key=lambda k: direction * parts[k])
    if direction * parts[cause] <= 0:
        return "none"
    return "gap_short" if cause == "gap" and parts["gap"] < 0 else cause  # held memory grew less than the tensors


def capacity_estimator_off(at_max: dict) -> bool:
    return abs(at_max["ratio"] - 1) > MEMORY_TARGET


def tokens_per_s(run: dict) -> float:
    """A run's real-token throughput over its steady steps, the rate its MFU is computed from (the whole run's,
    first steps included, for runs recorded before throughput was measured steady)."""
    return run.get("throughput", {}).get("tokens_per_s", run["tokens_per_s"])


def finetune_table(rows: list[dict]) -> pd.DataFrame:
    """What each run cost and did; parameter counts, samples/s and the matmul ceiling the MFU is over are in
    summary.csv (the long results table)."""
    return pd.DataFrame([{
        "run": r["run"], "method": r["method"], "precision": r["mixed_precision"],
        "effective batch": r.get("effective_batch"),
        "pad tokens computed (%)": pct(r.get("pad_fraction")),
        "trainable (%)": r["parameters"]["trainable_pct"], "steps": r["steps"],
        "median step (s) [95%], warm-up excluded": median_text(r.get("step_time")),
        "tokens/s": tokens_per_s(r),
        "MFU (% of measured matmul)": pct(r.get("throughput", {}).get("mfu_vs_measured_ceiling")),
        "MFU (% of published peak)": pct(r.get("throughput", {}).get("mfu_vs_published_peak")),
        f"peak memory (MiB, {r['train_memory']['kind']})": peak_mib(r["train_memory"]),
        "val loss before": r["validation_before"]["loss"], "val loss after": r["validation_after"]["loss"],
        "energy (J/token)": (r.get("energy") or {}).get("joules_per_token"), "env": env_of(r),
    } for r in records.ok(rows)])


def merge_table(rows: list[dict]) -> pd.DataFrame:
    rows = records.ok(rows)
    return pd.DataFrame([{
        "run": r["run"], "reference": r["reference"], "merged into": r["merge_target"],
        "max |logit diff| (merge dtype)": r["merged"]["max_abs_logit_diff"],
        "max |logit diff| (saved folder)": r["merged_saved"]["max_abs_logit_diff"], "saved dtype": r["saved_dtype"],
        "perplexity adapter": r["adapter_validation"]["perplexity"],
        "merged: change vs adapter (%)": change_text(r["merged"], None),
        "saved: change vs adapter (%)": change_text(r["merged_saved"], None), "env": env_of(r),
    } for r in rows])


def merge_targets_table(rows: list[dict]) -> pd.DataFrame:
    rows = records.ok(rows)
    return pd.DataFrame([{
        "run": r["run"], "merged into": target, "max |logit diff| vs adapter on 4-bit base": t["max_abs_logit_diff"],
        "mean KL vs adapter": t["kl_mean"], "perplexity": t["validation"]["perplexity"],
        "change vs adapter (%)": change_text(t, None),
        "closest to the adapter (lowest KL)": "yes" if target == r.get("closest_target") else "", "env": env_of(r),
    } for r in rows for target, t in r.get("targets", {}).items()])


def attention_table(rows: list[dict]) -> pd.DataFrame:
    out = []
    for r in rows:
        if not records.is_ok(r):  # the whole implementation did not run: one row, not one per cell
            out.append({"implementation": r.get("implementation") or r.get("name"), "status": status_text(r),
                        "env": env_of(r) if "environment" in r else None})
            continue
        for row in r["rows"]:
            ok = records.is_ok(row)
            lat = row.get("latency", {})
            out.append({
                "implementation": row["implementation"], "mode": row.get("mode", "forward"),
                "seq len": row["seq_len"], "batch": row["batch_size"], "status": status_text(row),
                "median (ms)": 1000 * lat["median"] if ok else None,
                "95% CI or range of median (ms)": interval_text(lat, 1000) if ok else "-",
                "p90 (ms)": 1000 * lat["p90"] if ok else None,
                "p99 (ms)": 1000 * lat["p99"] if ok and "p99" in lat else None,
                "tokens/s": row["tokens_per_s"] if ok else None,
                # what the exponent is fitted on (measure.memory.allocated_delta); the resident delta is in the record
                "peak delta (MiB)": allocated_delta(row["memory"])[0] if ok else None,
                "memory kind": allocated_delta(row["memory"])[1] if ok else None,
                "max |diff| vs eager": row["max_abs_diff_vs_eager"] if ok else None,
                "speedup vs eager [95% CI]": speedup_text(row.get("vs_eager"), "speedup") if ok else "-",
                "verdict vs eager": speedup_verdict(row.get("vs_eager"), "speedup") if ok else "-",
                "env": env_of(r),
            })
    return pd.DataFrame(out, columns=ATTENTION_COLUMNS)


# The report keeps what decides, in one table: the interleaved speedup first; a cell's own median latency and its
# spread, p90/p99 and tokens/s are in summary.csv (the long results table).
ATTENTION_COLUMNS = ["implementation", "mode", "seq len", "batch", "status", "speedup vs eager [95% CI]",
                     "verdict vs eager", "median (ms)", "peak delta (MiB)", "max |diff| vs eager", "memory kind",
                     "env"]


def exponent_table(rows: list[dict]) -> pd.DataFrame:
    return pd.DataFrame([{
        "implementation": f["implementation"], "mode": f["mode"], "batch": f["batch_size"],
        "memory ~ seq^k: k": f["exponent"], "R²": f.get("r2"), "points": f["points"],
        "memory kind": f["memory_kind"], "env": env_of(r),
    } for r in rows for f in r.get("memory_exponents", [])])


def inference_table(rows: list[dict]) -> pd.DataFrame:
    out = []
    for r in rows:
        for c in r.get("cells", []):  # a job that failed outside its cells has none (table of jobs not run)
            if c.get("status") == "unavailable":  # a line each under the table (sections.unavailable_cells)
                continue
            ok = records.is_ok(c) and "decode_tokens_per_s" in c  # an engine's cell: whole generations only
            versus = c.get("vs_base") or c.get("vs_dynamic")
            out.append({
                "variant": r["variant"], "kind": r["kind"], "of": r["of"] or "-",
                "KV cache": "on" if c["kv_cache"] else "off", "batch": c["batch_size"],
                "generation": c.get("generation", "dynamic"), "status": status_text(c),
                "TTFT median (ms)": 1000 * c["ttft"]["median"] if ok else None,
                "TTFT p90 (ms)": 1000 * c["ttft"]["p90"] if ok else None,
                "decode tokens/s median": c["decode_tokens_per_s"]["median"] if ok else None,
                "decode tokens/s 95% CI or range": interval_text(c["decode_tokens_per_s"]) if ok else "-",
                "per-token p50 (ms)": 1000 * c["per_token_latency"]["median"] if ok else None,
                "per-token p90 (ms)": 1000 * c["per_token_latency"]["p90"] if ok else None,
                "per-token p99 (ms)": 1000 * c["per_token_latency"]["p99"] if ok else None,
                "per-token p99/p50": c["per_token_latency"].get("p99_over_p50") if ok else None,
                "tail cause (p99/p50 > 1.5)": (c["per_token_latency"].get("tail_cause") or "") if ok else "",
                "first generation (s)": first_generation(c) if ok else None,
                "peak delta (MiB)": c["memory"].get("delta_mib") if ok else None,
                "memory kind": c["memory"]["kind"] if ok else None,
                "footprint (MiB)": c["memory_footprint_bytes"] / MiB if records.is_ok(c) else None,
                **roofline_columns(c.get("roofline") if ok else None),
                "energy (J/token)": (c.get("energy") or {}).get("joules_per_token") if ok else None,
                "timed against": (versus or {}).get("against", "-") if records.is_ok(c) else "-",
                "speedup [95% CI]": speedup_text(versus, "generation_speedup") if records.is_ok(c) else "-",
                "verdict": speedup_verdict(versus, "generation_speedup") if records.is_ok(c) else "-",
                "env": env_of(r),
            })
    return pd.DataFrame(out, columns=INFERENCE_COLUMNS)


def first_generation(cell: dict) -> float | None:
    """The first generation's wall time (compiled: torch.compile's work for the first prompt batch with it)."""
    firsts = (cell.get("first_generations") or {}).get("first_generations_s")
    return firsts[0] if firsts else None


# TTFT p90, per-token p90 and p99/p50 are in summary.csv (the long results table).
INFERENCE_COLUMNS = ["variant", "kind", "of", "KV cache", "batch", "generation", "status", "TTFT median (ms)",
                     "decode tokens/s median", "decode tokens/s 95% CI or range", "per-token p50 (ms)",
                     "per-token p99 (ms)", "tail cause (p99/p50 > 1.5)", "first generation (s)", "peak delta (MiB)",
                     "memory kind", "footprint (MiB)", "MiB read per token", "% of bandwidth", "% of matmul ceiling",
                     "bound", "energy (J/token)", "timed against", "speedup [95% CI]", "verdict", "env"]


def roofline_columns(roof: dict | None) -> dict:
    """Where a cell's median decode rate stands between the machine's measured limits (measure.bandwidth): the
    bytes a token reads, the fractions of the copy bandwidth and of the matmul ceiling reached, and what bounds it
    (a record measured before the probe: empty)."""
    if not roof:
        return {"MiB read per token": None, "% of bandwidth": None, "% of matmul ceiling": None, "bound": "-"}
    return {"MiB read per token": roof["bytes_per_token"] / MiB, "% of bandwidth": 100 * roof["bandwidth_fraction"],
            "% of matmul ceiling": 100 * roof["compute_fraction"], "bound": roof["bound"]}


def not_run_table(metrics: dict[str, list[dict]]) -> pd.DataFrame:
    """Every job of the grid that did not produce numbers, and why: nothing disappears silently."""
    return pd.DataFrame(records.not_run(metrics), columns=["stage", "name", "status", "reason"])


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
                                         if p.get("batch") else f" ({p['phase']})" if p.get("phase") else ""), p, env_of(r))
           for r in finetune_rows if (p := r.get("memory_prediction"))]
    out += [row(f"inference {r['variant']} (KV {'on' if c['kv_cache'] else 'off'}, batch {c['batch_size']}"
                f"{'' if c.get('generation', 'dynamic') == 'dynamic' else ', ' + c['generation']})",
                c["memory_prediction"], env_of(r))
            for r in inference_rows for c in r.get("cells", []) if records.is_ok(c) and "memory_prediction" in c]
    return pd.DataFrame(out)


# How many leading columns name a row of each table: a table wider than the report allows is split into parts
# that repeat them (fmt.markdown).
KEYS = {"prune": 1, "qat": 1, "finetune": 1, "finetune_knobs": 3, "merge": 1, "merge_targets": 2,
        "bench_attention": 4, "bench_inference": 6, "bench_serving": 2, "bench_serving_latency": 2,
        "capacity": 2}


def build_tables(metrics: dict) -> dict[str, pd.DataFrame]:
    tables = {
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
        "bench_serving_latency": serving_latency_table(metrics["bench_serving"]),
        "capacity": capacity_table(metrics["capacity"]),
    }
    for name, df in tables.items():
        df.attrs["keys"] = KEYS.get(name)
    return tables
