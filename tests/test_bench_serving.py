import csv

import pytest

from efflab.measure import load, timing
from efflab.measure.stats import ratio_verdict, summarize
from efflab.stages.bench_serving import open_loop, rounds, servers
from efflab.stages.report import decisions, glance
from tests.helpers import TEST_PARAMS, SimulatedClock, run_stage, serving_record


@pytest.mark.integration  # make test's 10 minutes on a 2-core AVX2 CPU: run by make test-integration
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
        by_burst[method, concurrency] = again = [rounds.figures(b) for b in bursts]
        for mine, recomputed in zip(cell["by_burst"], again):
            for key in ("requests", "output_tokens", "makespan_s", "requests_per_s", "output_tokens_per_s"):
                assert mine[key] == pytest.approx(recomputed[key])
            assert mine["latency_s"] == pytest.approx(recomputed["latency_s"])
        for key in ("requests_per_s", "output_tokens_per_s"):
            stats = summarize([f[key] for f in again])
            assert cell[key]["median"] == pytest.approx(stats["median"]) and cell[key]["n"] == len(kept)
            assert cell[key]["ci95_median"] == pytest.approx(stats["ci95_median"])  # 6 bursts give an interval
        pooled = rounds.percentiles([r for b in bursts for r in b])
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
    rows, sentinel = rounds.serve_rounds(serve, cells, bursts=4)
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
    rows, sentinel = rounds.measure(cells, serve, bursts=6)
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
    rows, sentinel = rounds.measure(cells, serve, bursts=3)
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
    every = rounds.cell_figures([r for r in rows if r["method"] == "continuous"])
    assert every["output_tokens_per_s"]["min"] == pytest.approx(10 / 3), "what the set-aside bursts would have said"


def test_a_machine_that_never_settles_gives_serving_no_verdict(machine):
    """Every other probe halved: too few stable bursts after the extra ones; the figures are of every burst, flagged
    `unstable`, and no ratio has a verdict."""
    machine.probes([100, 50] * 20)
    serve = _server(machine, lambda method, k: {"naive": 4.0, "static": 2.0, "continuous": 1.0}[method])
    cells = [{"method": m, "concurrency": 1} for m in ("naive", "static", "continuous")]
    rows, sentinel = rounds.measure(cells, serve, bursts=3)
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


# Open loop


def _rows(times, repeat=0):
    """Planted open-loop rows: (arrival, first token, finished, output tokens) per request."""
    return [{"request": i, "repeat": repeat, "arrival_s": a, "first_token_s": f, "finished_s": e, "output_tokens": n,
             "prompt_tokens": 4} for i, (a, f, e, n) in enumerate(times)]


PLANTED = [(0.0, 0.5, 1.0, 6),   # TTFT 0.5, TPOT 0.1, E2E 1.0
           (0.5, 1.5, 2.0, 6),   # TTFT 1.0, TPOT 0.1, E2E 1.5
           (1.0, 1.6, 3.6, 5),   # TTFT 0.6, TPOT 0.5, E2E 2.6
           (1.5, 3.0, 4.0, 1)]   # TTFT 1.5, no TPOT (one token), E2E 2.5


@pytest.mark.parametrize(("slo", "met"), [({"ttft_s": 1.0, "tpot_s": 0.2, "e2e_s": None}, 2),
                                          ({"ttft_s": 1.0, "tpot_s": None, "e2e_s": None}, 3),
                                          ({"ttft_s": None, "tpot_s": None, "e2e_s": 2.0}, 2),
                                          ({"ttft_s": None, "tpot_s": None, "e2e_s": None}, 4), ({}, 4)])
def test_goodput_is_the_requests_meeting_every_slo_bound_over_the_span_of_the_run(slo, met):
    """Hand-computed: the span is the first arrival (0) to the last finish (4.0 s); a bound on a time the request lacks
    (TPOT of a one-token request) is not met."""
    f = load.run_figures(_rows(PLANTED), 2.0, slo)
    assert f["met_slo"] == met and f["goodput_per_s"] == pytest.approx(met / 4.0)
    assert f["span_s"] == 4.0 and f["requests_per_s"] == pytest.approx(1.0)
    assert f["output_tokens_per_s"] == pytest.approx(18 / 4.0)
    assert f["offered_per_s"] == pytest.approx(4 / (1.5 + 0.5)) and f["kept_up"] == pytest.approx(0.5)
    assert f["queue_growth"] == pytest.approx((0.6 + 1.5) / (0.5 + 1.0))
    pct = load.percentiles(_rows(PLANTED))
    assert pct["ttft_s"]["p50"] == pytest.approx(0.8) and pct["tpot_s"]["p50"] == pytest.approx(0.1)
    assert pct["e2e_s"]["p99"] == pytest.approx(2.5 + 0.97 * 0.1)


