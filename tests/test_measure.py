import os
import signal
import statistics
import subprocess
import sys
import time

import pytest
import torch

from efflab.measure import energy, env, flops, isolation, memory, stats, timing
from tests.helpers import REPO, SimulatedClock

CPU = torch.device("cpu")
MiB = 1024 * 1024


# Benchmark cells for the isolation tests: module-level, so a spawned child can import them.
def cell_doubles(x):
    return {"value": 2 * x}


def cell_raises():
    raise ValueError("bad cell")


def cell_grows(step_mib=64, total_mib=1536):
    """Grows past the test's cap to a fixed size, then waits to be killed: however late the parent looks, the
    resident set it sees is bounded, so no race decides the test."""
    blocks = []
    for _ in range(total_mib // step_mib):
        blocks.append(torch.ones(step_mib * MiB // 4))
    time.sleep(600)
    return {"allocated_mib": total_mib}


def cell_sleeps(seconds):
    time.sleep(seconds)
    return {}


def cell_killed():
    os.kill(os.getpid(), signal.SIGKILL)


def cell_allocates(mib):
    torch.ones(1024).sum()  # torch's one-time start-up (thread pool, allocator) is not the allocation under test
    with memory.track_memory(CPU) as mem:
        block = torch.ones(mib * MiB // 4)
        del block
    return {"memory": mem}


def cell_warns_repeatedly(stderr_path):
    """Repeats a Python warning (from two places), a logged warning, a bitsandbytes MatMul8bitLt warning and an
    error, and starts and stops the memory profiler; its stderr goes to `stderr_path` (a forkserver child's
    stderr is the forkserver's, which a test cannot capture)."""
    import logging
    import warnings

    os.dup2(os.open(stderr_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 2)
    os.environ.pop("KINETO_LOG_LEVEL", None)  # efflab's default, not the caller's
    for _ in range(3):
        warnings.warn("a user-facing warning", FutureWarning)
    warnings.warn("a user-facing warning", FutureWarning)  # another line: the 'default' action shows it again
    for _ in range(3):
        logging.getLogger("efflab").warning("a logged warning")
        logging.getLogger("bitsandbytes.autograd._functions").warning(
            "MatMul8bitLt: inputs will be cast from %s to float16 during quantization", torch.float32)
    for _ in range(2):
        logging.getLogger("efflab").error("an error")
    with memory.track_memory(CPU):
        torch.ones(1024).sum()
    return {"kineto_log_level_after": os.environ.get("KINETO_LOG_LEVEL")}


def test_percentiles_on_a_known_list():
    summary = stats.summarize([float(x) for x in range(1, 11)])
    assert summary["n"] == 10
    assert summary["median"] == pytest.approx(5.5)
    assert summary["p90"] == pytest.approx(9.1)
    assert summary["min"] == 1 and summary["max"] == 10
    assert summary["std"] == pytest.approx(3.02765, rel=1e-4)
    assert summary["p50"] == summary["median"] and summary["p99"] == pytest.approx(9.91)
    assert stats.summarize([2.0, 4.0])["p99"] == pytest.approx(3.98)


def test_the_median_s_interval_is_from_order_statistics_and_only_where_n_gives_one():
    samples = [float(x) for x in range(1, 102)]
    summary = stats.summarize(samples)
    lo, hi = summary["ci95_median"]
    assert 40 < lo < 51 < hi < 62 and summary["ci_median_coverage"] >= 0.95
    assert stats.summarize([3.0] * 7)["ci95_median"] == [3.0, 3.0]
    six = stats.summarize([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    assert six["ci95_median"] == [1.0, 6.0] and six["ci_median_coverage"] == pytest.approx(0.96875)
    for n in (1, 3, 5):  # too few values for a 95% interval: none is called one
        few = stats.summarize([float(x) for x in range(n)])
        assert few["ci95_median"] is None and few["ci_median_coverage"] is None


def test_known_durations_are_timed_exactly_and_warmup_is_not_timed(monkeypatch):
    clock = SimulatedClock()
    monkeypatch.setattr(timing, "clock", clock)
    durations = iter([9.0, 9.0, 0.05, 0.07, 0.05, 0.06, 0.05])  # the two warmup calls are slow, as first calls are
    calls = []
    summary = timing.time_fn(lambda: (calls.append(1), clock.advance(next(durations))), CPU, warmup=2, repeats=5)
    assert len(calls) == 7, "warmup runs happen but are not timed"
    assert summary["n"] == 5 and summary["clock"] == "perf_counter" and summary["warmup"] == 2
    assert summary["samples"] == pytest.approx([0.05, 0.07, 0.05, 0.06, 0.05])
    assert summary["median"] == pytest.approx(0.05)


def test_the_real_clock_times_real_work():
    """The one timing of the real machine: what holds on any machine, busy or idle (a sleep lasts at least as
    long as asked; how much longer depends on the machine, so there is no upper bound)."""
    summary = timing.time_fn(lambda: time.sleep(0.01), CPU, warmup=0, repeats=2)
    assert summary["n"] == 2 and min(summary["samples"]) >= 0.01


def test_a_known_allocation_is_seen_by_the_memory_tracker():
    with memory.track_memory(CPU) as mem:
        block = torch.ones(256 * 1024 * 1024 // 4, dtype=torch.float32)  # 256 MiB, touched
        del block
    assert mem["kind"] == "cpu_peak_rss"
    assert mem["delta_mib"] == pytest.approx(256, rel=0.05)
    assert mem["tensors"]["kind"] == "cpu_tensor_peak"
    assert mem["tensors"]["delta_mib"] == pytest.approx(256, abs=0.01)  # allocator events: exact bytes
    assert mem["tensors"]["end_delta_mib"] == pytest.approx(0, abs=0.01)


def test_the_tensor_peak_counts_live_bytes_not_what_malloc_keeps():
    before = torch.ones(32 * MiB // 4)  # allocated before: its free is not counted
    tensors = memory.CpuTensorPeak()
    with memory.track_memory(CPU, tensors) as mem:
        a = torch.zeros(16 * MiB // 4)
        tensors.pause()  # folding the events so far keeps the running count
        unseen = torch.zeros(64 * MiB // 4)  # allocated while paused: not counted
        del unseen
        tensors.resume()
        b = torch.zeros(8 * MiB // 4)  # live together with a: the peak, 24 MiB
        del a, b
        c = torch.zeros(12 * MiB // 4)  # reuses what malloc kept: no new RSS, but 12 MiB of live tensors
        del before
    assert mem["tensors"]["delta_mib"] == pytest.approx(24, abs=0.01)
    assert mem["tensors"]["end_delta_mib"] == pytest.approx(12, abs=0.01)
    assert mem["tensors"]["pause_resume_s"] > 0 and c.numel()
    assert not torch.autograd._profiler_enabled(), "the profiler is stopped at the end of the block"
    idle = memory.CpuTensorPeak()
    idle.resume()  # never started (a GPU run's counter): resuming starts nothing
    assert not idle.counting and not torch.autograd._profiler_enabled()


def test_a_free_of_a_block_allocated_before_is_not_counted_where_the_allocator_reports_a_stale_size():
    earlier = memory.CpuTensorPeak().start()
    seen = [torch.zeros(4096) for _ in range(64)]  # their sizes enter the allocator's table while it counts
    earlier.stop()
    addresses = {t.data_ptr() for t in seen}
    del seen  # freed with the profiler off: the table keeps them
    before = [torch.ones(4096) for _ in range(64)]  # malloc hands the same addresses out again
    reused = sum(t.data_ptr() in addresses for t in before)
    tensors = memory.CpuTensorPeak().start()
    kept = torch.zeros(3 * MiB // 4)
    del before  # the allocator reports the frees at reused addresses, with the sizes it kept
    counted = tensors.stop()
    assert reused > 0 and counted["unpaired_frees"] >= reused
    assert counted["end_delta_mib"] == pytest.approx(3, abs=1e-6) and kept.numel()
    assert counted["delta_mib"] == pytest.approx(3, abs=1e-6)


def test_auto_dtype_is_chosen_by_measurement_on_cpu():
    chosen, evidence = flops.resolve_dtype("auto", CPU)
    probe = evidence["linear_gflops"]
    assert chosen == max(probe, key=probe.get)
    assert flops.resolve_dtype("float32", CPU)[0] == "float32"


def test_environment_fingerprint_names_the_machine_and_libraries():
    record = env.environment(CPU, {"a": 1})
    assert record["device"] == "cpu" and record["cpu_cores"] >= 1
    assert record["packages"]["torch"] and record["packages"]["transformers"]
    assert record["params_sha256"] == env.environment(CPU, {"a": 1})["params_sha256"]


def test_a_failing_cell_is_recorded_and_the_next_cell_still_runs():
    first = isolation.run_cell(cell_raises, {}, timeout_s=120)
    second = isolation.run_cell(cell_doubles, {"x": 21}, timeout_s=120)
    assert first["status"] == "failed" and first["reason"] == "ValueError: bad cell"
    assert second["status"] == "ok" and second["value"] == 42 and second["isolation"] == "subprocess"


def test_a_cell_over_its_memory_cap_is_recorded_as_oom():
    result = isolation.run_cell(cell_grows, {}, memory_cap_mib=768, timeout_s=300)
    assert result["status"] == "oom" and "memory cap of 768 MiB" in result["reason"]
    assert 768 < result["cell_process_max_rss_mib"] < 1536 + 1024, "killed for passing the cap, not at the timeout"
    assert isolation.run_cell(cell_doubles, {"x": 1}, memory_cap_mib=768)["status"] == "ok"


def test_a_cell_past_its_timeout_is_killed_and_recorded():
    result = isolation.run_cell(cell_sleeps, {"seconds": 600}, timeout_s=4)
    assert result["status"] == "timeout" and "4 s" in result["reason"]
    assert 4 < result["cell_wall_s"] < 300, "killed at its timeout, long before its sleep would have ended"


def test_a_cell_killed_by_sigkill_is_recorded_as_probable_oom():
    result = isolation.run_cell(cell_killed, {}, timeout_s=120)
    assert result["status"] == "oom" and "SIGKILL" in result["reason"]


def test_inprocess_cells_record_exceptions_too():
    assert isolation.run_cell(cell_raises, {}, isolation="inprocess")["status"] == "failed"
    assert isolation.run_cell(cell_doubles, {"x": 2}, isolation="inprocess")["value"] == 4


def test_a_fresh_cell_is_not_polluted_by_earlier_work_in_the_parent():
    junk = [torch.ones(64 * MiB // 4) for _ in range(8)]  # 512 MiB freed before the cell
    del junk
    result = isolation.run_cell(cell_allocates, {"mib": 128}, timeout_s=120)
    assert result["status"] == "ok" and result["memory"]["kind"] == "cpu_peak_rss"
    assert result["memory"]["delta_mib"] == pytest.approx(128, rel=0.05)


def test_matmul_ceiling_and_mfu_are_consistent():
    ceiling = flops.matmul_ceiling("float32", CPU, size=512)
    assert ceiling["tflops"] > 0 and ceiling["dtype"] == "float32"
    # a workload doing exactly the ceiling's FLOP rate has MFU 1
    assert flops.mfu(1000.0, ceiling["tflops"] * 1e9, ceiling["tflops"]) == pytest.approx(1.0)
    assert flops.mfu(1000.0, 1e9, None) is None
    assert flops.published_peak_tflops(CPU, "bfloat16")["tflops"] is None


def test_fingerprint_ignores_commit_and_params_but_not_the_stack():
    record = env.environment(CPU, {"a": 1})
    other = env.environment(CPU, {"a": 2}) | {"git_commit": "0000000"}
    assert env.fingerprint(record) == env.fingerprint(other) == record["fingerprint"]
    changed = record | {"packages": record["packages"] | {"torch": "0.0.1"}}
    assert env.fingerprint(changed) != record["fingerprint"]


def test_a_cell_shows_each_warning_once_every_error_and_no_profiler_lines(tmp_path):
    stderr = tmp_path / "cell.err"
    result = isolation.run_cell(cell_warns_repeatedly, {"stderr_path": str(stderr)}, timeout_s=120)
    assert result["status"] == "ok"
    text = stderr.read_text()
    assert text.count("FutureWarning: a user-facing warning") == 1 and text.count("a logged warning") == 1
    assert text.count("an error") == 2, "errors are never folded"
    assert "MatMul8bitLt" not in text, "bitsandbytes logs errors only, as in the stage's own process"
    assert "USDT" not in text and "profiler_st" not in text, "Kineto's start/stop lines are off"
    assert result["kineto_log_level_after"] is None, "set only while efflab's profiler initialises Kineto"


def _work(clock, seconds_per_round):
    """A variant whose call at round r takes `seconds_per_round(r)` on the simulated clock."""
    return lambda r: clock.advance(seconds_per_round(r))


@pytest.fixture
def quiet_machine(monkeypatch):
    """A simulated clock, and a speed probe that reads the same every time."""
    clock = SimulatedClock()
    monkeypatch.setattr(timing, "clock", clock)
    monkeypatch.setattr(timing, "speed_probe", lambda device: 100.0)
    return clock


def test_interleaved_rounds_alternate_the_order_and_find_a_known_slowdown(quiet_machine):
    clock = quiet_machine
    timed = timing.interleave({"a": _work(clock, lambda r: 0.004), "b": _work(clock, lambda r: 0.008)}, 6, CPU)
    assert [r["order"] for r in timed["rounds"]] == [["a", "b"], ["b", "a"]] * 3
    assert timed["stable_rounds"] == 6 and timed["set_aside"] == 0 and "unstable" not in timed
    ratio = stats.paired_ratio(timed, "a", "b")
    assert ratio["median"] == pytest.approx(2) and ratio["verdict"] == "slower"
    assert ratio["ci95"] == pytest.approx([2, 2])
    assert stats.paired_ratio(timed, "b", "a")["verdict"] == "faster"


# Per-round jitter of the simulated timings (±5%), so that the intervals below are real order statistics, not [2, 2].
JITTER = [1.00, 1.04, 0.97, 1.02, 0.95, 1.05, 0.99, 1.03, 0.96, 1.01, 0.98, 1.00]


@pytest.mark.parametrize("rounds", [6, 12])
@pytest.mark.parametrize("cell_over_reference, median, verdict", [(0.5, 2.0, "faster"), (2.0, 0.5, "slower")])
def test_a_speedup_reads_faster_when_the_cell_takes_less_time_than_the_reference(quiet_machine, rounds,
                                                                                 cell_over_reference, median, verdict):
    """measure.stats.speedup is the reference's time over the cell's, said of the cell: a cell taking half the
    reference's time is 2x and `faster`, one taking twice as long 0.5x and `slower`, their intervals excluding 1.
    ratio_verdict alone speaks of the reference (b's time over a's): `slower` where the cell is faster, which
    said_of_faster_side turns round."""
    clock = quiet_machine
    reference = [0.010 * JITTER[r] for r in range(rounds)]
    cell = [cell_over_reference * 0.010 * JITTER[::-1][r] for r in range(rounds)]
    timed = timing.interleave({"cell": _work(clock, lambda r: cell[r]),
                               "reference": _work(clock, lambda r: reference[r])}, rounds, CPU, warmup=0)
    assert timed["stable_rounds"] == rounds and timed["variants"]["cell"]["samples"] == pytest.approx(cell)
    ratios = [ref / mine for ref, mine in zip(reference, cell)]
    sp = stats.speedup(timed, "cell", "reference")
    assert sp["median"] == pytest.approx(statistics.median(ratios)) == pytest.approx(median, rel=0.1)
    lo, hi = sp["ci95"]
    assert (1 < lo <= sp["median"] <= hi) if verdict == "faster" else (lo <= sp["median"] <= hi < 1)
    assert sp["verdict"] == verdict and sp["rounds"] == rounds
    of_reference = stats.ratio_verdict(ratios)
    assert of_reference["verdict"] == {"faster": "slower", "slower": "faster"}[verdict]
    assert of_reference["ci95"] == pytest.approx(sp["ci95"]) and of_reference["median"] == pytest.approx(sp["median"])
    said = stats.said_of_faster_side(of_reference)
    assert said["verdict"] == verdict and said["median"] == of_reference["median"], "only the verdict is turned round"
    assert stats.paired_ratio(timed, "cell", "reference")["verdict"] == of_reference["verdict"]


@pytest.mark.parametrize("cell_over_reference, median", [(0.5, 2.0), (2.0, 0.5)])
def test_two_rounds_leave_a_speedup_undecided_however_large(quiet_machine, cell_over_reference, median):
    """Two rounds give no 95% interval of the median: the verdict says so, in whichever direction the ratio goes,
    and said_of_faster_side leaves it as it is."""
    clock = quiet_machine
    timed = timing.interleave({"cell": _work(clock, lambda r: cell_over_reference * 0.010),
                               "reference": _work(clock, lambda r: 0.010)}, 2, CPU, warmup=0)
    sp = stats.speedup(timed, "cell", "reference")
    assert sp["median"] == pytest.approx(median) and sp["ci95"] is None and sp["rounds"] == 2
    assert sp["verdict"] == "not decided at this size: 2 rounds cannot give a 95% interval of the median (6 needed at 95%)"
    assert sp["verdict"] not in ("faster", "slower", "same within ±10%")
    assert stats.said_of_faster_side(stats.ratio_verdict([median] * 2))["verdict"] == sp["verdict"]
    assert stats.said_of_faster_side({"verdict": "same within ±10%"})["verdict"] == "same within ±10%"


def test_a_drift_that_hits_both_variants_alike_cancels_in_the_paired_ratio(quiet_machine):
    """The machine gets slower every round (a neighbour job ramping up): timed A A A then B B B, B reads over
    twice as slow; the interleaved per-round ratio sees two identical variants."""
    clock = quiet_machine
    drift = lambda r: 0.02 * (1 + 0.5 * r)  # noqa: E731
    timed = timing.interleave({"a": _work(clock, drift), "b": _work(clock, drift)}, 6, CPU, warmup=0)
    back_to_back = statistics.median(map(drift, range(6, 12))) / statistics.median(map(drift, range(6)))
    assert back_to_back > 2
    ratio = stats.paired_ratio(timed, "a", "b")
    assert ratio["median"] == pytest.approx(1) and ratio["verdict"] == "same within ±10%"


def test_the_interleaving_noise_of_real_rounds_gives_the_verdict_its_interval_allows(quiet_machine):
    """Per-round ratios that scatter (a recorded-like series, b 10-30% slower): the verdict follows the
    order-statistic interval of the median, not the mean or the best round."""
    clock = quiet_machine
    b_over_a = [1.10, 1.30, 1.18, 1.22, 1.12, 1.26, 1.15, 1.20, 1.14, 1.24, 1.17, 1.28]
    timed = timing.interleave({"a": _work(clock, lambda r: 0.1), "b": _work(clock, lambda r: 0.1 * b_over_a[r])},
                               12, CPU, warmup=0)
    ratio = stats.paired_ratio(timed, "a", "b")
    # of 12 values, the 3rd smallest and the 3rd largest bound the median at 96% coverage
    assert ratio["verdict"] == "slower" and ratio["ci95"] == pytest.approx([1.14, 1.26])
    assert ratio["median"] == pytest.approx(1.19) and ratio["coverage"] == pytest.approx(0.961, abs=1e-3)


def test_a_verdict_needs_enough_rounds_and_no_difference_needs_a_narrow_interval():
    """Order statistics: fewer than 6 values give no 95% interval of a median; an interval that holds 1 but
    also a 10% difference is not decided, not 'same within ±10%'."""
    assert stats.ratio_verdict([1.3, 1.4, 1.35, 1.32, 1.38])["verdict"].startswith("not decided at this size: 5 rounds")
    assert stats.ratio_verdict([1.3, 1.4, 1.35, 1.32, 1.38, 1.31])["verdict"] == "slower"
    assert stats.ratio_verdict([0.99, 1.01, 1.0, 1.02, 0.98, 1.03])["verdict"] == "same within ±10%"
    wide = stats.ratio_verdict([0.85, 1.2, 1.0, 1.1, 0.95, 1.05])
    assert wide["verdict"].startswith("not decided at this size: the 95% interval [0.85, 1.2] holds 1")
    assert wide["ci95"] == [0.85, 1.2] and wide["coverage"] == pytest.approx(1 - 2 / 64)


def _probes(monkeypatch, readings):
    probes = iter(readings)
    monkeypatch.setattr(timing, "speed_probe", lambda device: next(probes))


def test_rounds_where_the_machine_slowed_are_set_aside_and_measured_again(monkeypatch):
    clock = SimulatedClock()
    monkeypatch.setattr(timing, "clock", clock)
    _probes(monkeypatch, [100, 101, 50, 99, 100, 102, 100, 100])  # round k sees probes k and k+1
    timed = timing.interleave({"a": _work(clock, lambda r: 0.001), "b": _work(clock, lambda r: 0.001)}, 3, CPU,
                               warmup=0)
    assert [r["stable"] for r in timed["rounds"]] == [True, False, False, True, True]
    assert timed["stable_rounds"] == 3 and timed["set_aside"] == 2 and "unstable" not in timed
    assert timed["variants"]["a"]["n"] == 3, "set-aside rounds are not in the figures"


def test_a_machine_that_never_settles_gives_no_verdict(monkeypatch):
    clock = SimulatedClock()
    monkeypatch.setattr(timing, "clock", clock)
    _probes(monkeypatch, [100, 50] * 20)
    timed = timing.interleave({"a": _work(clock, lambda r: 0.001), "b": _work(clock, lambda r: 0.002)}, 3, CPU,
                               warmup=0)
    assert len(timed["rounds"]) == 6 and "machine's speed changed" in timed["unstable"]
    assert timed["variants"]["a"]["n"] == 6, "an unstable comparison's figures are of every round, flagged"
    assert stats.paired_ratio(timed, "a", "b")["verdict"].startswith("not a verdict: the machine's speed changed")


@pytest.mark.parametrize("busy_rate, set_aside", [(0.5, True), (0.7, True), (0.8, False), (1.2, False)])
def test_the_sentinel_sets_aside_a_round_run_beside_a_busy_core(monkeypatch, busy_rate, set_aside):
    """Another process taking a core scales the probe by `busy_rate` for one round (a core shared by two
    processes halves it): beyond the tolerance the round is set aside, within it the round counts."""
    clock = SimulatedClock()
    monkeypatch.setattr(timing, "clock", clock)
    quiet = 100.0
    _probes(monkeypatch, [quiet, quiet, quiet * busy_rate] + [quiet] * 10)  # the second round ends busy
    timed = timing.interleave({"a": _work(clock, lambda r: 0.01), "b": _work(clock, lambda r: 0.01)}, 4, CPU,
                               warmup=0)
    assert [r["stable"] for r in timed["rounds"][1:3]] == [not set_aside] * 2
    assert timed["set_aside"] == (2 if set_aside else 0) and timed["stable_rounds"] == 4
    assert timing.SENTINEL_TOLERANCE == 0.25, "the cases above straddle the tolerance"


def test_the_speed_probe_is_the_rate_of_its_fastest_matmul(monkeypatch):
    """The probe's arithmetic on known timings, then one real probe: a positive finite rate on any machine."""
    real = timing.speed_probe(CPU)
    assert 0 < real < float("inf")
    monkeypatch.setattr(timing, "time_fn", lambda fn, device, warmup, repeats: {"samples": [0.02, 0.01, 0.04]})
    assert timing.speed_probe(CPU) == pytest.approx(2 * 768**3 / 0.01 / 1e9)


def _zone(root, name, uj, max_uj=2**32):
    zone = root / name
    zone.mkdir(parents=True)
    (zone / "energy_uj").write_text(str(uj))
    (zone / "max_energy_range_uj").write_text(str(max_uj))
    return zone


def test_rapl_energy_sums_the_packages_and_survives_a_counter_wraparound(tmp_path, monkeypatch):
    monkeypatch.setenv(energy.POWERCAP_ENV, str(tmp_path))
    p0 = _zone(tmp_path, "intel-rapl:0", 1_000_000)
    p1 = _zone(tmp_path, "intel-rapl:1", 999_000_000, max_uj=1_000_000_000)
    _zone(tmp_path, "intel-rapl:0:0", 5)  # a subzone (core) of package 0: not counted twice
    meter = energy.EnergyMeter(torch.device("cpu")).start()
    (p0 / "energy_uj").write_text(str(3_500_000))  # +2.5 J
    (p1 / "energy_uj").write_text(str(1_000_000))  # wrapped: +1 J to the top, +1 J after
    got = meter.stop()
    assert got["joules"] == pytest.approx(4.5) and "intel-rapl:0, intel-rapl:1" in got["source"]
    assert energy.energy_per_token(got, 9)["joules_per_token"] == pytest.approx(0.5)


def test_energy_without_a_counter_is_unavailable_with_the_reason(tmp_path, monkeypatch):
    monkeypatch.setenv(energy.POWERCAP_ENV, str(tmp_path / "absent"))
    got, tokens = energy.energy_of(lambda: 1 / 0, torch.device("cpu"))  # nothing runs without a counter
    assert tokens == 0 and got["unavailable"].startswith(f"no {tmp_path / 'absent'}")
    assert energy.energy_per_token(got, 100) == {"unavailable": got["unavailable"]}


def test_energy_on_this_machine_is_measured_or_says_why_not():
    got = energy.EnergyMeter(torch.device("cpu")).start().stop()
    assert got.get("joules", 0) >= 0 and ("joules" in got or got["unavailable"])


def test_gpu_energy_reads_nvml_s_board_counter_in_millijoules(monkeypatch):
    import sys
    import types

    readings = iter([1_000, 4_500])  # mJ
    fake = types.SimpleNamespace(nvmlDeviceGetTotalEnergyConsumption=lambda handle: next(readings))
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setattr(energy, "nvml_handle", lambda device: "handle")
    monkeypatch.setattr(energy, "synchronize", lambda device: None)
    got = energy.EnergyMeter(torch.device("cuda", 0)).start().stop()
    assert got["joules"] == pytest.approx(3.5) and got["source"] == "NVML total energy of the GPU board"


def test_the_bandwidth_probe_counts_a_copy_s_read_and_write_over_its_time(monkeypatch):
    """A copy the simulated clock says takes 2 ms moves 2 x 1 MiB (read and write): the probe's rate is exactly
    the bytes over the time computed by hand, and the real probe gives a rate, best repeat first."""
    from efflab.measure import bandwidth

    clock = SimulatedClock()
    monkeypatch.setattr(timing, "clock", lambda: (clock.advance(0.001), clock())[1])  # each reading 1 ms later
    probe = bandwidth.bandwidth_ceiling(CPU, nbytes=2**20 + 4)  # (a size no other test caches)
    assert probe["best_s"] == pytest.approx(0.001)
    assert probe["gb_per_s"] == pytest.approx(2 * (2**20 + 4) / 0.001 / 1e9)
    monkeypatch.undo()
    real = bandwidth.bandwidth_ceiling(CPU, nbytes=2**22)
    assert real["gb_per_s"] >= real["median_gb_per_s"] > 0


def test_a_decode_rate_is_placed_between_the_bandwidth_and_the_matmul_ceilings():
    from efflab.measure import bandwidth

    shape = {"layers": 2, "kv_heads": 2, "head_dim": 16, "heads": 4}
    costs = bandwidth.decode_roofline(shape, weight_bytes=10_000_000, element_bytes=4, matmul_params=2_000_000,
                                      prompt_len=20, new_tokens=6, batch=2, kv_cache=True)
    kv = 2 * 2 * 2 * 16 * 4 * 22  # layers x (K, V) x heads x dim x bytes x mean context (20 + (6 - 2) / 2)
    assert costs["bytes_per_token"] == 5_000_000 + kv and costs["mean_context"] == 22
    assert costs["flops_per_token"] == 2 * 2_000_000 + 4 * 2 * 4 * 16 * 22
    limits = {"bandwidth": {"gb_per_s": 10.0}, "matmul": {"tflops": 0.1}}
    at = lambda tps: bandwidth.roofline(tps, costs, limits["bandwidth"], limits["matmul"])  # noqa: E731
    assert at(1000.0)["bandwidth_fraction"] == pytest.approx(1000 * (5_000_000 + kv) / 10e9)
    assert at(100.0)["bound"] == "framework-bound"  # 5% of the bandwidth, 0.4% of the matmul ceiling
    assert at(1000.0)["bound"] == "memory-bound"  # 50% and 4%
    compute_heavy = costs | {"bytes_per_token": 1000}
    assert bandwidth.roofline(10_000.0, compute_heavy, limits["bandwidth"], limits["matmul"])["bound"] == "compute-bound"


def test_a_pass_that_gives_several_tokens_reads_its_weights_once_for_all_of_them():
    """Prompt lookup's 8 tokens in 3 passes of the model (5 candidates accepted of 12 shown): a token reads 3/8 of a
    pass's bytes and processes (3 + 12) / 8 tokens' FLOPs, so a rate that would read 2.4x the bandwidth at one
    pass per token stays under it."""
    from efflab.measure import bandwidth

    costs = {"bytes_per_token": 8e9, "flops_per_token": 1e9, "weights_bytes": 8e9, "mean_context": 30}
    spec = bandwidth.speculative_costs(costs, {"steps": 3, "proposed": 12, "accepted": 5})
    assert spec["bytes_per_token"] == pytest.approx(8e9 * 3 / 8) and spec["tokens_per_pass"] == pytest.approx(8 / 3)
    assert spec["flops_per_token"] == pytest.approx(1e9 * 15 / 8)
    limits = {"gb_per_s": 100.0}, {"tflops": 1.0}
    assert bandwidth.roofline(30.0, costs, *limits)["bandwidth_fraction"] == pytest.approx(2.4)
    assert bandwidth.roofline(30.0, spec, *limits)["bandwidth_fraction"] == pytest.approx(0.9)


def test_a_training_steps_phases_are_cut_at_its_marks_and_add_up_to_it():
    """PhaseClock's arithmetic on known marks: two micro-batches (each forward's backward runs until the next
    forward, the last one's until the optimizer), and a compiled model with no forward marks."""
    from efflab.measure.phases import PHASES, step_phases

    marks = [("data_begin", 0.0), ("data_end", 0.5), ("step_begin", 0.6), ("forward_begin", 0.7),
             ("forward_end", 1.7), ("forward_begin", 3.7), ("forward_end", 4.7), ("optimizer_begin", 6.0),
             ("optimizer_end", 6.4), ("step_end", 6.5), ("data_begin", 7.0), ("data_end", 7.2), ("step_begin", 7.2),
             ("optimizer_begin", 9.2), ("optimizer_end", 9.3), ("step_end", 9.4), ("train_end", 9.5)]
    first, compiled = step_phases(marks)
    assert first == pytest.approx({"data": 0.5, "forward": 2.0, "backward": 2.0 + 1.3, "forward+backward": 0.0,
                                   "optimizer": 0.4, "step_end": 0.1, "between": 0.5, "instrument": 0.0,
                                   "other": 0.2, "total": 7.0})
    assert compiled["forward+backward"] == pytest.approx(2.0) and compiled["forward"] == 0
    assert compiled["between"] == pytest.approx(0.1) and compiled["total"] == pytest.approx(2.5)
    for step in (first, compiled):
        assert sum(step[p] for p in PHASES) == pytest.approx(step["total"])


def test_an_instruments_own_time_is_its_own_phase_taken_out_of_the_phase_it_fell_in():
    """A watched instrument's calls (the tensor count resuming inside the data fetch, pausing after the step's end)
    are the `instrument` phase; data and between keep only the loop's own time, and the phases still add up."""
    from efflab.measure.phases import PHASES, PhaseClock, step_phases

    marks = [("data_begin", 0.0), ("instrument_begin", 0.1), ("instrument_end", 0.3), ("data_end", 0.5),
             ("step_begin", 0.6), ("forward_begin", 0.7), ("forward_end", 1.7), ("optimizer_begin", 3.0),
             ("optimizer_end", 3.4), ("step_end", 3.5), ("instrument_begin", 3.6), ("instrument_end", 4.6),
             ("data_begin", 4.8), ("data_end", 4.9), ("step_begin", 4.9), ("forward_begin", 5.0),
             ("forward_end", 6.0), ("optimizer_begin", 7.0), ("optimizer_end", 7.1), ("step_end", 7.2),
             ("train_end", 7.3)]
    counted, plain = step_phases(marks)
    assert counted["instrument"] == pytest.approx(0.2 + 1.0)
    assert counted["data"] == pytest.approx(0.3) and counted["between"] == pytest.approx(0.3)
    assert plain["instrument"] == 0 and plain["between"] == pytest.approx(0.1)
    for step in (counted, plain):
        assert sum(step[p] for p in PHASES) == pytest.approx(step["total"])

    class Counter:
        def pause(self):
            return "paused"
    clock, counter = PhaseClock(torch.device("cpu")), Counter()
    clock.watch(counter, "pause")
    assert counter.pause() == "paused" and [label for label, _ in clock.marks] == ["instrument_begin",
                                                                                   "instrument_end"]


def test_a_light_job_s_cells_fork_from_a_forkserver_without_the_trainer(monkeypatch):
    """prestart(light=True): the forkserver imports the model machinery only (on a GPU it always does); a job's
    extra modules are still added. Without it, a CPU forkserver imports what the job server does, lm-eval aside."""
    from efflab import evaluation, zygote
    from efflab.measure import isolation

    monkeypatch.setattr(isolation, "_LIGHT", False)
    monkeypatch.setattr(isolation, "_EXTRA", [])
    monkeypatch.setattr(isolation.torch.cuda, "is_available", lambda: False)
    full = isolation.cell_preload()
    assert "transformers.trainer" in full and "peft" in full and not set(full) & set(evaluation.PRELOAD)
    assert full[0] == "efflab" and set(full[1:]) <= set(zygote.PRELOAD)  # efflab first: it quiets the imports after
    monkeypatch.setattr(isolation, "_cell_context", lambda: type("Ctx", (), {"get_start_method": lambda s: "spawn"})())
    isolation.prestart("subprocess", extra=["json"], light=True)
    light = isolation.cell_preload()
    assert light == ["efflab", *isolation._CELL_PRELOAD_LIGHT, "json"]  # efflab first: it quiets the imports after
    assert "transformers.trainer" not in light and "peft" not in light
    isolation.prestart("inprocess", light=False)
    assert isolation.cell_preload() == light, "a job's light choice is not undone by a later prestart"


def test_a_killed_cell_leaks_no_semaphore():
    """A cell killed at its timeout after a progress bar (tqdm's lock is a multiprocessing semaphore by default)
    leaves nothing for the resource tracker to report at shutdown: the console stays quiet."""
    code = ("from efflab.measure.isolation import run_cell\nfrom tests.helpers import progress_then_hang\n"
            "print(run_cell(progress_then_hang, {}, 'subprocess', timeout_s=3)['status'])")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert done.stdout.strip() == "timeout", done.stderr[-2000:]
    assert "leaked" not in done.stderr and "Warning" not in done.stderr, done.stderr[-2000:]


@pytest.mark.parametrize(("level", "shown"), [(None, False), ("WARNING", True)])
def test_the_live_tensor_count_s_allocator_warning_is_off_unless_the_user_asks_for_torch_s_cpp_warnings(level, shown):
    """CpuTensorPeak resumed over a tensor allocated before it: torch's C++ allocator warns ("Memory block of unknown
    size ..."), three times in a default run's console. efflab sets torch's C++ log level to errors before torch is
    imported, unless the user set it."""
    code = ("import efflab, torch\nfrom efflab.measure.memory import CpuTensorPeak\nx = torch.empty(1_000_000)\n"
            "peak = CpuTensorPeak().start()\ndel x\npeak.pause()\nprint('counted')\n")
    env = {k: v for k, v in os.environ.items() if k != "TORCH_CPP_LOG_LEVEL"} | (
        {"TORCH_CPP_LOG_LEVEL": level} if level else {})
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert "counted" in done.stdout, done.stderr
    assert ("allocated before the profiling started" in done.stderr) == shown


def test_loading_a_local_model_draws_no_progress_bar_and_restores_the_setting(results, capfd):
    from transformers.utils import logging as hf_logging

    from efflab.layout import Layout
    from efflab.models.modeling import load_model

    hf_logging.enable_progress_bar()  # a stage run earlier in this worker turns them off (cli.no_library_bars)
    load_model(Layout(results).base_model(), "float32", torch.device("cpu"))
    assert "Loading weights" not in capfd.readouterr().err
    assert hf_logging.is_progress_bar_enabled()


def test_the_trainer_s_progress_bar_stays_and_its_per_step_dicts_do_not_reach_the_console(capsys):
    """QuietProgress keeps the bar and drops ProgressCallback's printout of each logged dict."""
    from efflab.stages.finetune.callbacks import QuietProgress

    written = []
    quiet = QuietProgress()
    quiet.training_bar = type("Bar", (), {"write": lambda self, text: written.append(text)})()
    state = type("State", (), {"is_world_process_zero": True})()
    quiet.on_log(None, state, None, logs={"loss": 3.2, "grad_norm": 0.5})
    assert written == [] and capsys.readouterr().out == ""
