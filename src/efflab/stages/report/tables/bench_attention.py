"""The attention part's tables: each implementation's cells against eager, and its memory's exponent in the
sequence length."""
from __future__ import annotations

import pandas as pd

from .... import records
from ....measure.memory import allocated_delta
from ..writing import env_of, interval_text, speedup_text, speedup_verdict, status_text


def attention_table(rows: list[dict]) -> pd.DataFrame:
    out = []
    for r in rows:
        if not records.is_ok(r):  # the whole implementation did not run: a line under the table (sections)
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
