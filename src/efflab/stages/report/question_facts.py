"""The report's opening answers, derived from the records and never written by hand.

For each decision (quantization scheme, fine-tuning method, attention implementation, inference variant, merge
route) the options are read from the records with an interval on every axis (report.options), the frontier is
what no option beats on one axis without losing on another (report.dominance), and a recommendation is named only
where the intervals separate; it states its cost on the other axes. One baseline and one stated tolerance per
decision. The words are in templates/advice.md.j2; this module computes the facts they say.
"""
from __future__ import annotations

import pandas as pd

from ... import records
from ...experiment import evaluated_name
from ...measure.stats import NOT_DECIDED, against_tolerance, compare
from ...measure.timing import SENTINEL_TOLERANCE
from . import options as opts
from . import short_glance
from .dominance import beats, best_point, frontier, winner
from .glance import fact
from .glance import lines as question_lines
from .sections import prompt_count
from .templating import render, value_text
from .writing import markdown, percent

SPEED, QUALITY = {"speed": "max"}, {"quality": "min"}


def quality_status(a: dict | None, tolerance_pct: float) -> str:
    """A perplexity change against the tolerance, by its interval (stats.against_tolerance): within / beyond /
    not decided at this size / not measured."""
    if not a:
        return "not measured"
    return against_tolerance(a["value"], a["lo"], a["hi"], tolerance_pct, n=a.get("n")).split(" +")[0].split(" (")[0]


def speed_word(a: dict | None) -> str:
    """An interleaved ratio over the baseline in the one vocabulary (stats.compare)."""
    if not a:
        return "not measured"
    return compare(a["value"], a["lo"], a["hi"], n=a.get("n"), why=a.get("why"))


def task_gates(evaluate: list[dict]) -> dict[str, str]:
    """The evaluate stage's quality gate per evaluated model (e.g. "quantized-nf4": "fails")."""
    return {r["model"]: r["gate"]["verdict"] for r in records.ok(evaluate)}


def gate_of(gates: dict[str, str] | None, model: str) -> str:
    """A model's task gate: passes / fails / undecided, "reference" for the base, "not evaluated" without a job."""
    return (gates or {}).get(model, "not evaluated")


def with_gate(status: dict[str, str], gates: dict[str, str] | None, model_of) -> dict[str, str]:
    """Perplexity statuses with the task gate on top: an option whose task scores fail the gate is never kept."""
    return {name: "fails the task gate" if gate_of(gates, model_of(name)) == "fails" else s
            for name, s in status.items()}


def _table(options: list[dict], columns: dict[str, tuple[str, str]], front: list[str], extra=None) -> str:
    """The options as a small table: one column per axis (value [interval]) and whether it is on the frontier."""
    rows = [{"option": o["name"] + (" (baseline)" if o.get("baseline") else ""),
             **{title: value_text(o["axes"].get(key), unit, signed=key == "quality") for key, (title, unit) in
                columns.items()},
             **(extra(o) if extra else {}), "on the frontier": "yes" if o["name"] in front else "no"}
            for o in options]
    return markdown(pd.DataFrame(rows))


def quantize_facts(quantize: list[dict], inference: list[dict], baseline: str, tolerance: float,
                   gates: dict[str, str] | None = None) -> dict | None:
    options = opts.quantize_options(quantize, inference, baseline)
    if not options:
        return None
    model_of = {o["name"]: "base" if o["baseline"] else evaluated_name("quantized", o["name"]) for o in options}
    quality = {o["name"]: "within" if o["baseline"] else quality_status(o["axes"]["quality"], tolerance)
               for o in options}  # the perplexity against the tolerance; status adds the task gate to it
    status = with_gate(quality, gates, model_of.get)
    kept = [o for o in options if status[o["name"]] == "within"]
    pick = min(kept, key=lambda o: o["axes"]["memory"]["value"]) if kept else None
    front = frontier(options, {"memory": "min", **SPEED, **QUALITY})
    base = next((o for o in options if o["baseline"]), None)
    smaller = base["axes"]["memory"]["value"] / pick["axes"]["memory"]["value"] if pick and base else None
    return {"options": options, "pick": pick, "status": status, "quality": quality, "baseline": baseline, "front": front,
            "smaller": smaller,
            "speed": speed_word(pick["axes"]["speed"]) if pick else None,
            "by_status": {s: [n for n, v in status.items() if v == s and n != baseline]
                          for s in ("within", "beyond", NOT_DECIDED, "not measured", "fails the task gate")},
            "table": _table(options, {"memory": ("footprint", " MiB"), "quality": ("perplexity change", "%"),
                                      "speed": ("decode speed × baseline", "")}, front,
                            lambda o: {"quality vs tolerance": quality[o["name"]],
                                       "task gate": gate_of(gates, model_of[o["name"]])})}


