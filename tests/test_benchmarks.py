"""Smoke tests of the benchmarks of efflab itself (benchmarks/*.py), on the CI's tiny model with the smallest
settings: each runs end to end and writes what it says it writes. What they measure is not asserted: they are
benchmarks, run by hand on a quiet machine (docs/guides/benchmarks.md). verdict_stability.py needs two pipeline
runs: tests/test_workflow.py runs it on the session's CI pipeline."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from efflab.measure.phases import PHASES
from tests.helpers import REPO, TEST_PARAMS

BENCHMARKS = REPO / "benchmarks"


def bench(script: str, *args) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, str(BENCHMARKS / script), *map(str, args)], cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{script} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


@pytest.mark.integration  # two training processes end to end: ~26 s (make test-integration); the summary's
# arithmetic is tested below, in make test
def test_finetune_throughput_compares_the_loops_phase_by_phase_on_the_same_batches(prepared, tmp_path):
    """Both loops train the same run on the same rows, stamped by the same phase clock: each cell's phases add up to
    its step, its speed against the script is the script's step over its own, its phases' differences from the
    script's are named, and its loss curve is compared with the script's step by step."""
    out = tmp_path / "finetune_throughput"
    bench("finetune_throughput.py", "--params", TEST_PARAMS, "--results", prepared, "--run", "lora-r8",
          "--repeats", 1, "--steps", 3, "--cells", "script,efflab-bare", "--unwatched", "--out", out)
    written = json.loads(out.with_suffix(".json").read_text())
    summary, samples = written["summary"], written["samples"]
    assert set(summary) == {"script", "efflab-bare"} and all(s["n"] == 1 for s in summary.values())
    for cell, entry in summary.items():
        (run,) = samples[cell]
        assert run["tokens_seen"] > 0 and len(run["losses"]) == run["steps"] == 3 and run["phases"]["steps"] >= 1
        for step in run["phases"]["per_step"]:  # every step is cut into phases that add up to it
            assert sum(step[p] for p in PHASES) == pytest.approx(step["total"], rel=1e-9)
        assert entry["phases_s"]["forward"] > 0 and entry["phases_s"]["backward"] > 0
        assert entry["phases_s"]["optimizer"] > 0
    bare, script = summary["efflab-bare"], summary["script"]
    assert bare["speedup_vs_script"]["median"] == pytest.approx(script["step_s_median"] / bare["step_s_median"])
    assert bare["speedup_vs_script"]["ci95"] is None, "one repeat gives no interval"
    assert bare["mixed_precision"] == "no, trainable weights float32" and bare["max_abs_loss_diff_vs_script"] >= 0
    table = out.with_suffix(".md").read_text()
    assert "| script | 1 |" in table and "| efflab-bare | 1 |" in table and "- efflab-bare against script:" in table


def test_harness_overhead_times_the_harness_and_bare_generation_alike(prepared, tmp_path):
    out = tmp_path / "harness_overhead.json"
    bench("harness_overhead.py", "--model", prepared / "base_model" / "model", "--new-tokens", 3, "--repeats", 1,
          "--out", out)
    result = json.loads(out.read_text())
    per_path = [result[f"{k}_decode_tokens_per_s"] for k in ("harness", "bare_generate", "manual_loop")]
    assert all(p["n"] == result["prompts"] * result["repeats"] and p["median"] > 0 for p in per_path)
    harness, bare = per_path[0]["median"], per_path[1]["median"]
    assert result["overhead_pct_vs_bare_generate"] == pytest.approx(100 * (1 - harness / bare))


def test_key_sets_names_a_lost_key_and_a_missing_job_and_passes_an_unchanged_run(tmp_path):
    """key_sets.py flattens each job's record to its key paths (list items share one): the same records pass, a
    record that lost a nested key or a job that is gone fails, naming them; an added key is listed and passes."""
    def results(name: str, records: dict) -> object:
        for job, record in records.items():
            (tmp_path / name / job).mkdir(parents=True)
            (tmp_path / name / job / "metrics.json").write_text(json.dumps(record))
        return tmp_path / name

    record = {"status": "ok", "cells": [{"ttft": {"median": 1.0}}, {"ttft": {"median": 2.0, "p90": 3.0}}]}
    before = results("before", {"quantize/int8": record, "claims": {"counts": {"reproduced": 3}}})
    same = results("same", {"quantize/int8": record, "claims": {"counts": {"reproduced": 4}}})
    assert "same key sets" in bench("key_sets.py", before, same).stdout
    changed = results("changed", {"quantize/int8": {"status": "ok", "cells": [{"ttft": {"median": 1.0}}],
                                                    "new": 1}})
    proc = subprocess.run([sys.executable, str(BENCHMARKS / "key_sets.py"), before, changed], capture_output=True,
                          text=True)
    assert proc.returncode == 1
    assert "quantize/int8: - cells[].ttft.p90" in proc.stdout and "quantize/int8: + new" in proc.stdout
    assert "claims: only in the before run" in proc.stdout


def test_finetune_throughput_gives_a_95_interval_from_six_repeats_and_names_each_phases_difference():
    """The summary on known samples: six repeats of each cell, the efflab cell's step 10% shorter in each, all of it
    in its forward phase."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("finetune_throughput", REPO / "benchmarks" / "finetune_throughput.py")
    bench_module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench_module)

    def sample(step: float, forward: float) -> dict:
        phases = dict.fromkeys(PHASES, 0.0) | {"forward": forward, "backward": step - forward, "total": step}
        return {"phases": {"median_s": phases, "steps": 6}, "tokens_seen": 600, "steps": 6, "losses": [3.0, 2.0],
                "mixed_precision": "no"}
    steps = [1.0, 1.1, 0.9, 1.2, 1.0, 1.05]
    samples = {"script": [sample(s, 0.4) for s in steps], "efflab-equal": [sample(0.9 * s, 0.4 - 0.1 * s)
                                                                           for s in steps]}
    summary = bench_module.summarise(samples)["efflab-equal"]
    speed = summary["speedup_vs_script"]
    assert speed["median"] == pytest.approx(1 / 0.9) and speed["ci95"] == pytest.approx([1 / 0.9, 1 / 0.9])
    assert speed["coverage"] > 0.95 and speed["repeats"] == 6
    assert summary["phase_delta_s"]["forward"] == pytest.approx(-0.1 * 1.025) and summary["step_delta_pct"] == (
        pytest.approx(-10))
    args = type("Args", (), {"run": "lora-r8", "repeats": 6})()
    text = bench_module.table(args, {"max_steps": 7, "batch_size": 2}, bench_module.summarise(samples))
    assert "1.11 [1.11, 1.11] (96.9% CI): faster" in text and "- efflab-equal against script: -10.0% a step; forward" in text
    samples["efflab-bare"] = [sample(0.9 * s / 1.02, 0.4 - 0.1 * s) for s in steps]  # the instruments: 2% a step
    said = bench_module.findings(bench_module.summarise(samples))
    assert "- efflab-equal against the script: 1.11 [1.11, 1.11] (96.9% CI): faster" in said
    assert "instruments (step timer, live-tensor count) add +2.0% [+2.0%, +2.0%] (96.9% CI)" in said
    assert "(efflab-equal against efflab-bare): slower with them" in said
    assert "loss curves within the script's own run-to-run difference, its repeats (0): efflab-equal, efflab-bare" \
        in said


