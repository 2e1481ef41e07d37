"""Every decision the report answers, computed once from the records and written as decisions.json.

For each question: its baseline, the options with every axis (value, kind, interval (lo, hi), n and verdict
against the baseline, in the one vocabulary of measure.stats: faster / slower / same within ±X% / not decided at
this size; quality against its tolerance), the frontier and the answer. The glance (advice), the tables' verdict
columns, the Pareto plots and figures.json render these; none decides again. A question whose stage did not run is
absent from `questions` and named in `absent` with why. `memory_error`: the run-to-run spread of each memory kind
the records read twice (options.memory_errors), stated with where it comes from; a peak of that kind carries it
as its interval (`error_pct`), and two peaks differ only where they are further apart than that.
"""
from __future__ import annotations

import json
import statistics
from pathlib import Path

from ... import questions, records
from ...measure import load
from ...measure.stats import NOT_DECIDED, compare, ratio_words
from . import generation_modes as modes
from . import options as opts
from . import question_facts, target
from .annotate import against_tolerance, with_memory_error
from .dominance import winner
from .results import absent
from .tables.qat import verdict_of

# What each axis is, for a reader of decisions.json: its kind and which way is better.
AXES = {"memory": ("MiB", "min"), "speed": ("ratio over the baseline (higher is faster)", "max"),
        "step": ("median step time, s", "min"), "step_ratio": ("step time over the baseline's", "min"),
        "quality": ("perplexity change over the baseline, %", "min"), "kl": ("mean KL to the adapter", "min"),
        "agreement": ("max abs difference from the baseline's output", "min")}


def axis_verdict(key: str, a: dict | None, base: dict | None, tolerance: float) -> str:
    """One option's verdict on one axis against the baseline's value, in the one vocabulary."""
    if not a:
        return "not measured"
    if key == "quality":
        return question_facts.quality_status(a, tolerance)
    if key == "speed":
        return compare(a["value"], a["lo"], a["hi"], n=a.get("n"), why=a.get("why"))
    if key == "step_ratio":
        return compare(a["value"], a["lo"], a["hi"], n=a.get("n"), higher="slower", lower="faster",
                       why=a.get("why"))
    if key == "memory" and base and base.get("value"):
        if a["lo"] is None or base["lo"] is None:  # one of them without an interval: the ratio has none either
            return compare(a["value"] / base["value"], None, None, n=a.get("n"), higher="more", lower="less")
        # exact footprints, or peaks ± their kind's measured error: the ratio's interval from the far ends
        return compare(a["value"] / base["value"], a["lo"] / base["hi"], a["hi"] / base["lo"], higher="more",
                       lower="less")
    return "-"


def _option(o: dict, base: dict | None, tolerance: float, extra: dict | None = None) -> dict:
    axes = {}
    for key, a in o["axes"].items():
        kind, better = AXES[key]
        axes[key] = None if a is None else {
            "value": a["value"], "lo": a["lo"], "hi": a["hi"], "n": a.get("n"), "kind": kind, "better": better,
            "verdict": "baseline" if o.get("baseline") else axis_verdict(key, a, (base or {}).get("axes", {}).get(key),
                                                                           tolerance),
            **({"error_pct": a["error_pct"]} if a.get("error_pct") is not None else {}),
            **({"source": a["source"]} if a.get("source") else {})}
    return {"name": o["name"], "baseline": bool(o.get("baseline")), "axes": axes, **(extra or {})}


def _question(facts: dict, baseline: str | None, answer, why: str, tolerance: float,
              status: dict | None = None) -> dict:
    base = next((o for o in facts["options"] if o.get("baseline")), None)
    return {"baseline": baseline, "answer": answer, "why": why,
            "frontier": facts.get("front", []),
            "options": [_option(o, base, tolerance, {"status": status[o["name"]]} if status else None)
                        for o in facts["options"]]}


def _finetune_answer(f: dict) -> dict:
    return {k: f["winners"][k] for k in question_facts.FINETUNE_AXES}