def test_the_poisson_schedule_has_its_rate_and_is_the_same_for_the_same_seed_rate_and_repeat():
    """Over 20,000 gaps the mean gap is 1/rate within 3% (its standard error is 0.7%); the schedule is a function of
    (seed, rate, repeat) alone."""
    for rate in (0.5, 4.0, 64.0):
        at = load.arrivals(20_000, rate, seed=0, repeat=0)
        gaps = [b - a for a, b in zip(at, at[1:])]
        assert at[0] == 0.0 and min(gaps) >= 0
        assert sum(gaps) / len(gaps) == pytest.approx(1 / rate, rel=0.03)
    assert load.arrivals(50, 4, 7, 1) == load.arrivals(50, 4.0, 7, 1)
    assert load.arrivals(50, 4, 7, 1) != load.arrivals(50, 4, 7, 2) != load.arrivals(50, 4, 8, 1)


def test_every_method_is_sent_the_same_schedule_in_each_round_and_the_figures_are_its_rows(machine, monkeypatch):
    """The open-loop harness with planted servers: in round k at a rate, every method gets the requests at
    load.arrivals(n, rate, seed, k); the warm-up the first two; the cells' figures are measure.load's of their rows."""
    sent = []

    def planted(method):
        def serve(model, tokenizer, reqs, concurrency, device, arrivals):
            sent.append((method, concurrency, arrivals))
            return [servers._row(r, 0.0, at + 0.1, at + 0.3, arrival=at) for r, at in zip(reqs, arrivals)]
        return serve
    monkeypatch.setattr(servers, "SERVERS", {m: planted(m) for m in ("naive", "continuous")})
    reqs = [{"request": i, "prompt": [1] * (i + 2), "new_tokens": 3} for i in range(5)]
    serve = servers.server(None, None, [], None, None, reqs, seed=3)
    cells = [{"method": m, "rate": rate, "concurrency": 4} for rate in (2.0, 8.0) for m in ("naive", "continuous")]
    rows, sentinels = open_loop.measure_open(cells, serve, repeats=3, slo={"ttft_s": 0.2})
    by_round = [a for _, _, a in sent if len(a) == 5]
    assert [len(a) for _, _, a in sent[:2]] == [2, 2] and len(sent) == 2 + 2 * 2 * 3, \
        "a warm-up (the first two requests of round 0) at the first rate only"
    expected = [load.arrivals(5, rate, 3, k) for rate in (2.0, 8.0) for k in range(3) for _ in range(2)]
    assert by_round == expected, "one schedule per rate and round, sent to both methods"
    assert [o["sentinel"]["rounds"][k]["order"] for o in sentinels for k in range(3)] == [
        timing.balanced_order([f"naive@{r:g}/s", f"continuous@{r:g}/s"], k) for r in (2.0, 8.0) for k in range(3)]
    for c in cells:
        mine = [r for r in rows if (r["method"], r["rate"]) == (c["method"], c["rate"])]
        assert [r["arrival_s"] for r in mine if r["repeat"] == 1] == load.arrivals(5, c["rate"], 3, 1)
        again = load.cell_figures(mine, c["rate"], {"ttft_s": 0.2})
        assert c["status"] == "ok" and c["goodput_per_s"] == again["goodput_per_s"] and c["repeats"] == 3
        assert c["ttft_s"]["p50"] == pytest.approx(0.1) and c["e2e_s"]["p99"] == pytest.approx(0.3)


def _cell(rate, times, repeats=2, slo=None):
    rows = [r for k in range(repeats) for r in _rows(times, k)]
    return {"method": "m", "status": "ok"} | load.cell_figures(rows, rate, slo or {})