def inference_facts(inference: list[dict], quantize: list[dict], tolerance: float,
                    gates: dict[str, str] | None = None, finetune: list[dict] = (),
                    merge: list[dict] = ()) -> dict | None:
    options = opts.inference_options(inference, quantize, finetune, merge)
    if not options:
        return None
    model_of = {o["name"]: evaluated_name(o["kind"], o["of"]) for o in options}
    quality = {o["name"]: "within" if o["baseline"] else quality_status(o["axes"]["quality"], tolerance)
               for o in options}
    status = with_gate(quality, gates, model_of.get)
    base = next((o for o in options if o["baseline"]), None)
    faster = [o for o in options if not o["baseline"] and speed_word(o["axes"]["speed"]) == "faster"]
    kept = [o for o in faster if status[o["name"]] == "within"]
    pick = winner(kept, "speed", "max") if len(kept) > 1 else (kept[0]["name"] if kept else None)
    front = frontier(options, {"memory": "min", **SPEED, **QUALITY})
    top = best_point([o for o in options if not o["baseline"]], "speed", "max")
    return {"options": options, "pick": next((o for o in options if o["name"] == pick), None), "base": base,
            "status": status, "quality": quality, "faster": [o["name"] for o in faster], "front": front,
            "top": next((o for o in options if o["name"] == top), None),
            "top_word": speed_word(next(o for o in options if o["name"] == top)["axes"]["speed"]) if top else None,
            "table": _table(options, {"memory": ("footprint", " MiB"), "speed": ("decode speed × base", ""),
                                      "quality": ("perplexity change", "%")}, front,
                            lambda o: {"speed verdict": "baseline" if o["baseline"] else speed_word(o["axes"]["speed"]),
                                       "quality vs tolerance": quality[o["name"]],
                                       "task gate": gate_of(gates, model_of[o["name"]])}),
            "gate_failed_faster": [o["name"] for o in faster if status[o["name"]] == "fails the task gate"]}


# Settings that change what a run learns: when runs differ in them, their losses compare settings, not methods.
LEARNING_SETTINGS = ("learning_rate", "max_steps", "batch_size", "gradient_accumulation_steps", "lr_scheduler",
                     "warmup_steps", "seed")


FINETUNE_AXES = ("memory", "step_ratio", "quality")  # lower is better on each


def _beats(a: dict, b: dict, key: str, runs: dict, bench_finetune: list[dict]) -> bool:
    """Whether run a beats run b on one axis, by the pair's own comparison where the records hold one: step time
    by b's step over a's (records.step_ratio: interleaved, else their steps paired, else their runs' intervals),
    perplexity by b's change over a's on the same rows; else (memory: peaks ± their measured error) by separated
    intervals (report.dominance.beats)."""
    ra, rb = runs[a["name"]], runs[b["name"]]
    if key == "step_ratio":
        ratio = records.step_ratio(ra, rb, bench_finetune, SENTINEL_TOLERANCE)
        if ratio:
            return ratio["verdict"] == "slower"
    if key == "quality":
        change = opts.paired_axis(ra.get("validation_after"), rb.get("validation_after"))
        if change and change["lo"] is not None:
            return change["lo"] > 0
    return beats(a["axes"].get(key), b["axes"].get(key), "min")