def _qat(job: dict, tolerance: float) -> dict:
    tests = job["precision_range_test"]  # decided against tolerance.perplexity_pct (annotate.against_tolerance)
    options = []
    for method in ("ptq", "qat"):
        for bits in job["bits"]:
            v = next((v for v in job["variants"] if (v["method"], v["bits"]) == (method, bits)), {})
            o = {"name": f"{method} {bits} bits", "baseline": False, "method": method, "bits": bits,
                 "axes": {"quality": opts.change_axis(v.get("perplexity_change"))}}
            options.append({**_option(o, None, tolerance), "method": method, "bits": bits,
                            "verdict": verdict_of(tests[method], bits)})
    qat = {v["bits"]: v for v in job["variants"] if v["method"] == "qat" and records.is_ok(v)}
    return {"baseline": "the full-precision fine-tune", "frontier": [],
            "answer": {m: tests[m]["b_min"] for m in ("ptq", "qat")},
            "undecided_at": {m: tests[m].get("undecided_at") for m in ("ptq", "qat")},
            "why": "the fewest bits whose perplexity interval lies within the tolerance",
            "recovered": {b: v["recovered_share"] for b, v in qat.items() if v.get("recovered_share")},
            # its own quantizer and reference: not the quantize stage's schemes, nor their base-model baseline
            "quantizer": job.get("quantizer"), "group_size": job.get("group_size"), "options": options}


def _serving(job: dict) -> dict:
    top = {}
    for c in records.ok(job["cells"]):
        if c["method"] not in top or c["concurrency"] > top[c["method"]]["concurrency"]:
            top[c["method"]] = c
    options = []
    for method, c in top.items():
        ratio = records.serving_ratio(c, "throughput_vs_naive") if method != "naive" else None
        versus = records.serving_ratio(c, "continuous_vs_static") if method == "continuous" else None
        options.append({"name": method, "baseline": method == "naive", "concurrency": c["concurrency"], "axes": {
            "speed": None if ratio is None else {
                "value": ratio["median"], "lo": (ratio.get("ci95") or [None])[0],
                "hi": (ratio.get("ci95") or [None, None])[1], "n": ratio.get("rounds"), "kind": AXES["speed"][0],
                "better": "max", "verdict": "baseline" if method == "naive" else ratio_words(ratio)}},
            **({"versus_static": ratio_words(versus)} if versus else {})})
    decided = [o for o in options if (o["axes"]["speed"] or {}).get("verdict") == "faster"]
    answer = max(decided, key=lambda o: o["axes"]["speed"]["value"])["name"] if decided else None
    return {"baseline": "naive", "answer": answer, "frontier": [],
            "why": "the fastest over naive by its paired burst ratio, where that is decided", "options": options,
            "open_loop": _open_loop(job.get("open_loop")), "slo_search": slo_search_answer(job.get("slo_search"))}


def _more_goodput(a: dict, b: dict) -> str:
    """One method's highest goodput against another's, in the one vocabulary (more / less where their intervals
    lie apart: the ratio's interval from their far ends, as memory peaks; same within ±X%; not decided)."""
    if max(a["hi"] or a["value"], b["hi"] or b["value"]) == 0:
        return "neither met the SLO"
    tiny = 1e-12
    value = a["value"] / max(b["value"], tiny)
    if a["lo"] is None or b["lo"] is None:
        return compare(value, None, None, n=min(a["n"], b["n"]), higher="more", lower="less")
    return compare(value, a["lo"] / max(b["hi"], tiny), a["hi"] / max(b["lo"], tiny), n=min(a["n"], b["n"]),
                   higher="more", lower="less")


def _open_loop(o: dict | None) -> dict | None:
    """The open loop's answer: per method its highest goodput under the SLO (median over the repeats, interval, at
    which rate; measure.load.best_goodput) and its saturation rate, each method's goodput against every other's,
    and the method with more than every other, where the intervals say so (one method: none)."""
    if not o:
        return None
    methods = {m: {"best_goodput": load.best_goodput(records.ok([c for c in o["cells"] if c["method"] == m]))} | sat
               for m, sat in o["saturation"].items()}
    versus = {a: {b: _more_goodput(methods[a]["best_goodput"], methods[b]["best_goodput"]) for b in methods if b != a}
              for a in methods}
    answer = next((a for a, vs in versus.items() if vs and all(v == "more" for v in vs.values())), None)
    return {"question": "Which method serves the most requests within the SLO (open loop)?", "slo": o["slo"],
            "answer": answer, "methods": methods, "versus": versus, "saturation_rule": o["saturation_rule"],
            "why": "the highest goodput (requests/s meeting every SLO bound) over the rates swept, more than every "
                   "other method's by intervals that lie apart"}


