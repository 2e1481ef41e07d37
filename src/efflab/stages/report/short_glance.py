"""The glance a reader takes in in a minute: the run's scale first, then at most MAX_LINES lines of at most
MAX_CHARS characters, each a question's answer with its figure and interval and one caveat, rendered from
decisions.json as report.glance's full lines are (those, with every option's cost, move to details.md). Questions
beyond the lines left are named in the last line, with the link to their full answers. Nothing here decides."""
from __future__ import annotations

import re

from ...measure.stats import interval_is_range
from ...questions import QUESTIONS, kind_of, of
from .dominance import best_point
from .glance import LINKS, b_min_text, kl_text, quantizer_library, say
from .templating import value_text
from .writing import brief

MAX_LINES = 12  # the scale line and the closing pointer included
MAX_CHARS = 200  # of what a reader sees: a link's target is not counted
FULL = "details.md#every-answer-in-full"
# efflab.questions' order and labels, with the open loop after the serving method it belongs to
ORDER = tuple(k for q in QUESTIONS for k in ((q.kind, "open_loop", "slo_search") if q.kind == "serving" else (q.kind,)))
TITLES = {q.kind: q.title for q in QUESTIONS} | {"open_loop": "Open-loop serving",
                                                  "slo_search": "Highest rate meeting the SLO"}


def _said(a: dict | None, unit: str = "×", signed: bool = False) -> str:
    """An axis with its verdict; a ratio decided on its extreme rounds (its interval is their range) says so."""
    if not a or not a.get("verdict"):
        return value_text(a, unit, signed=signed)
    extreme = a["verdict"] in ("faster", "slower") and unit == "×" and interval_is_range(a.get("n"))
    return f"{value_text(a, unit, signed=signed)}, {brief(a['verdict'])}" + (
        f" in all {a['n']} rounds" if extreme else "")


def _opts(d: dict) -> dict:
    return {o["name"]: o for o in d.get("options", [])}


def _closest(d: dict, key: str, better: str = "max") -> dict | None:
    """The option other than the baseline a reader would guess from the table (decide.best_point), to say when it
    is not an answer."""
    name = best_point([o for o in d["options"] if not o.get("baseline")], key, better)
    return _opts(d)[name] if name else None


def quantize(d: dict, tolerance: float) -> str:
    if d["answer"] and not _opts(d)[d["answer"]]["baseline"]:
        o = _opts(d)[d["answer"]]
        return f"**{o['name']}**, perplexity {_said(o['axes']['quality'], '%', True)}, {value_text(o['axes']['memory'], ' MiB')}"
    o = _closest(d, "quality", "min")
    return f"none shown within +{tolerance:g}% perplexity" + (
        f"; nearest {o['name']} {_said(o['axes']['quality'], '%', True)}" if o else "")


def finetune(d: dict) -> str:
    a, opts, base = d["answer"], _opts(d), d["baseline"]
    parts = [f"least memory **{a['memory']}**" if a["memory"] else "least memory not decided",
             f"shortest step **{a['step_ratio']}** ({value_text(opts[a['step_ratio']]['axes']['step_ratio'], '×')} "
             f"{base}'s)" if a["step_ratio"] else "shortest step not decided at this size",
             f"lowest perplexity **{a['quality']}**" if a["quality"] else "lowest perplexity not decided at this size"]
    return ", ".join(parts)


def finetune_target(d: dict) -> str:
    if d["answer"]:
        t = next(o["time"] for o in d["options"] if o["name"] == d["answer"])
        return f"first **{d['answer']}**: {t['steps']} steps, " + value_text(
            {"value": t["time_s"], "lo": t["lo"], "hi": t["hi"], "n": t["n"]}, " s")
    if not d["options"]:
        return f"not measured: {d['why']}"
    return f"first {d['why']}"


def inference(d: dict, tolerance: float) -> str:
    if d["answer"]:
        o = _opts(d)[d["answer"]]
        return f"**{o['name']}** generates {_said(o['axes']['speed'])}, perplexity {o['status']}"
    o = _closest(d, "speed")
    return f"none shown both faster and within +{tolerance:g}%" + (
        f"; fastest {o['name']} {_said(o['axes']['speed'])}" if o else "")


def attention(d: dict) -> str:
    if d["answer"]:
        return f"**{d['answer']}** {_said(_opts(d)[d['answer']]['axes']['speed'])}"
    o = _closest(d, "speed")
    return "none shown faster than all the others" + (f"; {o['name']} {_said(o['axes']['speed'])}" if o else "")


def speculative(d: dict) -> str:
    o = _opts(d).get(d["answer"]) or _closest(d, "speed")
    if not o:
        return "nothing measured"
    head = f"**{o['name']}** pays" if d["answer"] else f"none shown to pay; {o['name']}"
    prompts = o.get("prompts")
    return f"{head}: {_said(o['axes']['speed'])}" + (
        f", on {prompts} prompt{'s' if prompts != 1 else ''}" if prompts else "")


def kv_quant(d: dict) -> str:
    if d["answer"]:
        o = _opts(d)[d["answer"]]
        return f"**{o['cache']}** holds {value_text(o['axes']['memory'], ' MiB')} at {o['context']} tokens"
    trade = next((t for t in d.get("trades", []) if t["saves_mib"] is not None), None)
    return "none shown to hold less within the tolerance and generate no slower than " \
           f"{d.get('speed_floor', 0.9):g}×" + (f"; a trade: {trade['cache']} saves {trade['saves_mib']:,.0f} MiB "
                                                  f"for {value_text(_opts(d)[trade['name']]['axes']['speed'], '×')}"
                                                  if trade else "")