def finetune_front(options: list[dict], finetune: list[dict], bench_finetune: list[dict]) -> tuple[list, dict]:
    """The fine-tuning frontier and each axis's winner, every pair of runs compared by its own measurement (_beats):
    two runs' step times over the reference's are not their ratio to each other. A run is dominated where another
    beats it on an axis and loses on none, both measured on the same axes (report.dominance.frontier's rule)."""
    runs = {r["run"]: r for r in records.ok(finetune)}

    def wins(a: dict, b: dict) -> list[str]:
        return [k for k in FINETUNE_AXES if _beats(a, b, k, runs, bench_finetune)]

    def dominates(a: dict, b: dict) -> bool:
        if any((a["axes"].get(k) is None) != (b["axes"].get(k) is None) for k in FINETUNE_AXES):
            return False
        return bool(wins(a, b)) and not wins(b, a)

    others = {o["name"]: [p for p in options if p is not o] for o in options}
    front = [o["name"] for o in options if not any(dominates(p, o) for p in others[o["name"]])]
    return front, {k: next((o["name"] for o in options if others[o["name"]] and all(
        _beats(o, p, k, runs, bench_finetune) for p in others[o["name"]])), None) for k in FINETUNE_AXES}


def finetune_facts(finetune: list[dict], bench_finetune: list[dict] = ()) -> dict | None:
    options = opts.finetune_options(finetune, bench_finetune)
    if not options:
        return None
    confounds = [{"setting": k, "values": {o["name"]: o["settings"].get(k) for o in options}}
                 for k in LEARNING_SETTINGS if len({repr(o["settings"].get(k)) for o in options}) > 1]
    front, winners = finetune_front(options, finetune, bench_finetune)
    return {"options": options, "front": front, "reference": options[0], "confounds": confounds,
            "kind": options[0]["memory_kind"], "winners": winners,
            "best": {k: best_point(options, k, "min") for k in FINETUNE_AXES},
            "without_interval": {k: any((o["axes"].get(k) or {}).get("lo") is None for o in options)
                                 for k in FINETUNE_AXES},
            "memory_error_pct": (options[0]["axes"].get("memory") or {}).get("error_pct"),
            "table": finetune_table(options, front)}


def finetune_table(options: list[dict], front: list[str]) -> str:
    """The fine-tuning options as a table, its "on the frontier" column from `front` (finetune_front's)."""
    return _table(options, {"step": ("median step", " s"), "step_ratio": (f"step × {options[0]['name']}'s", ""),
                            "quality": ("val perplexity change", "%")}, front,
                  lambda o: {"method": o["method"], "peak memory": memory_text(o["axes"].get("memory")),
                             "step verdict": "baseline" if o["baseline"] else step_word(o["axes"]["step_ratio"])})


def memory_text(a: dict | None) -> str:
    """A training peak with its measured error (not an interval: one run each), or alone where none was measured."""
    if not a or a.get("value") is None:
        return "-"
    error = a.get("error_pct")
    return f"{a['value']:,.0f} MiB" + (f" ± {percent(error, signed=False)}% (measured error)" if error is not None
                                       else "")


def step_word(a: dict | None) -> str:
    """A step-time ratio over the reference run in the one vocabulary (above 1: slower)."""
    if not a:
        return "not measured"
    return compare(a["value"], a["lo"], a["hi"], n=a.get("n"), higher="slower", lower="faster", why=a.get("why"))


def attention_facts(attention: list[dict]) -> dict | None:
    options, cell = opts.attention_options(attention)
    if len(options) < 2:
        return None
    faster = [o for o in options if not o["baseline"] and speed_word(o["axes"]["speed"]) == "faster"]
    pick = (winner(faster, "speed", "max") if len(faster) > 1 else faster[0]["name"]) if faster else None
    front = frontier(options, {"speed": "max", "memory": "min"})
    return {"options": options, "cell": cell, "front": front, "faster": [o["name"] for o in faster],
            "memory_error_pct": (options[0]["axes"].get("memory") or {}).get("error_pct"),
            "pick": next((o for o in options if o["name"] == pick), None),
            "table": _table(options, {"speed": ("speed × eager (interleaved)", ""),
                                      "memory": (f"peak over the start (`{options[0].get('memory_kind')}`)",
                                                 " MiB"),
                                      "agreement": ("max abs difference vs eager", "")}, front,
                            lambda o: {"verdict": "baseline" if o["baseline"] else speed_word(o["axes"]["speed"])})}


