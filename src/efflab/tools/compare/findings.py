"""Two runs' findings set side by side: each figure both hold as B over A, with an interval from both runs' intervals
and a verdict in the one vocabulary (measure.stats.compare: improved / regressed where the interval lies wholly on
one side of 1, same within ±X% where it lies inside the band, else not decided at this size), or why the two figures
are not comparable."""
from __future__ import annotations

from ... import questions
from ...measure.bounds import BOUNDS, at_bound
from ...measure.env import cpu_kind
from ...measure.stats import compare
from .runs import Run

# How a metric's two figures are set side by side: as a ratio of the figures or, for a change in % over the run's own
# baseline (perplexity), as a ratio of (1 + change); which way is better; and whether it is a within-run ratio
# (comparable across machines) or an absolute figure of the machine it ran on (a time, a rate, MiB).
METRICS = {"speed": ("ratio", "max", True), "step_ratio": ("ratio", "min", True), "kl": ("ratio", "min", True),
           "agreement": ("ratio", "min", True), "quality": ("change", "min", True),
           "memory": ("ratio", "min", False), "step": ("ratio", "min", False),
           "time_to_target": ("ratio", "min", False), "goodput": ("ratio", "max", False),
           "slo_rate": ("ratio", "max", False), "prefix_caching": ("ratio", "max", True)}
# decisions.json's facts state their figure as `value`: what it is, and the stage whose records make it
FACTS = {"qat_step_cost": (("ratio", "min", True), "qat"),
         "qlora_worse_than_base": (("change", "min", True), "finetune"),
         "requantized_merge_loses_the_fine_tune": (("change", "min", True), "merge"),
         "finetune_knobs": (None, "finetune")}
# what every finding rests on: the model and the data
UNDER_ALL = ("base_model", "prepare_data")
SAME_FIGURE = "same figure"
NOT_COMPARABLE = "not comparable: "
SAME_VERDICT = "same verdict"


def stage_of(finding: str) -> str | None:
    """The stage whose records make a finding: its question's (efflab.questions), a fact's, or the stage it names."""
    head = finding.split(":", 1)[0].split(".", 1)[0]
    if head in questions.BY_KIND:
        return questions.BY_KIND[head].stage
    return FACTS[head][1] if head in FACTS else head


def how(finding: str, metric: str):
    """(ratio or change, better, within-run) for a finding's metric; None for a verdict without a figure."""
    if metric == "value":
        return FACTS.get(finding.split(":", 1)[0], (None,))[0]
    return METRICS.get(metric)


def _flat(settings: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in settings.items():
        out |= _flat(v, f"{prefix}{k}.") if isinstance(v, dict) and v else {f"{prefix}{k}": v}
    return out


def params_differ(a: Run, b: Run, stage: str) -> str | None:
    """How a stage's params differ between the runs (the keys where both records keep their settings, else its
    section's hash), or None where they do not or neither run has the stage."""
    sa, sb = a.stages.get(stage), b.stages.get(stage)
    if not sa or not sb:
        return None
    if sa.settings and sb.settings:
        fa, fb = _flat(sa.settings), _flat(sb.settings)
        keys = sorted(k for k in fa.keys() | fb.keys() if fa.get(k) != fb.get(k))
        return ", ".join(f"{k}: {fa.get(k)!r} → {fb.get(k)!r}" for k in keys) or None
    return f"{stage} section (params hash {'/'.join(sorted(sa.params))} → {'/'.join(sorted(sb.params))})" \
        if sa.params != sb.params else None


def machine_text(machine: dict) -> str:
    return machine.get("gpu") or \
        f"{machine.get('cpu')} {cpu_kind(machine.get('cpu_isa'))}, {machine.get('cpu_cores')} cores"


def versions_differ(a: dict, b: dict) -> str | None:
    keys = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))
    return ", ".join(f"{k} {a.get(k)} → {b.get(k)}" for k in keys) or None


