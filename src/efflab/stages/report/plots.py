"""The report's plots, each drawn from a stage's records or table (conventions: report.figure). The benchmarks'
plots are in report.bench_plots; draw_plots draws them all, or a placeholder saying why a stage has none."""
from __future__ import annotations

from pathlib import Path

import matplotlib.ticker
import pandas as pd

from ... import records, registry
from . import options as opts
from .bench_plots import (
    attention_speedups,
    plot_attention,
    plot_attention_memory,
    plot_capacity,
    plot_inference,
    plot_serving,
)
from .figure import (
    label_column,
    legend_below,
    legend_beside,
    placeholder_plot,
    plt,
    save_figure,
    spread_bars,
    spread_values,
    spread_words,
)
from .fmt import MiB
from .notes import same_updates
from .results import absent
from .spread import as_ratio, of_axis, of_change, of_median, spread, text


def plot_quantize(rows: list[dict], path: Path, tolerance_pct: float) -> None:
    """Footprint from zero; the perplexity change over the baseline with its paired interval, against zero and the
    tolerance line that decides which scheme keeps quality (tolerance.perplexity_pct)."""
    ok = records.ok(rows)
    x, names = list(range(len(ok))), [r["scheme"] for r in ok]
    changes = [of_change(r.get("perplexity_change")) or spread(r.get("perplexity_change_pct")) for r in ok]
    fig, (mem_ax, ppl_ax) = plt.subplots(1, 2, figsize=(10, 4))
    mem_ax.bar(x, [r["memory_footprint_bytes"] / MiB for r in ok], color="tab:blue", alpha=0.8)
    mem_ax.set_ylabel("model footprint (MiB)")
    mem_ax.set_title("Memory bought")
    ppl_ax.bar(x, spread_values(changes), color="tab:red", alpha=0.7)
    kinds = spread_bars(ppl_ax, x, changes)
    ppl_ax.axhline(0, color="black", lw=0.8)
    ppl_ax.axhline(tolerance_pct, color="grey", lw=0.8, ls="--",
                   label=f"tolerance (+{tolerance_pct:g}%): kept only where the whole interval is below")
    ppl_ax.legend(fontsize=8, loc="upper left")
    ppl_ax.set_ylabel("validation perplexity change vs baseline (%)\n"
                      + spread_words(kinds, "no paired interval recorded"))
    ppl_ax.set_title("Perplexity paid (same validation rows)")
    for ax in (mem_ax, ppl_ax):
        ax.set_xticks(x, names)
        ax.set_xlabel("scheme")
    fig.suptitle("Post-training quantization: memory bought vs perplexity paid")
    save_figure(fig, path)


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
    ax.axhline(1, color="grey", lw=0.8, ls=":", label="the base model (ratio 1)")
    ax.set_yscale("log")
    every = [s for s in pruned + healed if s] + [spread(1.0)]
    ax.set_ylim(min(s["lo"] or s["value"] for s in every) / 1.6, max(s["hi"] or s["value"] for s in every) * 1.6)
    ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    ax.set_xlim(0, 100)
    ax.set_xlabel("parameters kept (%)")
    ax.set_ylabel(f"validation perplexity ÷ base model's (log)\n{spread_words(kinds, 'no paired interval recorded')}")
    ax.set_title("Structured pruning: parameters removed vs perplexity paid")
    label_column(ax, list(zip(kept, spread_values(pruned))),
                  [f"{r['strategy']}: ×{text(p)}" + (f" → ×{text(h)} healed" if h else "")
                   for r, p, h in zip(ok, pruned, healed)], ["black"] * len(ok))
    legend_below(ax, ncol=3)
    save_figure(fig, path)


def plot_qat(df: pd.DataFrame, job: dict | None, path: Path) -> None:
    """Perplexity vs bits for PTQ and QAT (log scale), the full-precision reference and the tolerance line."""
    fig, ax = plt.subplots(figsize=(7, 4))
    for label, color in (("PTQ", "tab:red"), ("QAT", "tab:blue")):
        ok = df.dropna(subset=[f"{label} perplexity"])
        ax.plot(ok["bits"], ok[f"{label} perplexity"], "o-", color=color, label=label)
    if job and job.get("reference_perplexity"):
        reference = job["reference_perplexity"]
        ax.axhline(reference, color="grey", lw=0.8, label="full precision (fine-tuned)")
        ax.axhline((1 + job["tolerance_pct"] / 100) * reference, color="grey", lw=0.8, ls="--",
                   label=f"tolerance (+{job['tolerance_pct']:g}%, tolerance.perplexity_pct)")
    ax.set_yscale("log")
    ax.set_xticks(sorted(df["bits"].unique()) if not df.empty else [])
    ax.set_xlabel("weight bits (per-group symmetric, round to nearest)")
    ax.set_ylabel("validation perplexity (log; one evaluation each)")
    ax.set_title("Precision range test: post-training vs quantization-aware training")
    legend_beside(ax, fontsize=8)
    save_figure(fig, path)


