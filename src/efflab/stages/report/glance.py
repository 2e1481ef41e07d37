"""The glance: one line per question, each rendered from its decision (decisions.build: the answer, its verdicts
and its cost on the other axes) with the link to its table, then the facts of this run that hold (decisions'
`facts`). Nothing here decides: every word of a verdict is the one decisions.json holds."""
from __future__ import annotations

from ...measure.bounds import at_bound
from ...questions import QUESTIONS, of
from .templating import value_text
from .writing import brief, number, recovered_text

# Where each question's table is (efflab.questions): the glance's option tables in details.md, the stages' sections
# in report.md.
LINKS = {q.kind: q.link for q in QUESTIONS}


def _pct(a):
    return value_text(a, "%", signed=True)


def _x(a):
    return value_text(a, "×")


def _mib(a):
    return value_text(a, " MiB")


def _said(a, text) -> str:
    """An axis with its verdict in the one vocabulary: '0.56× [0.53, 0.59], slower'."""
    return f"{text(a)}, {a['verdict']}" if a else "not measured"


def _link(key: str) -> str:
    return f" ([table]({LINKS[key]}))"


def quantize(d: dict, tolerance: float) -> str:
    opts = {o["name"]: o for o in d["options"]}
    base = next((o for o in d["options"] if o["baseline"]), None)
    others = [o for o in d["options"] if not o["baseline"] and o["name"] != d["answer"]]
    rest = "; ".join(f"{o['name']} {_pct(o['axes']['quality'])} ({o['status']})" for o in others)
    if d["answer"] and not opts[d["answer"]]["baseline"]:
        o = opts[d["answer"]]
        smaller = base["axes"]["memory"]["value"] / o["axes"]["memory"]["value"] if base else None
        head = (f"**{o['name']}**: perplexity {_pct(o['axes']['quality'])}, within +{tolerance:g}%; "
                f"{_mib(o['axes']['memory'])}" + (f" ({smaller:.2f}× smaller)" if smaller else "")
                + f"; generates {_said(o['axes']['speed'], _x)}")
    else:
        head = f"none shown within +{tolerance:g}% perplexity"
    return f"- **Quantization scheme** (vs {d['baseline']}): {head}" + (f". Others: {rest}" if rest else "") + \
        "." + _link("quantize")


def _least_memory(d: dict, opts: dict) -> str:
    """The memory winner with its peak and its ratio to the baseline's, or why there is none."""
    name, error, base = d["answer"]["memory"], d.get("memory_error"), opts[d["baseline"]]["axes"]["memory"]
    if not name:
        return "least memory not decided: " + (f"no peak below every other's by more than ±{error['pct']:.1f}%"
                                               if error else "one measurement per run")
    a = opts[name]["axes"]["memory"]
    versus = f", {number(a['value'] / base['value'], 2)}× {d['baseline']}'s {base['value']:,.0f}" \
        if base and name != d["baseline"] else ""
    return f"least memory **{name}** ({a['value']:,.0f} MiB{versus})"


def _peaks(d: dict) -> str:
    """The memory kind the peaks are of and its measured error (or why none); each run's peak and verdict are in
    details.md's table of the options."""
    error, kind = d.get("memory_error"), d.get("memory_kind")
    said = (f"±{number(error['pct'], 2)}% measured error, from {error['pairs']} pair{'s' if error['pairs'] != 1 else ''}"
            " of processes" if error
            else "one measurement per run: no record read it twice")
    return f"peak memory (`{kind}`, {said})"


def finetune(d: dict) -> str:
    opts, base = {o["name"]: o for o in d["options"]}, d["baseline"]
    said = {"step_ratio": ("shortest step", lambda a: f"{_x(a)} {base}'s"), "quality": ("lowest perplexity", _pct)}
    parts = [_least_memory(d, opts)]
    for key, (what, text) in said.items():
        name = d["answer"][key]
        parts.append(f"{what} **{name}** ({text(opts[name]['axes'][key])})" if name
                     else f"{what} not decided at this size")
    front = ", ".join(f"**{n}**" for n in d["frontier"])
    return (f"- **Fine-tuning method** (vs {base}; {_peaks(d)}): " + ", ".join(parts) + f"; on the frontier of "
            f"memory × step time × perplexity: {front}." + _link("finetune"))


