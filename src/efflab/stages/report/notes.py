"""Notes beside the answers, each computed from the records: runs that make the same updates, what a result
that may surprise comes from, and the seed-claims check in brief."""
from __future__ import annotations

from ... import records
from .render import render


def same_updates(finetune: list[dict]) -> list[list[str]]:
    """Groups of runs whose loss curves are identical: the same math under different memory or speed knobs
    (checkpointing, packing vs padding), which is why their curves lie on top of each other."""
    groups: dict[tuple, list[str]] = {}
    for r in records.ok(finetune):
        key = (r["method"], round(r["first_loss"], 4), round(r["last_loss"], 4),
               round(r["validation_after"]["loss"], 4))
        groups.setdefault(key, []).append(r["run"])
    return [g for g in groups.values() if len(g) > 1]


def claims_facts(claims: list[dict]) -> dict | None:
    """The seed-claims check in brief: it concerns documents, not the user's data."""
    job = next(iter(records.ok(claims)), None)
    if job is None:
        return None
    counts = {e: {v: n for v, n in by.items() if n} for e, by in (job.get("counts") or {}).items()}
    return {"claims": job["claims"], "by_verdict": {v: n for v, n in job["by_verdict"].items() if n},
            "counts": {e: by for e, by in counts.items() if by}}


def qlora_above_lora(finetune: list[dict]) -> dict | None:
    """Why QLoRA's resident peak can top LoRA's on a CPU, from the two runs' own measurements."""
    ok = {r["method"]: r for r in records.ok(finetune) if r["method"] in ("lora", "qlora")
          and not r["settings"]["gradient_checkpointing"] and r["settings"]["packing"]}
    lora, qlora = ok.get("lora"), ok.get("qlora")
    if not lora or not qlora or lora["train_memory"]["kind"] != "cpu_peak_rss":
        return None
    peak = {k: r["train_memory"].get("peak_mib") for k, r in ok.items()}
    if None in peak.values() or peak["qlora"] <= peak["lora"]:
        return None
    live = {k: (r.get("memory_prediction") or {}).get("measured_mib") for k, r in ok.items()}
    return {"peak": peak, "added": {k: r["train_memory"]["delta_mib"] for k, r in ok.items()},
            "before": {k: r["train_memory"]["peak_mib"] - r["train_memory"]["delta_mib"] for k, r in ok.items()},
            "live": live if None not in live.values() else None}


def attention_law(bench_attention: list[dict], config: dict) -> dict | None:
    """Why eager attention's memory can grow about linearly over the measured lengths: where the L² scores
    overtake the activations that grow with L, from the model's config (where it names these sizes)."""
    fits = {impl: [f for r in records.ok(bench_attention) if r.get("implementation", r.get("name")) == impl
                   for f in r.get("memory_exponents", []) if f.get("exponent") is not None]
            for impl in ("eager", "sdpa")}
    heads, hidden, inter = (config.get(k) for k in ("num_attention_heads", "hidden_size", "intermediate_size"))
    if not fits["eager"] or not (heads and hidden and inter) or all(f["exponent"] > 1.5 for f in fits["eager"]):
        return None
    lengths = sorted({row["seq_len"] for r in records.ok(bench_attention) for row in r.get("rows", [])})
    return {"fits": fits["eager"], "sdpa": fits["sdpa"], "heads": heads, "hidden": hidden, "inter": inter,
            "lengths": lengths, "crossover": (4 * hidden + 3 * inter) / (2 * heads)}


def lines(metrics: dict) -> list[str]:
    return [render("notes.md.j2", qlora=qlora_above_lora(metrics["finetune"]),
                   attention=attention_law(metrics["bench_attention"], metrics["base_model"][0].get("config", {})))]


def claims_lines(claims: list[dict], link: str) -> list[str]:
    facts = claims_facts(claims)
    return [render("claims.md.j2", link=link, **facts)] if facts else []
