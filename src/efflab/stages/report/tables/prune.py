"""The pruning part's table: each strategy's kept parameters, perplexity change and speedup, pruned and healed."""
from __future__ import annotations

import pandas as pd

from .... import records
from ..writing import MiB, env_of, speedup_text, speedup_verdict
from . import change_text

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
