"""How much does efflab's inference harness cost? Decode tokens/s through efflab.stages.bench_inference's timed
generation (token streamer, per-token timestamps) vs bare generation loops on the same model, same prompts,
same length, interleaved in one process so drift hits both alike.

  python benchmarks/harness_overhead.py [--model results/base_model/model] [--new-tokens 32] [--repeats 5]

Bare references:
  * generate: `model.generate` with no streamer; decode time = T(n tokens) - T(1 token), so the prefill
    cancels out and the harness's own bookkeeping is the only difference;
  * manual loop: prefill, then a hand-written greedy loop over the KV cache (no generate() at all), the
    floor any harness built on generate() sits above.
Prints one JSON object and writes it to --out; overhead_pct > 0 means the harness reports fewer tokens/s than
the bare loop.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from efflab.measure.device import set_threads
from efflab.measure.env import environment
from efflab.measure.stats import summarize
from efflab.models.modeling import load_model, load_tokenizer
from efflab.stages.bench_inference.generation import generate_timed, prompt_batches, prompts

PROMPTS = ["What is a building permit and when do I need one?",
           "Can I build a small shed without asking the municipality?",
           "What is the capital of France?"]


@torch.no_grad()
def bare_generate_s(model, batch: dict, new_tokens: int, pad: int) -> float:
    t0 = time.perf_counter()
    model.generate(**batch, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, num_beams=1,
                   pad_token_id=pad)
    return time.perf_counter() - t0


@torch.no_grad()
def manual_loop_decode_s(model, batch: dict, new_tokens: int) -> float:
    out = model(**batch, use_cache=True)
    past, token = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
    mask = batch["attention_mask"]
    t0 = time.perf_counter()
    for _ in range(new_tokens - 1):
        mask = torch.cat([mask, torch.ones_like(token)], dim=1)
        out = model(input_ids=token, attention_mask=mask, past_key_values=past, use_cache=True)
        past, token = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="results/base_model/model")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="results/benchmarks/harness_overhead.json", help="where the JSON goes too")
    args = parser.parse_args()
    set_threads({"threads": None})
    device = torch.device("cpu")
    tokenizer = load_tokenizer(args.model)
    model = load_model(args.model, "float32", device)
    batches = prompt_batches(tokenizer, [p["text"] for p in prompts({"prompts": PROMPTS}, None, tokenizer)], 1, device)
    n, pad = args.new_tokens, tokenizer.pad_token_id
    harness, bare, manual = [], [], []
    for batch in batches:  # warmup every path once
        generate_timed(model, tokenizer, batch, n)
        bare_generate_s(model, batch, n, pad)
        manual_loop_decode_s(model, batch, n)
    for _ in range(args.repeats):
        for batch in batches:
            harness.append((n - 1) / generate_timed(model, tokenizer, batch, n)["decode_s"])
            decode = bare_generate_s(model, batch, n, pad) - bare_generate_s(model, batch, 1, pad)
            bare.append((n - 1) / decode)
            manual.append((n - 1) / manual_loop_decode_s(model, batch, n))
    h, b, m = (summarize(x, unit="tokens/s") for x in (harness, bare, manual))
    result = {
        "new_tokens": n, "prompts": len(PROMPTS), "repeats": args.repeats,
        "harness_decode_tokens_per_s": h, "bare_generate_decode_tokens_per_s": b,
        "manual_loop_decode_tokens_per_s": m,
        "overhead_pct_vs_bare_generate": 100 * (1 - h["median"] / b["median"]),
        "overhead_pct_vs_manual_loop": 100 * (1 - h["median"] / m["median"]),
        "paired_ratio_median": statistics.median(x / y for x, y in zip(harness, bare)),
        "environment": environment(device),
    }
    for key in ("harness_decode_tokens_per_s", "bare_generate_decode_tokens_per_s", "manual_loop_decode_tokens_per_s"):
        result[key].pop("samples")
    text = json.dumps(result, indent=2)
    print(text)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