def _at_answer(subject: dict, key: str) -> dict:
    """The median over the schedules of a probe figure at each schedule's highest rate met (those met nowhere: left
    out), with the arrival rate's median as its bound (goodput <= arrival rate schedule by schedule, so the medians
    keep the order)."""
    top: dict[int, dict] = {}
    for p in (p for p in subject["probes"] if p["meets"]):
        if p["schedule"] not in top or p["rate"] > top[p["schedule"]]["rate"]:
            top[p["schedule"]] = p
    probes = list(top.values())
    if not probes:
        return {"value": None, "bound": None, "n": 0}
    return {"value": statistics.median(p[key] for p in probes),
            "bound": statistics.median(p["arrival_per_s"] for p in probes), "n": len(probes)}


def slo_search_answer(o: dict | None) -> dict | None:
    """The SLO search's answer: per subject its highest rate meeting the SLO (measure.rate_search.answer: the median
    over the schedules, the interval of their brackets) and its goodput there; per method and workload, the prefix
    cache on against off in the one vocabulary (more / less only where 95% intervals lie apart: from 6 schedules)."""
    if not o or not o.get("subjects"):
        return None
    subjects = {}
    for x in records.ok(o["subjects"]):
        a = x["answer"]
        axis = {"value": a["value"], "lo": a["lo"] if a["interval"] == "ci95" else None,
                "hi": a["hi"] if a["interval"] == "ci95" else None, "n": a["n"]}
        subjects[x["name"]] = {"answer": a, "axis": axis, "goodput": _at_answer(x, "goodput_per_s"),
                               "method": x["method"], "workload": x["workload"], "prefix_caching": x["prefix_caching"]}
    caching = {}
    for name, on in subjects.items():
        off = next((v for v in subjects.values() if v["prefix_caching"] is False and
                    (v["method"], v["workload"]) == (on["method"], on["workload"])), None)
        if on["prefix_caching"] and off:
            caching[f"{on['method']} {on['workload']}"] = {
                "on": name, "verdict": _more_goodput(on["axis"], off["axis"]),
                "ratio": on["answer"]["value"] / off["answer"]["value"] if off["answer"]["value"] else None}
    return {"question": "What is the highest request rate that meets the SLO?", "slo": o["slo"],
            "percentile": o["percentile"], "requests_per_probe": o["requests_per_probe"], "subjects": subjects,
            "caching": caching, "rule": o.get("rule")}


def _speculative(options: list[dict], tolerance: float) -> dict:
    """Which speculative mode pays: faster than the model's own dynamic generation with its own greedy tokens; the
    fastest of those where the intervals separate. Each option says why where it does not pay."""
    extra = ("mode", "draft", "acceptance_rate", "accepted_per_step", "tokens_per_step", "proposed", "greedy_equal",
             "prompts", "passes")
    made = [_option(o, None, tolerance, {k: o[k] for k in extra}) for o in options]
    for o in made:
        o["status"] = modes.speculative_status(o, (o["axes"]["speed"] or {}).get("verdict", "not measured"))
    paid = [o for o in made if o["status"] == "pays"]
    answer = paid[0]["name"] if len(paid) == 1 else winner(paid, "speed", "max") if paid else None
    return {"baseline": "the same model's dynamic generation", "answer": answer, "frontier": [], "options": made,
            "why": "faster than the model's own dynamic generation, with its greedy tokens; the fastest of those where "
                   "the intervals separate"}


KV_SPEED_FLOOR = 0.9  # a quantized cache is an answer only if its decode is shown no slower than this × the full cache


