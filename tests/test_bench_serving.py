import csv

import pytest

from tests.helpers import TEST_PARAMS, run_stage
from efflab import bench_serving


def test_every_serving_figure_is_recomputed_from_the_per_request_log(results, test_cfg):
    s = test_cfg["bench_serving"]
    metrics = run_stage("bench_serving", TEST_PARAMS, results)
    with open(results / "bench_serving" / "requests.csv", newline="") as f:
        log = [{k: (v if k == "method" else float(v) if v else None) for k, v in r.items()} for r in csv.DictReader(f)]
    cells = {(c["method"], c["concurrency"]): c for c in metrics["cells"]}
    assert cells["vllm", s["concurrency"][0]]["status"] == "unavailable"
    assert cells["naive", 1]["status"] == cells["static", s["concurrency"][0]]["status"] == "ok"
    for (method, concurrency), cell in cells.items():
        if cell["status"] != "ok":
            assert cell["reason"], "a method that cannot run here says why"
            continue
        rows = [r for r in log if r["method"] == method and r["concurrency"] == concurrency]
        assert len(rows) == s["requests"]
        again = bench_serving.figures(rows)
        for key in ("requests_per_s", "output_tokens_per_s"):
            assert cell[key] == pytest.approx(again[key])
        assert cell["latency_s"] == pytest.approx(again["latency_s"])
        assert [int(r["output_tokens"]) for r in sorted(rows, key=lambda r: r["request"])] == metrics["new_tokens"]
        assert all(r["first_token_s"] is None or r["first_token_s"] <= r["finished_s"] for r in rows)
    naive = sorted((r for r in log if r["method"] == "naive"), key=lambda r: r["request"])
    assert all(b["first_token_s"] >= a["finished_s"] for a, b in zip(naive, naive[1:])), "one at a time: requests queue"
    static = [r for r in log if r["method"] == "static" and r["concurrency"] == s["concurrency"][-1]]
    assert len({r["finished_s"] for r in static}) == 1, "one batch: every request returns when the longest is done"