def _to_target(o: dict) -> str:
    """One method's time to the target: steps, time [interval] and the peak it trained at, or that it did not."""
    t, m = o["time"], o["memory"]
    lr = (f" (lr {o['learning_rate']:g}, best of {len(set(o['swept'].values()))})" if o.get("swept") else "") \
        + (f" (median of {len(o['seeds'])} seeds, steps {', '.join('never' if s is None else str(s) for s in t['steps_each'])})"
           if o.get("seeds") else "")
    if not t["reached"]:
        return f"{o['name']}{lr}: {t['why']}" + (f" (> {t['lo']:.3g} s)" if t["lo"] is not None else "")
    time = value_text({"value": t["time_s"], "lo": t["lo"], "hi": t["hi"], "n": t["n"]}, " s") \
        if t["time_s"] is not None else "no step timer"
    return f"{o['name']}{lr}: {t['steps']} steps, {time}" + (f", {m['value']:,.0f} MiB" if m["value"] else "")


def finetune_target(d: dict) -> str:
    """Which fine-tune reaches the target loss first (MLPerf's time to quality), and at what memory."""
    t = d["target"]
    if t.get("loss") is None:
        return f"- **Time to target**: not measured: {t['why']}."
    said = (f"the base model's {t['base_loss']:.4g} −{t['below_base_pct']:g}%" if t["source"] == "auto"
            else "finetune.target.loss")
    kind = next((o["memory"]["kind"] for o in d["options"] if o["memory"].get("kind")), None)
    first = next((o for o in d["options"] if o["name"] == d["answer"]), None)
    head = f"first **{first['name']}**" if first else f"first {d['why']}"
    rest = "; ".join(_to_target(o) for o in d["options"])
    return (f"- **Time to target** (validation loss ≤ {t['loss']:.4g}: {said}; time = the warm-up step as measured + the rest × median step"
            + (f", memory `{kind}`" if kind else "") + f"): {head}. {rest}." + _link("finetune_target"))


def inference(d: dict, tolerance: float) -> str:
    opts = {o["name"]: o for o in d["options"]}
    if d["answer"]:
        o = opts[d["answer"]]
        head = (f"**{o['name']}**, generates {_said(o['axes']['speed'], _x)}, {_mib(o['axes']['memory'])}, "
                f"perplexity {_pct(o['axes'].get('quality'))}")
    else:
        head = f"no variant shown both faster than the base and within +{tolerance:g}% perplexity"
    rest = "; ".join(f"{o['name']} {_said(o['axes']['speed'], _x)}, perplexity {_pct(o['axes'].get('quality'))} "
                     f"({o['status']})" for o in d["options"] if not o["baseline"] and o["name"] != d["answer"])
    return f"- **Inference variant** (vs the base model): {head}" + (f". Others: {rest}" if rest else "") + "." + \
        _link("inference")


def _acceptance(o: dict) -> str:
    rate = o.get("acceptance_rate")
    said = f"{100 * rate:.0f}% of {o['proposed']} candidates accepted" if rate is not None else "nothing proposed"
    steps, prompts = o.get("tokens_per_step"), o.get("prompts")
    # what the acceptance rests on: one prompt's candidates are not a workload's (the verdict's interval is of rounds)
    rests = f"; on {prompts} prompt{'s' if prompts != 1 else ''} and {o['passes']} steps of the model" \
        if prompts and o.get("passes") else ""
    return said + (f", {number(steps, 2)} tokens per step of the model" if steps is not None else "") + rests


def speculative(d: dict) -> str:
    """Which speculative decoding pays: the answer, then each option's speed, acceptance and status."""
    rest = "; ".join(f"{o['name']} {_said(o['axes']['speed'], _x)} ({_acceptance(o)}): {o['status']}"
                     for o in d["options"])
    head = f"**{d['answer']}**" if d["answer"] else "none shown faster with the model's own greedy tokens"
    return (f"- **Speculative decoding** (vs the same model's dynamic generation): {head}. {rest}."
            + _link("speculative"))


def kv_quant(d: dict) -> str:
    """What a quantized KV cache saves and costs: memory held at the longest context measured, speed, perplexity."""
    rest = "; ".join(f"{o['cache']}: holds {_mib(o['axes']['memory'])} at {o['context']} tokens "
                     f"({o['axes']['memory']['verdict'] if o['axes']['memory'] else 'not measured'}), generates "
                     f"{_said(o['axes']['speed'], _x)}, perplexity {_said(o['axes']['quality'], _pct)}"
                     for o in d["options"] if not o["baseline"])
    base = next((o for o in d["options"] if o["baseline"]), None)
    against = f" (full precision: {_mib(base['axes']['memory'])} at {base['context']} tokens)" if base else ""
    floor = d.get("speed_floor")
    head = f"**{d['answer']}**" if d["answer"] else ("no quantized cache shown to hold less within the tolerance"
                                                     + (f" and generate no slower than {floor:g}×" if floor else ""))
    speed = {o["name"]: o["axes"]["speed"] for o in d["options"]}
    trades = "; ".join(f"a trade: {t['cache']} saves {t['saves_mib']:,.0f} MiB at {t['context']} tokens for a "
                       f"generation speed of {_x(speed[t['name']])}" for t in d.get("trades", [])
                       if t["saves_mib"] is not None)
    return (f"- **Quantized KV cache** of {d['variant']}{against}: {head}" + (f"; {trades}" if trades else "")
            + f". {rest}." + _link("kv_quant"))