def _kv_quant(variant: str, options: list[dict], tolerance: float) -> dict:
    """What a quantized KV cache saves and costs on `variant`: the cache holding the least memory among those whose
    perplexity interval lies within the tolerance and whose decode speed's interval lies at or above KV_SPEED_FLOOR;
    a cache that meets the first two but not the speed is a trade (`trades`: the MiB it saves, the speed it costs)."""
    base = next((o for o in options if o["baseline"]), None)
    made = [_option(o, base, tolerance, {k: o.get(k) for k in ("cache", "context", "memory_kind", "memory_ratio")})
            for o in options]
    kept = [o for o in made if not o["baseline"] and o["axes"]["memory"] and o["axes"]["memory"]["verdict"] == "less"
            and (o["axes"]["quality"] or {}).get("verdict") == "within"]
    fast = [o for o in kept if (o["axes"]["speed"] or {}).get("lo") is not None
            and o["axes"]["speed"]["lo"] >= KV_SPEED_FLOOR]
    answer = min(fast, key=lambda o: o["axes"]["memory"]["value"])["name"] if fast else None
    full = (base or {}).get("axes", {}).get("memory") or {}
    trades = [{"name": o["name"], "cache": o["cache"], "context": o["context"],  # its speed: the option's axis
               "saves_mib": full["value"] - o["axes"]["memory"]["value"] if full.get("value") else None}
              for o in kept if o not in fast]
    return {"variant": variant, "baseline": (base or {}).get("name"),
            "answer": answer, "trades": trades, "speed_floor": KV_SPEED_FLOOR,
            "frontier": [], "options": made,
            "why": "the quantized cache holding the least memory whose perplexity interval lies within the tolerance "
                   f"and whose decode speed's interval lies at or above {KV_SPEED_FLOOR:g}× the full-precision cache's"}


def _prune(rows: list[dict], tolerance: float) -> dict:
    options = []
    for r in records.ok(rows):
        o = {"name": r["strategy"], "baseline": False, "axes": {
            "speed": opts.ratio_axis(r.get("generation_speedup")),
            "quality": opts.change_axis((r.get("pruned") or {}).get("perplexity_change"))}}
        options.append(_option(o, None, tolerance))
        if records.is_ok(h := r.get("healing") or {}) and h.get("perplexity_change"):
            # LoRA healing merged into the same shapes: its quality measured, its speed not (said as not timed)
            healed = {"name": f"{r['strategy']} healed", "baseline": False,
                      "axes": {"speed": None, "quality": opts.change_axis(h["perplexity_change"])}}
            options.append(_option(healed, None, tolerance, {"healed_from": r["strategy"]}))
    kept = [o for o in options if (o["axes"]["quality"] or {}).get("verdict") == "within"
            and (o["axes"]["speed"] or {}).get("verdict") == "faster"]
    return {"baseline": "the base model", "frontier": [],
            "answer": kept[0]["name"] if len(kept) == 1 else None,
            "why": "faster than the base model with perplexity within the tolerance", "options": options}


def _capacity(job: dict, finetune: list[dict] = ()) -> dict:
    methods = {r["run"]: r["method"] for r in records.ok(finetune)}
    options = [{"name": f"{s['subject']} {s['kind']} {s['dimension']}", "baseline": False, "axes": {},
                "subject": s["subject"], "kind": s["kind"], "dimension": s["dimension"],
                "method": methods.get(s["subject"]) if s["kind"] == "train" else None,
                "measured_max": s.get("measured_max"), "whole_range_fits": s.get("whole_range_fits", False),
                "first_failing": s.get("first_failing"), "kv_quant": s.get("kv_quant"), "cause": s.get("cause")}
               for s in job["searches"] if records.is_ok(s)]
    # The longest context at batch 1 without and with each quantized KV cache (capacity.kv_quant), per subject
    plain = {s["subject"]: s for s in job["searches"] if s["dimension"] == "seq_len" and not s.get("kv_quant")}
    fields = ("status", "reason", "measured_max", "whole_range_fits", "first_failing")
    context: dict[str, dict] = {}
    for s in (s for s in job["searches"] if s.get("kv_quant")):
        full = plain.get(s["paired_with"], {"status": "absent"})
        context.setdefault(s["paired_with"], {"subject": s["paired_with"], **{k: full.get(k) for k in fields},
                                              "quantized": []})["quantized"].append(
            {k: s.get(k) for k in ("kv_quant", *fields, "context_gain", "context_gain_why")})
    return {"baseline": None, "frontier": [], "budget": job["budget"],
            "train_seq_len": job["fixed"].get("train_seq_len"), "prompt_len": job["fixed"].get("prompt_len"),
            "answer": {o["name"]: o["measured_max"] for o in options}, "context": list(context.values()),
            "why": "the largest measured size that fits, per subject (None: nothing fits); `context`: the longest "
                   "context at batch 1 with the full-precision KV cache and with each quantized one",
            "options": options}


