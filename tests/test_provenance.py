"""Every stage's provenance names the upstream jobs its rule reads, so a replaced base model or dataset marks
its numbers stale in the report."""
import re
from pathlib import Path

import pytest

from efflab.provenance import upstream_jobs
from efflab.registry import names as stage_names

RULES = Path(__file__).resolve().parents[1] / "workflow" / "rules"
READ_ALL = {"claims", "report"}  # they read every job's metrics, each of which carries its own chain


def _inputs(rule_file: Path) -> str:
    """The text of the rule's input block."""
    text = rule_file.read_text()
    return text[text.index("input:"):text.index("output:")]


@pytest.mark.parametrize("rule_file", sorted(p for p in RULES.glob("*.smk") if p.stem not in READ_ALL | {"common"}),
                         ids=lambda p: p.stem)
def test_upstream_jobs_cover_what_each_rule_reads(rule_file, test_cfg):
    stage, inputs = rule_file.stem, _inputs(rule_file)
    for name in stage_names(test_cfg, stage) or [None]:
        jobs = upstream_jobs(stage, name, test_cfg)
        for upstream in sorted(set(re.findall(r'"results/(base_model|prepare_data)/', inputs)) - {stage}):
            assert upstream in jobs, f"{stage}/{name} reads results/{upstream}/ but its provenance omits it"
