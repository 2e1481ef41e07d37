"""figures.json: the few figures of a job that DVC shows, picked from its record by the registry's paths."""
from __future__ import annotations

from efflab.figure_picks import pick
from efflab.measure.stats import summarize
from efflab.registry import STAGES


def test_paths_reach_scalars_intervals_summaries_and_labelled_list_elements():
    record = {"status": "ok", "tokens_per_s": 250.0, "environment": {"torch": "2.13"},
              "step_time": summarize([1.0, 1.1, 1.2, 1.3, 1.4, 1.5, 1.6]),
              "change": {"pct": 3.0, "ci95_pct": [-1.0, 7.0], "method": "paired t", "per_row": [1, 2, 3]},
              "cells": [{"kv_cache": True, "batch_size": 1, "status": "ok", "ttft": summarize([0.2, 0.3])},
                        {"kv_cache": False, "batch_size": 1, "status": "oom", "reason": "out of memory"}]}
    figures = pick(record, ("tokens_per_s", "step_time", "change.pct", "change.ci95_pct", "cells[kv_cache,batch_size].ttft",
                            "missing.path"))
    assert figures == {
        "status": "ok", "tokens_per_s": 250.0,
        "step_time": {"median": 1.3, "ci95_lo": 1.0, "ci95_hi": 1.6},  # 7 samples: the order-statistics interval
        "change": {"pct": 3.0, "ci95_pct": {"lo": -1.0, "hi": 7.0}},
        "cells": {"kv_cache=true/batch_size=1": {"ttft": {"median": 0.25}},  # 2 samples: no interval to name
                  "kv_cache=false/batch_size=1": {"status": "oom"}}}


def test_a_job_that_did_not_run_shows_its_status_and_why_and_every_key_of_a_dict():
    assert pick({"status": "unavailable", "reason": "needs a CUDA GPU"}, STAGES["finetune"].figures) == \
        {"status": "unavailable", "reason": "needs a CUDA GPU"}
    assert pick({"tasks": {"a": {"metrics": {"acc": {"value": 0.5, "stderr": 0.1}}},
                           "b": {"metrics": {"bpb": {"value": 1.5, "stderr": None}}}}},
                ("tasks.*.metrics.*.value",)) == \
        {"status": "ok", "tasks": {"a": {"metrics": {"acc": {"value": 0.5}}}, "b": {"metrics": {"bpb": {"value": 1.5}}}}}


def test_every_stage_names_its_figures():
    assert [s for s, stage in STAGES.items() if not stage.figures] == []