def test_a_queue_that_grows_is_saturated_and_a_steady_one_is_not():
    """One request served at a time in 1 s: sent at 4/s the later requests wait ever longer and the server finishes
    under 90% of the offered rate (saturated); sent at 0.5/s each is served at once (not)."""
    growing = _cell(4.0, [(i * 0.25, i * 1.0 + 0.5, (i + 1) * 1.0, 8) for i in range(8)])
    steady = _cell(0.5, [(i * 2.0, i * 2.0 + 0.5, i * 2.0 + 1.0, 8) for i in range(8)])
    assert growing["saturated"] and growing["queue_growth"] > load.QUEUE_GROWTH and growing["kept_up"] < load.KEPT_UP
    assert not steady["saturated"] and steady["queue_growth"] == pytest.approx(1.0)
    # finished (15 s) inside its window (8 arrivals, 2 s apart, and one mean gap: 16 s): the rate it served is counted
    # over that window, so it serves exactly the offered rate, never more
    assert steady["kept_up"] == pytest.approx(1.0) and steady["requests_per_s"]["median"] == pytest.approx(0.5)
    assert load.saturation([steady, growing]) == {"saturation_rate": 4.0, "said": "saturates at 4 requests/s"}
    assert load.saturation([steady]) == {"saturation_rate": None, "said": "not reached up to 0.5 requests/s"}
    slow_but_kept_up = _cell(4.0, [(i * 0.25, i * 0.25 + 0.02 * (i + 1), i * 0.25 + 0.02 * (i + 1), 8)
                                   for i in range(8)])
    assert slow_but_kept_up["queue_growth"] > load.QUEUE_GROWTH and not slow_but_kept_up["saturated"], \
        "waits that grow while the server still finishes at the offered rate are not saturation"


def _open_record(goodputs: dict[tuple[str, float], tuple[list[float], bool]]) -> dict:
    """A bench_serving record whose open loop holds planted goodputs (one per repeat) per (method, rate)."""
    cells = [{"method": m, "rate": rate, "status": "ok", "goodput_per_s": summarize(g, "requests/s"),
              "saturated": saturated} for (m, rate), (g, saturated) in goodputs.items()]
    methods = sorted({m for m, _ in goodputs})
    job = serving_record({("naive", 1): [10.0] * 6, ("continuous", 4): [30.0] * 6})
    return job | {"open_loop": {"slo": {"ttft_s": 1.0, "tpot_s": None, "e2e_s": None}, "cells": cells,
                                "saturation_rule": load.SATURATION_RULE,
                                "saturation": {m: load.saturation([c for c in cells if c["method"] == m])
                                               for m in methods}}}


def test_the_open_loop_answer_is_decided_once_and_the_glance_says_what_decisions_hold():
    drift = [1.0, 1.02, 0.98, 1.01, 0.99, 1.0]
    job = _open_record({("naive", 1.0): ([0.5 * d for d in drift], False), ("naive", 4.0): ([0.6 * d for d in drift], True),
                        ("continuous", 1.0): ([0.9 * d for d in drift], False),
                        ("continuous", 4.0): ([3.1 * d for d in drift], False)})
    d = decisions._serving(job)
    o = d["open_loop"]
    assert o["answer"] == "continuous" and o["versus"] == {"continuous": {"naive": "more"}, "naive": {"continuous": "less"}}
    best = o["methods"]["continuous"]["best_goodput"]
    assert best["rate"] == 4.0 and best["value"] == pytest.approx(3.1) and best["lo"] == pytest.approx(3.1 * 0.98)
    assert o["methods"]["naive"]["best_goodput"]["rate"] == 4.0
    assert o["methods"]["naive"]["saturation_rate"] == 4.0 and o["methods"]["continuous"]["saturation_rate"] is None
    line = glance.serving(d).splitlines()[1]
    assert line.startswith("- **Open-loop serving** (goodput: requests/s meeting TTFT ≤ 1 s; Poisson arrivals): "
                           "**continuous** the most.")
    assert "naive: 0.6" in line and "saturates at 4 requests/s" in line and "not reached up to 4 requests/s" in line
    close = _open_record({("naive", 4.0): ([3.0 * d for d in drift], True),
                          ("continuous", 4.0): ([3.1 * d for d in drift], False)})
    o = decisions._serving(close)["open_loop"]
    assert o["answer"] is None and o["versus"]["continuous"]["naive"] == "same within ±10%"
    assert "no method shown to serve more than every other" in glance.serving(decisions._serving(close))
    few = _open_record({("naive", 4.0): ([0.5] * 3, True), ("continuous", 4.0): ([3.0] * 3, False)})
    o = decisions._serving(few)["open_loop"]
    assert o["answer"] is None and o["versus"]["continuous"]["naive"].startswith("not decided at this size")
    assert decisions._serving(serving_record({("naive", 1): [10.0] * 6}))["open_loop"] is None
    assert len(glance.serving(decisions._serving(serving_record({("naive", 1): [10.0] * 6}))).splitlines()) == 1