def _change_panel(ax, y: list[int], changes: list, reference: str) -> None:
    ax.barh(y, spread_values(changes), color="tab:red", alpha=0.7)
    kinds = spread_bars(ax, y, changes, horizontal=True)
    for i, c in zip(y, changes):
        if c is None:
            ax.annotate("not paired", (0, i), xytext=(4, 0), textcoords="offset points", va="center", fontsize=8)
    ax.axvline(0, color="black", lw=0.8)
    ax.set_xlabel(f"validation perplexity change vs {reference} (%, same rows)\n{spread_words(kinds)}")


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
    step_ax.barh(y, spread_values(steps), color="tab:blue", alpha=0.8)
    kinds = spread_bars(step_ax, y, steps, horizontal=True)
    for i in (i for i, s in zip(y, steps) if s is None):
        step_ax.annotate("no step times recorded", (0, i), xytext=(4, 0), textcoords="offset points", va="center",
                         fontsize=8)
    step_ax.set_xlabel(f"median optimizer step (s; steady steps)\n{spread_words(kinds)}")
    step_ax.set_yticks(y, [r["run"] for r in ok])
    step_ax.invert_yaxis()
    changes = [of_axis(o["axes"]["quality"]) for o in options]
    if any(c for c, o in zip(changes, options) if not o["baseline"]):
        _change_panel(quality_ax, y, changes, ok[0]["run"])
    else:
        _loss_panel(quality_ax, y, ok)
    fig.suptitle("Fine-tuning runs: what a step costs and what the run learned")
    save_figure(fig, path)


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
    kinds = spread_bars(ax, [p["x"]["value"] for p in placed], [p["y"] for p in placed], "dimgrey")
    ax.set_xlim(0, 1.08 * max((p["x"]["value"] for p in placed), default=1))
    ax.set_ylim(bottom=0)
    label_column(ax, [(p["x"]["value"], p["y"]["value"]) for p in placed],
                  [f"{p['name']}: {'dominated' if p['dominated'] else 'on the frontier'}; "
                   f"{_quality_text(p, words)}" for p in placed],
                  ["grey" if p["dominated"] else "black" for p in placed])
    ax.set_xlabel(xlabel)
    ax.set_ylabel(f"{ylabel}\n({spread_words(kinds)})")
    ax.set_title(f"{title}\nfilled: on the frontier (nothing beats it on one axis by separated intervals\n"
                 "without losing on another); open: dominated", fontsize=9)
    missing = [p["name"] for p in points if p not in placed]
    if missing:
        ax.text(0, -0.2, "not placed (an axis not measured): " + ", ".join(missing), transform=ax.transAxes,
                fontsize=8, color="grey")
    save_figure(fig, path)


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
    legend_beside(ax, loc="upper left", bbox_to_anchor=(1.02, 1), fontsize=8)  # outside: curves may lie anywhere
    save_figure(fig, path)


# Which stage's results each plot draws: a stage left out or without numbers gets a plot that says so.
PLOT_STAGES = {"quantize.png": "quantize", "prune.png": "prune", "qat.png": "qat", "finetune_loss.png": "finetune",
               "finetune.png": "finetune", "bench_attention.png": "bench_attention",
               "bench_attention_memory.png": "bench_attention", "bench_inference.png": "bench_inference",
               "bench_serving.png": "bench_serving", "capacity.png": "capacity", "finetune_pareto.png": "finetune",
               "inference_pareto.png": "bench_inference"}


def draw_plots(cfg: dict, metrics: dict, tables: dict, fronts: dict, layout, out: Path) -> list[str]:
    names = registry.names(cfg, "finetune") or []
    plots = {"quantize.png": lambda p: plot_quantize(metrics["quantize"], p, cfg["tolerance"]["perplexity_pct"]),
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