def attention(d: dict) -> str:
    cell = d.get("cell") or {}
    where = f" at {cell.get('seq_len')} tokens, {str(cell.get('mode', '')).replace('_', '+')}" if cell else ""
    rest = "; ".join(f"{o['name']} {_said(o['axes']['speed'], _x)}" for o in d["options"] if not o["baseline"])
    head = f"**{d['answer']}**" if d["answer"] else "none shown faster than all the others"
    return f"- **Attention implementation** (vs eager{where}): {head}. Speed: {rest}." + _link("attention")


def kl_text(kl: float) -> str:
    """A mean KL as read: a float32 sum a few 1e-9 below 0 is 0 to within rounding, and said so with its value."""
    return f"0 up to float rounding, {kl:.1e}" if at_bound("kl", kl) else number(kl, 3)


def merge(key: str, d: dict) -> str:
    run = key.split(":", 1)[1]
    a = d["answer"]
    opts = {o["name"]: o for o in d["options"]}
    closest = a["closest"]
    text = f"**{closest}** is closest to the adapter (mean KL {kl_text(opts[closest]['axes']['kl']['value'])})" \
        if closest else "no route"
    if a["best_quality"] and a["best_quality"] != closest:
        text += f"; **{a['best_quality']}** has the lower perplexity ({_pct(opts[a['best_quality']]['axes']['quality'])} vs the adapter)"
    return f"- **Merge route for {run}**: {text}." + _link("merge")


def b_min_text(d: dict, method: str, bold: bool = True) -> str:
    """A method's fewest bits within the tolerance (B_min), as the qat decision holds it, or where it is not decided."""
    bits, at = d["answer"][method], d["undecided_at"].get(method)
    if bits:
        return f"**{bits} bits**" if bold else f"{bits} bits"
    return f"not decided at this size from {at} bits" if at else "none"


def quantizer_library(d: dict) -> str:
    """The library the qat decision's quantizer is of ('torchao'), or '' where its record says none."""
    return (d.get("quantizer") or "").split(" ")[0]


def qat(d: dict) -> str:
    widths = "; ".join(f"{o['name']} {_said(o['axes']['quality'], _pct)}" for o in d["options"])
    lib = quantizer_library(d)
    what = f"; {lib}'s quantizer, one scale per {d['group_size']} weights, not the quantize stage's schemes" \
        if lib and d.get("group_size") else ""
    return (f"- **Fewest weight bits** (vs the full-precision fine-tune{what}): quantized after training "
            f"{b_min_text(d, 'ptq')}, with quantization-aware training {b_min_text(d, 'qat')}. {widths}."
            f"{_recovered(d)}" + _link("qat"))


def _recovered(d: dict) -> str:
    """QAT as torchao reports it: the share of PTQ's gap it recovers, per width."""
    said = []
    for bits, r in (d.get("recovered") or {}).items():
        if r.get("share") is None:
            said.append(f"at {bits} bits PTQ left no gap decided for QAT to recover")
            continue
        said.append(f"at {bits} bits QAT recovers {recovered_text(r, '%')} of PTQ's perplexity gap")
    text = "; ".join(said)
    return f" {text[:1].upper()}{text[1:]}." if said else ""


def prune(d: dict) -> str:
    def said(o: dict) -> str:
        speed = (f"generates {_said(o['axes']['speed'], _x)}, " if not o.get("healed_from") else
                 "not timed (healing kept the pruned shapes), ")
        return f"{o['name']}: {speed}perplexity {_said(o['axes']['quality'], _pct)}"

    rest = "; ".join(map(said, d["options"]))
    head = f"**{d['answer']}**" if d["answer"] else "no strategy shown faster with perplexity within the tolerance"
    return f"- **Pruning strategy** (vs the base model): {head}. {rest}." + _link("prune")