def test_finetune_throughput_states_one_verdict_per_comparison_in_the_report_s_words():
    """Repeats whose paired ratios straddle 1 (the issue's 1.06 (0.95-1.09) beside tokens/s 142.6 vs 149.0): the table
    says the comparison is not decided and says why its medians may order the other way, and never 'no
    difference measured'."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("finetune_throughput", REPO / "benchmarks" / "finetune_throughput.py")
    bench_module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench_module)

    def sample(step: float) -> dict:
        phases = dict.fromkeys(PHASES, 0.0) | {"forward": step / 2, "backward": step / 2, "total": step}
        return {"phases": {"median_s": phases, "steps": 6}, "tokens_seen": 600, "steps": 6, "losses": [3.0, 2.0],
                "mixed_precision": "no"}
    script = [1.0, 1.3, 0.9, 1.25, 1.0, 1.2]
    mine = [0.8, 1.5, 0.85, 1.3, 1.15, 0.95]
    samples = {"script": [sample(s) for s in script], "efflab": [sample(s) for s in mine]}
    args = type("Args", (), {"run": "lora-r8", "repeats": 6})()
    summary = bench_module.summarise(samples)
    text = bench_module.table(args, {"max_steps": 7, "batch_size": 2}, summary) + bench_module.findings(summary)
    assert "not decided at this size" in text and "no difference" not in text and "inconclusive" not in text
    assert "its comparison with the script is the × script column alone" in text


def test_finetune_throughput_reads_each_cells_mfu_against_the_ceiling_of_its_own_matmul_dtype():
    import importlib.util

    spec = importlib.util.spec_from_file_location("finetune_throughput", REPO / "benchmarks" / "finetune_throughput.py")
    bench_module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench_module)

    def sample(ceiling: float, dtype: str) -> dict:
        phases = dict.fromkeys(PHASES, 0.0) | {"forward": 0.5, "backward": 0.5, "total": 1.0}
        return {"phases": {"median_s": phases, "steps": 6}, "tokens_seen": 600, "steps": 6, "losses": [3.0, 2.0],
                "mixed_precision": "no", "flops_per_token": 1e9, "ceiling_tflops": ceiling, "ceiling_dtype": dtype}
    samples = {"efflab-equal": [sample(c, "float32") for c in (0.2, 0.1, 0.3)],
               "efflab-bf16w": [sample(c, "bfloat16") for c in (0.02, 0.01, 0.03)]}
    summary = bench_module.summarise(samples)
    # 100 tokens/s x 1 GFLOP a token = 0.1 TFLOP/s: half the fp32 ceiling's median, five times the bf16 one's
    assert summary["efflab-equal"]["mfu"] == pytest.approx(0.5)
    assert summary["efflab-bf16w"]["mfu"] == pytest.approx(5.0) and "bfloat16" in summary["efflab-bf16w"]["mfu_of"]


def _throughput_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("finetune_throughput", REPO / "benchmarks" / "finetune_throughput.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _cell(step_ms: float, computes: dict | None = None, **phase_ms) -> dict:
    phases = dict.fromkeys(PHASES, 0.0) | {p: ms / 1000 for p, ms in phase_ms.items()}
    phases["forward"] = step_ms / 1000 - sum(phases.values())
    return {"phases": {"median_s": phases | {"total": step_ms / 1000}, "steps": 6,
                       "per_step": [phases | {"total": step_ms / 1000}]},
            "tokens_seen": 600, "steps": 6, "losses": [3.0, 2.0], "mixed_precision": "no"} | (
        {"computes": computes} if computes else {})


def test_finetune_throughput_refuses_a_run_whose_machine_changed_speed_or_was_shared():
    """The watch's verdict on planted readings: steady probes and a quiet CPU pass; one probe 40% down (a clock
    drop between two cells) or another process taking 45% of the CPU during one cell refuses the run, naming it."""
    bench_module = _throughput_module()
    cells = [f"{c} (repeat 1)" for c in ("script", "efflab", "efflab-equal")]
    quiet = {"probes_gflops": [120.0, 118.0, 125.0, 121.0], "others_share": [0.01, 0.02, 0.0], "cells": cells,
             "tolerance": 0.25, "max_others_share": 0.10}
    assert bench_module.refusal(quiet) is None
    slowed = quiet | {"probes_gflops": [120.0, 118.0, 72.0, 121.0]}
    why = bench_module.refusal(slowed)
    assert "speed changed" in why and "after efflab (repeat 1)" in why and "72.0 GFLOP/s" in why
    shared = quiet | {"others_share": [0.01, 0.45, 0.0]}
    assert bench_module.refusal(shared) == ("the machine was not ours: other processes took 45% of its CPU during "
                                            "efflab (repeat 1) (at most 10%)")
    assert "Watched: 4 speed probes" in bench_module.watch_line(quiet)


def test_others_share_of_the_cpu_is_the_busy_time_less_ours():
    from efflab.measure import quiet

    stat = "cpu  1000 50 400 9000 20 10 5 15 0 0\ncpu0 500 25 200 4500 10 5 2 8 0 0\n"
    assert quiet.busy_seconds(stat, 100) == (1000 + 50 + 400 + 10 + 5 + 15) / 100
    # 10 s of wall on 2 cores; 12 s busy, 9 of them ours: others took 3 of 20 core-seconds
    assert quiet.others_share(12.0, 9.0, 10.0, 2) == pytest.approx(0.15)
    assert quiet.others_share(8.0, 9.0, 10.0, 2) == 0.0  # ours counted a bit more than the kernel's ticks
    with pytest.raises(ValueError):
        quiet.busy_seconds("intr 1 2 3\n", 100)


def test_finetune_throughput_holds_efflab_s_own_phases_to_a_millisecond_of_the_script_s_with_an_interval():
    """Six paired repeats: a between phase 0.3 ms over the script's in each is within 1 ms; one 3 ms over is
    beyond; an instrument's own phase is not among efflab's own phases (it is reported on its own)."""
    bench_module = _throughput_module()
    script = [_cell(500 + k, between=0.6, data=0.5) for k in range(6)]
    close = [_cell(480 + k, between=0.9, data=0.5, instrument=30.0) for k in range(6)]
    far = [_cell(480 + k, between=3.6, data=0.5) for k in range(6)]
    within = bench_module.phase_overhead({"script": script, "efflab-equal": close})
    assert within["between"]["median_ms"] == pytest.approx(0.3) and within["between"]["verdict"] == "within +1 ms"
    assert "instrument" not in within and all(d["verdict"] == "within +1 ms" for d in within.values())
    said = bench_module.overhead_lines(within)[0]
    assert "between +0.30 ms [+0.30, +0.30] (96.9% CI): within +1 ms" in said and "Each within 1 ms" in said
    beyond = bench_module.phase_overhead({"script": script, "efflab-equal": far})
    assert beyond["between"]["verdict"] == "beyond +1 ms"
    assert "Not every one" in bench_module.overhead_lines(beyond)[0]
    short = bench_module.phase_overhead({"script": script[:3], "efflab-equal": close[:3]})
    assert short["between"]["ci95_ms"] is None and short["between"]["verdict"].startswith("not decided")


def test_finetune_throughput_names_what_each_side_computes_differently_and_its_gain_alone():
    """efflab packs where the script pads: the difference is named, with packing's gain measured alone by the pair
    that differs in it alone (efflab-equal against efflab-padded); a difference whose pair did not run says which
    cells would measure it; a cell this machine cannot run is listed with its reason and left out of the tables."""
    bench_module = _throughput_module()
    same = {"packing": False, "autocast": "no", "optimizer": "adamw_torch_fused", "trainable dtype": "float32",
            "attention": "sdpa", "torch.compile": False, "liger kernels": False}
    samples = {"script": [_cell(500, same) for _ in range(6)],
               "efflab-equal": [_cell(400, same | {"packing": True}) for _ in range(6)],
               "efflab": [_cell(300, same | {"packing": True, "autocast": "bf16"}) for _ in range(6)],
               "efflab-padded": [_cell(500, same) for _ in range(6)],
               "efflab-fa2": [{"unavailable": "attn_implementation flash_attention_2: FlashAttention-2 is CUDA kernels"}]}
    found = {(d["cell"], d["knob"]): d for d in bench_module.differences(samples)}
    assert set(found) == {("efflab", "packing"), ("efflab", "autocast"), ("efflab-equal", "packing")}
    assert found[("efflab-equal", "packing")]["gain"]["median"] == pytest.approx(500 / 400)
    assert found[("efflab", "autocast")]["gain"]["median"] == pytest.approx(400 / 300)
    summary = bench_module.summarise(samples)
    assert "efflab-fa2" not in summary
    said = bench_module.findings(summary, samples)
    assert ("- efflab and efflab-equal compute differently from the script: packing on where the script has off; "
            "alone, efflab-equal against efflab-padded: 1.25 [1.25, 1.25] (96.9% CI): faster") in said
    assert "- efflab-fa2: unavailable here: attn_implementation flash_attention_2" in said
    del samples["efflab-padded"]
    said = bench_module.findings(bench_module.summarise(samples), samples)
    assert "packing on where the script has off; not measured alone here (add the cells efflab-equal and " \
           "efflab-padded)" in said
    samples["efflab@16"] = [_cell(900) | {"tokens_seen": 4800} for _ in range(6)]  # a batch sweep: other work
    summary = bench_module.summarise(samples)
    assert "speedup_vs_script" not in summary["efflab@16"] and "max_abs_loss_diff_vs_script" not in summary["efflab@16"]
    assert "efflab@16: 800 tokens a step" in bench_module.findings(summary, samples)
    assert bench_module.cell_spec("efflab@16") == ("efflab", 16) and bench_module.cell_spec("efflab") == ("efflab", None)
    assert bench_module.cell_spec("efflab@x")[1] == -1


def test_a_probe_off_the_median_is_taken_again_and_the_second_reading_kept(monkeypatch):
    """A dip as a cell's process exits reads low once: taken again after a pause, the steady reading is kept (both
    recorded); a machine that really slowed reads low twice and is refused."""
    bench_module = _throughput_module()
    readings = iter([150.0, 152.0, 149.0, 100.0, 151.0, 90.0, 92.0])
    monkeypatch.setattr(bench_module, "speed_probe", lambda device: next(readings))
    monkeypatch.setattr(bench_module.time, "sleep", lambda s: None)
    watch = {"probes_gflops": [], "others_share": [], "cells": ["a", "b"], "reprobed": [], "tolerance": 0.25,
             "max_others_share": 0.10}
    bench_module.probe(watch, "cpu", settle=3)  # the best of three before the first cell
    bench_module.probe(watch, "cpu")  # 100: off by a third, again: 151
    assert watch["probes_gflops"] == [152.0, 151.0]
    assert watch["reprobed"] == [{"at": 1, "first_gflops": 100.0, "again_gflops": 151.0}]
    bench_module.probe(watch, "cpu")  # 90, then 92 again: slowed
    assert watch["probes_gflops"][-1] == 92.0 and "speed changed" in bench_module.refusal(watch)
