import csv

import pytest

from efflab.measure import timing
from efflab.measure.stats import ratio_verdict, summarize
from efflab.stages import bench_serving
from tests.helpers import TEST_PARAMS, SimulatedClock, run_stage, serving_record


def test_every_serving_figure_is_recomputed_from_the_per_request_log_burst_by_burst(results, test_cfg):
    """The stage on this machine, the real speed probe between bursts: whatever it set aside, the figures are those
    of the bursts the sentinel kept, recomputed from requests.csv."""
    s = test_cfg["bench_serving"]
    metrics = run_stage("bench_serving", TEST_PARAMS, results)
    with open(results / "bench_serving" / "requests.csv", newline="") as f:
        log = [{k: (v if k == "method" else float(v) if v else None) for k, v in r.items()} for r in csv.DictReader(f)]
    cells = {(c["method"], c["concurrency"]): c for c in metrics["cells"]}
    assert cells["vllm", s["concurrency"][0]]["status"] == "unavailable"
    assert cells["naive", 1]["status"] == cells["static", s["concurrency"][0]]["status"] == "ok"
    measured = [f"{m}@{c}" for (m, c), cell in cells.items() if cell["status"] == "ok"]
    sentinel = metrics["sentinel"]
    served = len(sentinel["rounds"])
    assert s["bursts"] <= served <= 2 * s["bursts"] and metrics["sentinel_tolerance"] == s["sentinel_tolerance"]
    assert metrics["round_orders"] == [r["order"] for r in sentinel["rounds"]] == [
        timing.balanced_order(measured, b) for b in range(served)]
    assert [r["burst"] for r in sentinel["rounds"]] == list(range(served))
    assert all(len(r["probe_gflops"]) == 2 and ("set_aside_because" in r) != r["stable"] for r in sentinel["rounds"])
    kept = sentinel["figures_of_bursts"]
    stable = [r["burst"] for r in sentinel["rounds"] if r["stable"]]
    assert kept == (stable if "unstable" not in sentinel else list(range(served)))
    by_burst = {}
    for (method, concurrency), cell in cells.items():
        if cell["status"] != "ok":
            assert cell["reason"], "a method that cannot run here says why"
            continue
        rows = [r for r in log if r["method"] == method and r["concurrency"] == concurrency]
        assert {int(r["burst"]) for r in rows} == set(range(served)), "set-aside bursts are in the log too"
        bursts = [[r for r in rows if r["burst"] == b] for b in kept]
        assert [len(b) for b in bursts] == [s["requests"]] * len(kept) == [cell["requests"]] * cell["bursts"]
        assert [f["burst"] for f in cell["by_burst"]] == kept
        by_burst[method, concurrency] = again = [bench_serving.figures(b) for b in bursts]
        for mine, recomputed in zip(cell["by_burst"], again):
            for key in ("requests", "output_tokens", "makespan_s", "requests_per_s", "output_tokens_per_s"):
                assert mine[key] == pytest.approx(recomputed[key])
            assert mine["latency_s"] == pytest.approx(recomputed["latency_s"])
        for key in ("requests_per_s", "output_tokens_per_s"):
            stats = summarize([f[key] for f in again])
            assert cell[key]["median"] == pytest.approx(stats["median"]) and cell[key]["n"] == len(kept)
            assert cell[key]["ci95_median"] == pytest.approx(stats["ci95_median"])  # 6 bursts give an interval
        pooled = bench_serving.percentiles([r for b in bursts for r in b])
        assert cell["latency_s"] == pytest.approx(pooled["latency_s"]) and cell["ttft_s"] == pytest.approx(pooled["ttft_s"])
        for b in bursts:
            assert [int(r["output_tokens"]) for r in sorted(b, key=lambda r: r["request"])] == metrics["new_tokens"]
            assert all(r["first_token_s"] is None or r["first_token_s"] <= r["finished_s"] for r in b)
    for (method, concurrency), cell in cells.items():
        pairs = {"throughput_vs_naive": ("naive", 1), "continuous_vs_static": ("static", concurrency)}
        for key, reference in pairs.items():
            if key not in cell:
                continue
            ratios = [a["output_tokens_per_s"] / b["output_tokens_per_s"]
                      for a, b in zip(by_burst[method, concurrency], by_burst[reference])]
            assert cell[key]["ratios"] == pytest.approx(ratios) and cell[key]["rounds"] == len(kept)
            if "unstable" in sentinel:  # a busy machine: no verdict, as interleave() gives none
                assert cell[key]["median"] is None and cell[key]["verdict"].startswith("not a verdict: the machine's")
                continue
            again = ratio_verdict(ratios)
            assert cell[key]["median"] == pytest.approx(again["median"])
            assert cell[key]["ci95"] == pytest.approx(again["ci95"])
    assert {k for k, c in cells.items() if "throughput_vs_naive" in c} == {k for k in by_burst if k[0] != "naive"}
    assert {k for k, c in cells.items() if "continuous_vs_static" in c} == {k for k in by_burst if k[0] == "continuous"}
    naive = sorted((r for r in log if r["method"] == "naive" and r["burst"] == 0), key=lambda r: r["request"])
    assert all(b["first_token_s"] >= a["finished_s"] for a, b in zip(naive, naive[1:])), "one at a time: requests queue"
    static = [r for r in log if r["method"] == "static" and r["concurrency"] == s["concurrency"][-1] and r["burst"] == 0]
    assert len({r["finished_s"] for r in static}) == 1, "one batch: every request returns when the longest is done"


