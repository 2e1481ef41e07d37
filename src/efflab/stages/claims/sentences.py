"""One verdict per seed sentence. A sentence can carry several claims (readings): "INT8: ~2x memory savings" is
computed from the seed's own inputs, and measured on this run's int8 scheme and on torchao's. Its verdict is its
strongest reading's: one that decides (reproduced, differs, inconclusive), measured before computed before a
definition; where none decides, its first reading's (not reproducible here, needs GPU). The other readings stay in
claims.csv and on the page as readings, never as a second verdict of the sentence."""
from __future__ import annotations

import pandas as pd

from .verdict import verdict_class

DECIDES = ("reproduced", "differs", "inconclusive")
STRENGTH = {"measured": 0, "computed": 1, "definition": 2}


def _deciding(rows: pd.DataFrame) -> pd.Series:
    """The reading a sentence's verdict rests on."""
    classes = rows["verdict"].map(verdict_class)
    decided = rows[classes.isin(DECIDES)]
    if decided.empty:
        return rows.iloc[0]
    return decided.iloc[decided["evidence"].map(STRENGTH).argsort(kind="stable")].iloc[0]


def with_sentences(df: pd.DataFrame) -> pd.DataFrame:
    """claims.csv's rows, each with its sentence's one verdict (`sentence_verdict`) and the claim it rests on
    (`sentence_claim`)."""
    if df.empty:
        return df.assign(sentence_verdict=[], sentence_claim=[])
    picks = {key: _deciding(rows) for key, rows in df.groupby(["source", "quote"], sort=False)}
    keys = list(zip(df["source"], df["quote"]))
    return df.assign(sentence_verdict=[picks[k]["verdict"] for k in keys],
                     sentence_claim=[picks[k]["id"] for k in keys])


def sentence_counts(df: pd.DataFrame, verdicts, evidence) -> dict:
    """The sentences by their verdict and the evidence of the reading it rests on."""
    deciding = df[df["id"] == df["sentence_claim"]]
    classes = deciding["verdict"].map(verdict_class)
    return {"sentences": len(deciding),
            "sentence_counts": {e: {v: int(((deciding["evidence"] == e) & (classes == v)).sum()) for v in verdicts}
                                for e in evidence},
            "by_sentence_verdict": {v: int((classes == v).sum()) for v in verdicts}}
