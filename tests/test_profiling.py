import json

import pandas as pd
import pytest

from efflab import profiling
from tests.helpers import run_stage

TRAINING_PHASES = {"data", "forward", "backward", "optimizer step"}


def _chrome_trace(path):
    """The trace parses as Chrome trace event format: a traceEvents list of events with a phase, a name, a
    process and thread, and for complete events ('X') a start and duration in microseconds."""
    trace = json.loads(path.read_text())
    events = trace["traceEvents"]
    assert isinstance(events, list) and events
    complete = [e for e in events if e.get("ph") == "X"]
    assert complete
    for e in complete:
        assert {"name", "pid", "tid", "ts", "dur"} <= set(e), e
        assert isinstance(e["ts"], (int, float)) and e["dur"] >= 0
    return {e["name"] for e in complete}


def _profiled(cfg, stages):
    cfg["profile"].update(stages=stages, skip_steps=1, steps=2)


def test_a_profiled_fine_tune_writes_a_chrome_trace_with_its_phases_and_its_top_operators(results, write_params):
    metrics = run_stage("finetune", write_params(lambda cfg: _profiled(cfg, ["finetune"])), results, "lora-r8")
    prof = metrics["profile"]
    folder = results / "finetune" / "lora-r8"
    names = _chrome_trace(folder / prof["trace"])
    assert TRAINING_PHASES <= names, names
    top = pd.read_csv(folder / prof["top_ops"])
    assert len(prof["top10"]) == 10 and [r["operator"] for r in prof["top10"]] == list(top.operator[:10])
    assert top.self_cpu_ms.is_monotonic_decreasing and "aten::mm" in set(top.operator)
    assert top[top.operator == "aten::mm"].calls.iloc[0] > 0
    # on CPU the tensor counter is itself a torch.profiler: a profiled run records it as unavailable, not wrong
    assert "profiled" in metrics["train_memory"]["tensors"]["unavailable"]
    assert metrics["validation_after"]["loss"] < metrics["validation_before"]["loss"]


def test_a_profiled_generation_cell_has_its_own_trace(results, write_params):
    params = write_params(lambda cfg: _profiled(cfg, ["bench_inference"]))
    metrics = run_stage("bench_inference", params, results, "baseline")
    measured = [c for c in metrics["cells"] if c["status"] == "ok"]  # not the engine's unavailable cells
    assert len(measured) == len(metrics["cells"]) - sum(c["generation"] == "vllm" for c in metrics["cells"])
    for cell in measured:
        prof = cell["profile"]
        names = _chrome_trace(results / "bench_inference" / "baseline" / prof["trace"])
        assert "generate" in names and prof["steps"] == 2
    assert len({c["profile"]["trace"] for c in measured}) == len(measured), "a trace per cell, the modes' too"


def test_profiling_off_starts_no_profiler(results, write_params, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a profiler was built while profile.stages is empty")
    monkeypatch.setattr(profiling, "Profiler", refuse)
    metrics = run_stage("finetune", write_params(), results, "lora-r8")
    assert metrics["profile"] is None and not (results / "finetune" / "lora-r8" / profiling.FOLDER).exists()
    assert metrics["train_memory"]["tensors"]["delta_mib"] > 0, "the tensor counter ran as usual"


def test_a_run_shorter_than_the_profile_says_how_many_steps_it_profiled(results, write_params):
    def few(cfg):
        _profiled(cfg, ["finetune"])
        cfg["profile"]["steps"] = 50
    metrics = run_stage("finetune", write_params(few), results, "lora-r8")
    assert metrics["profile"]["steps"] == metrics["steps"] - 1
    assert f"only {metrics['steps'] - 1} of the 50 steps" in metrics["profile"]["short"]


@pytest.mark.parametrize("stage", ["finetune", "bench_inference"])
def test_the_profile_switch_reruns_only_the_profiled_stages(test_cfg, stage):
    from efflab.registry import STAGES

    assert STAGES[stage].profiled and "profile" in STAGES[stage].params
    assert all("profile" not in s.params for s in STAGES.values() if not s.profiled)
