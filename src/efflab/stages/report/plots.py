"""The report's plots, each drawn from a stage's records or table (conventions: report.plotting). The benchmarks'
plots are in report.bench_plots; report.draw draws each part's plots (report.parts) with them."""
from __future__ import annotations

import textwrap
from pathlib import Path

import matplotlib.ticker
import pandas as pd

from ... import records
from ...measure.timing import SENTINEL_TOLERANCE
from .glance import b_min_text
from .plotting import (
    label_column,
    legend_below,
    legend_beside,
    plt,
    ratio_rows,
    save_figure,
    spread_bars,
    spread_top,
    spread_values,
    spread_words,
    verdict_colour,
)
from .spread import CI, as_ratio, of_axis, of_change, spread, text
from .writing import MiB, setting_text


def plot_quantize(rows: list[dict], path: Path, tolerance_pct: float, question: dict | None = None) -> None:
    """Footprint from zero; the perplexity change over the baseline with its paired interval, against zero and the
    tolerance line that decides which scheme keeps quality (tolerance.perplexity_pct), each bar marked with the
    quantization decision's quality verdict (decisions.json)."""
    ok = records.ok(rows)
    x, names = list(range(len(ok))), [r["scheme"] for r in ok]
    changes = [of_change(r.get("perplexity_change")) or spread(r.get("perplexity_change_pct")) for r in ok]
    fig, (mem_ax, ppl_ax) = plt.subplots(1, 2, figsize=(10, 4.4))
    mem_ax.bar(x, [r["memory_footprint_bytes"] / MiB for r in ok], color="tab:blue", alpha=0.8)
    mem_ax.set_ylabel("model footprint (MiB)")
    mem_ax.set_title("Memory bought")
    ppl_ax.bar(x, spread_values(changes), color="tab:red", alpha=0.7)
    kinds = spread_bars(ppl_ax, x, changes)
    ppl_ax.axhline(0, color="black", lw=0.8)
    ppl_ax.axhline(tolerance_pct, color="grey", lw=0.8, ls="--",
                   label=f"tolerance (+{tolerance_pct:g}%): within only where the whole interval is below")
    _mark_quality(ppl_ax, names, changes, question)
    legend_below(ppl_ax)
    ppl_ax.set_ylabel("validation perplexity change vs baseline (%)\n"
                      + spread_words(kinds, "no paired interval recorded"))
    ppl_ax.set_title("Perplexity paid (same validation rows)")
    for ax in (mem_ax, ppl_ax):
        ax.set_xticks(x, names)
        ax.set_xlabel("scheme")
    fig.suptitle("Post-training quantization: memory bought vs perplexity paid")
    save_figure(fig, path)


def _mark_quality(ax, names: list[str], changes: list, question: dict | None) -> None:
    """Above each bar, its quality verdict as the decision says it (decisions.json's words)."""
    said = {o["name"]: o["axes"]["quality"]["verdict"] for o in (question or {}).get("options", [])
            if o["axes"].get("quality")}
    for i, (name, c) in enumerate(zip(names, changes)):
        if name in said:
            ax.annotate(said[name], (i, spread_top(c)), xytext=(0, 3), textcoords="offset points", ha="center",
                        va="bottom", fontsize=8, color=verdict_colour(said[name]))
    ax.margins(y=0.15)


def _prune_ratio(change: dict | None, after: dict, base: dict) -> dict:
    """Perplexity over the base model's: paired, with its interval, where recorded; else the two evaluations'."""
    return as_ratio(of_change(change)) or spread(after["perplexity"] / base["perplexity"])


