"""bench_serving's SLO search (measure.rate_search and stages.bench_serving.slo_search): a simulated server of known
service rate, with no clock, is found within the search's interval; the schedules keep their rate; goodput is held
below the arrival rate by construction and by the statements ledger; the real harness on the tiny model."""
import csv
import heapq
import math

import pytest

from efflab.measure import load, rate_search
from efflab.stages.bench_serving import slo_search
from efflab.stages.report import decisions, glance, ledger, short_glance
from efflab.stages.report.ledger import Ledger, Statement, check
from efflab.stages.report.tables import bench_serving as tables
from tests.helpers import run_stage, serving_record

SLOTS, PREFILL, PER_TOKEN, TOKENS = 4, 0.05, 0.01, 6
SERVICE_RATE = SLOTS / (PREFILL + PER_TOKEN * (TOKENS - 1))  # 40 requests/s: the server's saturation


def simulate(arrivals: list[float]) -> list[dict]:
    """A FIFO server of SLOTS slots, each request PREFILL s to its first token and PER_TOKEN s a token after it: the
    rows it would log, computed, not timed."""
    free, rows = [0.0] * SLOTS, []
    for i, at in enumerate(arrivals):
        first = max(at, heapq.heappop(free)) + PREFILL
        done = first + PER_TOKEN * (TOKENS - 1)
        heapq.heappush(free, done)
        rows.append({"request": i, "arrival_s": at, "first_token_s": first, "finished_s": done,
                     "output_tokens": TOKENS})
    return rows


def _prober(q: float, slo: dict, schedules: int):
    n = rate_search.requests_for(q)
    drawn = [rate_search.unit_schedule(n, 0, k) for k in range(schedules)]

    def probe(subject, k, rate):
        arrivals, window = rate_search.at_rate(drawn[k], rate)
        return rate_search.probe_figures(simulate(arrivals), rate, window, slo, q)
    return probe, drawn


def test_a_probe_sends_ten_requests_beyond_its_percentile_on_a_schedule_within_ten_percent_of_its_rate():
    assert [rate_search.requests_for(q) for q in (50, 90, 99)] == [20, 100, 1000]
    for q in (50, 90, 99):
        n = rate_search.requests_for(q)
        assert n - 1 - math.floor((n - 1) * q / 100) >= rate_search.BEYOND, "ranks past the interpolated percentile"
        for k in range(6):
            s = rate_search.unit_schedule(n, 0, k)
            assert len(s["arrivals"]) == n and s["arrivals"][0] == 0.0 and s["arrivals"][-1] < s["window"]
            assert abs(n / s["window"] - 1) <= rate_search.RATE_TOLERANCE
            arrivals, window = rate_search.at_rate(s, 8.0)
            assert n / window == pytest.approx(8.0 * s["achieved"])
    assert rate_search.unit_schedule(20, 0, 1) == rate_search.unit_schedule(20, 0, 1), "seeded"


def test_the_search_finds_the_known_saturation_of_a_simulated_server_within_its_interval():
    """p99 TTFT within 1 s over 1000 requests: below the service rate the queue stays short, above it the wait grows
    by tens of seconds. Every schedule's own threshold, found by probing a fine grid, and the service rate lie in the
    answer's interval, which is the 95% one of 6 schedules and narrower than ±10%."""
    slo = {"ttft_s": 1.0, "tpot_s": None}
    probe, _ = _prober(99, slo, 6)
    searches = rate_search.search(probe, ["sim"], 6, start=10.0, lowest=1.0, highest=1000.0, steps=4)
    a = rate_search.answer(searches, 1.0, 1000.0)
    assert a["interval"] == "ci95" and a["coverage"] >= 0.95 and a["censored"] is None
    assert a["lo"] <= SERVICE_RATE <= a["hi"] and a["hi"] / a["lo"] < 1.1
    for k in range(6):
        grid = [SERVICE_RATE * (0.8 + 0.005 * i) for i in range(80)]
        threshold = max(r for r in grid if probe("sim", k, r)["meets"])
        assert a["lo"] <= threshold <= a["hi"]


