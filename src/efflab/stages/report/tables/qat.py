"""The precision range test's table: per bit width, PTQ and QAT perplexity, change and verdict."""
from __future__ import annotations

import pandas as pd

from .... import records
from ....measure.stats import NOT_DECIDED
from .. import spread
from ..writing import MiB, env_of, percent, recovered_text, status_text

QAT_COLUMNS = ["bits", "PTQ perplexity", "PTQ change vs full precision (%)", "PTQ verdict", "QAT perplexity",
               "QAT change vs full precision (%)", "QAT verdict", "QAT recovers of PTQ's gap (%)",
               "packed weights (MiB)", "env"]


def qat_table(jobs: list[dict]) -> pd.DataFrame:
    """One row per bit width: PTQ and QAT validation perplexity, its change over the full-precision fine-tune
    paired row by row (95% interval where the rows give one), and the precision range test's verdict at that
    width, decided by that interval."""
    out = []
    for job in records.ok(jobs):
        tests = job["precision_range_test"]
        for bits in job["bits"]:
            row = {"bits": bits, "env": env_of(job)}
            for method in ("ptq", "qat"):
                v = next(v for v in job["variants"] if (v["method"], v["bits"]) == (method, bits))
                label = method.upper()
                if records.is_ok(v):
                    row |= {f"{label} perplexity": v["perplexity"],
                            f"{label} change vs full precision (%)": spread.text(
                                spread.of_change(v.get("perplexity_change")), percent),
                            f"{label} verdict": verdict_of(tests[method], bits),
                            "packed weights (MiB)": v["weight_bytes"]["packed_bytes"] / MiB}
                else:
                    row[f"{label} verdict"] = status_text(v)
            row |= recovered_columns(next(v for v in job["variants"] if (v["method"], v["bits"]) == ("qat", bits)))
            out.append(row)
    return pd.DataFrame(out, columns=QAT_COLUMNS)


def recovered_columns(v: dict) -> dict:
    """A QAT model's share of PTQ's gap recovered (quality.recovered_share); '-' for a record from before it."""
    r = v.get("recovered_share") or {}
    return {"QAT recovers of PTQ's gap (%)": recovered_text(r) or ("no PTQ gap decided" if r else "-")}


def verdict_of(test: dict | None, bits: int) -> str:
    """A width's verdict in the precision range test; a record from before intervals has none to give."""
    verdicts = (test or {}).get("verdicts") or {}  # JSON keys: the width as a string
    said = verdicts.get(str(bits), verdicts.get(bits, "undecided"))  # the stage's words, in the vocabulary
    return {"passes": "within", "fails": "beyond", "undecided": NOT_DECIDED}.get(said, said)
