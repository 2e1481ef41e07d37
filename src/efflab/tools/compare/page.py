"""The comparison as a page and its rows as JSON (results/compare/<A>-vs-<B>/): who the runs are and what differs
between them (machine, library versions, params), the questions whose answer changed, the findings that changed,
those not comparable grouped by reason, and how many held."""
from __future__ import annotations

import json
import shutil
import tempfile
from collections import Counter
from pathlib import Path

from ...measure.stats import EQUIVALENCE_MARGIN
from .findings import NOT_COMPARABLE, changed, machine_text, not_comparable, params_differ, versions_differ
from .runs import Run

INTERVAL = ("B over A, with the interval from both runs' intervals (B's low end over A's high end, B's high end over "
            "A's low end): where each run's is a 95% interval, theirs covers at least 95%; a perplexity change is "
            "compared as 1 + change, so a ratio of the two runs' perplexity ratios to their own baseline")


def _figure(f: dict) -> str:
    if f["value"] is None:
        return f["verdict"] or "-"
    ends = f" [{f['lo']:.4g}, {f['hi']:.4g}]" if f["lo"] is not None and f["hi"] is not None and f["lo"] != f["hi"] \
        else ""
    return f"{f['value']:.4g}{ends}" + (f" (n={f['n']})" if f["n"] else "")


def _ratio(r: dict) -> str:
    if r["ratio"] is None:
        return "-"
    return f"{r['ratio']:.3g}" + (f" [{r['lo']:.3g}, {r['hi']:.3g}]" if r["lo"] is not None else " (no interval)")


def _differs(a: Run, b: Run) -> list[str]:
    """What differs between the runs: commit, machine, library versions, and each stage's params."""
    ba, bb = a.stages.get("base_model"), b.stages.get("base_model")
    said = [f"- commit: {a.commit} → {b.commit}" if a.commit != b.commit else f"- commit: {a.commit} in both"]
    if ba and bb:
        said.append(f"- machine: {machine_text(ba.machine)}" + (f" → {machine_text(bb.machine)}"
                                                                 if ba.machine != bb.machine else " in both"))
        said.append(f"- library versions: {versions_differ(ba.packages, bb.packages) or 'the same'}")
    for stage in sorted(a.stages.keys() & b.stages.keys()):
        if differ := params_differ(a, b, stage):
            said.append(f"- {stage}'s params: {differ}")
    return said


def markdown(a: Run, b: Run, paired: dict, answers: list[dict]) -> str:
    rows = paired["rows"]
    moved = [r for r in rows if changed(r["verdict"])]
    apart = Counter(r["verdict"].removeprefix(NOT_COMPARABLE) for r in rows if not_comparable(r["verdict"]))
    counts = Counter("changed" if changed(r["verdict"]) else "not comparable" if not_comparable(r["verdict"])
                     else r["verdict"].split(" (")[0] for r in rows)
    out = [f"# {b.label} against {a.label}", "", f"A: `{a.folder}`. B: `{b.folder}`.", "", "## What differs", "",
           *_differs(a, b), "", "## Questions whose answer changed", ""]
    out += [f"- **{q['question']}**: {json.dumps(q['a'])} → {json.dumps(q['b'])}"
            + (f" ({q['stage']}'s params: {q['params']})" if q["params"] else "") for q in answers] or ["None."]
    out += ["", f"## Findings that changed ({len(moved)} of {len(rows)} both runs hold)", "",
            f"Each is {INTERVAL}. Same within ±{100 * EQUIVALENCE_MARGIN:g}% where that interval lies inside the band. "
            "An absolute figure (a time, a rate, MiB) is compared on one machine and stack only, and is two runs' "
            "measurements: the machine's drift between them is not in the interval.", ""]
    if moved:
        out += ["| finding | subject | metric | A | B | B / A | verdict |", "|---|---|---|--:|--:|--:|---|"]
        out += [f"| {r['finding']} | {r['subject']} | {r['metric']} | {_figure(r['a'])} | {_figure(r['b'])} | "
                f"{_ratio(r)} | {r['verdict']} |" for r in moved]
    else:
        out.append("None.")
    out += ["", "## Not comparable", ""]
    out += [f"- {n} finding{'s' if n != 1 else ''}: {why}" for why, n in apart.most_common()] or ["None."]
    out += ["", "## Every finding", "", "; ".join(f"{v}: {n}" for v, n in sorted(counts.items())) + ".",
            f"Only in A: {len(paired['only_a'])}; only in B: {len(paired['only_b'])} (compare.json lists them).", ""]
    return "\n".join(out)


def write(a: Run, b: Run, paired: dict, answers: list[dict], out: Path) -> Path:
    """compare.md and compare.json into `out`, written whole or not at all."""
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    (staging / "compare.md").write_text(markdown(a, b, paired, answers))
    (staging / "compare.json").write_text(json.dumps(
        {"a": {"label": a.label, "folder": str(a.folder), "commit": a.commit},
         "b": {"label": b.label, "folder": str(b.folder), "commit": b.commit},
         "answers_changed": answers, **paired}, indent=1, default=str) + "\n")
    if out.exists():
        shutil.rmtree(out)
    staging.rename(out)
    return out
