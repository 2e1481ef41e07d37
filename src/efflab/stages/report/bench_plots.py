"""The benchmarks' plots: serving, capacity, attention (speed and memory) and inference, each drawn from its
stage's records or table, with the conventions of report.figure."""
from __future__ import annotations

import math
from pathlib import Path

import matplotlib.ticker
import pandas as pd
from matplotlib.patches import Patch

from ... import records
from .figure import (
    legend_below,
    legend_beside,
    plt,
    save_figure,
    spread_bars,
    spread_values,
    spread_words,
)
from .spread import of_median, of_ratio, of_speedup, spread, text

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
    tps_ax.bar(x, spread_values(rates), color=colours, alpha=0.8)
    kinds = spread_bars(tps_ax, x, rates)
    tps_ax.set_ylabel("output tokens/s, median over the bursts\n"
                      f"({spread_words(kinds, 'one burst each: no interval')})")
    tps_ax.set_title("Throughput")
    vs_naive = [spread(1.0) if c["method"] == "naive" else of_ratio(records.serving_ratio(c, "throughput_vs_naive"))
                for c in cells]
    vs_ax.bar(x, spread_values(vs_naive), color=colours, alpha=0.8)
    kinds = spread_bars(vs_ax, x, vs_naive)
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
                     f"({spread_words(kinds, 'one burst each: no interval')})")
    vs_ax.set_title("Throughput over naive serving (same rounds)")
    latency = {q: [of_median((c.get("latency_s") or {}).get(q)) for c in cells] for q in ("p50", "p90", "p99")}
    lat_ax.bar(x, spread_values(latency["p50"]), color=colours, alpha=0.8)
    kinds = spread_bars(lat_ax, x, latency["p50"])
    lat_ax.scatter(x, spread_values(latency["p90"]), marker="_", s=500, color="black", zorder=4)
    lat_ax.scatter(x, spread_values(latency["p99"]), marker="v", color="black", zorder=4)
    lat_ax.set_ylabel(f"request latency (s): bar p50, — p90, ▼ p99\n"
                      f"({spread_words(kinds, 'over the requests of all bursts, pooled')})")
    lat_ax.set_title("Latency per request, arrival to completion")
    for ax in (tps_ax, vs_ax, lat_ax):
        ax.set_xticks(x, [f"{c['method']}\n@{c['concurrency']}" for c in cells])
        ax.set_xlabel("method @ concurrency")
    bursts = "/".join(map(str, sorted({c.get("bursts", 1) for c in cells})))
    fig.suptitle(f"Serving a burst of requests ({bursts} burst(s) a cell, interleaved): naive vs static vs continuous "
                 f"batching")
    save_figure(fig, path)


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
    save_figure(fig, path, bottom=0.08)

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
            kinds |= spread_bars(ax, part["seq len"].tolist(), [_speedup_spread(r) for _, r in part.iterrows()],
                           line.get_color())
        ax.axhline(1, color="grey", lw=0.8, ls=":")
        _seq_axis(ax, ok, log_y=False)
        ax.set_ylabel(f"speedup over eager (×; > 1: faster)\n({spread_words(kinds)})")
        ax.set_title(f"{mode.replace('_', '+')}: interleaved with eager, same process", fontsize=10)
        legend_below(ax)
    save_figure(fig, path)


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
        legend_beside(ax, fontsize=8)
    save_figure(fig, path)


def plot_inference(rows: list[dict], path: Path) -> None:
    """Decode tokens/s per variant and generation mode, one panel per batch size, each median with its interval or
    range, and above each bar the fractions of the machine's measured limits it reaches (memory bandwidth, matmul
    ceiling) with what bounds it. Each variant runs in its own process: the interleaved speedups over the base
    model are in inference_pareto.png."""
    cells = [(r["variant"], c) for r in records.ok(rows) for c in records.ok(r.get("cells", []))
             if "decode_tokens_per_s" in c]  # an engine's cell has whole generations only
    batches = sorted({c["batch_size"] for _, c in cells}) or [1]
    counts = [max(2, sum(c["batch_size"] == b for _, c in cells)) for b in batches]  # room for a panel's title
    fig, axes = plt.subplots(1, len(batches), figsize=(max(7.0, 1.3 * sum(counts) + 2), 4.8), sharey=True,
                             squeeze=False, gridspec_kw={"width_ratios": counts})
    kinds = set()
    for ax, batch in zip(axes[0], batches):
        mine = [(v, c) for v, c in cells if c["batch_size"] == batch]
        rates, x = [of_median(c["decode_tokens_per_s"]) for _, c in mine], list(range(len(mine)))
        ax.bar(x, spread_values(rates), color=[MODE_COLOURS.get(c.get("generation", "dynamic"), "tab:gray")
                                              if c["kv_cache"] else "tab:orange" for _, c in mine], alpha=0.8)
        kinds |= spread_bars(ax, x, rates)
        for i, (_, c) in enumerate(mine):
            if roof := c.get("roofline"):
                ax.annotate(f"{100 * roof['bandwidth_fraction']:.1f}% BW\n{100 * roof['compute_fraction']:.1f}% MM\n"
                            f"{roof['bound'].replace('-bound', '')}", (i, bar_top(rates[i])),
                            xytext=(0, 3), textcoords="offset points", ha="center", va="bottom", fontsize=7)
        ax.set_xticks(x, [inference_label(v, c) for v, c in mine], rotation=30, ha="right")
        ax.set_title(f"batch {batch}" + (f"\n(tokens of all {batch} sequences)" if batch > 1 else ""), fontsize=10)
        ax.margins(y=0.25)  # room for the labels above the tallest bar
    axes[0][0].set_ylabel(f"decode tokens/s, median\n({spread_words(kinds)})")
    fig.suptitle("Greedy generation by variant and mode, each cell in its own process (green: dynamic KV cache, blue: "
                 "static, purple: compiled, orange: KV cache off)\n"
                 "above each bar: % of measured memory bandwidth (BW) and matmul ceiling (MM) reached, and the bound",
                 fontsize=10)
    save_figure(fig, path)


def bar_top(value: dict | None) -> float:
    value = value or {}
    return max((v for v in (value.get("hi"), value.get("value")) if v is not None), default=0.0)


MODE_COLOURS = {"dynamic": "tab:green", "static": "tab:blue", "compiled": "tab:purple"}


def inference_label(variant: str, cell: dict) -> str:
    mode = cell.get("generation", "dynamic")
    return variant + ("" if cell["kv_cache"] else " (KV off)") + ("" if mode == "dynamic" else f" ({mode})")

