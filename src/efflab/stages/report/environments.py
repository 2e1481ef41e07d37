"""Where results were measured: tables compared only within one environment, and the provenance of each job."""
from __future__ import annotations

import json

import pandas as pd

from ... import provenance
from ...measure.env import FINGERPRINT_KEYS
from .writing import markdown


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
        return markdown(df.drop(columns="env"))
    diff = env_differences(environments, fps)
    if allow_mixed:
        return (f"> Rows from {len(fps)} environments ({diff}) are combined because "
                "`report.allow_mixed_environments` is true; the env column says which is which.\n\n" + markdown(df))
    parts = [f"> **Not compared in one table:** these rows were measured in {len(fps)} different environments "
             f"({diff}). Each environment gets its own table; set `report.allow_mixed_environments: true` "
             "to combine them.", ""]
    for fp in fps:
        parts += [f"Environment `{fp}`:", "", markdown(df[df["env"] == fp].drop(columns="env")), ""]
    return "\n".join(parts)


def environment_table(environments: dict[str, dict]) -> pd.DataFrame:
    return pd.DataFrame([{"env": fp, **_flat(env)} for fp, env in environments.items()]).dropna(axis=1, how="all")


def provenance_table(jobs: dict[str, dict]) -> pd.DataFrame:
    return pd.DataFrame([{
        "job": job, "wrote (sha256)": (m.get("provenance", {}).get("outputs_sha256") or "-")[:12],
        "measured on": "; ".join(provenance.chain(m.get("provenance", {}))) or "-",
    } for job, m in jobs.items()], columns=["job", "wrote (sha256)", "measured on"])
