"""Peak memory of a greedy generation (an inference cell's, a capacity search's), predicted before it starts (what
a prediction is and how it is compared with the measurement: estimators.memory), with the two transients it
measures on this machine rather than assumes: a frozen LM head's weight copy and a quantized layer's dequantized
weight. Sizes are bytes; results are MiB.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from .. import architecture
from ..measure.device import DTYPES
from ..measure.memory import live_tensor_bytes
from ..models import quantization
from . import analytic
from .memory import ELEMENT_BYTES, MiB

# bitsandbytes is optional and slow to import: it is imported where a quantized layer is measured.

GENERATION_COMPARES_TO = "peak of live tensor bytes over those of the loaded, warmed-up model"


@dataclass(frozen=True)
class Generation:
    """The shape of a greedy generation: prompts a batch, each `prompt_len` tokens, `new_tokens` generated, with or
    without the KV cache."""
    batch: int
    prompt_len: int
    new_tokens: int
    kv_cache: bool = True


def generation_peak(folder, dtype: str, quant: dict | None, shape: Generation, frozen: bool = False,
                    device: str = "cpu", quantized_transient_bytes: int = 0) -> dict:
    """Predicted peak of what greedy generation adds over the loaded model: the KV cache at its final length
    (plus the one layer's old K and V that DynamicCache's torch.cat copies while growing), the largest
    transient of a forward pass (the gated MLP of the prefill: gate, SiLU(gate) and up), the last position's
    logits and the vocabulary-sized temporaries of the logits processors that hold the length fixed.
    `frozen`: the weights do not require grad (a peft adapter on its base). Where `frozen_head_copies_weight`
    measures it on this CPU (torch 2.13 in bf16 on AVX512-BF16 CPUs; not on AVX2-only ones), the LM head of
    the prefill's last position (a strided slice of the prompt's hidden states) runs as a batched matmul over a
    contiguous copy of the transposed head weight: vocabulary x hidden x element bytes, once per generation.
    `quantized_transient_bytes`: what one forward of the largest bitsandbytes layer allocates beyond its output
    on this machine, measured by `quantized_layer_transient` (a dequantized weight on AVX2 CPUs: ~3.4 MiB for
    SmolLM2's MLP in INT8; little on the AVX512-BF16 path, which packs 4-bit weights once). `weights_mib` is the
    resident model, for reference: it is in the baseline, not in the compared delta."""
    a = architecture.shape(analytic.hf_config(str(folder)))
    el = ELEMENT_BYTES[dtype]
    batch, prompt_len, new_tokens, kv_cache = shape.batch, shape.prompt_len, shape.new_tokens, shape.kv_cache
    final = prompt_len + new_tokens - 1  # the last generated token is never fed back
    kv_width = 2 * a["kv_heads"] * a["head_dim"]
    terms = {}
    if kv_cache:
        terms["kv_cache"] = a["layers"] * kv_width * final * batch * el
        terms["kv_cache_growth_copy"] = kv_width * (final - 1) * batch * el
        forward_tokens = batch * prompt_len
    else:  # every step runs the whole sequence again
        forward_tokens = batch * final
    terms["forward_transients"] = 3 * a["intermediate"] * forward_tokens * el
    # the last position's logits in the model dtype and generate()'s fp32 copy of them
    terms["logits"] = (el + 4) * a["vocab"] * batch
    # efflab forces every generation to max_new_tokens with min_new_tokens, from which generate() also sets
    # min_length: two EOS-suppressing logits processors, each building an int64 arange over the vocabulary, a
    # boolean EOS mask and an fp32 copy of the scores; at the second one's peak the first one's copy is alive
    terms["logits_processors"] = (8 + 1 + 2 * 4 * batch) * a["vocab"]
    if frozen and device == "cpu" and prompt_len > 1 and frozen_head_copies_weight(a["vocab"], a["hidden"], dtype):
        terms["frozen_head_weight_copy"] = a["vocab"] * a["hidden"] * el
    if quantized_transient_bytes:
        terms["quantized_layer_transient"] = quantized_transient_bytes
    if (quant or {}).get("method", "none") == "none":
        weights = el * analytic.parameter_count(str(folder))
    else:
        footprint = analytic.quant_footprint(str(folder), quant, dtype)
        weights = footprint and footprint["total"]
    return {"total_mib": sum(terms.values()) / MiB, "compares_to": GENERATION_COMPARES_TO,
            "terms_mib": {k: v / MiB for k, v in terms.items()}, "weights_mib": weights and weights / MiB}


@functools.lru_cache(maxsize=None)
def frozen_head_copies_weight(vocab: int, hidden: int, dtype: str) -> bool:
    """Whether this CPU and torch copy a frozen (requires_grad False) `vocab x hidden` weight when F.linear
    reads one strided position, as generation's prefill does for the LM head: measured once per process with
    the live-tensor counter, not assumed from the CPU's name. torch 2.13 copies the transposed bf16 weight
    for a batched matmul on CPUs with native bf16 (AVX512-BF16/AMX); AVX2-only CPUs and fp32 do not copy.
    Unmeasurable (a profiler already running): False, so the term is left out rather than guessed."""
    last = torch.zeros(1, 2, hidden, dtype=DTYPES[dtype])[:, -1:, :]
    weight = torch.zeros(vocab, hidden, dtype=DTYPES[dtype])
    with torch.no_grad():
        seen = live_tensor_bytes(lambda: torch.nn.functional.linear(last, weight))
    return seen is not None and seen >= weight.numel() * weight.element_size()


def quantized_layer_transient(model, dtype: str) -> int:
    """Bytes one forward of one token through the model's largest quantized layer (bitsandbytes', or a linear layer
    with torchao's quantized weight) allocates beyond its output, measured now with the live-tensor counter (CPU):
    the dequantized or cast weight that some CPU kernels build for each matmul and free after it. 0 for a model
    without quantized layers, or when unmeasurable."""
    layers = [m for m in model.modules() if quantization.quantized_kind(m)]
    if not layers:
        return 0
    layer = max(layers, key=lambda m: m.in_features * m.out_features)
    x = torch.zeros(1, 1, layer.in_features, dtype=DTYPES[dtype])
    outputs = []
    with torch.no_grad():
        seen = live_tensor_bytes(lambda: outputs.append(layer(x)))
    return 0 if seen is None else max(0, round(seen) - outputs[0].numel() * outputs[0].element_size())
