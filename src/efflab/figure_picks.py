"""A job's figures: the few numbers a person compares across experiments, picked from its record by the paths the
stage registry names (`Stage.figures`). cli.main writes them beside metrics.json as figures.json, the job's DVC
metric (`dvc exp show`, `dvc metrics diff`); the whole record stays an output.

A path is dot-separated keys into the record. `name[f1,f2]` takes every element of the list `name`, labelled by
its fields f1 and f2 (`kv_cache=true/batch_size=1`; a field `f?` only where the element has it); `*` takes every
key of a dict. What a path reaches is kept
when it is a number, a string or a boolean; a two-number list (an interval) becomes `lo` and `hi`; a summary from
measure.stats.summarize becomes its `median` with its interval's `ci95_lo` and `ci95_hi` where n gives one; a dict of such
values keeps them. A path a record lacks (a job or cell that did not run) is left out: its `status` says why.

No torch here: the registry names these paths, and Snakemake reads the registry while it plans the DAG.
"""
from __future__ import annotations

import re

FIGURES = "figures.json"
_LIST = re.compile(r"^(?P<key>[^\[]+)\[(?P<fields>[^\]]+)\]$")


def pick(record: dict, paths: tuple[str, ...]) -> dict:
    """The job's figures: its status (and reason), then each path's value, nested as in the record."""
    out: dict = {"status": record.get("status", "ok")}
    if out["status"] != "ok":
        out["reason"] = str(record.get("reason", ""))
    for path in paths:
        _put(out, record, path.split("."))
    return out


def _label(item: dict, fields: list[str]) -> str:
    """`f1=v1/f2=v2` (no comma: `dvc exp show --csv` headers); a field marked `f?` only where the item has it."""
    return "/".join(f"{f.rstrip('?')}={_text(item.get(f.rstrip('?')))}" for f in fields
                    if not f.endswith("?") or f.rstrip("?") in item)


def _text(value) -> str:
    return str(value).lower() if isinstance(value, bool) or value is None else str(value)


def _put(out: dict, node, keys: list[str]) -> None:
    """Copy what `keys` reach in `node` into `out`, under the same keys (a list element under its label)."""
    key, rest = keys[0], keys[1:]
    listed = _LIST.match(key)
    if listed:
        items = node.get(listed["key"]) if isinstance(node, dict) else None
        fields = listed["fields"].split(",")
        for item in items if isinstance(items, list) else []:
            if not isinstance(item, dict):
                continue
            slot = out.setdefault(listed["key"], {}).setdefault(_label(item, fields), {})
            if item.get("status", "ok") != "ok":
                slot["status"] = item["status"]
            elif rest:
                _put(slot, item, rest)
        return
    children = list(node) if key == "*" and isinstance(node, dict) else [key]
    for child in children:
        if not isinstance(node, dict) or child not in node:
            continue
        if rest:
            slot = out.setdefault(child, {})
            _put(slot, node[child], rest)
            if not slot:
                del out[child]
        else:
            value = _leaf(node[child])
            if value is not None:
                out[child] = value


def _leaf(value):
    """A figure from what a path reached, or None where it is not one."""
    if isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, list) and len(value) == 2 and all(isinstance(v, (int, float)) for v in value):
        return {"lo": value[0], "hi": value[1]}
    if isinstance(value, dict) and "median" in value:  # measure.stats.summarize
        interval = value.get("ci95_median") or value.get("ci95")  # at least 95% (None where n is under 6)
        return {"median": value["median"], **({"ci95_lo": interval[0], "ci95_hi": interval[1]} if interval else {})}
    if isinstance(value, dict):
        kept = {k: _leaf(v) for k, v in value.items() if isinstance(v, (bool, int, float, str))}
        return kept or None
    return None
