"""The inference part's table: every variant's cells, their speed, memory and roofline, against their reference."""
from __future__ import annotations

import pandas as pd

from .... import records
from ..generation_modes import speculative_options, speculative_status
from ..writing import MiB, env_of, interval_text, pct, speedup_text, speedup_verdict, status_text
from . import change_text


def inference_table(rows: list[dict]) -> pd.DataFrame:
    """Each cell's speed: TTFT, decode rate and its speedup with verdict."""
    return _cells(rows)[INFERENCE_COLUMNS]


def costs_table(rows: list[dict]) -> pd.DataFrame:
    """Each cell's latency tail and costs beside its speed (details.md): per-token latency and its tail's cause, the
    first generation, memory, the roofline and its bound, energy."""
    return _cells(rows)[COSTS_COLUMNS]


def _cells(rows: list[dict]) -> pd.DataFrame:
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
                "generation": records.cell_mode(c), "status": status_text(c),
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
    return pd.DataFrame(out, columns=list(dict.fromkeys(INFERENCE_COLUMNS + COSTS_COLUMNS)))


def first_generation(cell: dict) -> float | None:
    """The first generation's wall time (compiled: torch.compile's work for the first prompt batch with it)."""
    firsts = (cell.get("first_generations") or {}).get("first_generations_s")
    return firsts[0] if firsts else None


# TTFT p90, per-token p90 and p99/p50 are in summary.csv (the long results table).
CELL_KEYS = ["variant", "kind", "of", "KV cache", "batch", "generation"]
INFERENCE_COLUMNS = [*CELL_KEYS, "status", "TTFT median (ms)", "decode tokens/s median",
                     "decode tokens/s 95% CI or range", "timed against", "speedup [95% CI]", "verdict", "env"]
COSTS_COLUMNS = [*CELL_KEYS, "status", "per-token p50 (ms)", "per-token p99 (ms)", "tail cause (p99/p50 > 1.5)",
                 "first generation (s)", "peak delta (MiB)", "memory kind", "footprint (MiB)", "MiB read per token",
                 "% of bandwidth", "% of matmul ceiling", "bound", "energy (J/token)", "env"]


def roofline_columns(roof: dict | None) -> dict:
    """Where a cell's median decode rate stands between the machine's measured limits (measure.bandwidth): the
    bytes a token reads, the fractions of the copy bandwidth and of the matmul ceiling reached, and what bounds it
    (a record measured before the probe: empty)."""
    if not roof:
        return {"MiB read per token": None, "% of bandwidth": None, "% of matmul ceiling": None, "bound": "-"}
    return {"MiB read per token": roof["bytes_per_token"] / MiB, "% of bandwidth": pct(roof["bandwidth_fraction"]),
            "% of matmul ceiling": pct(roof["compute_fraction"]), "bound": roof["bound"]}


def speculative_table(rows: list[dict]) -> pd.DataFrame:
    """Each speculative cell (prompt lookup, a draft): its speed over the same model's dynamic generation, what its
    verification steps accepted, whether its greedy tokens were the model's own, and whether it pays (the speculative
    decision's status, from the same verdict)."""
    out = []
    for o in speculative_options(rows):
        versus = o["vs_dynamic"]
        verdict = speedup_verdict(versus, "generation_speedup")
        rate = o["acceptance_rate"]
        out.append({"variant": o["variant"], "mode": o["mode"], "draft": o["draft"] or "-", "env": o["env"],
                    "speedup vs dynamic [95% CI]": speedup_text(versus, "generation_speedup"), "verdict": verdict,
                    "candidates proposed": o["proposed"], "accepted %": None if rate is None else 100 * rate,
                    "tokens per model step": o["tokens_per_step"],
                    "greedy tokens equal": {True: "yes", False: "no"}.get(o["greedy_equal"], "-"),
                    "pays?": speculative_status(o, verdict)})
    return pd.DataFrame(out, columns=SPECULATIVE_COLUMNS)


SPECULATIVE_COLUMNS = ["variant", "mode", "draft", "speedup vs dynamic [95% CI]", "verdict", "candidates proposed",
                       "accepted %", "tokens per model step", "greedy tokens equal", "pays?", "env"]


def kv_quant_table(rows: list[dict]) -> pd.DataFrame:
    """Each quantized-cache cell at each context length measured: the memory the full-precision and the quantized
    cache hold after that prefill, their ratio, the perplexity change read through the cache (paired, with its
    interval) and the generation speed over the full-precision cache."""
    out = []
    for job in records.ok(rows):
        for c in records.ok(job.get("cells", [])):
            q = c.get("quantized_cache")
            if not c.get("kv_quant") or not q:
                continue
            for m in q.get("memory_by_context") or []:
                out.append({"variant": job["variant"], "cache": c["kv_quant"], "context (tokens)": m["context"],
                            "full precision (MiB)": m["full_mib"], "quantized (MiB)": m["quantized_mib"],
                            "ratio": m["ratio"], "memory kind": m["kind"],
                            "perplexity change % [95% CI]": change_text(q),
                            "generation speedup vs full cache [95% CI]": speedup_text(c.get("vs_dynamic"),
                                                                                  "generation_speedup"),
                            "verdict": speedup_verdict(c.get("vs_dynamic"), "generation_speedup"),
                            "env": env_of(job)})
    return pd.DataFrame(out, columns=KV_QUANT_COLUMNS)


KV_QUANT_COLUMNS = ["variant", "cache", "context (tokens)", "full precision (MiB)", "quantized (MiB)", "ratio",
                    "memory kind", "perplexity change % [95% CI]", "generation speedup vs full cache [95% CI]", "verdict",
                    "env"]

