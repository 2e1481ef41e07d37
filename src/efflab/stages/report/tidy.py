"""Every measured figure of every record in one long table: stage, job, metric, value, lower, upper, unit, n.

A figure with spread keeps its interval: a summary (measure.stats.summarize) is its median and 95% interval of the
median where n gives one; an interleaved ratio (measure.stats.speedup) its median and interval over rounds; a paired
quality change (quality.paired_change) its change and interval over rows. Any other number is a value alone.
What describes the run rather than measures it (environment, provenance, settings, config, samples) is left out.
"""
from __future__ import annotations

import pandas as pd

COLUMNS = ["stage", "job", "metric", "value", "lower", "upper", "unit", "n"]
SKIPPED = {"environment", "provenance", "settings", "config", "samples", "per_row", "terms_mib", "profile",
           "dtype_choice", "top10", "rows_detail", "curve", "by_round", "by_burst", "rounds", "fixed", "budget",
           "stats", "seq_len", "batch_size", "concurrency", "bits",  # grid coordinates: in the metric's name
           "readings"}  # the claims' readings: claims.csv has each, by claim
UNITS = (("_pct", "%"), ("_mib", "MiB"), ("_bytes", "bytes"), ("tokens_per_s", "tokens/s"), ("_per_s", "1/s"),
         ("_s", "s"), ("_ms", "ms"), ("joules_per_token", "J/token"), ("tflops", "TFLOP/s"))


def unit_of(path: str) -> str:
    leaf = path.rsplit(".", 1)[-1]
    return next((u for suffix, u in UNITS if leaf.endswith(suffix)), "")


def figure(path: str, d: dict) -> dict | None:
    """A dict that is one figure with spread, as a row; None for any other dict."""
    if "median" in d and "n" in d:  # measure.stats.summarize
        lo, hi = d.get("ci95_median") or (None, None)
        return {"metric": path, "value": d["median"], "lower": lo, "upper": hi, "unit": d.get("unit") or unit_of(path),
                "n": d["n"]}
    if "median" in d and "rounds" in d:  # an interleaved ratio
        lo, hi = d.get("ci95") or (None, None)
        return {"metric": path, "value": d["median"], "lower": lo, "upper": hi, "unit": "ratio", "n": d["rounds"]}
    if "change_pct" in d and "n_rows" in d:  # a paired quality change
        lo, hi = d.get("ci95_change_pct") or (None, None)
        return {"metric": path, "value": d["change_pct"], "lower": lo, "upper": hi, "unit": "%", "n": d["n_rows"]}
    return None


def flatten(record, path: str = "") -> list[dict]:
    """The figures under `record`, dotted paths as metric names (list items by their name or index)."""
    if isinstance(record, dict):
        found = figure(path, record) if path else None
        if found:  # a ratio with no median (every round set aside on a busy machine) is no figure
            return [found] if found["value"] is not None else []
        return [row for k, v in record.items() if k not in SKIPPED
                for row in flatten(v, f"{path}.{k}" if path else str(k))]
    if isinstance(record, list):
        if all(not isinstance(v, (dict, list)) for v in record):
            return []  # a list of plain values (token counts, head indices): detail, not a figure
        return [row for i, v in enumerate(record)
                for row in flatten(v, f"{path}[{_label(v, i)}]")]
    if isinstance(record, bool) or not isinstance(record, (int, float)):
        return []
    return [{"metric": path, "value": record, "lower": None, "upper": None, "unit": unit_of(path), "n": None}]


def _label(item, i: int):
    """A list item's name in a metric path: its name and the grid coordinates it carries, else its index."""
    if not isinstance(item, dict):
        return i
    name = [item[k] for k in ("name", "implementation", "method", "variant", "subject", "run")
             if isinstance(item.get(k), str)][:1]
    extra = [f"{k}={item[k]}" for k in ("mode", "seq_len", "batch_size", "kv_cache", "concurrency", "bits",
                                        "dimension") if k in item and not isinstance(item[k], (dict, list))]
    return ",".join(map(str, name + extra)) or i


def results_table(metrics: dict[str, list[dict]]) -> pd.DataFrame:
    rows = [{"stage": stage, "job": m.get("name") or stage, **row}
            for stage, jobs in metrics.items() for m in jobs for row in flatten(m)]
    return pd.DataFrame(rows, columns=COLUMNS)