def serving(d: dict) -> str:
    if d["answer"]:
        o = _opts(d)[d["answer"]]
        return f"**{o['name']}**, throughput over naive's {_said(o['axes']['speed'])}"
    return "no method shown faster than naive"


def open_loop(o: dict) -> str:
    each = "; ".join(f"{m}: {value_text(f['best_goodput'], ' requests/s')} at {f['best_goodput']['rate']:g}/s offered, "
                     f"{f['said']}" for m, f in o["methods"].items() if f["best_goodput"])
    return (f"**{o['answer']}** the most goodput; " if o["answer"] else "") + (each or "no goodput measured")


def slo_search(o: dict) -> str:
    """Each subject's highest rate meeting the SLO, and each prefix cache's verdict."""
    each = "; ".join(f"{name}: {x['answer']['value']:.3g}/s" for name, x in o["subjects"].items())
    caching = "".join(f"; prefix cache ({pair}): {brief(c['verdict'])}" for pair, c in o["caching"].items())
    return f"p{o['percentile']:g} meets the SLO up to: {each or 'none searched'}{caching}"


def capacity(d: dict) -> str:
    """Per training subject: the largest batch and the longest sequence at batch 1 that fit, or that none does."""
    by: dict[str, list[str]] = {}
    for o in d["options"]:
        if o.get("kv_quant") or o["kind"] != "train":
            continue
        n, said = o["measured_max"], by.setdefault(o["subject"], [])
        if n:
            said.append(f"batch {n:,}" if o["dimension"] == "batch_size" else f"{n:,} tokens at batch 1")
    subjects = "; ".join(f"{s}: {', '.join(v) if v else 'none fits'}" for s, v in by.items())
    return f"in {d['budget']['mib']:,.0f} MiB, " + (subjects or "no training search")


def merge(key: str, d: dict) -> str:
    a, opts = d["answer"], _opts(d)
    text = f"{key.split(':', 1)[1]}: closest **{a['closest']}** (KL {kl_text(opts[a['closest']]['axes']['kl']['value'])})" \
        if a["closest"] else "no route"
    if a["best_quality"] and a["best_quality"] != a["closest"]:
        text += f"; lower perplexity **{a['best_quality']}**"
    return text


def qat(d: dict) -> str:
    lib = quantizer_library(d)
    return f"PTQ {b_min_text(d, 'ptq')}, QAT {b_min_text(d, 'qat')}" + (
        f" ({lib}'s quantizer against the fine-tune: not Quantization's schemes)" if lib else "")


def prune(d: dict) -> str:
    if d["answer"]:
        return f"**{d['answer']}**"
    o = _closest(d, "speed")
    return "none shown faster within the tolerance" + (
        f"; {o['name']} perplexity {_said(o['axes']['quality'], '%', True)}" if o else "")


def _entries(decisions: dict) -> list[tuple[str, str, str, str]]:
    """(the question's key in decisions.json, its kind, title, text) for every question answered, in ORDER."""
    out = []
    for key, d in decisions["questions"].items():
        kind = of(key).kind
        out.append((key, kind, TITLES[kind], say(SAYS, key, d, decisions["tolerance_pct"])))
        if kind == "serving" and d.get("open_loop"):
            out.append((key, "open_loop", TITLES["open_loop"], open_loop(d["open_loop"])))
        if kind == "serving" and d.get("slo_search"):
            out.append((key, "slo_search", TITLES["slo_search"], slo_search(d["slo_search"])))
    return sorted(out, key=lambda e: ORDER.index(e[1]))


SAYS = {"quantize": quantize, "finetune": finetune, "finetune_target": finetune_target, "inference": inference,
        "attention": attention, "speculative": speculative, "kv_quant": kv_quant, "serving": serving,
        "capacity": capacity, "merge": merge, "qat": qat, "prune": prune}


def visible(line: str) -> int:
    """A Markdown line's length as read: a link counts its text, not its target."""
    return len(re.sub(r"\]\([^)]*\)", "]", line).replace("**", ""))


def lines(decisions: dict) -> dict[str, str]:
    """The glance's bullets by question key (a key may hold two: serving and its open loop), at most MAX_LINES - 2
    (the scale line opens them, a pointer to the words and the full answers closes them); where more questions are
    answered, the last bullet names them with the link to their full answers."""
    entries, room = _entries(decisions), MAX_LINES - 2
    shown = entries if len(entries) <= room else entries[:room - 1]
    out: dict[str, str] = {}
    for key, kind, title, text in shown:
        d = decisions["questions"][key]
        # a question measured nothing has no table to link to: its full line says why
        link = LINKS[kind_of(key)] if d.get("options", True) else FULL
        out[key] = (out[key] + "\n" if key in out else "") + f"- **{title}**: {text}. ([table]({link}))"
    rest = entries[len(shown):]
    if rest:
        names = ", ".join(dict.fromkeys(title for _, _, title, _ in rest))
        out["_more"] = f"- **Also answered**: {names}. ([every answer in full]({FULL}))"
    return out


def scale(size: dict, base: dict) -> str:
    """What the run's numbers rest on, said before any of them."""
    env = base.get("environment", {})
    where = f"{env.get('cpu_cores')} CPU cores" if env.get("device") == "cpu" else env.get("gpu") or env.get("device")
    return (f"**Scale**: a {base['parameters'] / 1e6:,.1f}M-parameter {base['model_type']} on {where} "
            f"({base['dtype']}); {size['steps']} fine-tuning steps a run, {size['rows']} validation rows, "
            f"{size['inference_repeats']} interleaved rounds an inference variant, {size['prompts']} "
            f"prompt{'s' if size['prompts'] != 1 else ''}. Each answer holds at that size.")