def _step_cost(job: dict) -> dict | None:
    """QAT's median training step over the full-precision fine-tune's, at each width (one run each, its steps'
    medians: no interval); `value` is the widest cost."""
    step = lambda v: (v.get("step_time") or {}).get("median")  # noqa: E731
    full = next((step(v) for v in job.get("variants", []) if v["variant"] == "full precision"), None)
    by_bits = {v["bits"]: step(v) / full for v in job.get("variants", []) if v["method"] == "qat" and step(v) and full}
    if not by_bits:
        return None
    return {"fact": "qat_step_cost", "value": max(by_bits.values()), "lo": None, "hi": None, "n": 1,
            "by_bits": dict(sorted(by_bits.items())),
            "verdict": f"{NOT_DECIDED}: one run each, the ratio of their steps' medians has no interval"}


def said_facts(metrics: dict) -> list[dict]:
    """Facts a user should hear that no question asks, each stored with its figure and interval where it holds:
    QLoRA's trained model against the untouched base; a QLoRA merge re-quantized to 4 bits against the untrained
    4-bit base (the fine-tune lost); what a QAT step costs."""
    out = []
    runs = records.ok(metrics.get("finetune", []))
    untouched = next((r for r in runs if r["method"] != "qlora"), None)  # its validation_before: the base as loaded
    for r in (r for r in runs if r["method"] == "qlora"):
        a = opts.paired_axis((untouched or {}).get("validation_before"), r.get("validation_after"))
        if a and a["lo"] is not None and a["lo"] > 0:  # where it stands: its 4-bit base before, what training did
            out.append({"fact": "qlora_worse_than_base", "run": r["run"], **a, "verdict": "worse",
                        "four_bit_base": opts.paired_axis(untouched["validation_before"], r.get("validation_before")),
                        "training": opts.paired_axis(r.get("validation_before"), r.get("validation_after"))})
        for m in (m for m in records.ok(metrics.get("merge", [])) if m["run"] == r["run"]):
            target = m.get("targets", {}).get("round-trip merge re-quantized to nf4")
            merged = opts.paired_axis(r.get("validation_before"), (target or {}).get("validation"))
            adapter = opts.paired_axis(r.get("validation_before"), m.get("adapter_validation"))
            if merged and adapter and adapter["hi"] is not None and adapter["hi"] < 0 and merged["hi"] is not None \
                    and merged["hi"] >= 0:
                out.append({"fact": "requantized_merge_loses_the_fine_tune", "run": r["run"], **merged,
                            "verdict": "not better: than the untrained 4-bit base", "adapter": adapter,
                            "perplexity": target["validation"]["perplexity"],
                            "base_perplexity": r["validation_before"]["perplexity"]})
    job = next(iter(records.ok(metrics.get("qat", []))), None)
    cost = _step_cost(job) if job else None
    return out + ([cost] if cost else [])


