"""The merging part's tables: each merged run against its adapter, and each merge target's distance from it."""
from __future__ import annotations

import pandas as pd

from .... import records
from ..writing import env_of
from . import change_text


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