@pytest.fixture
def machine(monkeypatch):
    """A simulated clock (measure.timing.clock) and planted speed probes: `machine.probes(readings)` makes the
    probes read those values in turn (probe k is the one after burst k-1 and before burst k); until then the
    machine is quiet (every probe 100 GFLOP/s)."""
    clock = SimulatedClock()
    monkeypatch.setattr(timing, "clock", clock)
    monkeypatch.setattr(timing, "speed_probe", lambda device: 100.0)

    def probes(readings):
        planted = iter(readings)
        monkeypatch.setattr(timing, "speed_probe", lambda device: next(planted))
    clock.probes = probes
    return clock


def _server(clock, seconds):
    """serve(cell, warm) whose k-th burst of a cell takes `seconds(method, k)` on the simulated clock: one request
    of 10 output tokens finishing then (the warm-up takes no time)."""
    served = {}

    def serve(cell, warm):
        if warm:
            return []
        k = served[cell["method"]] = served.get(cell["method"], -1) + 1
        t = seconds(cell["method"], k)
        clock.advance(t)
        return [{"request": 0, "prompt_tokens": 4, "output_tokens": 10, "submitted_s": 0.0, "first_token_s": t / 2,
                 "finished_s": t}]
    return serve


def test_rounds_serve_every_cell_once_in_a_balanced_order_after_a_warm_up(machine):
    calls = []

    def serve(cell, warm):
        calls.append(("warm" if warm else "burst", cell["method"]))
        if cell["method"] == "b" and len([c for c in calls if c == ("burst", "b")]) == 2:
            raise RuntimeError("out of pages\nmore detail")
        return [{"request": 0, "output_tokens": 1, "submitted_s": 0.0, "first_token_s": 0.1, "finished_s": 0.2}]

    cells = [{"method": m, "concurrency": 1} for m in "abc"]
    rows, sentinel = bench_serving.serve_rounds(serve, cells, bursts=4)
    assert calls[:3] == [("warm", "a"), ("warm", "b"), ("warm", "c")]
    assert [m for _, m in calls[3:]] == list("abc" + "cba" + "ca" + "ac"), "b failed in round 2 and left the rounds"
    orders = [r["order"] for r in sentinel["rounds"]]
    assert orders == [["a@1", "b@1", "c@1"], ["c@1", "b@1", "a@1"], ["c@1", "a@1"], ["a@1", "c@1"]]
    assert cells[1] == {"method": "b", "concurrency": 1, "status": "failed", "reason": "RuntimeError: out of pages"}
    assert [(r["method"], r["burst"]) for r in rows] == [("a", b) for b in range(4)] + [("c", b) for b in range(4)]
    assert sentinel["stable_rounds"] == 4 and sentinel["set_aside"] == 0 and "unstable" not in sentinel
    assert [r["probe_gflops"] for r in sentinel["rounds"]] == [[100.0, 100.0]] * 4