def build(cfg: dict, metrics: dict) -> dict:
    """Every question the records support, its options, verdicts, frontier and answer."""
    errors = opts.memory_errors(metrics.get("capacity", []))
    metrics = with_memory_error(against_tolerance(cfg, metrics), errors)
    facts = question_facts.facts(metrics, cfg)
    tolerance = facts["tolerance"]
    q: dict[str, dict] = {}
    if facts["quantize"]:
        f = facts["quantize"]
        q["quantize"] = _question(f, f["baseline"], (f["pick"] or {}).get("name"),
                                  "the smallest scheme whose perplexity interval lies within the tolerance and "
                                  "whose task gate does not fail", tolerance, f["status"])
    if facts["finetune"]:
        f = facts["finetune"]
        q["finetune"] = _question(f, f["reference"]["name"], _finetune_answer(f),
                                  "per axis, the run that beats every other: step time and perplexity by each "
                                  "pair's own comparison, memory by peaks apart by more than their measured error",
                                  tolerance)
        q["finetune"] |= {"memory_kind": f["kind"], "memory_error": errors.get(f["kind"])}
    if ttt := target.question(cfg, metrics.get("finetune", []), metrics.get("bench_finetune", [])):
        q["finetune_target"] = ttt
    if facts["inference"]:
        f = facts["inference"]
        q["inference"] = _question(f, "base",
                                   (f["pick"] or {}).get("name"), "faster than the base model and within the "
                                   "quality tolerance; the fastest of those where intervals separate",
                                   tolerance, f["status"])
    if facts["attention"]:
        f = facts["attention"]
        q["attention"] = _question(f, "eager", (f["pick"] or {}).get("name"),
                                   "faster than eager; the fastest where intervals separate", tolerance)
        q["attention"]["cell"] = f["cell"]
        q["attention"]["memory_kind"] = f["options"][0].get("memory_kind")
        q["attention"]["memory_error"] = opts.attention_memory_error(metrics.get("bench_attention", []))
    for m in facts["merge"]:
        q[f"merge:{m['run']}"] = _question(m, "the adapter",
                                           {"closest": m["closest"], "best_quality": m["best_quality"]},
                                           "lowest mean KL to the adapter; lowest perplexity where its interval "
                                           "separates", tolerance)
    if records.ok(metrics.get("qat", [])):
        q["qat"] = _qat(records.ok(metrics["qat"])[0], tolerance)
    if records.ok(metrics.get("prune", [])):
        q["prune"] = _prune(metrics["prune"], tolerance)
    if spec := modes.speculative_options(metrics.get("bench_inference", [])):
        q["speculative"] = _speculative(spec, tolerance)
    for variant, options in modes.kv_quant_options(metrics.get("bench_inference", [])).items():
        q[f"kv_quant:{variant}"] = _kv_quant(variant, options, tolerance)
    if records.ok(metrics.get("bench_serving", [])):
        q["serving"] = _serving(records.ok(metrics["bench_serving"])[0])
    if records.ok(metrics.get("capacity", [])):
        q["capacity"] = _capacity(records.ok(metrics["capacity"])[0], metrics.get("finetune", []))
    # each question as asked and what an answer must be, from the one table of questions
    q = {key: {"question": questions.asked(key), **d, "objective": questions.of(key).objective} for key, d in q.items()}
    missing = {k: absent(cfg, metrics, s) or "its records give no comparison" for k, s in questions.asked_once().items()
               if k not in q}
    return {"tolerance_pct": tolerance, "vocabulary": VOCABULARY, "memory_error": errors, "questions": q,
            "facts": said_facts(metrics), "absent": missing,
            "_facts": facts}


VOCABULARY = {"faster / slower": "the 95% interval of the ratio excludes 1",
              "same within ±X%": "the interval lies inside the equivalence band",
              "within / beyond +X%": "a quality change's whole interval is at or below / above its tolerance",
              "less / more": "memory: footprints (exact) that differ, or peaks further apart than their kind's "
                             "measured error (`memory_error`)",
              "worse / not better": "a quality change whose whole interval is above 0 / that reaches 0 or above",
              NOT_DECIDED: "everything else, with about the n that would decide it where computable",
              "not decided: <why>": "no comparison (the machine's speed changed, too few stable rounds)"}


def write(decisions: dict, path: Path) -> None:
    path.write_text(json.dumps({k: v for k, v in decisions.items() if not k.startswith("_")}, indent=1,
                               default=str) + "\n")


def answers(decisions: dict) -> dict:
    """The answers alone (the report's figures.json: what `dvc exp show` compares)."""
    return {k: q["answer"] for k, q in decisions["questions"].items()}
