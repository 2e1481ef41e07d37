"""The quantization part's table: each scheme's footprint, load time and perplexity change, and whether a LoRA
adapter trains on it."""
from __future__ import annotations

import pandas as pd

from .... import records
from ..writing import MiB, env_of
from . import change_text


def quantize_table(rows: list[dict]) -> pd.DataFrame:
    return pd.DataFrame([{
        "scheme": r["scheme"], "method": r["method"], "double quant": r["double_quant"],
        "quantized as": quantized_as(r),
        "footprint (MiB)": r["memory_footprint_bytes"] / MiB, "x smaller than baseline": r["footprint_ratio_vs_base"],
        "on disk (MiB)": r["bytes_on_disk"] / MiB, "load (s)": r["load_s"],
        "val perplexity": r["validation"]["perplexity"], "perplexity change (%) [95% CI]": change_text(r),
        "env": env_of(r),
    } for r in records.ok(rows)], columns=["scheme", "method", "double quant", "quantized as", "footprint (MiB)",
                                           "x smaller than baseline", "on disk (MiB)", "load (s)", "val perplexity",
                                           "perplexity change (%) [95% CI]", "env"])


def adapter_table(rows: list[dict]) -> pd.DataFrame:
    """Whether a LoRA adapter trains on each scheme and merges back (details.md)."""
    return pd.DataFrame([{"scheme": r["scheme"], "method": r["method"], "LoRA on it": adapter_text(r.get("adapter")),
                          "env": env_of(r)} for r in records.ok(rows)],
                        columns=["scheme", "method", "LoRA on it", "env"])


def quantized_as(record: dict) -> str:
    """The quantized module or weight classes and their counts (a record before efflab.models.quantization: its bnb layers)."""
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
