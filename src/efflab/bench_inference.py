"""Stage bench_inference: greedy generation of a fixed length over a fixed prompt set, per variant.

Variants: the base model, a quantized scheme, a merged run, or an adapter on its base. A streamer
timestamps every token as generate() emits it, so one call gives the prefill (time to first token)
and the decode (time per output token) apart; the generation length is forced so runs compare.
"""
from __future__ import annotations

import logging
import time

import torch

from . import cli
from .config import finetune_run
from .measure import environment, pick_device, set_threads, summarize, track_memory
from .modeling import base_dtype, load_model, load_tokenizer

log = logging.getLogger("efflab")


class TokenClock:
    """A generate() streamer that records when each put() arrives: first the prompt, then each token."""

    def __init__(self):
        self.times: list[float] = []

    def put(self, value):
        self.times.append(time.perf_counter())

    def end(self):
        pass


def load_variant(cfg: dict, variant: dict, layout, dtype: str, device: torch.device):
    from peft import PeftModel

    kind, of = variant["kind"], variant.get("of")
    if kind == "base":
        return load_model(layout.base_model(), dtype, device)
    if kind == "quantized":
        return load_model(layout.model("quantize", of), dtype, device)
    if kind == "merged":
        return load_model(layout.model("merge", of), dtype, device)
    run_cfg = finetune_run(cfg, of)
    quant = run_cfg["quant"] if run_cfg["method"] == "qlora" else None
    base = load_model(layout.base_model(), dtype, device, quant=quant)
    return PeftModel.from_pretrained(base, layout.model("finetune", of)).eval()


def generate_timed(model, tokenizer, prompt_ids: torch.Tensor, new_tokens: int) -> dict:
    clock = TokenClock()
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(input_ids=prompt_ids, attention_mask=torch.ones_like(prompt_ids),
                             max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                             num_beams=1, streamer=clock, pad_token_id=tokenizer.pad_token_id)
    if prompt_ids.device.type == "cuda":
        torch.cuda.synchronize()
    token_times = clock.times[1:]  # the first put() is the prompt itself
    return {"ttft_s": token_times[0] - start, "token_gaps_s": [b - a for a, b in zip(token_times, token_times[1:])],
            "decode_s": token_times[-1] - token_times[0], "new_tokens": out.shape[1] - prompt_ids.shape[1],
            "text": tokenizer.decode(out[0, prompt_ids.shape[1]:], skip_special_tokens=True)}


def run(cfg: dict, paths: dict) -> dict:
    """Benchmark greedy generation of one variant."""
    b, name, layout = cfg["bench_inference"], paths["name"], paths["layout"]
    variant = b["variants"][name]
    set_threads(cfg["runtime"])
    device = pick_device(cfg["runtime"])
    dtype = base_dtype(layout)
    tokenizer = load_tokenizer(layout.base_model())
    model = load_variant(cfg, variant, layout, dtype, device)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                             return_tensors="pt", return_dict=True)["input_ids"].to(device)
               for p in b["prompts"]]
    n = b["max_new_tokens"]
    with track_memory(device) as mem:
        for _ in range(max(b["warmup"], 1)):
            warm = [generate_timed(model, tokenizer, p, n) for p in prompts]
    runs = [generate_timed(model, tokenizer, p, n) for _ in range(b["repeats"]) for p in prompts]
    if any(r["new_tokens"] != n for r in runs):
        raise RuntimeError(f"generation length differs from max_new_tokens={n}")
    ttft = summarize([r["ttft_s"] for r in runs])
    decode_tps = summarize([(n - 1) / r["decode_s"] for r in runs], unit="tokens/s")
    per_token = summarize([g for r in runs for g in r["token_gaps_s"]])
    per_token.pop("samples")
    log.info("%s: TTFT median %.3f s, decode %.1f tokens/s (p50 per token %.1f ms), peak %s MiB (%s)", name,
             ttft["median"], decode_tps["median"], 1000 * per_token["median"], mem.get("peak_mib"), mem["kind"])
    return {
        "variant": name, "kind": variant["kind"], "of": variant.get("of"), "dtype": dtype,
        "prompts": len(prompts), "prompt_tokens": [int(p.shape[1]) for p in prompts], "new_tokens": n,
        "repeats": b["repeats"], "warmup": b["warmup"],
        "ttft": ttft, "decode_tokens_per_s": decode_tps, "per_token_latency": per_token, "memory": mem,
        "memory_footprint_bytes": model.get_memory_footprint(),
        "samples": [{"prompt": p, "answer": w["text"]} for p, w in zip(b["prompts"], warm)],
        "environment": environment(device, b),
    }


if __name__ == "__main__":
    cli.main("bench_inference", run)