def _open_loop(o: dict) -> str:
    """The open loop's line: the SLO, the method with the most goodput where decided, each method's highest goodput
    (at which rate) and its saturation, all as decisions' `open_loop` holds them."""
    slo = ", ".join(f"{k.removesuffix('_s').upper()} ≤ {v:g} s" for k, v in o["slo"].items() if v is not None)
    each = "; ".join(f"{m}: {value_text(f['best_goodput'], ' requests/s')} at {f['best_goodput']['rate']:g} "
                     f"requests/s offered, {f['said']}" for m, f in o["methods"].items() if f["best_goodput"])
    head = (f"**{o['answer']}** the most. " if o["answer"] else "no method shown to serve more than every other. "
            if len(o["methods"]) > 1 else "")
    return (f"- **Open-loop serving** (goodput: requests/s meeting {slo or 'no SLO bound'}; Poisson arrivals): "
            f"{head}{each}." + _link("serving"))


def _slo_rate(x: dict) -> str:
    """A subject's highest rate meeting the SLO, its interval named by its coverage."""
    a = x["answer"]
    if a["censored"] == "below the lowest rate":
        return f"met at no rate down to {a['lowest']:g} requests/s"
    top = f"{a['hi']:.3g}" if a["hi"] is not None else f"over {a['highest']:g}"
    kind = "95% CI" if a["interval"] == "ci95" else f"range of {a['n']} schedules"
    return f"{a['value']:.3g} requests/s [{a['lo']:.3g}, {top}] ({kind})"


def slo_search_line(o: dict) -> str:
    """The SLO search's line: the SLO at its percentile, each subject's highest rate meeting it, and each prefix
    cache's verdict, all as decisions' `slo_search` holds them."""
    slo = ", ".join(f"{k.removesuffix('_s').upper()} ≤ {v:g} s" for k, v in o["slo"].items() if v is not None)
    each = "; ".join(f"{name}: {_slo_rate(x)}" for name, x in o["subjects"].items())
    caching = "".join(f" Prefix cache on vs off ({pair}): {brief(c['verdict'])}"
                      + (f", ×{c['ratio']:.2f} the rate" if c["ratio"] else "") + "."
                      for pair, c in o["caching"].items())
    return (f"- **Highest rate meeting the SLO** (p{o['percentile']:g} {slo or 'of no bound'}, and kept up; "
            f"{o['requests_per_probe']} Poisson requests a probe): {each or 'no subject searched'}.{caching}"
            + _link("serving"))


def serving(d: dict) -> str:
    """The serving answer; a why that several verdicts share (the machine's speed changed) said once, at the end."""
    opts = [o for o in d["options"] if not o["baseline"]]
    whys = [w for o in opts for w in ((o["axes"]["speed"] or {}).get("verdict", ""), o.get("versus_static") or "")
            if brief(w) != w]
    rest = "; ".join(f"{o['name']} at {o['concurrency']} requests "
                     + (f"{_x(o['axes']['speed'])}, {brief(o['axes']['speed']['verdict'])}" if o["axes"]["speed"]
                        else "not measured")
                     + (f" ({o['versus_static']} than static)" if o.get("versus_static") in ("faster", "slower")
                        else f" (vs static: {brief(o['versus_static'])})" if o.get("versus_static") else "")
                     for o in opts)
    head = f"**{d['answer']}**" if d["answer"] else "no method shown faster than naive"
    why = f" Why: {whys[0].split(': ', 1)[1]}." if whys else ""
    return f"- **Serving method** (vs naive, throughput): {head}. {rest}.{why}" + _link("serving") + (
        "\n" + _open_loop(d["open_loop"]) if d.get("open_loop") else "") + (
        "\n" + slo_search_line(d["slo_search"]) if d.get("slo_search") else "")


def _fits(o: dict, rows: str) -> str:
    """One search's largest size that fits, for reading: 'batch 3', '384 tokens at batch 1', or what does not fit."""
    n, more = o["measured_max"], " or more" if o["whole_range_fits"] else ""
    if o["dimension"] == "batch_size":
        return f"batch {n:,}{more}" if n else f"no batch of {rows} fits"
    return f"{n:,} tokens{more} at batch 1" if n else "no sequence fits at batch 1"


def _subject(o: dict) -> str:
    """A capacity subject as a reader names it: 'full fine-tuning', 'lora-r8', 'generating with nf4'."""
    if o["kind"] != "train":
        return f"generating with {o['subject']}"
    return f"{o['subject']} fine-tuning" if o.get("method") == o["subject"] else o["subject"]