def why_not(a: Run, b: Run, stage: str | None, absolute: bool) -> str | None:
    """Why a finding of `stage` is not comparable between the runs, or None."""
    for s in dict.fromkeys(([stage] if stage else []) + list(UNDER_ALL)):
        if differ := params_differ(a, b, s):
            return f"{s}'s params differ ({differ})"
    if not absolute:
        return None
    sa = a.stages.get(stage) or a.stages.get("base_model")
    sb = b.stages.get(stage) or b.stages.get("base_model")
    if not sa or not sb:
        return "no environment recorded: an absolute figure is compared on one machine only"
    if sa.machine != sb.machine:
        return (f"another machine ({machine_text(sa.machine)} → {machine_text(sb.machine)}): across machines only "
                "within-run ratios are compared")
    if differ := versions_differ(sa.packages, sb.packages):
        return f"other library versions ({differ}): an absolute figure is compared on one stack only"
    return None


def _zero(metric: str, value: float) -> bool:
    return value == 0 or (metric in BOUNDS and at_bound(metric, value))


def _ratio(kind: str, a: dict, b: dict) -> tuple:
    """B over A with the interval from both runs' intervals (B's low end over A's high end, B's high over A's low);
    no interval where either run has none."""
    def scaled(x):
        return None if x is None else (1 + x / 100 if kind == "change" else x)
    va, vb = scaled(a["value"]), scaled(b["value"])
    ends = [scaled(a["lo"]), scaled(a["hi"]), scaled(b["lo"]), scaled(b["hi"])]
    if None in ends or min(ends[:2]) <= 0:
        return vb / va, None, None
    return vb / va, ends[2] / ends[1], ends[3] / ends[0]


def verdict(a: dict, b: dict, said: tuple | None, why: str | None) -> dict:
    """One finding of both runs (`said`: how its metric is compared, findings.how): B over A where both have a
    figure, its interval, and the verdict."""
    figure = ("value", "lo", "hi", "n", "verdict")
    row = {"ratio": None, "lo": None, "hi": None}
    if all(a.get(k) == b.get(k) for k in figure):
        return row | {"verdict": SAME_FIGURE}
    if why:
        return row | {"verdict": NOT_COMPARABLE + why}
    if said is None or a["value"] is None or b["value"] is None:
        return row | {"verdict": SAME_VERDICT if a["verdict"] == b["verdict"] else
                      f"verdict changed: {a['verdict']} → {b['verdict']}"}
    kind, better, _ = said
    za, zb = _zero(a["metric"], a["value"]), _zero(a["metric"], b["value"])
    if kind == "ratio" and (za or zb):  # a KL or a difference of 0 (to rounding) has no ratio
        if za and zb:
            return row | {"verdict": "same: 0 in both"}
        worse = za if better == "min" else zb
        return row | {"verdict": f"{'regressed' if worse else 'improved'} ({'from' if za else 'to'} 0: no ratio)"}
    ratio, lo, hi = _ratio(kind, a, b)
    words = ("improved", "regressed") if better == "max" else ("regressed", "improved")
    return {"ratio": ratio, "lo": lo, "hi": hi, "verdict": compare(ratio, lo, hi, higher=words[0], lower=words[1])}


def changed(v: str) -> bool:
    return v in ("improved", "regressed") or v.startswith(("improved (", "regressed (", "verdict changed"))


def not_comparable(v: str) -> bool:
    return v.startswith(NOT_COMPARABLE)


def pair(a: Run, b: Run) -> dict:
    """Every finding both runs hold, side by side, and those only one holds."""
    rows = []
    for key in (k for k in a.findings if k in b.findings):
        fa, fb = a.findings[key], b.findings[key]
        said = how(key[0], key[2])
        why = why_not(a, b, stage_of(key[0]), absolute=bool(said) and not said[2])
        rows.append({"finding": key[0], "subject": key[1], "metric": key[2],
                     "a": {k: fa.get(k) for k in ("value", "lo", "hi", "n", "verdict")},
                     "b": {k: fb.get(k) for k in ("value", "lo", "hi", "n", "verdict")},
                     **verdict(fa, fb, said, why)})
    return {"rows": rows, "only_a": [list(k) for k in a.findings if k not in b.findings],
            "only_b": [list(k) for k in b.findings if k not in a.findings]}


def answers_changed(a: Run, b: Run) -> list[dict]:
    """The questions both runs answer whose answer differs, with the params of the stage that answers them."""
    out = []
    for key in (k for k in a.answers if k in b.answers and a.answers[k] != b.answers[k]):
        stage = stage_of(key)
        out.append({"question": key, "a": a.answers[key], "b": b.answers[key], "stage": stage,
                    "params": params_differ(a, b, stage) if stage else None})
    return out