def test_the_open_loop_harness_serves_every_request_at_its_scheduled_arrival(results, write_params, test_cfg):
    """The real harness on the tiny model: naive and continuous batching sent each round's Poisson schedule; every
    request served, its arrival the schedule's, and the record's figures those of open_loop_requests.csv."""
    def edit(cfg):
        cfg["bench_serving"] |= {"methods": ["naive"], "bursts": 1, "requests": 3, "concurrency": [2],
                                 "open_loop": {"rates": [4, 40], "requests": 4, "repeats": 2,
                                               "methods": ["naive", "continuous", "vllm"]},
                                 "slo": {"ttft_s": 10.0, "tpot_s": None, "e2e_s": None}}
    params = write_params(edit)
    metrics = run_stage("bench_serving", params, results)
    o, seed = metrics["open_loop"], test_cfg["bench_serving"]["seed"]
    with open(results / "bench_serving" / "open_loop_requests.csv", newline="") as f:
        rows = [{k: v if k == "method" else float(v) if v else None for k, v in r.items()} for r in csv.DictReader(f)]
    assert list(rows[0]) == list(open_loop.OPEN_COLUMNS)
    cells = {(c["method"], c["rate"]): c for c in o["cells"]}
    assert all(cells["vllm", r]["status"] == "unavailable" and cells["vllm", r]["reason"] for r in (4, 40))
    for (method, rate), c in cells.items():
        if method == "vllm":
            continue
        assert c["status"] == "ok", c.get("reason")
        mine = [r for r in rows if (r["method"], r["rate"]) == (method, rate)]
        served = sorted({int(r["repeat"]) for r in mine})
        for k in served:
            one = sorted((r for r in mine if r["repeat"] == k), key=lambda r: r["request"])
            assert [r["arrival_s"] for r in one] == pytest.approx(load.arrivals(4, rate, seed, k), abs=1e-9)
            assert len(one) == 4 and [int(r["output_tokens"]) for r in one[:3]] == metrics["new_tokens"], \
                "the burst's first requests, forced to their lengths"
            assert all(r["arrival_s"] <= r["first_token_s"] <= r["finished_s"] for r in one)
        sentinel = next(b["sentinel"] for b in o["by_rate"] if b["rate"] == rate)
        kept = sentinel["figures_of_bursts"]
        again = load.cell_figures([r for r in mine if r["repeat"] in kept], rate, o["slo"])
        for key in ("requests_per_s", "output_tokens_per_s", "goodput_per_s"):
            assert c[key]["samples"] == pytest.approx(again[key]["samples"])
        assert c["ttft_s"] == pytest.approx(again["ttft_s"]) and c["saturated"] == again["saturated"]
    for method in ("naive", "continuous"):
        assert o["saturation"][method] == load.saturation([cells[method, r] for r in (4, 40)])


def test_a_cell_that_cannot_serve_its_warm_up_is_unavailable_and_the_others_are_measured(machine):
    """A serving path this stack cannot run for this model (transformers' paged cache and DeepSeek-V3's latent
    cache) raises on its first call: unavailable with the library's reason, never a failed measurement."""
    def serve(cell, warm):
        if cell["method"] == "continuous":
            raise RuntimeError("index_copy_(): Source/destination tensor must have same slice shapes.\nmore")
        return [{"request": 0, "output_tokens": 1, "submitted_s": 0.0, "first_token_s": 0.1, "finished_s": 0.2}]

    cells = [{"method": m, "concurrency": 2} for m in ("static", "continuous")]
    rows, sentinel = rounds.serve_rounds(serve, cells, bursts=2)
    assert cells[1] == {"method": "continuous", "concurrency": 2, "status": "unavailable",
                        "reason": "RuntimeError: index_copy_(): Source/destination tensor must have same slice shapes."}
    assert {r["method"] for r in rows} == {"static"} and sentinel["stable_rounds"] == 2
