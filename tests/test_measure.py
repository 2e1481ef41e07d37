import time

import pytest
import torch

from efflab import measure

CPU = torch.device("cpu")


def test_percentiles_on_a_known_list():
    stats = measure.summarize([float(x) for x in range(1, 11)])
    assert stats["n"] == 10
    assert stats["median"] == pytest.approx(5.5)
    assert stats["p90"] == pytest.approx(9.1)
    assert stats["min"] == 1 and stats["max"] == 10
    assert stats["std"] == pytest.approx(3.02765, rel=1e-4)


def test_a_known_sleep_is_timed_within_tolerance():
    calls = []
    stats = measure.time_fn(lambda: (calls.append(1), time.sleep(0.05)), CPU, warmup=2, repeats=5)
    assert len(calls) == 7, "warmup runs happen but are not timed"
    assert stats["n"] == 5 and stats["clock"] == "perf_counter"
    assert 0.05 <= stats["median"] < 0.07


def test_a_known_allocation_is_seen_by_the_memory_tracker():
    with measure.track_memory(CPU) as mem:
        block = torch.ones(256 * 1024 * 1024 // 4, dtype=torch.float32)  # 256 MiB, touched
        del block
    assert mem["kind"] == "cpu_peak_rss"
    assert mem["delta_mib"] == pytest.approx(256, rel=0.05)


def test_auto_dtype_is_chosen_by_measurement_on_cpu():
    chosen, evidence = measure.resolve_dtype("auto", CPU)
    probe = evidence["linear_gflops"]
    assert chosen == max(probe, key=probe.get)
    assert measure.resolve_dtype("float32", CPU)[0] == "float32"


def test_environment_fingerprint_names_the_machine_and_libraries():
    env = measure.environment(CPU, {"a": 1})
    assert env["device"] == "cpu" and env["cpu_cores"] >= 1
    assert env["packages"]["torch"] and env["packages"]["transformers"]
    assert env["params_sha256"] == measure.environment(CPU, {"a": 1})["params_sha256"]