def plot_prune(rows: list[dict], path: Path) -> None:
    """Per strategy: the share of parameters kept against the perplexity over the base model's (log), pruned and
    after LoRA healing."""
    ok = records.ok(rows)
    kept = [100 * r["parameter_ratio"] for r in ok]
    pruned = [_prune_ratio(r["pruned"].get("perplexity_change"), r["pruned"]["validation"], r["base"]["validation"])
              for r in ok]
    healed = [_prune_ratio(h.get("perplexity_change"), h["validation"], r["base"]["validation"])
              if (h := r.get("healing")) and records.is_ok(h) and "validation" in h else None for r in ok]
    fig, ax = plt.subplots(figsize=(10, max(4.5, 0.3 * len(ok) + 2.5)))
    ax.scatter(kept, spread_values(pruned), color="tab:purple", zorder=4, label="pruned")
    kinds = spread_bars(ax, kept, pruned, "tab:purple")
    ax.scatter(kept, spread_values(healed), color="tab:green", marker="v", zorder=4,
               label="after LoRA healing" if any(healed) else None)
    kinds |= spread_bars(ax, kept, healed, "tab:green")
    for x, before, after in zip(kept, pruned, healed):
        if after:
            ax.annotate("", (x, after["value"]), (x, before["value"]),
                        arrowprops={"arrowstyle": "->", "color": "tab:green", "shrinkA": 5, "shrinkB": 5})
    ax.axhline(1, color="grey", lw=0.8, ls=":")
    ax.scatter([100], [1], color="grey", marker="s", zorder=4, label="the base model (100%, ratio 1)")
    ax.set_yscale("log")
    every = [s for s in pruned + healed if s] + [spread(1.0)]
    ax.set_ylim(min(s["lo"] or s["value"] for s in every) / 1.6, max(s["hi"] or s["value"] for s in every) * 1.6)
    ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    ax.set_xlim(max(0, min(kept, default=0) - 15), 104)  # from the smallest model kept to the base model
    ax.set_xlabel("parameters kept (%)")
    ax.set_ylabel(f"validation perplexity ÷ base model's (log)\n{spread_words(kinds, 'no paired interval recorded')}")
    ax.set_title("Structured pruning: parameters removed vs perplexity paid")
    label_column(ax, list(zip(kept, spread_values(pruned))),
                  [f"{r['strategy']}: ×{text(p)}" + (f" → ×{text(h)} healed" if h else "")
                   for r, p, h in zip(ok, pruned, healed)], ["black"] * len(ok))
    legend_below(ax, ncol=3)
    save_figure(fig, path)


def _qat_change(option: dict, job: dict) -> dict | None:
    """A width's perplexity change over the full-precision fine-tune (%): the decision's, paired row by row with
    its 95% interval; for a record without per-row losses, its two evaluations' ratio, a point without one."""
    if option["axes"].get("quality"):
        return of_axis(option["axes"]["quality"])
    v = next((v for v in job["variants"] if (v["method"], v["bits"]) == (option["method"], option["bits"])), {})
    reference = job.get("reference_perplexity")
    return spread(100 * (v["perplexity"] / reference - 1)) if records.is_ok(v) and reference else None


def _qat_answer(question: dict) -> str:
    """The decision's answer: each method's fewest bits within the tolerance (B_min), or none, and where not."""
    return "fewest bits within the tolerance: " + ", ".join(f"{m.upper()} {b_min_text(question, m, bold=False)}"
                                                              for m in question["answer"])


