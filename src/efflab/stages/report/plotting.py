"""The plots' common parts (matplotlib, Agg): saving a figure, spread bars and their words, labels in a column
beside the axes, ratios in rows with their verdicts, legends beside or below, and a placeholder that says why a
plot has nothing to draw.

A figure with a spread is drawn with it (report.spread): solid bars for its 95% interval where n gives one,
dashed bars for the range of n values too few for one, dotted bars for another named spread (a memory peak's
measured error), no bar for one measurement or an exact count; the axis label says which. Sizes and rates
start at zero, ratios are drawn against a line at 1 and changes against a line at 0; where points may lie
close, their labels sit in a column beside the axes and never overprint. A verdict is written in the report's
own words (decisions.json's, in the one vocabulary of measure.stats), never decided again from what the plot
draws.
"""
from __future__ import annotations

import math
import textwrap
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from .spread import CI, RANGE  # noqa: E402


def save_figure(fig, path: Path, bottom: float = 0.0) -> None:
    """Laid out to fit its labels and legends, also those beside or under the axes; `bottom`: the share of the
    height kept for a figure legend."""
    fig.tight_layout(rect=(0, bottom, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def spread_values(spreads: list) -> list[float]:
    return [s["value"] if s else math.nan for s in spreads]


# How a spread's bars are drawn, by its kind; a kind not named here (a memory peak's measured error) is dotted.
BAR_STYLES = {CI: "-", RANGE: "--"}


def spread_bars(ax, positions, spreads: list, colour: str = "black", horizontal: bool = False) -> set[str]:
    """Error bars at `positions`: solid for a 95% interval, dashed for a range, dotted for any other kind of spread
    (named by spread_words). Returns the kinds drawn."""
    drawn = set()
    kinds = [CI, RANGE] + sorted({s["kind"] for s in spreads if s and s["kind"] and s["kind"] not in BAR_STYLES})
    for kind in kinds:
        at = [(x, s) for x, s in zip(positions, spreads) if s and s["kind"] == kind]
        if not at:
            continue
        where, values = [x for x, _ in at], [s["value"] for _, s in at]
        err = [[max(0.0, s["value"] - s["lo"]) for _, s in at], [max(0.0, s["hi"] - s["value"]) for _, s in at]]
        xy, key = ((values, where), "xerr") if horizontal else ((where, values), "yerr")
        bars = ax.errorbar(*xy, **{key: err}, fmt="none", ecolor=colour, capsize=3, lw=1.2, zorder=3)
        bars.lines[2][0].set_linestyle(BAR_STYLES.get(kind, ":"))
        drawn.add(kind)
    return drawn


def spread_top(s: dict | None) -> float:
    """The top of a bar and its spread (0 where nothing was measured): where a label above it goes."""
    s = s or {}
    return max([v for v in (s.get("hi"), s.get("value")) if v is not None] + [0.0])


def spread_words(kinds: set[str], none: str = "no interval recorded") -> str:
    words = {CI: "bars: 95% CI", RANGE: "dashed bars: range of n < 6, no 95% CI"}
    said = [words[k] for k in (CI, RANGE) if k in kinds] + [f"dotted bars: {k}" for k in sorted(kinds - set(words))]
    return "; ".join(said) or none


def spaced(heights: list[float], gap: float) -> list[float]:
    """Heights in [0, 1] moved apart just enough that neighbours are `gap` apart, in their order."""
    out = []
    for h in heights:
        out.append(max(h, out[-1] + gap) if out else max(h, gap / 2))
    top = 1 - gap / 2
    for i in reversed(range(len(out))):
        top = min(out[i], top)
        out[i], top = top, top - gap
    return out


def label_column(ax, points: list[tuple], texts: list[str], colours: list[str]) -> None:
    """Each point's text in a column right of the axes (call it once the limits are set), as near its point's
    height as the others leave room for and joined to it by a thin line: however close the points lie, their texts
    (of as many lines as the longest) never overprint."""
    ax.get_xlim(), ax.get_ylim()  # settle the autoscaled limits before reading heights through them
    heights = [ax.transAxes.inverted().transform(ax.transData.transform(p))[1] for p in points]
    order = sorted(range(len(points)), key=lambda i: heights[i])
    lines = max([t.count("\n") + 1 for t in texts], default=1)
    gap = 0.2 * lines / (ax.get_position().height * ax.figure.get_figheight())  # 0.2 inch a line of 8-point text
    for i, y in zip(order, spaced([min(max(heights[i], 0), 1) for i in order], gap)):
        ax.annotate(texts[i], xy=points[i], xytext=(1.03, y), textcoords="axes fraction", va="center", fontsize=8,
                    color=colours[i], arrowprops={"arrowstyle": "-", "color": "silver", "lw": 0.6, "shrinkB": 4})


# A verdict's colour by its first words: better green, worse red, the same black, anything undecided grey.
VERDICT_COLOURS = (("faster", "tab:green"), ("within", "tab:green"), ("less", "tab:green"), ("slower", "tab:red"),
                   ("beyond", "tab:red"), ("more", "tab:red"), ("same within", "black"))


def verdict_colour(verdict: str) -> str:
    return next((c for start, c in VERDICT_COLOURS if verdict.startswith(start)), "dimgrey")


def ratio_rows(ax, labels: list[str], ratios: list, verdicts: list[str], colours: list[str]) -> set[str]:
    """Ratios as points in rows (the first on top), from zero, with their intervals or ranges, against a dotted
    line at 1, and each row's verdict written right of the axes in its own words (wrapped, never reworded).
    Returns the kinds of spread drawn."""
    y = list(range(len(labels)))
    ax.scatter(spread_values(ratios), y, color=colours, s=40, zorder=4)
    kinds = spread_bars(ax, y, ratios, horizontal=True)
    ax.axvline(1, color="grey", lw=0.8, ls=":")
    ax.set_xlim(0, 1.12 * max([s["hi"] or s["value"] for s in ratios if s] + [1.0]))
    ax.set_yticks(y, labels, fontsize=8)
    ax.set_ylim(len(labels) - 0.5, -0.5)
    for i, words in zip(y, verdicts):
        ax.annotate(textwrap.fill(words, 44), (1.02, i), xycoords=("axes fraction", "data"), va="center",
                    fontsize=8, color=verdict_colour(words))
    return kinds


def legend_beside(ax, **kwargs) -> None:
    """The axes' legend, or, where nothing was measured (every cell failed or was unavailable), a note saying so
    instead of an empty legend."""
    if ax.get_legend_handles_labels()[0]:
        ax.legend(**kwargs)
    else:
        ax.text(0.5, 0.5, "nothing measured: see the table for why", ha="center", va="center",
                transform=ax.transAxes, color="grey")


def legend_below(ax, **kwargs) -> None:
    """The legend under the axes, where it covers no data."""
    legend_beside(ax, loc="upper center", bbox_to_anchor=(0.5, -0.14), fontsize=8, **kwargs)



def placeholder_plot(path: Path, why: str) -> None:
    fig, ax = plt.subplots(figsize=(7, 2))
    ax.axis("off")
    ax.text(0.5, 0.5, why, ha="center", va="center", wrap=True, fontsize=10)
    fig.savefig(path, dpi=120)
    plt.close(fig)

