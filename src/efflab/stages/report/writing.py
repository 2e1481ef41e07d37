"""How the report writes a value: units, intervals, ratios, statuses and Markdown tables."""
from __future__ import annotations

import json
import math
import re

import pandas as pd

from ... import records
from ...measure.env import fingerprint
from ...measure.stats import format_ratio, ratio_words

MiB = 2**20


def env_of(metrics: dict) -> str:
    """The environment fingerprint of a result (computed for results written before it was stored)."""
    env = metrics["environment"]
    return env.get("fingerprint") or fingerprint(env)


def pct(x: float | None) -> float | None:
    return None if x is None else 100 * x


def peak_mib(m: dict | None) -> float | None:
    return None if not m else m.get("peak_mib")


def status_text(row: dict) -> str:
    return "ok" if records.is_ok(row) else f"{row['status']}: {row.get('reason', '')}"


def interval_text(stats: dict, scale: float = 1.0) -> str:
    """The 95% interval of the median as lo–hi; where n gives none, the range of the n values, named so."""
    if "ci95_median" not in stats:
        return "-"
    if stats["ci95_median"] is None:
        return f"{scale * stats['min']:.4g}–{scale * stats['max']:.4g} (range, n={stats['n']})"
    lo, hi = stats["ci95_median"]
    return f"{scale * lo:.4g}–{scale * hi:.4g}"


def median_text(stats: dict | None) -> str:
    """The median with its 95% interval, or with the range of its n values where n gives no interval."""
    if not stats:
        return "-"
    if stats.get("ci95_median") is None:
        return f"{stats['median']:.2f} (range {stats['min']:.2f}–{stats['max']:.2f}, n={stats['n']})"
    lo, hi = stats["ci95_median"]
    return f"{stats['median']:.2f} [{lo:.2f}, {hi:.2f}]"


def speedup_text(pair: dict | None, key: str) -> str:
    """An interleaved comparison's speedup with its interval: '1.31 [1.22, 1.40]'."""
    ratio = (pair or {}).get(key) or {}
    if ratio.get("median") is None:
        return (pair or {}).get("unavailable", "-")
    if not ratio.get("ci95"):
        return f"{ratio['median']:.2f} (n={ratio['rounds']}, no interval)"
    return format_ratio(ratio)


def speedup_verdict(pair: dict | None, key: str) -> str:
    """A speedup's verdict as a table cell, in the one vocabulary (stats.ratio_words); '-' where none was timed."""
    ratio = (pair or {}).get(key)
    return ratio_words(ratio) if ratio else "-"


def setting_text(value) -> str:
    """A setting as params.yaml spells it: false, 1e-05, [q_proj, v_proj], lora."""
    return value if isinstance(value, str) else json.dumps(value)


def ratio_of(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or not a else b / a


def anchor(heading: str) -> str:
    """A heading's link target as GitHub and MkDocs make it: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def init_text(run: dict) -> str:
    """A fine-tuning run's adapter initialisation and its seconds ('pissa 0.41'), or '-' (a full fine-tune)."""
    init = run.get("lora_init")
    return f"{init['init']} {init['seconds']:.2g}" if init else "-"


def brief(verdict: str) -> str:
    """A verdict without the detail of its why, where the text beside it states that once: "not decided: the
    machine's speed changed: 10 of 12 rounds ..." reads "not decided: the machine's speed changed"."""
    for head in ("not decided: ", "not a verdict: "):
        if verdict.startswith(head):
            return head + verdict[len(head):].split(": ")[0]
    return verdict


def one_line(text: str | None, limit: int = 240) -> str:
    text = " ".join((text or "").split())
    return (text[:limit] + "…" if len(text) > limit else text).replace("|", "\\|")


MAX_COLUMNS = 10  # wider tables are split into parts that repeat the identifying columns


# Below this a figure is float noise (a KL of -5e-09, a change of -3.6e-05 %): it reads as 0.
NOISE = 1e-6


def number(x: float, digits: int = 4, signed: bool = False) -> str:
    """A number for reading: `digits` significant digits, never in exponent form, thousands separated; float noise
    and negative zero as 0."""
    if abs(x) < NOISE:
        return "0"
    decimals = min(8, max(0, digits - 1 - math.floor(math.log10(abs(x)))))
    return _trimmed(f"{x:{'+' if signed else ''},.{decimals}f}")


def percent(x: float, signed: bool = True) -> str:
    """A change in percent for reading: one decimal below 100, none above, thousands separated; a change that one
    decimal would round to 0 keeps two significant digits, without an exponent (a merge's +0.000056% is not
    nothing, said as 0), down to 1e-8%, below which it is float noise and 0."""
    if abs(x) < 1e-8:
        return "0"
    sign = "+" if signed else ""
    if abs(x) < 0.05:
        return f"{x:{sign}.{1 - math.floor(math.log10(abs(x)))}f}".rstrip("0")
    return f"{x:{sign},.{1 if abs(x) < 100 else 0}f}"


def _trimmed(text: str) -> str:
    text = text.rstrip("0").rstrip(".") if "." in text else text
    return "0" if text in ("-0", "+0") else text


def cell_text(value) -> str:
    """A table cell: numbers to 4 significant digits for reading (fmt.number), no value (a failed or unavailable
    row) as '-'."""
    if value is None or (isinstance(value, float) and value != value):
        return "-"
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, float | int):
        return number(value)
    return str(value).replace("|", "\\|").replace("\n", " ")


