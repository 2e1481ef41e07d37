"""The quality and memory of a quantized KV cache (a cell's `kv_quant`): the perplexity change it brings against a
full-precision cache, paired chunk by chunk, and what each cache holds by context length."""
from __future__ import annotations

from ... import quality
from ...models import kv_cache as kv_quant
from ...models.modeling import read_split


def quantized_cache(cfg: dict, layout, model, spec: str) -> dict:
    """What a quantized KV cache costs and holds: the paired perplexity change on validation rows fed through it
    in chunks against the same chunks through a full-precision cache, and the memory each cache holds after a
    prefill of each context length (up to the model's positions)."""
    o = cfg["bench_inference"]["kv_quant_options"]
    rows = read_split(layout.split("validation"), o["eval_rows"])
    change = quality.paired_change(kv_quant.chunked_row_nll(model, rows, kv_quant.NONE, o, o["chunk"]),
                                   kv_quant.chunked_row_nll(model, rows, spec, o, o["chunk"]))
    top = getattr(model.config.get_text_config(decoder=True), "max_position_embeddings", None) or 2**31
    lengths = [n for n in o["context_lengths"] if n <= top]
    tokens = [t for r in rows for t in r["input_ids"]]
    full, mine = (kv_quant.memory_by_context(model, tokens, s, o, lengths) for s in (kv_quant.NONE, spec))
    return {"cache": spec, "options": o, "perplexity_change": change,
            "quality_measured": f"{len(rows)} validation rows fed {o['chunk']} tokens at a time through the cache, "
                                "paired with the same chunks through a full-precision cache",
            "memory_by_context": [{"context": a["context"], "full_mib": a["held_mib"], "quantized_mib": b["held_mib"],
                                   "ratio": b["held_mib"] / a["held_mib"] if a["held_mib"] and b["held_mib"] else None,
                                   "kind": a["kind"]} for a, b in zip(full, mine)],
            "contexts_left_out": [n for n in o["context_lengths"] if n > top]}
