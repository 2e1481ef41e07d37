"""The benchmarks' plots: serving, capacity, attention (speed and memory) and inference, each drawn from its
stage's records or table, with the conventions of report.plotting."""
from __future__ import annotations

import math
from pathlib import Path

import matplotlib.ticker
import pandas as pd
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from ... import records
from .plotting import (
    legend_below,
    legend_beside,
    plt,
    ratio_rows,
    save_figure,
    spread_bars,
    spread_values,
    spread_words,
)
from .spread import of_median, of_ratio, of_speedup, spread, text
from .writing import speedup_verdict

METHOD_COLOURS = {"naive": "tab:gray", "static": "tab:blue", "continuous": "tab:green"}


def _plot_slo_search(ax, o: dict) -> None:
    """The SLO search's probes: per subject, each probe's percentile of TTFT against its rate (filled: met the SLO;
    hollow: did not), the TTFT bound, and the answer's interval as a band of the subject's colour."""
    q = f"p{o['percentile']:g}"
    palette = ("tab:red", "tab:green", "tab:blue", "tab:purple", "tab:orange", "tab:brown")
    for colour, x in zip(palette, records.ok(o["subjects"])):
        a = x["answer"]
        ax.axvspan(max(a["lo"], a["lowest"]), a["hi"] or a["highest"], color=colour, alpha=0.12)
        for met in (True, False):
            probes = [p for p in x["probes"] if p["meets"] is met and "ttft_s" in p[q]]
            ax.scatter([p["rate"] for p in probes], [p[q]["ttft_s"] for p in probes], color=colour,
                       facecolors=colour if met else "none", label=x["name"] if met else None, zorder=3)
    if (o.get("slo") or {}).get("ttft_s"):
        ax.axhline(o["slo"]["ttft_s"], color="black", lw=0.8, ls="--")
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
    ax.set_xlabel(f"offered rate (requests/s; {o['requests_per_probe']} Poisson requests a probe)")
    ax.set_ylabel(f"{q} TTFT of a probe (s): filled met the SLO\nand kept up; hollow did not; band: the answer's "
                  "interval")
    ax.set_title("Highest rate meeting the SLO")
    ax.legend(fontsize=7, loc="upper left")


def plot_serving(jobs: list[dict], path: Path) -> None:
    """Per method and concurrency: output tokens/s (median over the bursts), the throughput over naive serving
    paired burst round by burst round against a line at 1 (continuous batching's over static batching written
    above its bar), and each request's latency over the pooled bursts (p50 bar, p90 and p99 marks); intervals
    where the bursts give one, dashed ranges where they are too few."""
    cells = [c for job in records.ok(jobs) for c in records.ok(job["cells"])]
    x, colours = list(range(len(cells))), [METHOD_COLOURS.get(c["method"], "tab:olive") for c in cells]
    search = next((j["slo_search"] for j in records.ok(jobs) if records.ok((j.get("slo_search") or {})
                                                                            .get("subjects") or [])), None)
    fig, axes = plt.subplots(1, 4 if search else 3, figsize=(max(13, 3 * len(cells) + 3) + (5 if search else 0), 4.4))
    tps_ax, vs_ax, lat_ax = axes[:3]
    if search:
        _plot_slo_search(axes[3], search)
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
    generating = any(s["kind"] != "train" for s in searches)  # the title names only what a panel draws
    titles = {"batch_size": f"largest batch (training rows of {fixed.get('train_seq_len')} tokens"
                            + (f";\ngeneration: {fixed.get('prompt_len')}-token prompts, {fixed.get('new_tokens')} new)"
                               if generating else ")"),
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
    held = Patch(color="tab:orange", label=f"{held} growth, measured (below): what it holds beyond the blue bar is "
                                           "memory the estimator does not model")
    # the legend names only what is drawn: the hatched bar only where a search fit its whole grid
    drawn = CAPACITY_LEGEND[:2] + (CAPACITY_LEGEND[2:] if any(s.get("whole_range_fits") for s in searches) else [])
    fig.legend(handles=drawn + [held], loc="lower center", ncol=2, fontsize=8)
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


# What an inference cell's speed is a ratio over: the colour of its point and its legend entry.
AGAINST = {"base": ("tab:blue", "× the base model's (interleaved, same process)"),
           "dynamic": ("tab:purple", "× the same model's dynamic KV cache (interleaved)"),
           None: ("tab:gray", "the base model itself: the reference (exactly 1)")}


def inference_ratios(rows: list[dict], question: dict | None) -> list[dict]:
    """Every measured cell's interleaved generation speedup, the figure the verdicts are of: a variant's over the
    base model (vs_base), another mode's over the same model's dynamic cache (vs_dynamic); the base model's own
    cells are the reference. A variant's reference cell (batch 1, KV cache, dynamic) carries the inference
    decision's verdict (decisions.json), any other cell its record's (the inference table's), in the same words."""
    said = {o["name"]: o["axes"]["speed"]["verdict"] for o in (question or {}).get("options", [])
            if o["axes"].get("speed")}
    out = []
    for job in records.ok(rows):
        reference = records.reference_cell(job)
        for c in records.ok(job.get("cells", [])):
            against = next((k for k in ("base", "dynamic") if c.get(f"vs_{k}")), None)  # older records: no "against"
            versus = c.get(f"vs_{against}")
            own = job["kind"] == "base" and not versus
            ratio = spread(1.0) if own else of_speedup(versus, "generation_speedup", against)
            verdict = "the reference" if own else said[job["variant"]] if c is reference and job["variant"] in said \
                else speedup_verdict(versus, "generation_speedup")
            out.append({"label": f"{inference_label(job['variant'], c)}, batch {c['batch_size']}",
                        "against": None if own else against, "ratio": ratio, "verdict": verdict})
    return out


def plot_inference(rows: list[dict], path: Path, question: dict | None = None) -> None:
    """Per cell, its interleaved generation speedup (inference_ratios) with its 95% interval, or the range of its
    rounds, against a line at 1, and its verdict beside it: the comparison the verdicts are decided on, free of
    the machine's drift between processes (each cell's own tokens/s are in the inference table)."""
    cells = inference_ratios(rows, question)
    fig, ax = plt.subplots(figsize=(10, 0.42 * len(cells) + 2.2))
    kinds = ratio_rows(ax, [c["label"] for c in cells], [c["ratio"] for c in cells], [c["verdict"] for c in cells],
                       [AGAINST.get(c["against"], AGAINST["base"])[0] for c in cells])
    ax.set_xlabel(f"generation speed × the reference's (> 1: faster; whole generations, round by round)\n"
                  f"({spread_words(kinds)})")
    ax.set_title("Greedy generation: speed over the base model, interleaved", fontsize=10)
    used = [AGAINST.get(a, AGAINST["base"]) for a in dict.fromkeys(c["against"] for c in cells)]  # only those drawn
    fig.legend(handles=[Line2D([], [], marker="o", ls="", color=colour, label=words) for colour, words in used],
               loc="lower center", fontsize=8)
    save_figure(fig, path, bottom=(0.2 * len(used) + 0.15) / fig.get_figheight())


def inference_label(variant: str, cell: dict) -> str:
    mode = records.cell_mode(cell)
    return variant + ("" if cell["kv_cache"] else " (KV off)") + ("" if mode == "dynamic" else f" ({mode})")