def plot_qat(question: dict, job: dict, path: Path, tolerance_pct: float) -> None:
    """The precision range test: per method (PTQ, QAT) and width, the perplexity change over the full-precision
    fine-tune with its paired 95% interval, against the fine-tune (0) and the tolerance that decides it
    (tolerance.perplexity_pct); each point labelled with the decision's verdict (decisions.json), word for word."""
    fig, ax = plt.subplots(figsize=(10, 4.5))
    kinds, placed, texts, colours = set(), [], [], []
    for k, (method, colour) in enumerate((("ptq", "tab:red"), ("qat", "tab:blue"))):
        mine = [o for o in question["options"] if o["method"] == method]
        x, changes = [o["bits"] + 0.08 * (2 * k - 1) for o in mine], [_qat_change(o, job) for o in mine]
        # a line only between widths with none between them: 4 and 8 bits joined would draw 5-7, never measured
        joined = all(b - a == 1 for a, b in zip([o["bits"] for o in mine], [o["bits"] for o in mine][1:]))
        ax.plot(x, spread_values(changes), "o-" if joined else "o", color=colour, label=method.upper())
        kinds |= spread_bars(ax, x, changes, colour)
        for xi, c, o in ((xi, c, o) for xi, c, o in zip(x, changes, mine) if c):
            placed.append((xi, c["value"]))
            texts.append(f"{method.upper()} {o['bits']} bits: {text(c, '{:+.1f}%')}: {o['verdict']}")
            colours.append(colour)
    ax.axhline(0, color="grey", lw=0.8, label="full precision (fine-tuned)")
    ax.axhline(tolerance_pct, color="grey", lw=0.8, ls="--", label=f"tolerance (+{tolerance_pct:g}%)")
    ax.set_xticks(sorted({o["bits"] for o in question["options"]}))
    ax.margins(x=0.12)
    wide = max((y for _, y in placed), default=0) > 100  # a width that breaks the model: symlog keeps the rest legible
    if wide:
        ax.set_yscale("symlog", linthresh=10)
    label_column(ax, placed, texts, colours)
    ax.set_xlabel("weight bits (per-group symmetric, round to nearest)")
    ax.set_ylabel(f"validation perplexity change vs\nfull precision (%, same rows{'; log beyond ±10%' if wide else ''})"
                  f"\n({spread_words(kinds, 'no paired interval recorded')})")
    ax.set_title(f"Precision range test: post-training (PTQ) vs quantization-aware (QAT)\n{_qat_answer(question)}",
                 fontsize=10)
    legend_below(ax, ncol=4)
    save_figure(fig, path)


SOURCES = {"interleaved": "interleaved, one process", "paired": "paired steps, same batches",
           "runs": "the runs' own intervals"}


def _knob_ratios(rows: list[dict], bench_finetune: list[dict]) -> tuple[list[str], list, list[str]]:
    """Each knob pair's step-time ratio, later run over earlier, as the knob table gives it (records.step_ratio:
    bench_finetune's interleaved steps where it ran the pair): labels, spreads, verdicts."""
    labels, ratios, verdicts = [], [], []
    for knob, was, now, a, b in records.knob_pairs(rows):
        ratio = records.step_ratio(a, b, bench_finetune, SENTINEL_TOLERANCE) or {}
        lo, hi = ratio.get("ci95") or (None, None)
        labels.append(f"{b['run']} ÷ {a['run']}\n({knob}: {setting_text(was)} → {setting_text(now)}; "
                      f"{SOURCES.get(ratio.get('source'), 'not timed')})")
        ratios.append(spread(ratio.get("median"), lo, hi, CI, ratio.get("n")))
        verdicts.append(ratio.get("verdict", "not measured"))
    return labels, ratios, verdicts


def plot_finetune(question: dict, rows: list[dict], bench_finetune: list[dict], path: Path) -> None:
    """What a step costs, as ratios the verdicts are decided on (the Pareto plot shows absolute step times):
    above, each run's step time over the reference run's with the fine-tuning decision's verdict (decisions.json);
    below, each knob pair's, as the knob table has it; 95% intervals, or none where the runs give none, against 1."""
    knobs = _knob_ratios(rows, bench_finetune)
    options = question["options"]
    fig, (run_ax, knob_ax) = plt.subplots(2, 1, figsize=(10, 0.5 * (len(options) + len(knobs[0])) + 3.2),
                                          gridspec_kw={"height_ratios": [len(options), max(1, len(knobs[0]))]})
    ratios = [of_axis(o["axes"]["step_ratio"]) for o in options]
    names = [o["name"] if o["baseline"] or not o["axes"]["step_ratio"] else
             f"{o['name']}\n({SOURCES.get(o['axes']['step_ratio'].get('source'), 'not timed')})" for o in options]
    kinds = ratio_rows(run_ax, names, ratios,
                       [o["axes"]["step_ratio"]["verdict"] if o["axes"]["step_ratio"] else "not measured"
                        for o in options], ["tab:gray" if o["baseline"] else "tab:blue" for o in options])
    run_ax.set_xlabel(f"step time ÷ {question['baseline']}'s (< 1: faster)\n({spread_words(kinds)})")
    kinds = ratio_rows(knob_ax, *knobs, ["tab:purple"] * len(knobs[0]))
    knob_ax.set_xlabel(f"step time ratio of runs that differ in one knob (< 1: faster)\n({spread_words(kinds)})")
    if not knobs[0]:
        knob_ax.text(0.5, 0.5, "no two runs differ in one knob", ha="center", va="center", transform=knob_ax.transAxes)
    fig.suptitle("Fine-tuning: what a step costs, against the reference run and knob by knob")
    save_figure(fig, path)


