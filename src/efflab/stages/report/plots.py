"""The report's plots, each drawn from a stage's records or table (matplotlib, Agg).

A figure with a spread is drawn with it (report.spread): solid bars for its 95% interval where n gives one,
dashed bars for the range of n values too few for one, no bar for one measurement or an exact count; the axis
label says which. Sizes and rates start at zero, ratios are drawn against a line at 1 and changes against a
line at 0; where points may lie close, their labels sit in a column beside the axes and never overprint.
"""
from __future__ import annotations

import math
from pathlib import Path

import matplotlib
import matplotlib.ticker

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

from ... import records, registry  # noqa: E402
from . import options as opts  # noqa: E402
from .fmt import MiB  # noqa: E402
from .notes import same_updates  # noqa: E402
from .results import absent  # noqa: E402
from .spread import CI, RANGE, as_ratio, of_axis, of_change, of_median, of_ratio, of_speedup, spread, text  # noqa: E402


def _save(fig, path: Path, bottom: float = 0.0) -> None:
    """Laid out to fit its labels and legends, also those beside or under the axes; `bottom`: the share of the
    height kept for a figure legend."""
    fig.tight_layout(rect=(0, bottom, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _values(spreads: list) -> list[float]:
    return [s["value"] if s else math.nan for s in spreads]


def _bars(ax, positions, spreads: list, colour: str = "black", horizontal: bool = False) -> set[str]:
    """Error bars at `positions`: solid for a 95% interval, dashed for a range. Returns the kinds drawn."""
    drawn = set()
    for kind in (CI, RANGE):
        at = [(x, s) for x, s in zip(positions, spreads) if s and s["kind"] == kind]
        if not at:
            continue
        where, values = [x for x, _ in at], [s["value"] for _, s in at]
        err = [[max(0.0, s["value"] - s["lo"]) for _, s in at], [max(0.0, s["hi"] - s["value"]) for _, s in at]]
        xy, key = ((values, where), "xerr") if horizontal else ((where, values), "yerr")
        bars = ax.errorbar(*xy, **{key: err}, fmt="none", ecolor=colour, capsize=3, lw=1.2, zorder=3)
        if kind == RANGE:
            bars.lines[2][0].set_linestyle("--")
        drawn.add(kind)
    return drawn


def _spread_words(kinds: set[str], none: str = "no interval recorded") -> str:
    words = {CI: "bars: 95% CI", RANGE: "dashed bars: range of n < 6, no 95% CI"}
    return "; ".join(words[k] for k in (CI, RANGE) if k in kinds) or none


def _spaced(heights: list[float], gap: float) -> list[float]:
    """Heights in [0, 1] moved apart just enough that neighbours are `gap` apart, in their order."""
    out = []
    for h in heights:
        out.append(max(h, out[-1] + gap) if out else max(h, gap / 2))
    top = 1 - gap / 2
    for i in reversed(range(len(out))):
        top = min(out[i], top)
        out[i], top = top, top - gap
    return out


def _label_column(ax, points: list[tuple], texts: list[str], colours: list[str]) -> None:
    """Each point's text in a column right of the axes (call it once the limits are set), as near its point's
    height as the others leave room for and joined to it by a thin line: however close the points lie, their texts
    never overprint."""
    ax.get_xlim(), ax.get_ylim()  # settle the autoscaled limits before reading heights through them
    heights = [ax.transAxes.inverted().transform(ax.transData.transform(p))[1] for p in points]
    order = sorted(range(len(points)), key=lambda i: heights[i])
    gap = 0.2 / (ax.get_position().height * ax.figure.get_figheight())  # 0.2 inch a line of 8-point text
    for i, y in zip(order, _spaced([min(max(heights[i], 0), 1) for i in order], gap)):
        ax.annotate(texts[i], xy=points[i], xytext=(1.03, y), textcoords="axes fraction", va="center", fontsize=8,
                    color=colours[i], arrowprops={"arrowstyle": "-", "color": "silver", "lw": 0.6, "shrinkB": 4})


def _legend(ax, **kwargs) -> None:
    """The axes' legend, or, where nothing was measured (every cell failed or was unavailable), a note saying so
    instead of an empty legend."""
    if ax.get_legend_handles_labels()[0]:
        ax.legend(**kwargs)
    else:
        ax.text(0.5, 0.5, "nothing measured: see the table for why", ha="center", va="center",
                transform=ax.transAxes, color="grey")


def _below(ax, **kwargs) -> None:
    """The legend under the axes, where it covers no data."""
    _legend(ax, loc="upper center", bbox_to_anchor=(0.5, -0.14), fontsize=8, **kwargs)


def plot_quantize(rows: list[dict], path: Path) -> None:
    """Footprint from zero; the perplexity change over the baseline with its paired interval, against zero."""
    ok = records.ok(rows)
    x, names = list(range(len(ok))), [r["scheme"] for r in ok]
    changes = [of_change(r.get("perplexity_change")) or spread(r.get("perplexity_change_pct")) for r in ok]
    fig, (mem_ax, ppl_ax) = plt.subplots(1, 2, figsize=(10, 4))
    mem_ax.bar(x, [r["memory_footprint_bytes"] / MiB for r in ok], color="tab:blue", alpha=0.8)
    mem_ax.set_ylabel("model footprint (MiB)")
    mem_ax.set_title("Memory bought")
    ppl_ax.bar(x, _values(changes), color="tab:red", alpha=0.7)
    kinds = _bars(ppl_ax, x, changes)
    ppl_ax.axhline(0, color="black", lw=0.8)
    ppl_ax.set_ylabel("validation perplexity change vs baseline (%)\n"
                      + _spread_words(kinds, "no paired interval recorded"))
    ppl_ax.set_title("Perplexity paid (same validation rows)")
    for ax in (mem_ax, ppl_ax):
        ax.set_xticks(x, names)
        ax.set_xlabel("scheme")
    fig.suptitle("Post-training quantization: memory bought vs perplexity paid")
    _save(fig, path)


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
    ax.scatter(kept, _values(pruned), color="tab:purple", zorder=4, label="pruned")
    kinds = _bars(ax, kept, pruned, "tab:purple")
    ax.scatter(kept, _values(healed), color="tab:green", marker="v", zorder=4,
               label="after LoRA healing" if any(healed) else None)
    kinds |= _bars(ax, kept, healed, "tab:green")
    for x, before, after in zip(kept, pruned, healed):
        if after:
            ax.annotate("", (x, after["value"]), (x, before["value"]),
                        arrowprops={"arrowstyle": "->", "color": "tab:green", "shrinkA": 5, "shrinkB": 5})
    ax.axhline(1, color="grey", lw=0.8, ls=":", label="the base model (ratio 1)")
    ax.set_yscale("log")
    every = [s for s in pruned + healed if s] + [spread(1.0)]
    ax.set_ylim(min(s["lo"] or s["value"] for s in every) / 1.6, max(s["hi"] or s["value"] for s in every) * 1.6)
    ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    ax.set_xlim(0, 100)
    ax.set_xlabel("parameters kept (%)")
    ax.set_ylabel(f"validation perplexity ÷ base model's (log)\n{_spread_words(kinds, 'no paired interval recorded')}")
    ax.set_title("Structured pruning: parameters removed vs perplexity paid")
    _label_column(ax, list(zip(kept, _values(pruned))),
                  [f"{r['strategy']}: ×{text(p)}" + (f" → ×{text(h)} healed" if h else "")
                   for r, p, h in zip(ok, pruned, healed)], ["black"] * len(ok))
    _below(ax, ncol=3)
    _save(fig, path)


def plot_qat(df: pd.DataFrame, job: dict | None, path: Path) -> None:
    """Perplexity vs bits for PTQ and QAT (log scale), the full-precision reference and the threshold line."""
    fig, ax = plt.subplots(figsize=(7, 4))
    for label, color in (("PTQ", "tab:red"), ("QAT", "tab:blue")):
        ok = df.dropna(subset=[f"{label} perplexity"])
        ax.plot(ok["bits"], ok[f"{label} perplexity"], "o-", color=color, label=label)
    if job and job.get("reference_perplexity"):
        reference = job["reference_perplexity"]
        ax.axhline(reference, color="grey", lw=0.8, label="full precision (fine-tuned)")
        ax.axhline(job["threshold"] * reference, color="grey", lw=0.8, ls="--",
                   label=f"threshold ({job['threshold']:g}x)")
    ax.set_yscale("log")
    ax.set_xticks(sorted(df["bits"].unique()) if not df.empty else [])
    ax.set_xlabel("weight bits (per-group symmetric, round to nearest)")
    ax.set_ylabel("validation perplexity (log; one evaluation each)")
    ax.set_title("Precision range test: post-training vs quantization-aware training")
    _legend(ax, fontsize=8)
    _save(fig, path)


METHOD_COLOURS = {"naive": "tab:gray", "static": "tab:blue", "continuous": "tab:green"}


def plot_serving(jobs: list[dict], path: Path) -> None:
    """Per method and concurrency: output tokens/s (median over the bursts), the throughput over naive serving
    paired burst round by burst round against a line at 1 (continuous batching's over static batching written
    above its bar), and each request's latency over the pooled bursts (p50 bar, p90 and p99 marks); intervals
    where the bursts give one, dashed ranges where they are too few."""
    cells = [c for job in records.ok(jobs) for c in records.ok(job["cells"])]
    x, colours = list(range(len(cells))), [METHOD_COLOURS.get(c["method"], "tab:olive") for c in cells]
    fig, (tps_ax, vs_ax, lat_ax) = plt.subplots(1, 3, figsize=(max(13, 3 * len(cells) + 3), 4.4))
    rates = [of_median(c.get("output_tokens_per_s")) for c in cells]
    tps_ax.bar(x, _values(rates), color=colours, alpha=0.8)
    kinds = _bars(tps_ax, x, rates)
    tps_ax.set_ylabel("output tokens/s, median over the bursts\n"
                      f"({_spread_words(kinds, 'one burst each: no interval')})")
    tps_ax.set_title("Throughput")
    vs_naive = [spread(1.0) if c["method"] == "naive" else of_ratio(records.serving_ratio(c, "throughput_vs_naive"))
                for c in cells]
    vs_ax.bar(x, _values(vs_naive), color=colours, alpha=0.8)
    kinds = _bars(vs_ax, x, vs_naive)
    vs_ax.axhline(1, color="black", lw=0.8)
    for i, c in zip(x, cells):
        vs_static = of_ratio(records.serving_ratio(c, "continuous_vs_static"))
        if vs_static:
            bar = vs_naive[i] or {}
            top = max(bar.get("hi") or 0.0, bar.get("value") or 0.0)
            vs_ax.annotate(f"× static\n{text(vs_static)}", (i, top), xytext=(0, 4), textcoords="offset points",
                           ha="center", va="bottom", fontsize=7)
    vs_ax.margins(y=0.25)
    vs_ax.set_ylabel(f"output tokens/s × naive's, paired per burst round\n"
                     f"({_spread_words(kinds, 'one burst each: no interval')})")
    vs_ax.set_title("Throughput over naive serving (same rounds)")
    latency = {q: [of_median((c.get("latency_s") or {}).get(q)) for c in cells] for q in ("p50", "p90", "p99")}
    lat_ax.bar(x, _values(latency["p50"]), color=colours, alpha=0.8)
    kinds = _bars(lat_ax, x, latency["p50"])
    lat_ax.scatter(x, _values(latency["p90"]), marker="_", s=500, color="black", zorder=4)
    lat_ax.scatter(x, _values(latency["p99"]), marker="v", color="black", zorder=4)
    lat_ax.set_ylabel(f"request latency (s): bar p50, — p90, ▼ p99\n"
                      f"({_spread_words(kinds, 'over the requests of all bursts, pooled')})")
    lat_ax.set_title("Latency per request, arrival to completion")
    for ax in (tps_ax, vs_ax, lat_ax):
        ax.set_xticks(x, [f"{c['method']}\n@{c['concurrency']}" for c in cells])
        ax.set_xlabel("method @ concurrency")
    bursts = "/".join(map(str, sorted({c.get("bursts", 1) for c in cells})))
    fig.suptitle(f"Serving a burst of requests ({bursts} burst(s) a cell, interleaved): naive vs static vs continuous "
                 f"batching")
    _save(fig, path)


CAPACITY_LEGEND = [Patch(color="tab:gray", label="predicted by the estimator (above: the maximum; below: its live "
                                                   "tensors)"),
                   Patch(color="tab:blue", label="measured (above: the maximum, which passes while the next size "
                                                   "fails; below: live tensors)"),
                   Patch(fill=False, edgecolor="tab:blue", hatch="//",
                         label="the whole grid fits: at least its ceiling, no maximum measured")]
GROWTH = ("predicted_growth_mib", "tab:gray"), ("tensor_growth_mib", "tab:blue"), ("held_growth_mib", "tab:orange")


def _search_label(s: dict) -> str:
    return f"{s['subject']}\n({'train' if s['kind'] == 'train' else 'generate'})"


def _capacity_panel(ax, searches: list[dict]) -> None:
    x = list(range(len(searches)))
    ax.bar([i - 0.2 for i in x], [s.get("predicted_max") or math.nan for s in searches], width=0.4,
           color="tab:gray")
    for i, s in zip(x, searches):
        top = s.get("measured_max")
        if s.get("predicted_max") is None:
            ax.annotate("no\nprediction", (i - 0.2, 0), ha="center", va="bottom", fontsize=7)
        if top is None:
            ax.annotate(f"none fits\n({s.get('first_failing')} fails)", (i + 0.2, 0), ha="center", va="bottom",
                        fontsize=7)
        elif s.get("whole_range_fits"):
            ax.bar(i + 0.2, top, width=0.4, fill=False, edgecolor="tab:blue", hatch="//")
            ax.annotate(f"≥ {top}\n(grid ceiling)", (i + 0.2, top), ha="center", va="bottom", fontsize=7)
        else:
            ax.bar(i + 0.2, top, width=0.4, color="tab:blue")
    ax.set_xticks(x, [_search_label(s) for s in searches], fontsize=8)
    ax.margins(y=0.18)


def _growth_panel(ax, searches: list[dict]) -> None:
    """At each measured maximum: the estimator's live-tensor growth, the measured one, and the growth of the
    memory the budget holds, side by side (all over the loaded model)."""
    measured = [s for s in searches if s.get("at_max")]
    x = list(range(len(measured)))
    for k, (key, colour) in enumerate(GROWTH):
        ax.bar([i + (k - 1) * 0.27 for i in x], [s["at_max"].get(key) or math.nan for s in measured], width=0.27,
               color=colour)
    ax.set_xticks(x, [f"{_search_label(s)}\nat {s['measured_max']}" for s in measured], fontsize=8)
    ax.set_ylabel("growth over the loaded model (MiB)")


def plot_capacity(jobs: list[dict], path: Path) -> None:
    """The largest batch and the longest sequence that fit: prediction beside measurement. A search that fit its
    whole grid is drawn open and hatched, labelled ≥ its ceiling: a lower bound, not a measured maximum. Below,
    at each measured maximum, the memory growth the estimator predicts (live tensors) beside the live tensors
    measured and the memory the budget holds: the estimator's error, like with like, and the gap between them."""
    ok = records.ok(jobs)
    searches = [s for job in ok for s in job["searches"] if records.is_ok(s)]
    fixed = ok[0]["fixed"] if ok else {}
    held = "reserved memory" if ok and ok[0]["budget"]["memory"].startswith("cuda") else "RSS"
    titles = {"batch_size": f"largest batch (training rows of {fixed.get('train_seq_len')} tokens;\n"
                            f"generation: {fixed.get('prompt_len')}-token prompts, {fixed.get('new_tokens')} new)",
              "seq_len": "longest sequence at batch 1"}
    units = {"batch_size": "batch size (sequences)", "seq_len": "sequence length (tokens)"}
    fig, axes = plt.subplots(2, 2, figsize=(12, 8.5))
    for column, dimension in enumerate(("batch_size", "seq_len")):
        mine = [s for s in searches if s["dimension"] == dimension]
        _capacity_panel(axes[0][column], mine)
        axes[0][column].set_ylabel(units[dimension])
        axes[0][column].set_title(titles[dimension], fontsize=10)
        _growth_panel(axes[1][column], mine)
        axes[1][column].set_title(f"memory at the measured maximum ({'batch' if column == 0 else 'sequence'})",
                                  fontsize=10)
    budget = next((j["budget"] for j in ok), None)
    fig.suptitle("What fits" + (f" in {budget['mib']:.0f} MiB ({budget['source']})" if budget else ""))
    held = Patch(color="tab:orange", label=f"{held}, measured: above the blue bar, memory the estimator does not model")
    fig.legend(handles=CAPACITY_LEGEND + [held], loc="lower center", ncol=2, fontsize=8)
    _save(fig, path, bottom=0.08)


def _change_panel(ax, y: list[int], changes: list, reference: str) -> None:
    ax.barh(y, _values(changes), color="tab:red", alpha=0.7)
    kinds = _bars(ax, y, changes, horizontal=True)
    for i, c in zip(y, changes):
        if c is None:
            ax.annotate("not paired", (0, i), xytext=(4, 0), textcoords="offset points", va="center", fontsize=8)
    ax.axvline(0, color="black", lw=0.8)
    ax.set_xlabel(f"validation perplexity change vs {reference} (%, same rows)\n{_spread_words(kinds)}")


def _loss_panel(ax, y: list[int], runs: list[dict]) -> None:
    before = [r["validation_before"]["loss"] for r in runs]
    after = [r["validation_after"]["loss"] for r in runs]
    ax.scatter(before, y, facecolor="none", edgecolor="tab:gray", zorder=3)
    ax.scatter(after, y, color="tab:red", zorder=3)
    for i, b, a in zip(y, before, after):
        ax.annotate("", (a, i), (b, i), arrowprops={"arrowstyle": "->", "color": "grey", "shrinkA": 4, "shrinkB": 4})
    ax.set_xlabel("validation loss (nats per token): ○ before → ● after training\n"
                  "one evaluation each; no per-row losses recorded to pair the runs")


def plot_finetune(rows: list[dict], path: Path) -> None:
    """Per run: its median step time with its spread (each run in its own process), and its validation
    perplexity change over the first run, paired row by row where the records carry per-row losses (else the
    validation loss before and after training)."""
    ok, options = records.ok(rows), opts.finetune_options(rows)
    y = list(range(len(ok)))
    fig, (step_ax, quality_ax) = plt.subplots(1, 2, figsize=(11, 0.45 * len(ok) + 2.4), sharey=True)
    steps = [of_median(r.get("step_time")) for r in ok]
    step_ax.barh(y, _values(steps), color="tab:blue", alpha=0.8)
    kinds = _bars(step_ax, y, steps, horizontal=True)
    for i in (i for i, s in zip(y, steps) if s is None):
        step_ax.annotate("no step times recorded", (0, i), xytext=(4, 0), textcoords="offset points", va="center",
                         fontsize=8)
    step_ax.set_xlabel(f"median optimizer step (s; steady steps)\n{_spread_words(kinds)}")
    step_ax.set_yticks(y, [r["run"] for r in ok])
    step_ax.invert_yaxis()
    changes = [of_axis(o["axes"]["quality"]) for o in options]
    if any(c for c, o in zip(changes, options) if not o["baseline"]):
        _change_panel(quality_ax, y, changes, ok[0]["run"])
    else:
        _loss_panel(quality_ax, y, ok)
    fig.suptitle("Fine-tuning runs: what a step costs and what the run learned")
    _save(fig, path)


def _quality_text(p: dict, words: dict) -> str:
    if p["baseline"]:
        return words["baseline"]
    if p["quality"]:
        return "perplexity " + text(p["quality"], "{:+.1f}%")
    if p["quality_point"] is not None:
        return f"perplexity {p['quality_point']:+.1f}% (unpaired: no interval)"
    return words["missing"]


def _plot_front(points: list[dict], xlabel: str, ylabel: str, title: str, path: Path, words: dict) -> None:
    """The options on two axes with the y axis' spread, each marked on or off the advice's frontier (over every
    axis, quality included, by separated intervals) and labelled with its quality; no line joins them: a line
    through a frontier of three axes drawn on two would claim what was not measured."""
    placed = [p for p in points if p["x"] and p["y"]]
    fig, ax = plt.subplots(figsize=(11, max(4.5, 0.3 * len(placed) + 2.5)))
    for p in placed:
        on = not p["dominated"]
        ax.scatter(p["x"]["value"], p["y"]["value"], s=60, zorder=4, color="tab:green" if on else "white",
                   edgecolor="black" if on else "grey")
    kinds = _bars(ax, [p["x"]["value"] for p in placed], [p["y"] for p in placed], "dimgrey")
    ax.set_xlim(0, 1.08 * max((p["x"]["value"] for p in placed), default=1))
    ax.set_ylim(bottom=0)
    _label_column(ax, [(p["x"]["value"], p["y"]["value"]) for p in placed],
                  [f"{p['name']}: {'dominated' if p['dominated'] else 'on the frontier'}; "
                   f"{_quality_text(p, words)}" for p in placed],
                  ["grey" if p["dominated"] else "black" for p in placed])
    ax.set_xlabel(xlabel)
    ax.set_ylabel(f"{ylabel}\n({_spread_words(kinds)})")
    ax.set_title(f"{title}\nfilled: on the frontier (nothing beats it on one axis by separated intervals\n"
                 "without losing on another); open: dominated", fontsize=9)
    missing = [p["name"] for p in points if p not in placed]
    if missing:
        ax.text(0, -0.2, "not placed (an axis not measured): " + ", ".join(missing), transform=ax.transAxes,
                fontsize=8, color="grey")
    _save(fig, path)


def plot_finetune_pareto(points: list[dict], path: Path) -> None:
    kind = points[0]["kind"] if points else ""
    _plot_front(points, f"peak training memory (MiB, {kind}; one measurement per run)",
                "median optimizer step (s; lower is better)",
                "Fine-tuning: memory, step time and validation perplexity", path,
                {"baseline": "reference for perplexity", "missing": "perplexity not paired with the reference's rows"})


def plot_inference_pareto(points: list[dict], path: Path) -> None:
    _plot_front(points, "model footprint (MiB)", "decode speed × the base model's\n(interleaved; batch 1, KV cache)",
                "Inference variants: footprint, decode speed and perplexity change", path,
                {"baseline": "the base model", "missing": "quality not measured"})


def plot_loss(layout, runs: list[str], path: Path, identical: list[list[str]] = ()) -> None:
    """Every run's training loss; runs that make the same updates (`identical`) get distinct line styles and
    shrinking markers, so that curves lying exactly on top of each other all stay visible."""
    fig, ax = plt.subplots(figsize=(8, 4))
    twin = {run: group[0] for group in identical for run in group[1:]}
    styles = ["-", "--", ":", "-."]
    for i, run in enumerate(runs):
        curve = pd.read_csv(layout.out("finetune", run) / "loss.csv")
        if curve.empty:  # the run did not train
            continue
        ax.plot(curve["step"], curve["loss"], ls=styles[i % len(styles)], marker="os^D"[i % 4],
                markersize=max(3, 9 - 2 * i), fillstyle="none", lw=1.5,
                label=f"{run} (same as {twin[run]})" if run in twin else run)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("training loss (response tokens)")
    ax.set_title("Fine-tuning loss curves")
    _legend(ax, loc="upper left", bbox_to_anchor=(1.02, 1), fontsize=8)  # outside: curves may lie anywhere
    _save(fig, path)


def _seq_axis(ax, df: pd.DataFrame, log_y: bool = True) -> None:
    ax.set_xscale("log", base=2)
    if log_y:
        ax.set_yscale("log")
    ax.set_xticks(sorted(df["seq len"].unique()))
    ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.set_xlabel("sequence length (tokens)")


SPEEDUP_COLUMNS = ["implementation", "mode", "seq len", "batch", "status", "speedup", "lo", "hi", "spread", "n"]


def attention_speedups(jobs: list[dict]) -> pd.DataFrame:
    """Each cell's interleaved speedup over eager (its `vs_eager` pair: both timed in one process, round by
    round), the only figure that compares two implementations; eager's own cells ran in another process."""
    out = []
    for job in records.ok(jobs):
        for row in records.ok(job.get("rows", [])):
            s = None if row["implementation"] == "eager" else of_speedup(row.get("vs_eager"), "speedup", "eager")
            if s:
                out.append({"implementation": row["implementation"], "mode": row.get("mode", "forward"),
                            "seq len": row["seq_len"], "batch": row["batch_size"], "status": "ok",
                            "speedup": s["value"], "lo": s["lo"], "hi": s["hi"], "spread": s["kind"], "n": s["n"]})
    return pd.DataFrame(out, columns=SPEEDUP_COLUMNS)


def _speedup_spread(row) -> dict:
    bound = (lambda v: None if pd.isna(v) else v)
    return spread(row["speedup"], bound(row["lo"]), bound(row["hi"]), bound(row["spread"]), bound(row["n"]))


def plot_attention(speedups: pd.DataFrame, path: Path) -> None:
    """Per mode, each implementation's interleaved speedup over eager against sequence length, against 1."""
    ok = records.ok_rows(speedups)
    modes = sorted(ok["mode"].unique()) or ["forward"]
    fig, axes = plt.subplots(1, len(modes), figsize=(6 * len(modes), 4.2), squeeze=False)
    for ax, mode in zip(axes[0], modes):
        kinds = set()
        for (impl, batch), part in ok[ok["mode"] == mode].groupby(["implementation", "batch"]):
            part = part.sort_values("seq len")
            rounds = "–".join(str(int(n)) for n in sorted({part["n"].min(), part["n"].max()}))
            line = ax.plot(part["seq len"], part["speedup"], marker="o",
                           label=f"{impl} (batch {int(batch)}; {rounds} rounds)")[0]
            kinds |= _bars(ax, part["seq len"].tolist(), [_speedup_spread(r) for _, r in part.iterrows()],
                           line.get_color())
        ax.axhline(1, color="grey", lw=0.8, ls=":")
        _seq_axis(ax, ok, log_y=False)
        ax.set_ylabel(f"speedup over eager (×; > 1: faster)\n({_spread_words(kinds)})")
        ax.set_title(f"{mode.replace('_', '+')}: interleaved with eager, same process", fontsize=10)
        _below(ax)
    _save(fig, path)


def plot_attention_memory(df: pd.DataFrame, exponents: pd.DataFrame, path: Path) -> None:
    ok = records.ok_rows(df)
    ok = ok[ok["peak delta (MiB)"] > 0]
    modes = sorted(ok["mode"].unique()) or ["forward"]
    fig, axes = plt.subplots(1, len(modes), figsize=(6 * len(modes), 4), squeeze=False)
    for ax, mode in zip(axes[0], modes):
        for (impl, batch), part in ok[ok["mode"] == mode].groupby(["implementation", "batch"]):
            fit = exponents[(exponents["implementation"] == impl) & (exponents["mode"] == mode)
                            & (exponents["batch"] == batch)]["memory ~ seq^k: k"]
            k = f", k={fit.iloc[0]:.2f}" if len(fit) and pd.notna(fit.iloc[0]) else ""
            ax.plot(part["seq len"], part["peak delta (MiB)"], marker="o", label=f"{impl} (batch {int(batch)}{k})")
        _seq_axis(ax, ok)
        ax.set_ylabel(f"peak memory over baseline (MiB, {ok['memory kind'].iloc[0] if len(ok) else ''};\n"
                      "one measurement per cell, log)")
        ax.set_title(f"Attention memory vs length: {mode.replace('_', '+')}")
        _legend(ax, fontsize=8)
    _save(fig, path)


def plot_inference(rows: list[dict], path: Path) -> None:
    """Decode tokens/s per variant, one panel per batch size, each median with its interval or range. Each variant
    runs in its own process: the interleaved speedups over the base model are in inference_pareto.png."""
    cells = [(r["variant"], c) for r in records.ok(rows) for c in records.ok(r.get("cells", []))]
    batches = sorted({c["batch_size"] for _, c in cells}) or [1]
    counts = [max(2, sum(c["batch_size"] == b for _, c in cells)) for b in batches]  # room for a panel's title
    fig, axes = plt.subplots(1, len(batches), figsize=(max(7.0, 1.1 * sum(counts) + 2), 4.5), sharey=True,
                             squeeze=False, gridspec_kw={"width_ratios": counts})
    kinds = set()
    for ax, batch in zip(axes[0], batches):
        mine = [(v, c) for v, c in cells if c["batch_size"] == batch]
        rates, x = [of_median(c["decode_tokens_per_s"]) for _, c in mine], list(range(len(mine)))
        ax.bar(x, _values(rates), color=["tab:green" if c["kv_cache"] else "tab:orange" for _, c in mine], alpha=0.8)
        kinds |= _bars(ax, x, rates)
        ax.set_xticks(x, [v + ("" if c["kv_cache"] else " (KV off)") for v, c in mine], rotation=30, ha="right")
        ax.set_title(f"batch {batch}" + (f"\n(tokens of all {batch} sequences)" if batch > 1 else ""), fontsize=10)
    axes[0][0].set_ylabel(f"decode tokens/s, median\n({_spread_words(kinds)})")
    fig.suptitle("Greedy generation by variant, each in its own process (orange: KV cache off)")
    _save(fig, path)


def placeholder_plot(path: Path, why: str) -> None:
    fig, ax = plt.subplots(figsize=(7, 2))
    ax.axis("off")
    ax.text(0.5, 0.5, why, ha="center", va="center", wrap=True, fontsize=10)
    fig.savefig(path, dpi=120)
    plt.close(fig)


# Which stage's results each plot draws: a stage left out or without numbers gets a plot that says so.
PLOT_STAGES = {"quantize.png": "quantize", "prune.png": "prune", "qat.png": "qat", "finetune_loss.png": "finetune",
               "finetune.png": "finetune", "bench_attention.png": "bench_attention",
               "bench_attention_memory.png": "bench_attention", "bench_inference.png": "bench_inference",
               "bench_serving.png": "bench_serving", "capacity.png": "capacity", "finetune_pareto.png": "finetune",
               "inference_pareto.png": "bench_inference"}


def draw_plots(cfg: dict, metrics: dict, tables: dict, fronts: dict, layout, out: Path) -> list[str]:
    names = registry.names(cfg, "finetune") or []
    plots = {"quantize.png": lambda p: plot_quantize(metrics["quantize"], p),
             "prune.png": lambda p: plot_prune(metrics["prune"], p),
             "qat.png": lambda p: plot_qat(tables["qat"], next(iter(records.ok(metrics["qat"])), None), p),
             "finetune_loss.png": lambda p: plot_loss(layout, names, p, same_updates(metrics["finetune"])),
             "finetune.png": lambda p: plot_finetune(metrics["finetune"], p),
             "bench_attention.png": lambda p: plot_attention(attention_speedups(metrics["bench_attention"]), p),
             "bench_attention_memory.png": lambda p: plot_attention_memory(
                 tables["bench_attention"], tables["attention_memory_exponent"], p),
             "bench_inference.png": lambda p: plot_inference(metrics["bench_inference"], p),
             "bench_serving.png": lambda p: plot_serving(metrics["bench_serving"], p),
             "capacity.png": lambda p: plot_capacity(metrics["capacity"], p),
             "finetune_pareto.png": lambda p: plot_finetune_pareto(fronts["finetune"], p),
             "inference_pareto.png": lambda p: plot_inference_pareto(fronts["inference"], p)}
    for file, draw in plots.items():
        why = absent(cfg, metrics, PLOT_STAGES[file])
        placeholder_plot(out / file, f"{PLOT_STAGES[file]}: {why}") if why else draw(out / file)
    return sorted(plots)
