"""Notes beside the answers, each computed from the records: runs that make the same updates, what a result
that may surprise comes from, the precision range test, what fits, and the seed-claims check in brief."""
from __future__ import annotations

from .. import records


def same_updates(finetune: list[dict]) -> list[list[str]]:
    """Groups of runs whose loss curves are identical: the same math under different memory or speed knobs
    (checkpointing, packing vs padding), which is why their curves lie on top of each other."""
    groups: dict[tuple, list[str]] = {}
    for r in records.ok(finetune):
        key = (r["method"], round(r["first_loss"], 4), round(r["last_loss"], 4),
               round(r["validation_after"]["loss"], 4))
        groups.setdefault(key, []).append(r["run"])
    return [g for g in groups.values() if len(g) > 1]


def qat_lines(qat: list[dict]) -> list[str]:
    job = next(iter(records.ok(qat)), None)
    if job is None:
        return []
    tests = job["precision_range_test"]
    said = {m: f"{tests[m]['b_min']} bits" if tests[m]["b_min"] else "none" for m in ("ptq", "qat")}
    return [f"**Fewest weight bits that keep perplexity within {job['threshold']:g}x** of the full-precision "
            f"fine-tune: {said['qat']} with quantization-aware training, {said['ptq']} quantized after training "
            f"(of {', '.join(map(str, job['bits']))}).", ""]


def capacity_lines(capacity: list[dict]) -> list[str]:
    job = next(iter(records.ok(capacity)), None)
    if job is None:
        return []
    said = []
    for s in job["searches"]:
        if s["kind"] != "train" or not records.is_ok(s):
            continue
        what = {"batch_size": f"batch of {job['fixed']['train_seq_len']}-token rows",
                "seq_len": "sequence at batch 1"}[s["dimension"]]
        top = s["measured_max"]
        said.append(f"{s['subject']} {'nothing' if top is None else top}{' (whole range)' if s['whole_range_fits'] else ''}"
                    f" ({what})")
    if not said:
        return []
    return [f"**What fits in {job['budget']['mib']:,.0f} MiB** ({job['budget']['source']}), training: "
            + "; ".join(said) + ".", ""]


def claims_lines(claims: list[dict], link: str) -> list[str]:
    """The seed-claims check in a few lines, linked: it concerns documents, not the user's data."""
    job = next(iter(records.ok(claims)), None)
    if job is None:
        return []
    counts = ", ".join(f"{n} {v}" for v, n in job["by_verdict"].items() if n)
    return ["## Published numbers checked", "",
            f"efflab also checks {job['claims']} numeric claims of the texts it grew from ({counts}) against its "
            f"estimator and this run: [the claims page]({link}) lists each with its source.", ""]


def qlora_above_lora(finetune: list[dict]) -> list[str]:
    """Why QLoRA's resident peak can top LoRA's on a CPU, from the two runs' own measurements."""
    ok = {r["method"]: r for r in records.ok(finetune) if r["method"] in ("lora", "qlora")
          and not r["settings"]["gradient_checkpointing"] and r["settings"]["packing"]}
    lora, qlora = ok.get("lora"), ok.get("qlora")
    if not lora or not qlora or lora["train_memory"]["kind"] != "cpu_peak_rss":
        return []
    peak = {k: r["train_memory"].get("peak_mib") for k, r in ok.items()}
    if None in peak.values() or peak["qlora"] <= peak["lora"]:
        return []
    before = {k: r["train_memory"]["peak_mib"] - r["train_memory"]["delta_mib"] for k, r in ok.items()}
    added = {k: r["train_memory"]["delta_mib"] for k, r in ok.items()}
    live = {k: (r.get("memory_prediction") or {}).get("measured_mib") for k, r in ok.items()}
    held = "more" if before["qlora"] > before["lora"] else "less"
    lines = [f"- **QLoRA peaks above LoRA** ({peak['qlora']:,.0f} vs {peak['lora']:,.0f} MiB resident, the process's "
             f"high-water mark). Before training QLoRA's process held {held}: {before['qlora']:,.0f} vs "
             f"{before['lora']:,.0f} MiB"
             + (" (it reads the full-precision checkpoint and bitsandbytes packs it to 4 bits as it loads; memory "
                "freed after that is not necessarily returned to the system)" if held == "more" else "")
             + f". Training added {added['qlora']:,.0f} vs {added['lora']:,.0f} MiB"
             + (": bitsandbytes dequantizes each layer's weight to a full-precision temporary in the forward and "
                "the backward pass" if added["qlora"] > added["lora"] else "") + "."]
    if None not in live.values():
        lines[0] += (f" The live tensors of training peaked at {live['qlora']:,.0f} vs {live['lora']:,.0f} MiB; for "
                     "a small model, activations and logits dominate and the 4-bit saving on the frozen weights is "
                     "small next to them. QLoRA's saving shows where the weights dominate: a model of billions of "
                     "parameters, measured as CUDA allocated memory on a GPU.")
    return lines


def attention_law(bench_attention: list[dict], config: dict) -> list[str]:
    """Why eager attention's memory can grow about linearly over the measured lengths: compute where the L²
    scores overtake the activations that grow with L, from the model's config."""
    fits = [f for r in records.ok(bench_attention) if r.get("implementation", r.get("name")) == "eager"
            for f in r.get("memory_exponents", []) if f.get("exponent") is not None]
    heads, hidden, inter = (config.get(k) for k in ("num_attention_heads", "hidden_size", "intermediate_size"))
    if not fits or not (heads and hidden and inter) or all(f["exponent"] > 1.5 for f in fits):
        return []
    lengths = sorted({row["seq_len"] for r in records.ok(bench_attention) for row in r.get("rows", [])})
    crossover = (4 * hidden + 3 * inter) / (2 * heads)
    k = ", ".join(f"{f['exponent']:.2f} ({f['mode']})" for f in fits)
    return [f"- **Eager attention's memory fits seq_len^{k}, not ^2**, over {lengths[0]}–{lengths[-1]} tokens. "
            f"Its scores and their softmax take 2 × {heads} heads × L² floats per layer, while each layer's hidden "
            f"states, q/k/v and MLP activations take about (4 × {hidden} + 3 × {inter}) × L floats: the quadratic "
            f"term overtakes the linear ones only beyond L ≈ {crossover:,.0f} tokens, so "
            + ("over these lengths the linear terms dominate. " if lengths[-1] < crossover else
               "a fit over these lengths mixes both. ") + "Lengths up to several times that (the GPU profile goes to 8k) show the square law, and "
            "SDPA's fused kernels stay linear."]


def surprise_lines(metrics: dict) -> list[str]:
    notes = qlora_above_lora(metrics["finetune"]) + attention_law(
        metrics["bench_attention"], metrics["base_model"][0].get("config", {}))
    return ["### Results that may surprise", "", *notes, ""] if notes else []