def _quality_text(p: dict, words: dict) -> str:
    if p["baseline"]:
        return words["baseline"]
    if p["quality"]:
        return "perplexity " + text(p["quality"], "{:+.1f}%")
    if p["quality_point"] is not None:
        return f"perplexity {p['quality_point']:+.1f}% (unpaired: no interval)"
    return words["missing"]


# The axes whose verdicts a frontier plot's label states (memory is on the x axis, exact or one measurement).
SAID_AXES = {"speed": "speed", "step_ratio": "step time", "quality": "perplexity"}


def _front_label(p: dict, words: dict, option: dict | None, on: bool) -> str:
    """'name: on the frontier; perplexity +1.0% [..]', and under it the decision's verdict on each axis it states."""
    said = [f"{SAID_AXES[k]} {a['verdict']}" for k, a in ((option or {}).get("axes") or {}).items()
            if k in SAID_AXES and a and a["verdict"] not in ("baseline", "-")]
    verdicts = textwrap.fill("; ".join(said), 72, initial_indent="    ", subsequent_indent="    ")
    return f"{p['name']}: {'on the frontier' if on else 'dominated'}; {_quality_text(p, words)}" + \
        (f"\n{verdicts}" if said else "")


def _plot_front(points: list[dict], xlabel: str, ylabel: str, title: str, path: Path, words: dict,
                question: dict | None = None) -> None:
    """The options on two axes with the y axis' spread, each marked on or off the decision's frontier (over every
    axis, quality included, by separated intervals: decisions.json's, where given) and labelled with its quality
    and the decision's verdicts; no line joins them: a line through a frontier of three axes drawn on two would
    claim what was not measured."""
    placed = [p for p in points if p["x"] and p["y"]]
    front = question["frontier"] if question else [p["name"] for p in points if not p["dominated"]]
    options = {o["name"]: o for o in (question or {}).get("options", [])}
    fig, ax = plt.subplots(figsize=(11, max(4.5, 0.45 * len(placed) + 2.5)))
    for p in placed:
        on = p["name"] in front
        ax.scatter(p["x"]["value"], p["y"]["value"], s=60, zorder=4, color="tab:green" if on else "white",
                   edgecolor="black" if on else "grey")
    kinds = spread_bars(ax, [p["x"]["value"] for p in placed], [p["y"] for p in placed], "dimgrey")
    x_kinds = spread_bars(ax, [p["y"]["value"] for p in placed], [p["x"] for p in placed], "dimgrey", True)
    ax.set_xlim(0, 1.08 * max((spread_top(p["x"]) for p in placed), default=1))
    ax.set_ylim(bottom=0)
    label_column(ax, [(p["x"]["value"], p["y"]["value"]) for p in placed],
                 [_front_label(p, words, options.get(p["name"]), p["name"] in front) for p in placed],
                 ["black" if p["name"] in front else "grey" for p in placed])
    ax.set_xlabel(xlabel + (f"\n({spread_words(x_kinds)})" if x_kinds else ""))
    ax.set_ylabel(f"{ylabel}\n({spread_words(kinds)})")
    ax.set_title(f"{title}\nfilled: on the frontier (nothing beats it on one axis by separated intervals\n"
                 "without losing on another); open: dominated", fontsize=9)
    missing = [p["name"] for p in points if p not in placed]
    if missing:
        ax.text(0, -0.2, "not placed (an axis not measured): " + ", ".join(missing), transform=ax.transAxes,
                fontsize=8, color="grey")
    save_figure(fig, path)