@pytest.mark.parametrize("n", [2, 3, 4, 7])
def test_the_order_of_the_cells_is_balanced_over_the_bursts(n):
    """Over 2n bursts of n cells each cell takes every position twice and runs before each other cell n times; after
    every two bursts each cell's mean position is the middle, so a drift linear over a burst hits all alike."""
    names = [f"c{i}" for i in range(n)]
    orders = [timing.balanced_order(names, b) for b in range(2 * n)]
    assert all(sorted(o) == names for o in orders)
    for name in names:
        assert sorted(o.index(name) for o in orders) == sorted(list(range(n)) * 2)
        for two in range(0, 2 * n, 2):
            assert orders[two].index(name) + orders[two + 1].index(name) == n - 1
        for other in names:
            if other != name:
                assert sum(o.index(name) < o.index(other) for o in orders) == n
    assert orders[:6 if n == 3 else 2] == ([["c0", "c1", "c2"], ["c2", "c1", "c0"], ["c1", "c2", "c0"],
                                            ["c0", "c2", "c1"], ["c2", "c0", "c1"], ["c1", "c0", "c2"]]
                                           if n == 3 else [names, names[::-1]])


def test_the_bursts_are_served_in_the_balanced_order_with_a_probe_between_them(machine):
    cells = [{"method": m, "concurrency": 1} for m in ("naive", "static", "continuous")]
    serve = _server(machine, lambda method, k: {"naive": 4.0, "static": 2.0, "continuous": 1.0}[method])
    probes = [100.0 + i for i in range(7)]
    machine.probes(probes)
    rows, sentinel = bench_serving.measure(cells, serve, bursts=6)
    names = ["naive@1", "static@1", "continuous@1"]
    assert [r["order"] for r in sentinel["rounds"]] == [timing.balanced_order(names, b) for b in range(6)]
    assert [r["probe_gflops"] for r in sentinel["rounds"]] == [probes[b:b + 2] for b in range(6)], \
        "a probe before the first burst and after each: the one after a burst is the one before the next"
    for name in names:  # 6 bursts of 3 cells: each cell in each position twice
        assert sorted(r["order"].index(name) for r in sentinel["rounds"]) == [0, 0, 1, 1, 2, 2]
    assert sentinel["stable_rounds"] == 6 and sentinel["probe"]["tolerance"] == timing.SENTINEL_TOLERANCE
    assert sentinel["sentinel_s"] == 0.0, "the probes took no simulated time; the serving is not in it"


def test_a_burst_whose_probe_moved_is_set_aside_and_served_again_and_the_figures_are_of_the_stable_ones(machine):
    """The machine slows during bursts 1 and 2 (their probes read 50 GFLOP/s against a median of 100) and continuous
    batching, served then, takes 3x as long: both bursts are set aside, two more served in their place, and the
    figures and the paired ratios are those of bursts 0, 3 and 4 alone."""
    slowed = {1, 2}
    seconds = {"naive": 4.0, "static": 2.0, "continuous": 1.0}
    serve = _server(machine, lambda method, k: seconds[method] * (3 if method == "continuous" and k in slowed else 1))
    machine.probes([100, 101, 50, 99, 100, 102, 100, 100])  # burst k sees probes k and k+1
    cells = [{"method": m, "concurrency": 2 if m != "naive" else 1} for m in seconds]
    rows, sentinel = bench_serving.measure(cells, serve, bursts=3)
    assert [r["stable"] for r in sentinel["rounds"]] == [True, False, False, True, True]
    assert sentinel["stable_rounds"] == 3 and sentinel["set_aside"] == 2 and "unstable" not in sentinel
    assert sentinel["figures_of_bursts"] == [0, 3, 4]
    why = {r["burst"]: r["set_aside_because"] for r in sentinel["rounds"] if "set_aside_because" in r}
    assert why == {b: "speed probe 50.0 GFLOP/s (-50%) outside ±25% of the median probe 100.0 GFLOP/s" for b in (1, 2)}
    assert sorted({r["burst"] for r in rows}) == [0, 1, 2, 3, 4], "the log keeps the set-aside bursts"
    naive, static, continuous = cells
    for c in cells:
        assert c["status"] == "ok" and c["bursts"] == 3 and [f["burst"] for f in c["by_burst"]] == [0, 3, 4]
        assert c["output_tokens_per_s"]["samples"] == pytest.approx([10 / seconds[c["method"]]] * 3)
        assert c["latency_s"]["p99"] == pytest.approx(seconds[c["method"]]), "latency pooled over stable bursts only"
    assert continuous["continuous_vs_static"]["ratios"] == pytest.approx([2.0] * 3)
    assert continuous["continuous_vs_static"]["median"] == pytest.approx(2.0)
    assert continuous["throughput_vs_naive"]["ratios"] == pytest.approx([4.0] * 3)
    assert static["throughput_vs_naive"]["rounds"] == 3 and "throughput_vs_naive" not in naive
    every = bench_serving.cell_figures([r for r in rows if r["method"] == "continuous"])
    assert every["output_tokens_per_s"]["min"] == pytest.approx(10 / 3), "what the set-aside bursts would have said"