def merge_facts(merge: list[dict]) -> list[dict]:
    out = []
    for job in records.ok(merge):
        options = opts.merge_options(job)
        if len(options) < 2:
            continue
        quality_winner = winner(options, "quality", "min")
        out.append({"run": job["run"], "options": options, "closest": winner(options, "kl", "min"),
                    "best_quality": quality_winner, "lowest_point": best_point(options, "quality", "min"),
                    "table": _table(options, {"kl": ("mean KL to the adapter", ""),
                                              "quality": ("perplexity change vs adapter", "%")},
                                    frontier(options, {"kl": "min", "quality": "min"}),
                                    lambda o: {"perplexity": f"{o['perplexity']:.4g}"})})
    return out


def facts(metrics: dict, cfg: dict) -> dict:
    tolerance = cfg["tolerance"]["perplexity_pct"]
    gates = task_gates(metrics.get("evaluate", []))
    return {"tolerance": tolerance, "baseline": cfg["report"]["baseline_scheme"], "gates": gates,
            "quantize": quantize_facts(metrics["quantize"], metrics["bench_inference"], cfg["report"]["baseline_scheme"],
                                       tolerance, gates),
            "finetune": finetune_facts(metrics["finetune"], metrics.get("bench_finetune", [])),
            "inference": inference_facts(metrics["bench_inference"], metrics["quantize"], tolerance, gates,
                                         metrics["finetune"], metrics["merge"]),
            "attention": attention_facts(metrics["bench_attention"]),
            "merge": merge_facts(metrics["merge"])}


def run_size(cfg: dict) -> dict:
    return {"steps": cfg["finetune"]["defaults"]["max_steps"], "quantize_rows": cfg["quantize"]["eval_rows"],
            "finetune_rows": cfg["finetune"]["defaults"]["eval_rows"],
            "inference_repeats": cfg["bench_inference"]["repeats"]}


def lines(facts: dict, cfg: dict) -> list[str]:
    """The decisions option by option (details.md), rendered from the decisions' facts (decisions.build), never
    computed here again."""
    return [render("advice.md.j2", size=run_size(cfg), **facts)]


def glance(decisions: dict, cfg: dict, metrics: dict) -> list[str]:
    """The glance at the top of report.md, read in a minute: the run's scale, then a short line per question
    (report.short_glance); each question's full line goes to details.md (every_answer)."""
    size = run_size(cfg) | {"rows": _rows(cfg), "prompts": prompt_count(cfg, metrics)}
    return [render("glance.md.j2", scale=short_glance.scale(size, metrics["base_model"][0]),
                   questions=list(short_glance.lines(decisions).values()), full=short_glance.FULL)]


def _rows(cfg: dict) -> str:
    """The validation rows the perplexities rest on, as a range where the stages read different numbers of them."""
    rows = sorted({cfg[s]["eval_rows"] for s in ("quantize", "qat", "prune") if "eval_rows" in cfg.get(s, {})}
                  | {cfg["finetune"]["defaults"]["eval_rows"]})
    return f"{rows[0]}–{rows[-1]}" if len(rows) > 1 else str(rows[0])


def every_answer(decisions: dict) -> str:
    """details.md's full answers: each question's line with every option's cost, then the facts that hold."""
    facts = [f"- {fact(f)}" for f in decisions.get("facts", [])]
    # the lines' links are report.md's: from details.md its own sections are '#...' and report.md's 'report.md#...'
    lines = [line.replace("](#", "](report.md#").replace("](details.md#", "](#") for line in question_lines(decisions)]
    return "## Every answer in full\n\n" + "\n".join(lines) + (
        "\n\n" + "\n".join(facts) if facts else "") + "\n"
