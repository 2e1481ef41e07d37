"""claims.md: the claims page."""
from __future__ import annotations

import pandas as pd

from .verdict import VERDICTS, verdict_class

# The texts efflab grew from (the `source` of each claim), by title, so that a reader can look them up.
SOURCES = {
    "000_965e890cecb00a0b.txt": "\"Chapter 12: Efficient Training and Inference at Scale\" (a book chapter: LoRA, "
                                "QLoRA, post-training quantization, FlashAttention, serving)",
    "001_d5371e57926c34be.txt": "CS 696 Applied Large Language Models, Spring 2025, \"Assignment 2, Performance "
                                "Issues\" (a course deck: KV cache, quantization, pruning, attention)",
    "002_80b60e9b2efd77d3.txt": "\"Efficient Finetuning of LLMs\" (Sumanth R Hegde; a talk with the memory arithmetic of "
                                "full, LoRA and QLoRA fine-tuning)",
    "003_6740d5587871bfd4.txt": "a blog guide to scaling transformers in production (mixed precision, checkpointing, ZeRO)",
    "004_a8bbd29d2539a3ab.txt": "Quantization-aware training notes, with a \"GPU RAM usage\" appendix",
}


def markdown(df: pd.DataFrame) -> str:
    counts = df["verdict"].map(verdict_class).value_counts()
    used = [s for s in SOURCES if s in set(df["source"])]
    lines = ["# Published numbers: reported vs reproduced", "",
             "The texts these claims come from:", "", *[f"- `{s}`: {SOURCES[s]}" for s in used], "",
             f"{len(df)} numeric claims from the seed texts (workflow/claims.yaml): "
             + ", ".join(f"{counts.get(v, 0)} {v}" for v in VERDICTS) + ". Analytic values come from "
             "efflab.estimate on the shipped model configs (parameter counts from the meta-device model); "
             "ratio is reproduced / reported. A measured figure shown with its 95% CI [lo, hi] is judged by "
             "equivalence: reproduced only when the whole CI lies inside the claim's tolerance band, differs only "
             "when it lies wholly outside, inconclusive when it crosses an edge.", ""]
    wrong = df[df["verdict"].map(verdict_class) == "differs"]
    if len(wrong):
        lines += ["Where the seeds' figures do not reproduce:", ""]
        lines += [f"- **{r.id}** ({r.source}): reported {r.reported}, reproduced {r.reproduced}"
                  f"{' (analytic)' if r.verdict.endswith('(analytic)') else ''} — {r.finding}"
                  for r in wrong.itertuples()]
        lines.append("")
    undecided = df[df["verdict"] == "inconclusive"]
    if len(undecided):
        lines += ["Where the measurement cannot decide at 95%:", ""]
        lines += [f"- **{r.id}** ({r.source}): reported {r.reported}, reproduced {r.reproduced} — {r.finding}"
                  for r in undecided.itertuples()]
        lines.append("")
    table = df.assign(claim=df["id"] + ": “" + df["quote"].str.replace("\t", " ") + "”",
                      ratio=df["ratio"].map(lambda r: "" if r is None or pd.isna(r) else f"{r:.3g}"))
    table = table[["claim", "source", "reported", "reproduced", "ratio", "verdict", "reason"]]
    table = table.apply(lambda col: col.astype(str).str.replace("|", "\\|", regex=False))
    return "\n".join(lines) + table.to_markdown(index=False) + "\n"

