import csv

import pytest

from efflab.measure.stats import ratio_verdict, summarize
from efflab.stages import bench_serving
from tests.helpers import TEST_PARAMS, run_stage, serving_record


def test_every_serving_figure_is_recomputed_from_the_per_request_log_burst_by_burst(results, test_cfg):
    s = test_cfg["bench_serving"]
    metrics = run_stage("bench_serving", TEST_PARAMS, results)
    with open(results / "bench_serving" / "requests.csv", newline="") as f:
        log = [{k: (v if k == "method" else float(v) if v else None) for k, v in r.items()} for r in csv.DictReader(f)]
    cells = {(c["method"], c["concurrency"]): c for c in metrics["cells"]}
    assert cells["vllm", s["concurrency"][0]]["status"] == "unavailable"
    assert cells["naive", 1]["status"] == cells["static", s["concurrency"][0]]["status"] == "ok"
    measured = [f"{m}@{c}" for (m, c), cell in cells.items() if cell["status"] == "ok"]
    assert metrics["round_orders"] == [measured if b % 2 == 0 else measured[::-1] for b in range(s["bursts"])]
    by_burst = {}
    for (method, concurrency), cell in cells.items():
        if cell["status"] != "ok":
            assert cell["reason"], "a method that cannot run here says why"
            continue
        rows = [r for r in log if r["method"] == method and r["concurrency"] == concurrency]
        bursts = [[r for r in rows if r["burst"] == b] for b in range(s["bursts"])]
        assert [len(b) for b in bursts] == [s["requests"]] * s["bursts"] == [cell["requests"]] * cell["bursts"]
        by_burst[method, concurrency] = again = [bench_serving.figures(b) for b in bursts]
        for mine, recomputed in zip(cell["by_burst"], again):
            for key in ("requests", "output_tokens", "makespan_s", "requests_per_s", "output_tokens_per_s"):
                assert mine[key] == pytest.approx(recomputed[key])
            assert mine["latency_s"] == pytest.approx(recomputed["latency_s"])
        for key in ("requests_per_s", "output_tokens_per_s"):
            stats = summarize([f[key] for f in again])
            assert cell[key]["median"] == pytest.approx(stats["median"]) and cell[key]["n"] == s["bursts"]
            assert cell[key]["ci95_median"] == pytest.approx(stats["ci95_median"])  # 6 bursts give an interval
        pooled = bench_serving.percentiles(rows)
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
            again = ratio_verdict(ratios)
            assert cell[key]["median"] == pytest.approx(again["median"]) and cell[key]["ratios"] == pytest.approx(ratios)
            assert cell[key]["ci95"] == pytest.approx(again["ci95"]) and cell[key]["rounds"] == s["bursts"]
    assert {k for k, c in cells.items() if "throughput_vs_naive" in c} == {k for k in by_burst if k[0] != "naive"}
    assert {k for k, c in cells.items() if "continuous_vs_static" in c} == {k for k in by_burst if k[0] == "continuous"}
    naive = sorted((r for r in log if r["method"] == "naive" and r["burst"] == 0), key=lambda r: r["request"])
    assert all(b["first_token_s"] >= a["finished_s"] for a, b in zip(naive, naive[1:])), "one at a time: requests queue"
    static = [r for r in log if r["method"] == "static" and r["concurrency"] == s["concurrency"][-1] and r["burst"] == 0]
    assert len({r["finished_s"] for r in static}) == 1, "one batch: every request returns when the longest is done"


def test_rounds_serve_every_cell_once_in_reverse_order_every_other_round_after_a_warm_up():
    calls = []

    def serve(cell, warm):
        calls.append(("warm" if warm else "burst", cell["method"]))
        if cell["method"] == "b" and len([c for c in calls if c == ("burst", "b")]) == 2:
            raise RuntimeError("out of pages\nmore detail")
        return [{"request": 0, "output_tokens": 1, "submitted_s": 0.0, "first_token_s": 0.1, "finished_s": 0.2}]

    cells = [{"method": m, "concurrency": 1} for m in "abc"]
    rows, orders = bench_serving.serve_rounds(serve, cells, bursts=4)
    assert calls[:3] == [("warm", "a"), ("warm", "b"), ("warm", "c")]
    assert [m for _, m in calls[3:]] == list("abc" + "cba" + "ac" + "ca"), "b failed in round 2 and left the rounds"
    assert orders == [["a@1", "b@1", "c@1"], ["c@1", "b@1", "a@1"], ["a@1", "c@1"], ["c@1", "a@1"]]
    assert cells[1] == {"method": "b", "concurrency": 1, "status": "failed", "reason": "RuntimeError: out of pages"}
    assert [(r["method"], r["burst"]) for r in rows] == [("a", b) for b in range(4)] + [("c", b) for b in range(4)]


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
    assert verdict["ci95"][0] < 1 < verdict["ci95"][1] and verdict["verdict"].startswith("inconclusive: the 95%")
    few = serving_record({("naive", 1): naive[:5], ("static", 4): static[:5],
                          ("continuous", 4): [1.3 * x for x in static[:5]]})["cells"][2]
    assert few["continuous_vs_static"]["ci95"] is None and few["output_tokens_per_s"]["ci95_median"] is None
    assert few["continuous_vs_static"]["verdict"].startswith("inconclusive: 5 rounds cannot give a 95% interval")
