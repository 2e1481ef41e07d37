"""One pair rule: the step-time ratio of two fine-tuning runs that differ in one knob is read from their records by
records.step_ratio alone, so the report's knob table and the claims say the same of the same pair: the same
figure and interval from the same source, and the same refusal where the machine's speed changed between the
runs (or bench_finetune's interleaved pair gave no verdict)."""
from __future__ import annotations

import json

import pytest

from efflab.layout import Layout
from efflab.measure.stats import summarize
from efflab.stages.claims import stage
from efflab.stages.claims.registry import load
from efflab.stages.report import knobs

LENGTHS = [1.0, 1.6, 0.7, 1.3, 0.9, 1.1, 1.4]  # batches of different lengths: a wide spread per run
RUNS = ["lora", "lora-gc"]  # the grid's fine-tuning jobs (registry.names(cfg, "finetune"))


def _run(name: str, factor: float, tflops: float, tokens_seen: int = 1000, **settings) -> dict:
    steps = [factor * t for t in LENGTHS]
    step_s = sum(steps) / len(steps)
    return {"run": name, "status": "ok", "method": "lora", "step_s": step_s, "tokens_per_s": 100 / step_s,
            "settings": {"method": "lora", "gradient_checkpointing": False, "lora": {"r": 8}} | settings,
            "step_time": summarize(steps), "tokens_seen": tokens_seen,
            "throughput": {"matmul_ceiling": {"tflops": tflops}},
            "train_memory": {"kind": "cpu_peak_rss", "peak_mib": 1400, "delta_mib": 400},
            "validation_after": {"loss": 3.0}, "environment": {"fingerprint": "e"}}


def _bench(median, ci, verdict: str) -> list[dict]:
    return [{"status": "ok", "pairs": [{
        "status": "ok", "knob": "gradient_checkpointing", "a": "lora", "b": "lora-gc",
        "step_time_ratio": {"median": median, "ci95": ci, "rounds": 6, "verdict": verdict},
        "runs": {"lora": {"tokens_per_s": 200.0}, "lora-gc": {"tokens_per_s": 150.0}}}]}]


PLAIN = _run("lora", 1.0, 0.070)
CASES = {  # (plain run, checkpointing run, bench_finetune's records), and the source the rule reads
    "interleaved": (PLAIN, _run("lora-gc", 1.3, 0.070, gradient_checkpointing=True),
                    _bench(1.31, [1.22, 1.40], "slower"), "interleaved"),
    "interleaved, no verdict": (PLAIN, _run("lora-gc", 1.3, 0.070, gradient_checkpointing=True),
                                _bench(None, None, "not a verdict: the machine's speed changed"), "interleaved"),
    "paired steps": (PLAIN, _run("lora-gc", 1.3, 0.070, gradient_checkpointing=True), [], "paired"),
    "the runs' intervals": (PLAIN, _run("lora-gc", 1.3, 0.070, 2000, gradient_checkpointing=True), [], "runs"),
    # checkpointing read 2x faster: its run had the machine to itself, the plain run shared it (half speed)
    "speed changed": (PLAIN, _run("lora-gc", 0.5, 0.140, gradient_checkpointing=True), [], "paired"),
}


def _write(path, data) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))


@pytest.fixture(scope="module")
def claim() -> dict:
    return next(c for c in load()["claims"] if c["id"] == "checkpointing-30pct-slowdown")


@pytest.mark.parametrize("case", CASES)
def test_the_claims_and_the_report_read_a_knob_pair_by_one_rule(case, claim, tmp_path):
    plain, gc, bench, source = CASES[case]
    layout = Layout(tmp_path)
    for run in (plain, gc):
        _write(layout.metrics("finetune", run["run"]), run)
    if bench:
        _write(layout.metrics("bench_finetune"), bench[0])
    ratio, _ = knobs.knob_timing(plain, gc, bench)  # the report's: checkpointing's step over the plain run's
    row = knobs.knob_table([plain, gc], bench).iloc[0]
    said = stage.evaluate(claim, layout, finetune=RUNS)  # the claim's: checkpointing's step_s increase
    assert ratio["source"] == source and row["step time verdict"] == ratio["verdict"]
    if ratio["why"]:  # no comparison: both say so, for the same reason (the claim's runs in the claim's order)
        why = ratio["why"].removeprefix("not a verdict: ")
        assert row["step time verdict"] == f"not decided: {why}"
        assert said["verdict"] == "not reproducible here" and said["reason"].startswith(f"{source} step times of ")
        assert why.split(" (matmul ceiling")[0] in said["reason"]  # its figures in the claim's order
        return
    assert said["value"] == pytest.approx(100 * (ratio["median"] - 1))
    assert (said["ci_low"], said["ci_high"]) == pytest.approx(tuple(100 * (r - 1) for r in ratio["ci95"]))
    assert {"interleaved": "interleaved rounds", "paired": "paired steps", "runs": "the runs' median steps"}[
        source] in said["reason"]


def test_runs_at_different_speeds_give_no_figure_to_the_claims_either(claim, tmp_path):
    plain, gc, _, _ = CASES["speed changed"]
    layout = Layout(tmp_path)
    for run in (plain, gc):
        _write(layout.metrics("finetune", run["run"]), run)
    said = stage.evaluate(claim, layout, finetune=RUNS)
    assert "value" not in said and said["reproduced"] == "", "no -50% slowdown read off a machine at two speeds"
    assert said["reason"] == ("paired step times of lora-gc vs lora: the machine's speed changed between the runs "
                              "(matmul ceiling 140 vs 70 GFLOP/s)")
