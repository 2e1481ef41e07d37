"""A quantized KV cache: transformers' QuantizedCache (KIVI-style, keys and values quantized per channel in groups
beyond a residual window kept in full precision) with whichever backend is installed, quanto or HQQ.

A cache is named `<backend>-<bits>` (quanto-4, hqq-2); `none` is generate()'s own full-precision dynamic cache.
What it costs in quality is measured as it is used: each validation row fed through the cache in chunks, every
chunk attending to the earlier ones' keys and values as the cache stores them (quantized beyond the residual
window), its next-token loss summed; the same chunks through a full-precision cache give the paired reference.
"""
from __future__ import annotations

import importlib.util
import re

import torch

from .modeling import summed_nll

NONE = "none"
# backend -> (the module transformers imports, the package that installs it, the bit widths transformers accepts)
BACKENDS = {"quanto": ("optimum.quanto", "optimum-quanto", (2, 4)), "hqq": ("hqq", "hqq", (1, 2, 3, 4, 8))}
SPEC = re.compile(r"^(?P<backend>[a-z]+)-(?P<bits>\d)$")


def parse(spec: str) -> tuple[str, int] | None:
    """(backend, bits) of a cache name; None for `none`. A name of no known backend or width raises ValueError."""
    if spec == NONE:
        return None
    m = SPEC.match(spec)
    if not m or m["backend"] not in BACKENDS or int(m["bits"]) not in BACKENDS[m["backend"]][2]:
        known = ", ".join(f"{b}-{n}" for b, (_, _, bits) in BACKENDS.items() for n in bits)
        raise ValueError(f"{spec!r}: expected none or a quantized cache: {known}")
    return m["backend"], int(m["bits"])


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a namespace parent (optimum) missing
        return False


def unavailable(spec: str, config=None) -> str | None:
    """Why a cache cannot run here (its backend is not installed; the model has layers other than full attention,
    which QuantizedCache refuses), else None."""
    parsed = parse(spec)
    if parsed is None:
        return None
    module, package, _ = BACKENDS[parsed[0]]
    if not _installed(module):
        return f"the {parsed[0]} backend of transformers' QuantizedCache needs {package} (pip install {package})"
    types = set(getattr(config.get_text_config(decoder=True), "layer_types", None) or []) if config else set()
    if types - {"full_attention"}:
        return f"transformers' QuantizedCache takes full-attention layers only; this model has {sorted(types)}"
    return None


def options(spec: str, settings: dict) -> dict:
    """QuantizedCache's arguments for a cache name and bench_inference.kv_quant_options."""
    backend, bits = parse(spec)
    return {"backend": backend, "nbits": bits, "q_group_size": settings["group_size"],
            "residual_length": settings["residual_length"]}


def generate_kwargs(spec: str, settings: dict) -> dict:
    """generate()'s arguments for a cache: a fresh QuantizedCache each call (transformers' `quantized`)."""
    if spec == NONE:
        return {}
    return {"cache_implementation": "quantized", "cache_config": options(spec, settings)}


def new_cache(model, spec: str, settings: dict):
    """A fresh cache for `model`: a DynamicCache for `none`, else a QuantizedCache."""
    from transformers import DynamicCache, QuantizedCache

    if spec == NONE:
        return DynamicCache(config=model.config)
    return QuantizedCache(config=model.config, **options(spec, settings))


@torch.no_grad()
def chunked_row_nll(model, rows: list[dict], spec: str, settings: dict, chunk: int) -> list[dict]:
    """Each row's summed next-token loss over its label tokens, the row fed `chunk` tokens at a time through a fresh
    cache of kind `spec`, so that every chunk after the first reads the earlier tokens' keys and values as the cache
    keeps them. The rows: read_split's (input_ids, labels)."""
    device = next(model.parameters()).device
    out = []
    for i, row in enumerate(rows):
        ids = torch.tensor([row["input_ids"]], device=device)
        labels = torch.tensor([row["labels"]], device=device)
        cache, logits = new_cache(model, spec, settings), []
        for start in range(0, ids.shape[1], chunk):
            step = model(input_ids=ids[:, start:start + chunk], past_key_values=cache, use_cache=True)
            cache = step.past_key_values
            logits.append(step.logits)
        nll, tokens = summed_nll(torch.cat(logits, dim=1), labels)
        out.append({"row": i, "tokens": tokens, "nll_sum": nll})
    return out


def _held(fn, device: torch.device) -> tuple[object, float | None, str]:
    """fn()'s result, the MiB of tensors it left allocated (what the result holds) and the kind of memory."""
    from ..measure.device import synchronize
    from ..measure.memory import CpuTensorPeak, MiB

    if device.type == "cuda":
        synchronize(device)
        before = torch.cuda.memory_allocated(device)
        kept = fn()
        synchronize(device)
        return kept, (torch.cuda.memory_allocated(device) - before) / MiB, "cuda_allocated_held"
    counter = CpuTensorPeak().start()
    kept = fn()
    return kept, counter.stop().get("end_delta_mib"), "cpu_tensor_held"


@torch.no_grad()
def memory_by_context(model, tokens: list[int], spec: str, settings: dict, lengths: list[int]) -> list[dict]:
    """The memory a cache of kind `spec` holds after a prefill of each context length (the real tokens, cycled),
    measured as the tensors still allocated once the forward pass returned (the cache: its logits dropped)."""
    import gc

    device = next(model.parameters()).device
    out = []
    for n in lengths:
        ids = torch.tensor([[tokens[i % len(tokens)] for i in range(n)]], device=device)
        gc.collect()

        def prefill():
            cache = new_cache(model, spec, settings)
            model(input_ids=ids, past_key_values=cache, use_cache=True)
            return cache
        cache, mib, kind = _held(prefill, device)
        out.append({"context": n, "held_mib": mib, "kind": kind})
        del cache
    return out


def build_extensions() -> str:
    """Compile the installed backends' CPU kernels now (optimum-quanto builds its C++ unpacking kernel on first use,
    about 45 s on 2 cores, then reuses it): what was built, or why nothing was."""
    if not _installed("optimum.quanto"):
        return "optimum-quanto is not installed: no quantized-cache kernels to build"
    from optimum.quanto.library.extensions import get_extension

    get_extension("quanto_cpp").lib  # noqa: B018 (the property compiles and loads the extension)
    return "optimum-quanto's CPU kernels are built"


if __name__ == "__main__":
    print(build_extensions())
