"""Notes beside the answers, each computed from the records: runs that make the same updates, what the records
show of a result that may surprise, and the seed-claims check in brief."""
from __future__ import annotations

from ... import records
from ...estimators import analytic
from .templating import render


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
    """Where QLoRA's resident peak tops LoRA's, what the two runs' records show of it: the peaks, what each process
    held before training, what training added, and the live tensors training added. A cause is said only where a
    record shows one: equal live-tensor peaks put the difference training made outside the live tensors."""
    ok = {r["method"]: r for r in records.ok(finetune) if r["method"] in ("lora", "qlora")
          and not r["settings"]["gradient_checkpointing"] and r["settings"]["packing"]}
    lora, qlora = ok.get("lora"), ok.get("qlora")
    if not lora or not qlora or lora["train_memory"]["kind"] != "cpu_peak_rss":
        return None
    peak = {k: r["train_memory"].get("peak_mib") for k, r in ok.items()}
    if None in peak.values() or peak["qlora"] <= peak["lora"]:
        return None
    live = {k: (r.get("memory_prediction") or {}).get("measured_mib") for k, r in ok.items()}
    added = {k: r["train_memory"]["delta_mib"] for k, r in ok.items()}
    return {"peak": peak, "added": added, "before": {k: peak[k] - added[k] for k in ok},
            "live": live if None not in live.values() else None,
            "outside_live": outside_live(added, live) if None not in live.values() else None}


def outside_live(added: dict, live: dict) -> int | None:
    """The MiB more that QLoRA's training added than LoRA's where the live tensors training added peaked alike (to
    the MiB the note shows): memory outside the live tensors. None where the live peaks differ or nothing more."""
    more = round(added["qlora"]) - round(added["lora"])
    return more if round(live["qlora"]) == round(live["lora"]) and more > 0 else None


# The claim of the claims stage that the attention note measures, and where the report links the claims page
ATTENTION_CLAIM, CLAIMS_LINK = "eager-attention-quadratic-memory", "../claims/claims.md"


def claim_verdict(claims: list[dict], claim: str) -> str | None:
    """A claim's verdict as the claims stage's record names it (the record lists the claims that differ and the
    inconclusive ones); None where it names none."""
    job = next(iter(records.ok(claims)), {})
    return next((v for v in ("differs", "inconclusive") if claim in job.get(v, [])), None)


def attention_law(bench_attention: list[dict], config: dict, claims: list[dict] = ()) -> dict | None:
    """Eager attention's fitted memory exponent where it is well below 2, beside where the L² scores overtake the
    activations that grow with L, from the model's config (where it names these sizes), and the claims stage's
    verdict on the quadratic-memory claim: the note measures, the claims page decides."""
    fits = {impl: [f for r in records.ok(bench_attention) if r.get("implementation", r.get("name")) == impl
                   for f in r.get("memory_exponents", []) if f.get("exponent") is not None]
            for impl in ("eager", "sdpa")}
    heads, hidden, inter = (config.get(k) for k in ("num_attention_heads", "hidden_size", "intermediate_size"))
    crossover = analytic.attention_crossover(config)  # the law the claims' cause computes with too
    if not fits["eager"] or crossover is None or all(f["exponent"] > 1.5 for f in fits["eager"]):
        return None
    lengths = sorted({row["seq_len"] for r in records.ok(bench_attention) for row in r.get("rows", [])})
    share = lengths[-1] / crossover  # the L² term over the linear ones at the longest length
    return {"fits": fits["eager"], "sdpa": fits["sdpa"], "heads": heads, "hidden": hidden, "inter": inter,
            "lengths": lengths, "crossover": crossover, "share": share, "local_k": 1 + share / (1 + share),
            "claim": ATTENTION_CLAIM, "verdict": claim_verdict(claims, ATTENTION_CLAIM), "link": CLAIMS_LINK}


def lines(metrics: dict, facts: list[str] = ()) -> list[str]:
    """Results that may surprise: decisions.json's facts (their sentences), then the notes computed here."""
    return [render("notes.md.j2", facts=list(facts), qlora=qlora_above_lora(metrics["finetune"]),
                   attention=attention_law(metrics["bench_attention"], metrics["base_model"][0].get("config", {}),
                                           metrics.get("claims", [])))]


def claims_cited(claims: list[dict], made: dict) -> list[dict]:
    """Each claim whose reading is a figure a question of decisions.json decides (ledger.CLAIMED), beside that
    figure as the answer states it: one measurement, two readings of it (the ledger holds them equal)."""
    from ...questions import of
    from .ledger import claimed, readings
    from .templating import value_text

    out = []
    for r in readings(claims):
        key, name, axis = claimed(r) or (None, None, None)
        options = (made["questions"].get(key) or {}).get("options", []) if key else []
        option = next((o for o in options if o["name"] == name), None)
        a = ((option or {}).get("axes") or {}).get(axis)
        if a:
            out.append({"id": r["id"], "verdict": r["verdict"], "title": of(key).title, "subject": option["name"],
                        "axis": axis, "value": value_text(a, "×"), "said": a["verdict"]})
    return out


def claims_lines(claims: list[dict], link: str, made: dict | None = None) -> list[str]:
    facts = claims_facts(claims)
    cited = claims_cited(claims, made) if made else []
    return [render("claims.md.j2", link=link, cited=cited, **facts)] if facts else []
