"""Inference engines beside transformers' generate(): whether one runs here, and its offline generation.

An engine serves plain model folders (the base model, a merged run) on a CUDA GPU: vLLM today. Where it is not
installed, or the device or the variant is not one it serves, `unavailable` says why and nothing is timed.
Offline, an engine gives no per-token timestamps: what it is timed on is whole generations (prefill included),
the same prompt tokens and forced length as generate()'s.
"""
from __future__ import annotations

import importlib.util

import torch

ENGINES = ("vllm",)
SERVED = ("base", "merged")  # variant kinds whose folder is a plain model an engine loads as it is


def unavailable(engine: str, device: torch.device, kind: str) -> str | None:
    """Why `engine` cannot generate for a `kind` variant on `device` (None: it can, or `engine` is not one)."""
    if engine not in ENGINES:
        return None
    if importlib.util.find_spec(engine) is None:
        return f"{engine} is not installed (pip install {engine}: it runs on CUDA GPUs)"
    if device.type != "cuda":
        return f"{engine} is run here on a CUDA GPU only (this job's device is {device.type})"
    if kind not in SERVED:
        return f"the engine row serves plain model folders (base, merged); a {kind} variant is not passed to {engine}"
    return None


class Vllm:
    """vLLM's offline LLM on one model folder, greedy, every generation forced to `new_tokens` tokens."""

    def __init__(self, folder, dtype: str, seed: int, memory_fraction: float = 0.3):
        import vllm

        self.version = vllm.__version__
        # a share of the card: the transformers model it is interleaved with lives on the same GPU
        self.llm = vllm.LLM(model=str(folder), dtype=dtype, seed=seed, gpu_memory_utilization=memory_fraction,
                            trust_remote_code=False)
        self._vllm = vllm

    def generate(self, prompt_ids: list[list[int]], new_tokens: int) -> dict:
        """One batch of prompts (token ids, as generate() reads them) to exactly `new_tokens` new tokens each."""
        params = self._vllm.SamplingParams(temperature=0.0, max_tokens=new_tokens, min_tokens=new_tokens,
                                           ignore_eos=True)
        outs = self.llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], params, use_tqdm=False)
        return {"new_tokens": [len(o.outputs[0].token_ids) for o in outs], "texts": [o.outputs[0].text for o in outs]}


def load(engine: str, folder, dtype: str, seed: int):
    return {"vllm": Vllm}[engine](folder, dtype, seed)