def capacity(d: dict) -> str:
    by: dict[str, list[dict]] = {}
    paired = {c["subject"] for c in d.get("context", [])}  # their sequence searches are said with their caches'
    for o in d["options"]:
        if not o.get("kv_quant") and not (o["dimension"] == "seq_len" and o["subject"] in paired):
            by.setdefault(_subject(o), []).append(o)
    said = []
    for subject, searches in by.items():
        rows = f"{d['train_seq_len']}-token rows" if searches[0]["kind"] == "train" else \
            f"{d.get('prompt_len')}-token prompts"
        fitting = searches if any(o["measured_max"] for o in searches) else searches[:1]  # nothing: said once
        said.append(f"{subject}: " + ", ".join(_fits(o, rows) for o in fitting))

    def tokens(s: dict) -> str:  # a sequence search's longest context, or why there is none
        n = s["measured_max"]
        return s["status"] if s["status"] != "ok" else "none fits" if not n else \
            f"{n:,} tokens" + (" or more" if s["whole_range_fits"] else "")
    for c in d.get("context", []):
        caches = [f"{tokens(q)} with {q['kv_quant']} " + (f"({q['context_gain']:.2f}×)" if q["context_gain"] else
                                                           "(gain not decided)")
                  if q["status"] == "ok" else f"{q['kv_quant']} {q['status']}" for q in c["quantized"]]
        said.append(f"generating with {c['subject']}, the longest context at batch 1: {tokens(c)} with the "
                    "full-precision KV cache, " + ", ".join(caches))
    budget = d["budget"]
    held = f", held against `{budget['memory'].split(':')[0]}`" if budget.get("memory") else ""
    return (f"- **What fits {budget['mib']:,.0f} MiB** (`{budget['source']}`{held}): " + "; ".join(said) + "."
            + _link("capacity"))


def fact(f: dict) -> str:
    """One of decisions.json's `facts` as a sentence."""
    if f["fact"] == "qlora_worse_than_base":
        base, trained = f.get("four_bit_base"), f.get("training")
        lowered = bool(trained) and trained["hi"] is not None and trained["hi"] < 0
        whence = (f" Its 4-bit base starts {_pct(base)} against the untouched base, and training lowered that base's "
                  f"perplexity by {_pct(trained)}: the gap is the 4-bit base's, not training's." if base and lowered
                  else "")
        return (f"**QLoRA after training ({f['run']}) has a higher perplexity than the untouched base model**: "
                f"{_pct(f)}, paired on the same rows (the whole interval above 0).{whence}")
    if f["fact"] == "requantized_merge_loses_the_fine_tune":
        return (f"**Re-quantizing the {f['run']} merge to 4 bits undoes the fine-tune's gain**: perplexity "
                f"{number(f['perplexity'])} against the untrained 4-bit base's {number(f['base_perplexity'])} "
                f"({_pct(f)}), where the adapter was {_pct(f['adapter'])}.")
    if f["fact"] == "qat_step_cost":
        widths = ", ".join(f"{x:.2f}× at {b} bits" for b, x in (f.get("by_bits") or {}).items())
        return (f"**A QAT training step took up to {f['value']:.2f}× a full-precision one here**"
                + (f" ({widths})" if widths else "") + "; one run each, the ratio of their steps' medians: no "
                "interval.")
    raise KeyError(f"decisions.json's fact {f['fact']!r} has no sentence")


def lines(decisions: dict) -> list[str]:
    """The glance's question lines, in the report's order, for the questions the records answer."""
    return list(by_question(decisions).values())


def by_question(decisions: dict) -> dict[str, str]:
    """Each question's glance line, by its key in decisions.json (what the ledger checks each line against)."""
    return {key: say(SAYS, key, d, decisions["tolerance_pct"]) for key, d in decisions["questions"].items()}


def say(says: dict, key: str, d: dict, tolerance: float) -> str:
    """A question's line by the renderer `says` holds for its kind (efflab.questions: a key that is not a row fails
    loudly): merge's is per run, and quantize's and inference's read the perplexity tolerance."""
    kind = of(key).kind
    if kind not in says:
        raise KeyError(f"decisions.json's question {key!r} has no glance line")
    if kind == "merge":
        return says[kind](key, d)
    return says[kind](d, tolerance) if kind in ("quantize", "inference") else says[kind](d)


SAYS = {"quantize": quantize, "finetune": finetune, "finetune_target": finetune_target, "inference": inference,
        "attention": attention, "speculative": speculative, "kv_quant": kv_quant, "serving": serving,
        "capacity": capacity, "merge": merge, "qat": qat, "prune": prune}