def _pipe(df: pd.DataFrame) -> str:
    """GitHub Markdown without padding: a table's bytes are its content, not spaces."""
    numeric = [pd.api.types.is_numeric_dtype(df[c]) and not pd.api.types.is_bool_dtype(df[c]) for c in df.columns]
    lines = ["| " + " | ".join(cell_text(c) for c in df.columns) + " |",
             "|" + "|".join("--:" if n else "---" for n in numeric) + "|"]
    lines += ["| " + " | ".join(cell_text(v) for v in row) + " |" for row in df.itertuples(index=False)]
    return "\n".join(lines)


def markdown(df: pd.DataFrame, keys: int | None = None) -> str:
    """A Markdown table of at most MAX_COLUMNS columns. Columns with no value in any row ('-' or blank) are left
    out, a column with the same value in every row is said once above the table (same_note), and a wider table is
    split into parts, each repeating the `keys` leading columns that identify a row (by default its leading text
    columns, up to 4)."""
    keys = keys or df.attrs.get("keys")
    if keys is None:
        leading = [c for c in df.columns[:4]]
        keys = next((i for i, c in enumerate(leading) if pd.api.types.is_numeric_dtype(df[c])), len(leading)) or 1
    texts = {c: df[c].map(cell_text) for c in df.columns}
    valued = {c: texts[c][_has_value(texts[c])] for c in df.columns[1:]}
    # a key column after the first with one value in every row identifies nothing: said once, like the others
    const_keys = [c for c in df.columns[1:keys] if len(df) > 1 and len(valued[c]) == len(df) and valued[c].nunique() == 1]
    ids = [c for c in df.columns[:keys] if c not in const_keys]
    same = const_keys + [c for c in df.columns[keys:] if len(df) > 1 and len(valued[c]) > 1 and valued[c].nunique() == 1]
    rest = [c for c in df.columns[keys:] if c not in same and len(valued[c])]
    note = same_note(same, valued, len(df))
    width = MAX_COLUMNS - len(ids)
    parts = [rest[i:i + width] for i in range(0, len(rest), width)] or [[]]
    return note + "\n\n".join(_pipe(df[ids + part] if i == 0 else _with_values(df, texts, ids, part))
                                for i, part in enumerate(parts))


def same_note(same: list, valued: dict, rows: int) -> str:
    """The columns with one value in every row, said once above the table: 'In every row, steps: 7; memory kind:
    cpu_peak_rss.' ('In every row with a value' where some rows have none)."""
    if not same:
        return ""
    every = "In every row" if all(len(valued[c]) == rows for c in same) else "In every row with a value"
    return f"{every}, " + "; ".join(f"{c}: {valued[c].iloc[0]}" for c in same) + ".\n\n"


def _has_value(texts: pd.Series) -> pd.Series:
    """Which cells say something: not '-' (no value) and not blank."""
    return ~texts.str.strip().isin(("-", ""))


def _with_values(df: pd.DataFrame, texts: dict, ids: list, part: list) -> pd.DataFrame:
    """A later part of a split table keeps only the rows with a value in it (a baseline row of '-' says nothing
    there); the first part keeps every row, so that every row is named once."""
    has = pd.concat([_has_value(texts[c]) for c in part], axis=1).any(axis=1)
    return df.loc[has, ids + part]


def recovered_text(r: dict, unit: str = "") -> str:
    """quality.recovered_share in % with its interval: '38 [20, 55]' ('38% [20, 55]' with unit '%'),
    '52 (n=3, no interval)'; '' where there is no share."""
    if r.get("share") is None:
        return ""
    ci = r.get("ci95")
    return f"{100 * r['share']:.0f}{unit}" + (f" [{100 * ci[0]:.0f}, {100 * ci[1]:.0f}]" if ci else
                                         f" (n={r['n_rows']}, no interval)")
