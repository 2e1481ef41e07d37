"""What the capacity stage searches: its subjects (the runs training, the variants generating, each quantized KV
cache's longest context) and the grid of sizes each dimension is searched over."""
from __future__ import annotations

import json
from dataclasses import dataclass

from ...experiment import made_by
from ...models import kv_cache

DIMENSIONS = ("batch_size", "seq_len")
BASE = "base"  # the base model, generating: a subject where capacity.kv_quant asks and no variant of kind base is
# transformers' QuantizedCache defaults (None: the layer's own) where bench_inference has no kv_quant_options
KV_DEFAULTS = {"residual_length": None, "group_size": None}


@dataclass(frozen=True)
class Subject:
    """What a search runs: training (a finetune run) or generating (`variant`, a bench_inference variant or the base
    model) with `kv_quant`'s cache; its record name, the dimensions searched, and why it is skipped (None: it runs)."""
    kind: str
    name: str
    variant: dict | None = None
    kv_quant: str = kv_cache.NONE
    dimensions: tuple[str, ...] = DIMENSIONS
    skipped: dict | None = None
    paired_with: str | None = None  # a quantized cache's full-precision subject


def kv_settings(cfg: dict) -> dict:
    return cfg["bench_inference"].get("kv_quant_options") or KV_DEFAULTS


def subjects(cfg: dict, layout) -> list[Subject]:
    """Every run and variant the stage searches; where capacity.kv_quant asks, each generating subject's sequence
    search again per quantized cache, and the base model generating if no variant of kind base is searched."""
    c, variants = cfg["capacity"], cfg["bench_inference"]["variants"]
    caches = c.get("kv_quant") or []
    out = [Subject("train", name) for name in c["runs"]]
    generating = [(name, variants[name], DIMENSIONS) for name in c["variants"]]
    if caches and not any(variant["kind"] == "base" for _, variant, _ in generating):
        generating.append((BASE, {"kind": "base"}, ("seq_len",)))
    for name, variant, dimensions in generating:
        skipped = layout.skipped_because([made_by(variant["kind"], variant.get("of"))])
        out.append(Subject("generate", name, variant, dimensions=dimensions, skipped=skipped))
        out += [Subject("generate", f"{name}+kv-{kv}", variant, kv, ("seq_len",), skipped, paired_with=name)
                for kv in caches]
    return out


def grid(c: dict, kind: str, dimension: str, max_positions: int) -> list[tuple[int, int]]:
    """The (batch size, sequence length) cells a dimension is searched over, smallest first. Generation's
    sequence is its prompt; the prompt and its new tokens stay within the model's context."""
    fixed = c["train_seq_len"] if kind == "train" else c["generate"]["prompt_len"]
    top = max_positions - (0 if kind == "train" else c["generate"]["new_tokens"])
    if dimension == "batch_size":
        return [(b, fixed) for b in range(1, c["max_batch_size"] + 1)] if fixed <= top else []
    step = c["seq_len_step"]
    return [(1, n) for n in range(step, min(c["max_seq_len"], top) + 1, step)]


def max_positions(layout) -> int:
    config = json.loads((layout.base_model() / "config.json").read_text())
    return int(config.get("max_position_embeddings") or 2**31)
