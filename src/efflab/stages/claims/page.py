"""claims.md: the counts by evidence and verdict, then one short section per seed (its unit convention and a
compact table); every row's arithmetic and reasons are in claims.csv."""
from __future__ import annotations

import pandas as pd

from .verdict import verdict_class

HOW_TO_READ = (
    "**measured**: measured by this run and judged by equivalence: reproduced only when its whole 95% interval "
    "lies inside the claim's band, differs only when it lies wholly outside, otherwise inconclusive, as is a "
    "measurement with no interval (a count of this run's tensors is exact: its value is its interval). "
    "**computed**: arithmetic on the seed's own inputs (efflab.estimators.analytic on the shipped model configs). "
    "**definition**: a parameter count, a shape, a number format, a library default or another identity. The band "
    "is the values that reproduce the claim: its tolerance around the seed's figure. A hardware claim needs its GPU "
    "unless a computation settles it. Each row's arithmetic, assumptions and reasons: claims.csv.")


def _cell(text) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _table(header: list[str], rows: list[list]) -> list[str]:
    """A Markdown table without padding: the page stays small however long a cell is."""
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
            *["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]]


def _counts_table(counts: dict) -> list[str]:
    verdicts, evidence = counts["verdicts"], counts["evidence"]
    rows = [[e, *[counts["counts"][e][v] for v in verdicts], sum(counts["counts"][e].values())] for e in evidence]
    rows.append(["all", *[counts["by_verdict"][v] for v in verdicts], counts["claims"]])
    return _table(["evidence", *verdicts, "all"], rows)


def _units_line(seed: dict, fits: dict | None) -> str:
    if "units" not in seed:
        return "Units: no byte figures."
    u = seed["units"]
    tally = ", ".join(f"{n} {k}" for k, n in (fits or {}).items() if n)
    return (f"Units: its KB/MB/GB are read as **{u['convention']}** ({u['evidence_kind']} evidence: {u['evidence']})."
            + (f" Its byte figures with a value here fit: {tally}." if tally else ""))


def _verdict_cell(r) -> str:
    """The sentence's one verdict on the reading it rests on; another reading of the same sentence is said as a
    reading, pointing at the claim that decides."""
    if r.id == r.sentence_claim:
        return verdict_class(r.verdict)
    return f"reading: {verdict_class(r.verdict)} (the sentence: `{r.sentence_claim}`)"


def _seed_section(source: str, seed: dict, rows: pd.DataFrame, fits: dict | None) -> list[str]:
    table = _table(["claim", "quantity", "seed", "this run", "band", "verdict", "evidence"],
                   [[r.id, r.quantity.replace("_", " ").replace(":", ": ") or "—", r.reported, r.reproduced or "—",
                     r.band, _verdict_cell(r), r.evidence] for r in rows.itertuples()])
    open_ = rows[rows["verdict"].map(verdict_class).isin(["differs", "inconclusive"])]
    notes = [f"- **{r.id}** ({verdict_class(r.verdict)}): {r.finding}" for r in open_.itertuples() if r.finding]
    return [f"## `{source}`: {seed['title']}", "", _units_line(seed, fits), "", *table, "",
            *([*notes, ""] if notes else [])]


def markdown(df: pd.DataFrame, seeds: dict, counts: dict) -> str:
    lines = ["# Published numbers: reported vs reproduced", "",
             f"{counts['claims']} numeric claims of the seed texts (workflow/claims.yaml), by what decides each "
             f"(evidence) and its verdict:", "", *_counts_table(counts), "",
             f"They read {counts['sentences']} sentences of the seeds; each sentence has one verdict, its strongest "
             "reading's (one that decides, measured before computed before a definition): "
             + ", ".join(f"{n} {v}" for v, n in counts["by_sentence_verdict"].items() if n)
             + ". A claim that is another reading of a sentence says so in its verdict cell.", "", HOW_TO_READ, ""]
    for source, seed in seeds.items():
        rows = df[df["source"] == source]
        if len(rows):
            lines += _seed_section(source, seed, rows, counts["units"].get(source, {}).get("byte_figures"))
    return "\n".join(lines)
