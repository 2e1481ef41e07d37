"""Speculative decoding as transformers does it: `prompt_lookup` (candidate tokens copied from an n-gram of the prompt,
no draft model) and `assisted` (a small draft model proposes, the model checks every proposal in one forward pass).
Greedy, both give the model's own greedy tokens; what they change is how many forward passes of the model it takes.

Drafts (bench_inference.speculative.drafts): a model this run makes (`kind`/`of`, as a variant: a pruned or healed
strategy, a quantized scheme, a fine-tuned or merged run) or any local folder or hub id (`source`) with the base
model's tokenizer (model_check refuses a local one with another tokenizer at the dry run). What the model verified
is counted on the model itself: a hook on its input embeddings sees each forward pass's new tokens (the prompt and
the first candidates, then the last token and the next candidates), so
    verification steps = forward passes,   accepted = new tokens - steps (each step adds its accepted candidates
    and one token of the model's own),      proposed = tokens fed - prompt - (steps - 1).
"""
from __future__ import annotations

from pathlib import Path

import torch

from ..config import classify_source
from ..experiment import model_ref
from .build import build
from .modeling import load_model

SPECULATIVE = ("prompt_lookup", "assisted")
# the files a hub draft is fetched with: the weights as safetensors, the config and the tokenizer's
HUB_FILES = ["*.safetensors", "*.json", "tokenizer*", "*.model", "*.txt"]


def draft_folder(spec: dict, key: str) -> Path:
    """A `source` draft's folder: the local folder, or the hub id's snapshot (safetensors only)."""
    if classify_source(spec["source"], key) == "local":
        return Path(spec["source"]).expanduser()
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(spec["source"], revision=spec.get("revision"), allow_patterns=HUB_FILES))


def load_draft(cfg: dict, name: str, layout, dtype: str, device: torch.device):
    """The draft model `name` of bench_inference.speculative.drafts, loaded as a variant (a model this run makes) or
    from its source folder."""
    spec = cfg["bench_inference"]["speculative"]["drafts"][name]
    if "source" in spec:
        return load_model(draft_folder(spec, f"bench_inference.speculative.drafts.{name}.source"), dtype, device)
    return build(model_ref(cfg, spec), layout, dtype, device)


def batch_unavailable(mode: str, batch_size: int) -> str | None:
    """Why a speculative mode has no cell at this batch size (transformers' runs one sequence at a time)."""
    if mode in SPECULATIVE and batch_size > 1:
        return f"transformers' {mode} generation takes one sequence at a time (batch 1), not {batch_size}"
    return None


def generate_kwargs(mode: str, settings: dict, draft=None) -> dict:
    """generate()'s arguments for a speculative mode (bench_inference.speculative's settings)."""
    if mode == "prompt_lookup":
        return {"prompt_lookup_num_tokens": settings["prompt_lookup_num_tokens"]}
    return {"assistant_model": draft, "num_assistant_tokens": settings["num_assistant_tokens"],
            "num_assistant_tokens_schedule": "constant"}


class Verifications:
    """Counts the model's forward passes and the tokens each reads, on its input embeddings, while in `with`."""

    def __init__(self, model):
        self.embeddings, self.passes, self.tokens, self._hook = model.get_input_embeddings(), 0, 0, None

    def __enter__(self):
        def seen(module, args, output):
            self.passes += 1
            self.tokens += int(args[0].shape[-1])
        self._hook = self.embeddings.register_forward_hook(seen)
        return self

    def __exit__(self, *exc):
        self._hook.remove()

    def of_generation(self, prompt_tokens: int, new_tokens: int) -> dict:
        """One batch-1 generation's steps, proposed and accepted candidates (the counts since entering)."""
        proposed = self.tokens - prompt_tokens - (self.passes - 1)
        accepted = new_tokens - self.passes
        return {"steps": self.passes, "proposed": proposed, "accepted": accepted}


def acceptance(counts: list[dict]) -> dict:
    """Over several generations: candidates accepted per verification step, the share of proposed candidates
    accepted, and the new tokens each forward pass of the model gave (1.0: speculation saved no pass)."""
    steps, proposed, accepted = (sum(c[k] for c in counts) for k in ("steps", "proposed", "accepted"))
    return {"steps": steps, "proposed": proposed, "accepted": accepted,
            "accepted_per_step": accepted / steps if steps else None,
            "acceptance_rate": accepted / proposed if proposed else None,
            "tokens_per_step": (accepted + steps) / steps if steps else None,
            "measured": "forward passes of the model and the tokens each read, counted on its input embeddings; "
                        "accepted = new tokens - passes"}
