"""Inference engines beside transformers' generate(): whether one runs here, and its offline generation.

An engine serves plain model folders (the base model, a merged run) on a CUDA GPU: vLLM today. Where it is not
installed, or the device or the variant is not one it serves, `unavailable` says why and nothing is timed.
Offline, an engine gives no per-token timestamps: what it is timed on is whole generations (prefill included),
the same prompt tokens and forced length as generate()'s. Serving a burst (`Vllm.serve`), the engine is stepped
by hand, and each request's first token and end are stamped as the step that produced them returns.
"""
from __future__ import annotations

import importlib.util
import itertools
import time

import torch

from ..measure import timing

# vllm is optional (not one of efflab's requirements: pip install vllm, on a CUDA machine): it is imported only where
# an engine is built (Vllm), so that this module imports, and unavailable() says why not, where it is not installed.

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
    """vLLM's offline LLM on one model folder, greedy, every generation forced to its number of new tokens: whole
    batches (generate) or a burst of requests served at a concurrency (serve)."""

    def __init__(self, folder, dtype: str, seed: int, memory_fraction: float = 0.3, prefix_caching: bool | None = None):
        import vllm

        self.version = vllm.__version__
        # a share of the card: the transformers model it is interleaved with lives on the same GPU; the automatic
        # prefix cache on or off where asked (None: vLLM's default)
        caching = {} if prefix_caching is None else {"enable_prefix_caching": prefix_caching}
        self.llm = vllm.LLM(model=str(folder), dtype=dtype, seed=seed, gpu_memory_utilization=memory_fraction,
                            trust_remote_code=False, **caching)
        self._vllm = vllm
        self._request_ids = itertools.count()  # serve()'s request ids: unique in the engine, burst after burst

    def _params(self, new_tokens: int):
        """Greedy, exactly `new_tokens` new tokens (the end-of-sequence token does not stop it)."""
        return self._vllm.SamplingParams(temperature=0.0, max_tokens=new_tokens, min_tokens=new_tokens,
                                         ignore_eos=True)

    def generate(self, prompt_ids: list[list[int]], new_tokens: int) -> dict:
        """One batch of prompts (token ids, as generate() reads them) to exactly `new_tokens` new tokens each."""
        outs = self.llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], self._params(new_tokens),
                                 use_tqdm=False)
        return {"new_tokens": [len(o.outputs[0].token_ids) for o in outs], "texts": [o.outputs[0].text for o in outs]}

    def serve(self, prompt_ids: list[list[int]], new_tokens: list[int], concurrency: int,
              arrivals: list[float] | None = None) -> list[dict]:
        """A burst: every prompt (token ids) arrives at once (open loop: request i at `arrivals[i]` seconds after
        the start, admitted only once it has arrived), each to exactly its `new_tokens` tokens, at most
        `concurrency` of them in the engine at a time: a finished request leaves and the next waiting one enters
        before the next step, as a server with `concurrency` slots admits them (vLLM's scheduler batches the
        requests in the engine continuously). The engine is stepped by hand (LLM.generate's own loop); each
        step's outputs are stamped on measure.timing's clock as the step returns them. Per request, in order:
        {first_token_s, finished_s, output_tokens}, the times in seconds since the burst arrived."""
        engine = self.llm.llm_engine
        ids = {f"efflab-{next(self._request_ids)}": i for i in range(len(prompt_ids))}
        waiting, running = list(ids)[::-1], set()
        first, finished, tokens = {}, {}, {}
        due = arrivals or [0.0] * len(prompt_ids)
        t0 = timing.clock()
        while waiting or running:
            if not running and due[ids[waiting[-1]]] > timing.clock() - t0:
                time.sleep(due[ids[waiting[-1]]] - (timing.clock() - t0))  # idle until the next request arrives
            while waiting and len(running) < concurrency and due[ids[waiting[-1]]] <= timing.clock() - t0:
                rid = waiting.pop()
                engine.add_request(rid, {"prompt_token_ids": prompt_ids[ids[rid]]}, self._params(new_tokens[ids[rid]]))
                running.add(rid)
            outs = engine.step()
            now = timing.clock() - t0
            if not outs and not engine.has_unfinished_requests():
                raise RuntimeError(f"vLLM holds no request but {len(running)} never finished")
            for out in outs:
                rid = out.request_id
                count = len(out.outputs[0].token_ids)
                if count and rid not in first:
                    first[rid] = now
                if out.finished:
                    finished[rid], tokens[rid] = now, count
                    running.discard(rid)
        return [{"first_token_s": first.get(rid), "finished_s": finished[rid], "output_tokens": tokens[rid]}
                for rid in ids]


def load(engine: str, folder, dtype: str, seed: int, prefix_caching: bool | None = None, memory_fraction: float = 0.3):
    """The engine on `folder`, its prefix cache on or off where asked (None: the engine's default)."""
    return {"vllm": Vllm}[engine](folder, dtype, seed, memory_fraction, prefix_caching)
