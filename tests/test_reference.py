"""The committed reference runs' pages are what this commit's code makes of their records: the claims and the
report are rendered again from results/reference/<machine>/ (efflab.tools.reference.rerender) and must equal the
committed files, so that a change to a verdict, a tolerance or a sentence shows up as a diff of those files
(regenerate them with `python -m efflab.tools.reference --rerender results/reference/<machine>`)."""
import difflib

import pytest

from efflab.tools.reference import rerender
from tests.helpers import REPO

RUNS = sorted(p.parent.parent for p in (REPO / "results" / "reference").glob("*/report/report.md"))
# The rendered text; the PNGs are drawn by matplotlib (bytes vary by version) and the stage's metrics.json by run.
COMPARED = {"report": ("report.md", "details.md", "decisions.json", "statements.jsonl", "summary.csv",
                       "finetune_pareto.csv", "inference_pareto.csv"),
            "claims": ("claims.md", "claims.csv", "summary.json")}


@pytest.mark.parametrize("run", RUNS, ids=[r.name for r in RUNS])
def test_the_reference_run_renders_to_its_committed_report_and_claims(run, tmp_path):
    again = rerender(run, tmp_path / run.name)
    for stage, names in COMPARED.items():
        for name in names:
            committed, made = run / stage / name, again / stage / name
            assert committed.is_file(), f"{committed} is not committed: rerender the reference run"
            diff = list(difflib.unified_diff(committed.read_text().splitlines(), made.read_text().splitlines(),
                                             str(committed.relative_to(REPO)), "re-rendered", lineterm="", n=1))
            assert not diff, "\n".join(diff[:40])
