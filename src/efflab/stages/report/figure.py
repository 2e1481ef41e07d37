"""The plots' common parts (matplotlib, Agg): saving a figure, spread bars and their words, labels in a column
beside the axes, legends beside or below, and a placeholder that says why a plot has nothing to draw.

A figure with a spread is drawn with it (report.spread): solid bars for its 95% interval where n gives one,
dashed bars for the range of n values too few for one, no bar for one measurement or an exact count; the axis
label says which. Sizes and rates start at zero, ratios are drawn against a line at 1 and changes against a
line at 0; where points may lie close, their labels sit in a column beside the axes and never overprint.
"""
from __future__ import annotations

import math
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


def spread_bars(ax, positions, spreads: list, colour: str = "black", horizontal: bool = False) -> set[str]:
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


def spread_words(kinds: set[str], none: str = "no interval recorded") -> str:
    words = {CI: "bars: 95% CI", RANGE: "dashed bars: range of n < 6, no 95% CI"}
    return "; ".join(words[k] for k in (CI, RANGE) if k in kinds) or none


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
    never overprint."""
    ax.get_xlim(), ax.get_ylim()  # settle the autoscaled limits before reading heights through them
    heights = [ax.transAxes.inverted().transform(ax.transData.transform(p))[1] for p in points]
    order = sorted(range(len(points)), key=lambda i: heights[i])
    gap = 0.2 / (ax.get_position().height * ax.figure.get_figheight())  # 0.2 inch a line of 8-point text
    for i, y in zip(order, spaced([min(max(heights[i], 0), 1) for i in order], gap)):
        ax.annotate(texts[i], xy=points[i], xytext=(1.03, y), textcoords="axes fraction", va="center", fontsize=8,
                    color=colours[i], arrowprops={"arrowstyle": "-", "color": "silver", "lw": 0.6, "shrinkB": 4})


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