def test_a_short_schedule_that_ends_before_the_queue_reaches_the_bound_does_not_pass_a_rate_it_cannot_sustain():
    """20 requests at 3x the service rate all meet a 2 s TTFT bound (the run is over in half a second), but the
    server finished them at a third of their arrival rate: not met. The answer, with 3 schedules, is their range."""
    slo = {"ttft_s": 2.0}
    probe, _ = _prober(50, slo, 3)
    over = probe("sim", 0, 3 * SERVICE_RATE)
    assert over["attainment"] == 1.0 and over["kept_up"] < load.KEPT_UP and not over["meets"]
    searches = rate_search.search(probe, ["sim"], 3, start=10.0, lowest=1.0, highest=1000.0, steps=3)
    a = rate_search.answer(searches, 1.0, 1000.0)
    assert a["interval"] == "range" and a["coverage"] == pytest.approx(0.75)
    assert a["hi"] <= 2 * SERVICE_RATE and a["lo"] <= SERVICE_RATE


def test_goodput_is_at_most_the_requests_served_which_are_at_most_the_arrival_rate():
    """A schedule of 5 requests served at once, its last done long before its window ends: the rates are counted over
    the window, never over the shorter span served."""
    rows = [{"request": i, "arrival_s": i * 0.01, "first_token_s": i * 0.01 + 0.001, "finished_s": i * 0.01 + 0.002,
             "output_tokens": 3} for i in range(5)]
    f = rate_search.probe_figures(rows, 8.0, 5 / 8.0, {"ttft_s": 1.0}, 50)
    assert f["goodput_per_s"] == f["requests_per_s"] == pytest.approx(f["arrival_per_s"]) == pytest.approx(8.0)
    c = load.cell_figures([r | {"repeat": 0} for r in rows], 8.0, {"ttft_s": 1.0})
    assert c["goodput_per_s"]["median"] <= c["by_round"][0]["offered_per_s"] + 1e-12


def test_the_ledger_holds_goodput_to_the_arrival_rate_it_is_stated_with():
    ok = Statement("serving", "continuous", "goodput", 3.9, bound=4.0)
    over = Statement("serving", "naive", "goodput", 10.7, bound=8.0)
    problems = check([ok, over])
    assert len(problems) == 1 and "naive goodput" in problems[0] and "above 8" in problems[0]


def _searched(subject: str, brackets: list[list[float]]) -> dict:
    searches = [rate_search.Search(subject, k, lo, hi) for k, (lo, hi) in enumerate(brackets)]
    for s in searches:
        s.probes = [{"rate": s.passed, "meets": True, "goodput_per_s": s.passed * 0.9, "arrival_per_s": s.passed,
                     "p50": {"ttft_s": 0.1}}]
    return {"name": subject, "method": "continuous", "workload": "shared_prefix",
            "prefix_caching": subject.endswith("on"), "status": "ok",
            "answer": rate_search.answer(searches, 0.5, 64), "probes": [{"schedule": s.schedule} | s.probes[0]
                                                                       for s in searches]}


def test_prefix_caching_is_called_more_only_where_the_95_percent_intervals_lie_apart():
    off = "continuous shared_prefix cache off"
    on = "continuous shared_prefix cache on"
    record = {"percentile": 50, "slo": {"ttft_s": 2.0}, "requests_per_probe": 20,
              "subjects": [_searched(off, [[2, 4]] * 6), _searched(on, [[8, 16]] * 6)]}
    d = decisions.slo_search_answer(record)
    assert d["caching"]["continuous shared_prefix"]["verdict"] == "more"
    few = record | {"subjects": [_searched(off, [[2, 4]] * 3), _searched(on, [[8, 16]] * 3)]}
    assert decisions.slo_search_answer(few)["caching"]["continuous shared_prefix"]["verdict"].startswith(
        "not decided at this size")
    assert d["subjects"][on]["goodput"]["value"] <= d["subjects"][on]["goodput"]["bound"]


