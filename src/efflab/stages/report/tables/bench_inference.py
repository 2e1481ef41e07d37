"""The inference part's table: every variant's cells, their speed, memory and roofline, against their reference."""
from __future__ import annotations

import pandas as pd

from .... import records
from ..fmt import MiB, env_of, interval_text, speedup_text, speedup_verdict, status_text


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