def test_a_machine_that_never_settles_gives_serving_no_verdict(machine):
    """Every other probe halved: too few stable bursts after the extra ones; the figures are of every burst, flagged
    `unstable`, and no ratio has a verdict."""
    machine.probes([100, 50] * 20)
    serve = _server(machine, lambda method, k: {"naive": 4.0, "static": 2.0, "continuous": 1.0}[method])
    cells = [{"method": m, "concurrency": 1} for m in ("naive", "static", "continuous")]
    rows, sentinel = bench_serving.measure(cells, serve, bursts=3)
    assert len(sentinel["rounds"]) == 6 and "machine's speed changed" in sentinel["unstable"]
    assert sentinel["figures_of_bursts"] == list(range(6)) and cells[2]["bursts"] == 6
    for key, ratios in (("continuous_vs_static", [2.0] * 6), ("throughput_vs_naive", [4.0] * 6)):
        ratio = cells[2][key]
        assert ratio["median"] is None and ratio["verdict"].startswith("not a verdict: the machine's speed changed")
        assert ratio["ratios"] == pytest.approx(ratios) and ratio["rounds"] == 6


def test_continuous_vs_static_is_decided_only_by_an_interval_of_paired_rounds():
    """The machine's speed drifts by 2x over the rounds, but each round's continuous burst is 1.3x its static one:
    the paired ratio is decided although the per-cell rates overlap; a noisier pair is undecided; 5 rounds give no
    95% interval at all."""
    drift = [1.0, 1.4, 0.9, 2.0, 1.2, 0.8]
    naive = [10 * d for d in drift]
    static = [25 * d for d in drift]
    separated = serving_record({("naive", 1): naive, ("static", 4): static,
                                ("continuous", 4): [1.3 * x for x in static]})["cells"]
    cont = separated[2]
    assert cont["output_tokens_per_s"]["ci95_median"][0] < separated[1]["output_tokens_per_s"]["ci95_median"][1]
    assert cont["continuous_vs_static"]["verdict"] == "faster" and cont["continuous_vs_static"]["ci95"] == [1.3, 1.3]
    assert cont["throughput_vs_naive"]["median"] == pytest.approx(3.25) and separated[1]["throughput_vs_naive"][
        "verdict"] == "faster"
    assert "throughput_vs_naive" not in separated[0], "naive is the reference, not a ratio of its own"
    noisy = [x * f for x, f in zip(static, (0.9, 1.25, 1.0, 1.15, 0.85, 1.1))]
    overlapping = serving_record({("naive", 1): naive, ("static", 4): static, ("continuous", 4): noisy})["cells"][2]
    verdict = overlapping["continuous_vs_static"]
    assert verdict["ci95"][0] < 1 < verdict["ci95"][1] and verdict["verdict"].startswith("not decided at this size: the 95%")
    few = serving_record({("naive", 1): naive[:5], ("static", 4): static[:5],
                          ("continuous", 4): [1.3 * x for x in static[:5]]})["cells"][2]
    assert few["continuous_vs_static"]["ci95"] is None and few["output_tokens_per_s"]["ci95_median"] is None
    assert few["continuous_vs_static"]["verdict"].startswith("not decided at this size: 5 rounds cannot give a 95% interval")
