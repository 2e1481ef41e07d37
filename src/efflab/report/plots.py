"""The report's plots, each drawn from a stage's table or records (matplotlib, Agg)."""
from __future__ import annotations

from pathlib import Path

import matplotlib
import matplotlib.ticker

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

from .. import cli, records  # noqa: E402
from .notes import same_updates  # noqa: E402
from .fmt import peak_mib  # noqa: E402
from .results import absent  # noqa: E402
from .tables import tokens_per_s  # noqa: E402


def plot_prune(df: pd.DataFrame, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.scatter(df["parameters kept (%)"], df["perplexity change (%)"], color="tab:purple", label="pruned")
    for name, kept, change in zip(df["strategy"], df["parameters kept (%)"], df["perplexity change (%)"]):
        ax.annotate(name, (kept, change), textcoords="offset points", xytext=(4, 4), fontsize=8)
    healed = df.dropna(subset=["healed change (%)"])
    if not healed.empty:
        ax.scatter(healed["parameters kept (%)"], healed["healed change (%)"], color="tab:green", marker="v",
                   label="after LoRA healing")
        for kept, before, after in zip(healed["parameters kept (%)"], healed["perplexity change (%)"],
                                       healed["healed change (%)"]):
            ax.annotate("", (kept, after), (kept, before), arrowprops={"arrowstyle": "->", "color": "tab:green"})
        _legend(ax, fontsize=8)
    ax.axhline(0, color="grey", lw=0.8)
    ax.set_yscale("symlog")
    ax.set_xlabel("parameters kept (%)")
    ax.set_ylabel("validation perplexity change vs base (%, symlog)")
    ax.set_title("Structured pruning: parameters removed vs perplexity paid")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


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
    ax.set_ylabel("validation perplexity (log)")
    ax.set_title("Precision range test: post-training vs quantization-aware training")
    _legend(ax, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_serving(df: pd.DataFrame, path: Path) -> None:
    ok = records.ok_rows(df)
    fig, ax = plt.subplots(figsize=(7, 4))
    labels = [f"{m}\n@{c}" for m, c in zip(ok["method"], ok["concurrency"])]
    ax.bar(labels, ok["output tokens/s"], color="tab:green", alpha=0.8)
    ax.set_ylabel("output tokens/s (whole burst)")
    ax.set_title("Serving a burst of requests: naive vs static vs continuous batching")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_capacity(jobs: list[dict], path: Path) -> None:
    searches = [s for job in records.ok(jobs) for s in job["searches"] if records.is_ok(s)]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, dimension, label in zip(axes, ("batch_size", "seq_len"), ("largest batch", "longest sequence (batch 1)")):
        rows = [s for s in searches if s["dimension"] == dimension]
        names = [f"{s['subject']}\n({'train' if s['kind'] == 'train' else 'generate'})" for s in rows]
        x = range(len(rows))
        ax.bar([i - 0.2 for i in x], [s.get("predicted_max") or 0 for s in rows], width=0.4, color="tab:gray",
               label="predicted (estimator)")
        ax.bar([i + 0.2 for i in x], [s.get("measured_max") or 0 for s in rows], width=0.4, color="tab:blue",
               label="measured (passes; the next size fails)")
        for i, s in zip(x, rows):
            if s.get("whole_range_fits"):
                ax.annotate("whole range", (i + 0.2, s["measured_max"]), ha="center", va="bottom", fontsize=7)
            elif s.get("measured_max") is None:
                ax.annotate("none fits", (i + 0.2, 0), ha="center", va="bottom", fontsize=7)
        ax.set_xticks(list(x), names, fontsize=8)
        ax.set_ylabel(label)
        ax.set_title(label)
        if rows:
            _legend(ax, fontsize=7)
    budget = next((j["budget"] for j in records.ok(jobs)), None)
    fig.suptitle("What fits" + (f" in {budget['mib']:.0f} MiB ({budget['source']})" if budget else ""))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_finetune(rows: list[dict], path: Path) -> None:
    """Peak memory and throughput per run, side by side: what each method and knob costs and buys."""
    ok = records.ok(rows)
    fig, (mem_ax, tps_ax) = plt.subplots(1, 2, figsize=(10, 0.5 * len(ok) + 1.8), sharey=True)
    names = [r["run"] for r in ok]
    kind = ok[0]["train_memory"]["kind"] if ok else ""
    mem_ax.barh(names, [peak_mib(r["train_memory"]) or 0 for r in ok], color="tab:blue")
    mem_ax.set_xlabel(f"peak memory (MiB, {kind})")
    tps_ax.barh(names, [tokens_per_s(r) for r in ok], color="tab:green")
    tps_ax.set_xlabel("training tokens/s (real tokens)")
    mem_ax.invert_yaxis()
    fig.suptitle("Fine-tuning runs: memory and throughput")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _plot_pareto(points: list[dict], x: str, y: str, xlabel: str, ylabel: str, title: str, path: Path,
                 note=lambda p: "") -> None:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    front = sorted((p for p in points if not p["dominated"]), key=lambda p: p[x])
    ax.plot([p[x] for p in front], [p[y] for p in front], "-", color="tab:green", alpha=0.5, zorder=1)
    for p in points:
        colour = "lightgrey" if p["dominated"] else "tab:green"
        ax.scatter(p[x], p[y], color=colour, edgecolor="black" if not p["dominated"] else "grey", zorder=2)
        ax.annotate(p["name"] + note(p), (p[x], p[y]), textcoords="offset points", xytext=(5, 4), fontsize=8,
                    color="grey" if p["dominated"] else "black")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title + "\n(green: the Pareto frontier; grey: dominated, another config is better on every axis)",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_finetune_pareto(points: list[dict], path: Path) -> None:
    kind = points[0]["kind"] if points else ""
    _plot_pareto(points, "memory", "tokens_per_s", f"peak training memory (MiB, {kind})",
                 "training tokens/s (real tokens, steady steps)", "Fine-tuning: memory vs throughput", path)


def plot_inference_pareto(points: list[dict], path: Path) -> None:
    def note(p):
        d = p["perplexity_change_pct"]
        return "" if d is None else f" ({d:+.1f}% ppl)"
    _plot_pareto(points, "footprint", "decode", "model footprint (MiB)", "decode tokens/s (median, KV cache, batch 1)",
                 "Inference: memory vs speed vs perplexity change", path, note)


def plot_quantize(df: pd.DataFrame, path: Path) -> None:
    fig, ax1 = plt.subplots(figsize=(7, 4))
    ax1.bar(df["scheme"], df["footprint (MiB)"], color="tab:blue", alpha=0.7, label="footprint")
    ax1.set_ylabel("model footprint (MiB)")
    ax2 = ax1.twinx()
    ax2.plot(df["scheme"], df["val perplexity"], "o-", color="tab:red", label="perplexity")
    ax2.set_ylabel("validation perplexity", color="tab:red")
    ax1.set_title("Quantization: memory bought vs perplexity paid")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_loss(layout, runs: list[str], path: Path, identical: list[list[str]] = ()) -> None:
    """Every run's training loss; runs that make the same updates (`identical`) get distinct line styles and
    shrinking markers, so that curves lying exactly on top of each other all stay visible."""
    fig, ax = plt.subplots(figsize=(7, 4))
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
    _legend(ax)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _legend(ax, **kwargs) -> None:
    """The axes' legend, or, where nothing was measured (every cell failed or was unavailable), a note saying so
    instead of an empty legend."""
    if ax.get_legend_handles_labels()[0]:
        ax.legend(**kwargs)
    else:
        ax.text(0.5, 0.5, "nothing measured: see the table for why", ha="center", va="center",
                transform=ax.transAxes, color="grey")


def _ci_bars(part: pd.DataFrame, median: str, ci: str) -> list[list[float]]:
    bounds = part[ci].str.extract(r"^([-+\d.e]+)–([-+\d.e]+)").astype(float)  # an interval, or a range
    return [(part[median] - bounds[0]).clip(lower=0).tolist(), (bounds[1] - part[median]).clip(lower=0).tolist()]


def _seq_axis(ax, df: pd.DataFrame) -> None:
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(sorted(df["seq len"].unique()))
    ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.set_xlabel("sequence length (tokens)")


def plot_attention(df: pd.DataFrame, path: Path) -> None:
    ok = records.ok_rows(df)
    modes = sorted(ok["mode"].unique()) or ["forward"]
    fig, axes = plt.subplots(1, len(modes), figsize=(6 * len(modes), 4), squeeze=False)
    for ax, mode in zip(axes[0], modes):
        for (impl, batch), part in ok[ok["mode"] == mode].groupby(["implementation", "batch"]):
            ax.errorbar(part["seq len"], part["median (ms)"], yerr=_ci_bars(part, "median (ms)", "95% CI or range of median (ms)"),
                        marker="o", capsize=3, label=f"{impl} (batch {int(batch)})")
        _seq_axis(ax, ok)
        ax.set_ylabel("latency (ms, median; bars: 95% CI)")
        ax.set_title(f"Attention implementations: {mode.replace('_', '+')}")
        _legend(ax, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


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
        ax.set_ylabel(f"peak memory over baseline (MiB, {ok['memory kind'].iloc[0] if len(ok) else ''})")
        ax.set_title(f"Attention memory vs length: {mode.replace('_', '+')}")
        _legend(ax, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_inference(df: pd.DataFrame, path: Path) -> None:
    ok = records.ok_rows(df).copy()
    ok["cell"] = ok["variant"] + ok.apply(
        lambda r: "" if r["KV cache"] == "on" and r["batch"] == 1 else f" (KV {r['KV cache']}, b{r['batch']})", axis=1)
    fig, ax = plt.subplots(figsize=(max(7, 0.9 * len(ok)), 4))
    ax.bar(ok["cell"], ok["decode tokens/s median"], yerr=_ci_bars(ok, "decode tokens/s median", "decode tokens/s 95% CI or range"),
           capsize=4, color=["tab:green" if c == "on" else "tab:orange" for c in ok["KV cache"]], alpha=0.8)
    ax.set_ylabel("decode tokens/s (median; bars: 95% CI)")
    ax.set_title("Greedy generation by variant (orange: KV cache off)")
    plt.setp(ax.get_xticklabels(), rotation=25, ha="right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


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
    names = cli.stage_names(cfg, "finetune") or []
    plots = {"quantize.png": lambda p: plot_quantize(tables["quantize"], p),
             "prune.png": lambda p: plot_prune(tables["prune"], p),
             "qat.png": lambda p: plot_qat(tables["qat"], next(iter(records.ok(metrics["qat"])), None), p),
             "finetune_loss.png": lambda p: plot_loss(layout, names, p, same_updates(metrics["finetune"])),
             "finetune.png": lambda p: plot_finetune(metrics["finetune"], p),
             "bench_attention.png": lambda p: plot_attention(tables["bench_attention"], p),
             "bench_attention_memory.png": lambda p: plot_attention_memory(
                 tables["bench_attention"], tables["attention_memory_exponent"], p),
             "bench_inference.png": lambda p: plot_inference(tables["bench_inference"], p),
             "bench_serving.png": lambda p: plot_serving(tables["bench_serving"], p),
             "capacity.png": lambda p: plot_capacity(metrics["capacity"], p),
             "finetune_pareto.png": lambda p: plot_finetune_pareto(fronts["finetune"], p),
             "inference_pareto.png": lambda p: plot_inference_pareto(fronts["inference"], p)}
    for file, draw in plots.items():
        why = absent(cfg, metrics, PLOT_STAGES[file])
        placeholder_plot(out / file, f"{PLOT_STAGES[file]}: {why}") if why else draw(out / file)
    return sorted(plots)