def plot_finetune_pareto(points: list[dict], path: Path, question: dict | None = None) -> None:
    kind = points[0]["kind"] if points else ""
    _plot_front(points, f"peak training memory (MiB, {kind}; one measurement per run)",
                f"optimizer step × {next((p['name'] for p in points if p['baseline']), 'the first run')}'s\n(paired; "
                "lower is better)",
                "Fine-tuning: memory, step time and validation perplexity", path,
                {"baseline": "reference for perplexity", "missing": "perplexity not paired with the reference's rows"},
                question)


def plot_inference_pareto(points: list[dict], path: Path, question: dict | None = None) -> None:
    _plot_front(points, "model footprint (MiB)", "generation speed × the base model's\n(whole generations, "
                "prefill included;\ninterleaved; batch 1, KV cache)",
                "Inference variants: footprint, generation speed and perplexity change", path,
                {"baseline": "the base model", "missing": "quality not measured"}, question)


def smoothing_window(steps: int) -> int:
    """The width of the centred running mean drawn over a loss curve: about a tenth of its steps, odd so that it
    centres on a step, at least 3 (1: a curve too short to smooth)."""
    return 1 if steps < 3 else max(3, (steps // 10) | 1)


def _validation_points(ax, run: dict | None, last_step: int, colour: str) -> bool:
    """The run's validation loss before training (at step 0, open) and after it (at its last step, filled)."""
    if not run or not run.get("validation_before") or not run.get("validation_after"):
        return False
    ax.scatter([0], [run["validation_before"]["loss"]], s=70, marker="D", facecolor="white", edgecolor=colour,
               zorder=5)
    ax.scatter([last_step], [run["validation_after"]["loss"]], s=70, marker="D", color=colour, edgecolor="black",
               zorder=5)
    return True


def plot_loss(layout, runs: list[str], rows: list[dict], path: Path, identical: list[list[str]] = ()) -> None:
    """Every run's training loss smoothed by a centred running mean (the per-batch curve faint behind it: each
    batch's own loss zigzags with its rows) and its validation loss before and after training as marked points;
    runs that make the same updates (`identical`) get distinct line styles and shrinking markers, so that curves
    lying exactly on top of each other all stay visible."""
    fig, ax = plt.subplots(figsize=(9, 4.5))
    twin, recorded = {run: group[0] for group in identical for run in group[1:]}, {r["run"]: r for r in records.ok(rows)}
    widths, validated = set(), False
    for i, run in enumerate(runs):
        curve = pd.read_csv(layout.out("finetune", run) / "loss.csv")
        if curve.empty:  # the run did not train
            continue
        colour, width = f"C{i % 10}", smoothing_window(len(curve))
        widths.add(width)
        ax.plot(curve["step"], curve["loss"], color=colour, lw=0.8, alpha=0.25)
        ax.plot(curve["step"], curve["loss"].rolling(width, center=True, min_periods=1).mean(), color=colour,
                ls=["-", "--", ":", "-."][i % 4], marker="os^D"[i % 4], markersize=max(3, 9 - 2 * i),
                markevery=max(1, len(curve) // 12), fillstyle="none", lw=1.5,
                label=f"{run} (same as {twin[run]})" if run in twin else run)
        validated |= _validation_points(ax, recorded.get(run), int(curve["step"].iloc[-1]), colour)
    if validated:
        ax.scatter([], [], s=70, marker="D", facecolor="white", edgecolor="black", label="validation loss, before training")
        ax.scatter([], [], s=70, marker="D", color="black", label="validation loss, after training")
    ax.set_xlabel("optimizer step (validation: before training at 0, after it at the last step)")
    smoothed = "/".join(str(w) for w in sorted(widths) if w > 1)
    ax.set_ylabel("loss (nats per response token)\n" + (f"training: centred running mean of {smoothed} steps; "
                                                         "faint: per batch" if smoothed else "training: per batch"))
    ax.set_title("Fine-tuning loss: training (smoothed) and validation")
    legend_beside(ax, loc="upper left", bbox_to_anchor=(1.02, 1), fontsize=8)  # outside: curves may lie anywhere
    save_figure(fig, path)
