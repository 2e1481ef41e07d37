"""One greedy generation, timed token by token: the prompts the models are asked, their batches, generate()'s
arguments for a generation mode, and the timed generation itself."""
from __future__ import annotations

import math
import random

import torch

from ...config import UserError
from ...measure.timing import seconds_since, stamp
from ...models.modeling import require_input
from ...models.speculative import SPECULATIVE

# pandas (reading the validation prompts, the default prompts) and transformers' CompileConfig (a compiled generation)
# are imported inside the one function each that uses them, so that importing this module loads neither (under 1 s and
# 1-2 s on 2 cores): the job imports pandas when it reads the prompts, and transformers with its first model (modeling).


class TokenClock:
    """A generate() streamer that stamps each put(): first the prompt, then each new token. On a GPU the
    stamps are CUDA events recorded in the stream, read after the generation, so they time the kernels
    rather than their asynchronous launch and add no synchronisation to the loop; on a CPU, perf_counter."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._stamps: list = []
        self.counts: list[int] = []  # tokens per sequence in each put(): more than 1 where a speculative step accepted
        self.start()

    def start(self):
        self._origin = stamp(self.cuda)

    def put(self, value):
        self._stamps.append(stamp(self.cuda))
        self.counts.append(int(value.shape[-1]) if getattr(value, "ndim", 1) > 1 else 1)

    def end(self):
        pass

    def seconds(self) -> list[float]:
        """Each put()'s time since start(), in seconds."""
        return seconds_since(self._origin, self._stamps, self.cuda)


def prompts(b: dict, layout, tokenizer) -> list[dict]:
    """What the models are asked: by default `validation_rows` rows of the user's validation split, drawn with
    `seed`, as fine-tuning templated them, each with its reference answer; or the configured texts, each
    chat-templated. Each: {question, text (what the model reads), reference}."""
    import pandas as pd

    chosen = b["prompts"]
    if isinstance(chosen, list):
        return [{"question": p, "reference": None,
                 "text": tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                                       tokenize=False)} for p in chosen]
    path = require_input(layout.split("validation"))
    frame = pd.read_parquet(path)
    if "prompt" not in frame.columns:
        raise UserError(f"{path}: no prompt column (written by an older prepare_data): rerun prepare_data")
    picked = sorted(random.Random(chosen["seed"]).sample(range(len(frame)), min(chosen["validation_rows"], len(frame))))
    return [{"question": r.question, "text": r.prompt, "reference": r.answer} for r in frame.iloc[picked].itertuples()]


def prompt_batches(tokenizer, texts: list[str], batch_size: int, device: torch.device) -> list[dict]:
    """The templated prompts, left-padded into batches of `batch_size` (cycling through the prompt set so that
    every batch is full and each prompt appears at least once)."""
    count = math.ceil(len(texts) / batch_size) * batch_size
    cycled = [texts[i % len(texts)] for i in range(count)]
    tokenizer.padding_side = "left"
    return [tokenizer(cycled[i:i + batch_size], return_tensors="pt", padding=True, add_special_tokens=False).to(device)
            for i in range(0, count, batch_size)]


def mode_kwargs(mode: str, device: torch.device) -> dict:
    """generate()'s arguments for a generation mode (transformers' cache_implementation and compile_config)."""
    if mode == "dynamic" or mode in SPECULATIVE:  # a speculative mode's arguments: cell_kwargs
        return {}
    if mode == "static":  # transformers would compile a static-cache generate() on CUDA by itself: not here
        return {"cache_implementation": "static", "disable_compile": True}
    from transformers import CompileConfig

    # transformers' defaults on CUDA (fullgraph off, static shapes, inductor, reduce-overhead: CUDA graphs);
    # elsewhere it compiles only when told to, and CUDA graphs do not apply
    config = CompileConfig() if device.type == "cuda" else CompileConfig(mode="default")
    config._compile_all_devices = device.type != "cuda"
    return {"cache_implementation": "static", "compile_config": config}


def mode_unavailable(mode: str, model) -> str | None:
    """Why `model` cannot generate in `mode` here (None: it can). transformers falls back to eager generation,
    silently, for a quantizer it cannot compile: that is recorded here, not timed as if compiled."""
    quantizer = getattr(model, "hf_quantizer", None)
    if mode == "compiled" and quantizer is not None and not quantizer.is_compileable:
        return (f"transformers does not compile {type(quantizer).__name__} models (hf_quantizer.is_compileable "
                "is False): generate() would run them eagerly")
    return None


def generate_timed(model, tokenizer, batch: dict, new_tokens: int, kv_cache: bool = True,
                   mode: str = "dynamic", extra: dict | None = None) -> dict:
    """One greedy generation of exactly `new_tokens` tokens per sequence, timestamped as generate() hands them out
    (a token at a time; speculative modes, the tokens a verification step accepted at once). `extra`: generate()'s
    arguments for a quantized cache or a speculative mode (cells.cell_kwargs)."""
    prompt_len = batch["input_ids"].shape[1]
    clock = TokenClock(batch["input_ids"].device)
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                             num_beams=1, use_cache=kv_cache, streamer=clock, pad_token_id=tokenizer.pad_token_id,
                             **mode_kwargs(mode, batch["input_ids"].device), **(extra or {}))
    token_times = clock.seconds()[1:]  # the first put() is the prompt itself
    gaps = [(b - a) / k for a, b, k in zip(token_times, token_times[1:], clock.counts[2:]) for _ in range(k)]
    return {"ttft_s": token_times[0], "token_gaps_s": gaps,
            "decode_s": token_times[-1] - token_times[0], "new_tokens": out.shape[1] - prompt_len,
            "decoded_tokens": out.shape[1] - prompt_len - clock.counts[1],  # after the first put's
            "batch_size": int(out.shape[0]), "prompt_tokens": int(batch["attention_mask"].sum()),
            "texts": tokenizer.batch_decode(out[:, prompt_len:], skip_special_tokens=True),
            "token_ids": out[:, prompt_len:].tolist()}

