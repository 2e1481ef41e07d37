import pytest
import pandas as pd
import torch

from efflab import measure, report


def _envs():
    here = measure.environment(torch.device("cpu"))
    there = here | {"packages": here["packages"] | {"torch": "2.12.0"}, "cpu": "Other CPU"}
    there["fingerprint"] = measure.fingerprint(there)
    return here, there


def test_results_from_different_environments_are_not_put_in_one_table_unless_asked():
    here, there = _envs()
    assert here["fingerprint"] != there["fingerprint"]
    envs = {e["fingerprint"]: e for e in (here, there)}
    df = pd.DataFrame([{"variant": "a", "tokens/s": 10.0, "env": here["fingerprint"]},
                       {"variant": "b", "tokens/s": 12.0, "env": there["fingerprint"]}])
    refused = report.comparison(df, envs, allow_mixed=False)
    assert "Not compared in one table" in refused and "allow_mixed_environments" in refused
    assert f"torch: {here['packages']['torch']} / 2.12.0" in refused and "Other CPU" in refused
    assert refused.count("| variant") == 2, "one table per environment"
    combined = report.comparison(df, envs, allow_mixed=True)
    assert combined.count("| variant") == 1 and "combined" in combined
    same = report.comparison(df.assign(env=here["fingerprint"]), envs, allow_mixed=False)
    assert same.count("| variant") == 1 and "env" not in same


def test_missing_values_print_as_a_dash():
    table = report._md(pd.DataFrame([{"a": 1.5, "b": None}, {"a": float("nan"), "b": "x"}]))
    assert "nan" not in table and "-" in table.splitlines()[-1]


def _run(name, memory, step_s, **settings):
    base = {"method": "lora", "gradient_checkpointing": False, "packing": True, "eval_rows": 8, "lora": {"r": 8}}
    return {"run": name, "status": "ok", "settings": base | settings, "step_s": step_s, "tokens_per_s": 100 / step_s,
            "train_memory": {"kind": "cpu_peak_rss", "peak_mib": memory + 1000, "delta_mib": memory},
            "validation_after": {"loss": 3.0}, "environment": {"fingerprint": "e"}}


def test_runs_that_differ_in_one_knob_become_a_knob_row():
    rows = [_run("lora", 400, 1.0), _run("lora-gc", 250, 1.3, gradient_checkpointing=True),
            _run("lora-r16", 420, 1.0, lora={"r": 16}), _run("lora-eval", 400, 1.0, eval_rows=16),
            {"run": "broken", "status": "failed", "reason": "x", "settings": {}}]
    table = report.knob_table(rows)
    knobs = dict(zip(table["knob"], table.to_dict("records")))
    assert set(knobs) == {"gradient_checkpointing", "lora.r"}, "eval_rows is not a knob; the failed run is left out"
    gc = knobs["gradient_checkpointing"]
    assert gc["from → to"] == "false → true" and gc["runs"] == "lora → lora-gc"
    assert gc["memory change (%)"] == pytest.approx(-37.5) and gc["step time change (%)"] == pytest.approx(30)
    assert gc["tokens/s ratio"] == pytest.approx(1 / 1.3)
    assert gc["step time verdict"] == "-", "no per-step times recorded: no verdict"


def test_a_step_time_verdict_needs_the_intervals_apart():
    from efflab.measure import summarize

    steady = summarize([1.00, 1.02, 0.99, 1.01, 1.00, 0.98, 1.03])
    slower = summarize([1.30, 1.32, 1.29, 1.31, 1.33, 1.28, 1.30])
    noisy = summarize([0.80, 1.40, 1.00, 1.20, 0.90, 1.10, 1.05])
    assert report.step_time_verdict(steady, slower) == "slower"
    assert report.step_time_verdict(slower, steady) == "faster"
    assert report.step_time_verdict(steady, noisy) == "no significant difference"
    rows = [_run("lora", 400, 1.0) | {"step_time": steady},
            _run("lora-gc", 250, 1.3, gradient_checkpointing=True) | {"step_time": slower}]
    row = report.knob_table(rows).iloc[0]
    assert row["step time verdict"] == "slower" and row["median step (s) [95% CI]"].startswith("1.00 [")