def test_the_slo_search_harness_serves_every_probe_at_its_schedule_and_its_figures_are_its_rows(
        results, write_params, test_cfg):
    """The real search on the tiny model's continuous batching: every probe's requests sent at the schedule's
    arrivals scaled to its rate; the answer and its range reported; each probe's figures recomputed from
    slo_search_requests.csv."""
    def edit(cfg):
        cfg["bench_serving"] |= {"methods": ["naive"], "bursts": 1, "requests": 3, "concurrency": [2],
                                 "slo": {"ttft_s": 10.0, "tpot_s": None, "e2e_s": None},
                                 "slo_search": {"methods": ["continuous", "naive"], "workloads": ["shared_prefix"],
                                                "prefix_tokens": 32, "prefix_caching": [True], "page_tokens": 8,
                                                "concurrency": 4, "percentile": 50, "schedules": 2,
                                                "start_rate": 32, "range": [16, 64], "steps": 0}}
    metrics = run_stage("bench_serving", write_params(edit), results)
    o = metrics["slo_search"]
    subjects = {s["name"]: s for s in o["subjects"]}
    assert subjects["naive shared_prefix cache on"]["status"] == "unavailable"
    s = subjects["continuous shared_prefix cache on"]
    assert s["status"] == "ok", s.get("reason")
    a = s["answer"]
    assert a["n"] == 2 and a["interval"] == "range" and (a["censored"] or a["lo"] <= a["value"] <= a["hi"])
    with open(results / "bench_serving" / "slo_search_requests.csv", newline="") as f:
        rows = [{k: v if k == "subject" else float(v) if v else None for k, v in r.items()} for r in csv.DictReader(f)]
    assert list(rows[0]) == list(slo_search.COLUMNS)
    drawn = {d["index"]: d for d in o["schedules_drawn"]}
    for p in s["probes"]:
        mine = sorted((r for r in rows if r["schedule"] == p["schedule"] and r["rate"] == p["rate"]),
                      key=lambda r: r["request"])
        assert len(mine) == o["requests_per_probe"] == 20
        schedule = rate_search.unit_schedule(20, test_cfg["bench_serving"]["seed"], p["schedule"])
        assert schedule["window"] == pytest.approx(drawn[p["schedule"]]["window"])
        assert [r["arrival_s"] for r in mine] == pytest.approx(rate_search.at_rate(schedule, p["rate"])[0])
        assert all(r["prompt_tokens"] > 32 for r in mine), "the shared system prompt before each request"
        again = rate_search.probe_figures(mine, p["rate"], drawn[p["schedule"]]["window"] / p["rate"], o["slo"], 50)
        assert {k: again[k] for k in ("meets", "goodput_per_s", "kept_up")} == pytest.approx(
            {k: p[k] for k in ("meets", "goodput_per_s", "kept_up")})
        assert p["goodput_per_s"] <= p["requests_per_s"] <= p["arrival_per_s"] + 1e-12


def test_every_line_that_states_the_search_says_only_what_its_statements_hold():
    """The serving question with an SLO search: its glance lines, full and short, and the table's verdict column say
    the decisions' rates and verdicts, and the ledger finds nothing to refuse (no vocabulary word in a title)."""
    off, on = "continuous shared_prefix cache off", "continuous shared_prefix cache on"
    record = {"percentile": 50, "slo": {"ttft_s": 2.0, "tpot_s": None}, "requests_per_probe": 20,
              "subjects": [_searched(off, [[2, 4]] * 3), _searched(on, [[8, 16]] * 3)]}
    job = serving_record({("naive", 1): [10.0] * 6, ("continuous", 4): [30.0] * 6}) | {"slo_search": record}
    made = {"questions": {"serving": decisions._serving(job)}, "facts": [], "tolerance_pct": 5.0}
    book = Ledger()
    book.from_decisions(made)
    assert ledger.check(book.statements) == []
    for lines, file in ((glance.by_question(made), "details.md"), (short_glance.lines(made), "report.md")):
        assert f"{on}: 8" in lines["serving"] and f"{off}: 2" in lines["serving"]
        assert ledger.check_lines(book.statements, lines, file) == []
    table = tables.slo_search_table([job]).set_index("subject")
    assert table.loc[on, "cache on vs off"].startswith("not decided at this size") and table.loc[off, "cache on vs off"] == "-"
    assert table.loc[on, "interval"] == "[8, 16] (range, 75% coverage)"
    said = [s for s in book.statements if s.metric == "goodput"]
    assert said and all(s.value <= s.bound for s in said)
