"""decisions.json: each question answered once from planted records, in the one verdict vocabulary, and every
verdict the report states for a pair equal to the decision's."""
import json
import re

import pytest

from efflab import config
from efflab.measure import stats
from efflab.measure.stats import summarize
from efflab.stages.report import decisions, glance, knobs, pareto, question_facts, short_glance, writing
from tests.helpers import TEST_PARAMS
from tests.test_question_facts import CFG, INFERENCE, QUANTIZE, metrics


@pytest.fixture(scope="module")
def cfg():
    loaded = config.load(TEST_PARAMS)
    return loaded | {"report": loaded["report"] | CFG["report"]}


def _ft(name, steps, memory, **settings):
    base = {"method": "lora", "gradient_checkpointing": False, "lora": {"r": 8}}
    return {"run": name, "method": settings.get("method", "lora"), "status": "ok", "settings": base | settings,
            "step_s": sum(steps) / len(steps), "tokens_per_s": 100.0, "tokens_seen": 1000,
            "step_time": summarize(steps), "train_memory": {"kind": "cpu_peak_rss", "peak_mib": memory},
            "validation_after": {"loss": 3.0}, "environment": {"fingerprint": "e"}}


STEPS = [1.0, 1.6, 0.7, 1.3, 0.9, 1.1, 1.4]
FINETUNE = [_ft("lora", STEPS, 1400.0), _ft("lora-gc", [1.3 * t for t in STEPS], 1200.0, gradient_checkpointing=True)]
ATTENTION = [{"status": "ok", "rows": [
    {"status": "ok", "implementation": impl, "seq_len": 256, "batch_size": 1, "memory": {"delta_mib": mib},
     "max_abs_diff_vs_eager": 0.0 if impl == "eager" else 1e-6, "vs_eager": speedup}
    for impl, mib, speedup in (("eager", 130.0, None),
                               ("sdpa", 110.0, {"speedup": {"median": 1.4, "ci95": [1.3, 1.5], "rounds": 8}}))]}]
SERVING = [{"status": "ok", "cells": [
    {"status": "ok", "method": "naive", "concurrency": 4},
    {"status": "ok", "method": "static", "concurrency": 4,
     "throughput_vs_naive": {"median": 2.9, "ci95": [2.5, 3.3], "rounds": 6}},
    {"status": "ok", "method": "continuous", "concurrency": 4,
     "throughput_vs_naive": {"median": 3.0, "ci95": [2.6, 3.4], "rounds": 6},
     "continuous_vs_static": {"median": 1.02, "ci95": [0.97, 1.06], "rounds": 6}}]}]


def _build(cfg, **stages):
    return decisions.build(cfg, metrics(**{"qat": [], "prune": [], "bench_serving": [], "capacity": [],
                                           "bench_finetune": [], "evaluate": []} | stages))


def _option(decision, name):
    return next(o for o in decision["options"] if o["name"] == name)


def test_the_verdict_vocabulary_and_its_orientation_on_a_simulated_clock():
    """A cell timed 2x faster than its reference reads "faster" as a speedup and its time ratio "slower" the other
    way round; an interval inside ±10% is "same"; a wide one says about what n would decide it."""
    result = {"rounds": [{"stable": True, "seconds": {"fast": 1.0 + i / 100, "ref": 2.0 + i / 100}}
                         for i in range(6)]}
    assert stats.speedup(result, "fast", "ref")["median"] > 1
    assert stats.ratio_words(stats.speedup(result, "fast", "ref")) == "faster"
    assert stats.ratio_words(stats.speedup(result, "ref", "fast")) == "slower"
    assert stats.compare(1.01, 0.97, 1.05, n=8) == "same within ±10%"
    wide = stats.compare(1.05, 0.9, 1.3, n=8)
    assert wide.startswith("not decided at this size (about n=") and wide.endswith("n=8 here)")
    assert stats.compare(1.3, None, None, n=3) == "not decided at this size (n=3, no 95% interval)"


def test_quantization_names_the_smallest_scheme_within_the_tolerance_with_each_verdict(cfg):
    q = _build(cfg, quantize=QUANTIZE, bench_inference=INFERENCE)["questions"]["quantize"]
    assert q["answer"] == "int8" and q["baseline"] == "baseline"
    int8, nf4, fp4 = (_option(q, n) for n in ("int8", "nf4", "fp4"))
    assert int8["axes"]["quality"]["verdict"] == "within" and int8["axes"]["speed"]["verdict"] == "slower"
    assert nf4["axes"]["quality"]["verdict"] == "beyond" and nf4["axes"]["speed"]["verdict"] == "faster"
    assert fp4["axes"]["quality"]["verdict"] == "not decided at this size"
    assert int8["axes"]["memory"]["verdict"] == "less" and int8["axes"]["memory"]["lo"] == int8["axes"]["memory"]["hi"]


def test_inference_answers_none_when_the_faster_variant_is_beyond_the_tolerance(cfg):
    q = _build(cfg, quantize=QUANTIZE, bench_inference=INFERENCE)["questions"]["inference"]
    assert q["answer"] is None and _option(q, "nf4")["status"] == "beyond"
    assert _option(q, "nf4")["axes"]["speed"]["verdict"] == "faster"


def test_fine_tuning_decides_step_time_by_the_knob_tables_own_ratio_and_never_memory_from_one_measurement(cfg):
    q = _build(cfg, finetune=FINETUNE)["questions"]["finetune"]
    gc = _option(q, "lora-gc")
    assert gc["axes"]["step_ratio"]["verdict"] == "slower" and gc["axes"]["step_ratio"]["value"] == pytest.approx(1.3)
    assert gc["axes"]["memory"]["verdict"] == "not decided at this size (n=1, no 95% interval)"
    assert q["answer"] == {"memory": None, "step_ratio": "lora", "quality": None}
    row = knobs.knob_table(FINETUNE).iloc[0]
    assert row["step time verdict"] == gc["axes"]["step_ratio"]["verdict"]


def test_attention_and_serving_answers(cfg):
    made = _build(cfg, bench_attention=ATTENTION, bench_serving=SERVING)["questions"]
    assert made["attention"]["answer"] == "sdpa" and _option(made["attention"], "sdpa")["axes"]["speed"][
        "verdict"] == "faster"
    serving = made["serving"]
    assert serving["answer"] == "continuous" and _option(serving, "continuous")["versus_static"] == "same within ±10%"


def test_a_question_whose_stage_did_not_run_is_absent_and_says_why(cfg):
    made = _build(cfg, quantize=QUANTIZE, bench_inference=INFERENCE)
    assert "finetune" not in made["questions"] and made["absent"]["finetune"]
    assert "serving" in made["absent"]


def test_every_verdict_the_glance_states_for_a_pair_is_the_decisions(cfg, tmp_path):
    """The glance's tables and the knob table render from decisions.json: each option's verdict cell there is the
    decision's, word for word, and no other vocabulary appears."""
    made = _build(cfg, quantize=QUANTIZE, bench_inference=INFERENCE, finetune=FINETUNE, bench_attention=ATTENTION)
    decisions.write(made, tmp_path / "decisions.json")
    stored = json.loads((tmp_path / "decisions.json").read_text())["questions"]
    text = "\n".join(question_facts.lines(made["_facts"], cfg))
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")] if line.startswith("| ") else []
        if cells and cells[0] not in ("option", "---"):
            rows.setdefault(re.sub(r" \(baseline\)$", "", cells[0]), []).append(cells)
    checked = 0
    for key, axis in (("inference", "speed"), ("attention", "speed"), ("finetune", "step_ratio")):
        for o in stored[key]["options"]:
            if o["baseline"]:
                continue
            assert any(o["axes"][axis]["verdict"] in cells for cells in rows[o["name"]]), (key, o["name"])
            checked += 1
    assert checked == 4
    for word in ("no difference measured", "undecided", "inconclusive", "no significant difference"):
        assert word not in text
    knob = knobs.knob_table(FINETUNE).iloc[0]
    assert knob["step time verdict"] == _option(stored["finetune"], "lora-gc")["axes"]["step_ratio"]["verdict"]



def test_a_speedup_the_sentinel_left_without_a_figure_says_why_in_every_place(cfg):
    """int8's decode ratio had no stable round on a busy machine: the decision, the advice, the glance and the
    inference table all say "not decided: <why>", never "not measured" (CI's run of qwen2 on a loaded machine)."""
    why = "the machine's speed changed during the comparison"
    unstable = [INFERENCE[0], {**INFERENCE[1], "cells": [INFERENCE[1]["cells"][0] | {"vs_base": {
        "generation_speedup": {"median": None, "ci95": None, "rounds": 1, "verdict": f"not a verdict: {why}"}}}]},
        INFERENCE[2]]
    made = _build(cfg, quantize=QUANTIZE, bench_inference=unstable)
    for key in ("inference", "quantize"):
        speed = _option(made["questions"][key], "int8")["axes"]["speed"]
        assert speed["value"] is None and speed["verdict"] == f"not decided: {why}", (key, speed)
    assert writing.speedup_verdict(unstable[1]["cells"][0]["vs_base"], "generation_speedup") == f"not decided: {why}"
    assert f"Its decode speed has no figure: {why}." in "\n".join(question_facts.lines(made["_facts"], cfg))
    line = glance.inference(made["questions"]["inference"], 5.0)
    assert f"int8 no figure, not decided: {why}" in line and "not measured" not in line

def _change(lo, hi, n=12):
    return {"change_pct": (lo + hi) / 2, "ci95_change_pct": [lo, hi], "n_rows": n}


MERGE = [{"run": "qlora-r8", "status": "ok", "targets": {
    "original base": {"kl_mean": 0.54, "validation": {"perplexity": 26.6}, "perplexity_change": _change(-20.0, -10.0)},
    "nf4 round-trip base": {"kl_mean": 0.003, "validation": {"perplexity": 31.4},
                            "perplexity_change": _change(-0.5, 0.7)},
    "round-trip merge re-quantized to nf4": {"kl_mean": 0.06, "validation": {"perplexity": 35.8},
                                             "perplexity_change": _change(7.0, 16.0)}}}]


def _qat_variant(method, bits, lo, hi):
    return {"variant": f"{method}-int{bits}", "method": method, "bits": bits, "status": "ok",
            "perplexity_change": _change(lo, hi)}


# Recorded under a looser tolerance (the old qat.threshold, 1.1x): the report decides again against the one
# tolerance, +5% in the test params, from the same paired changes.
QAT = [{"status": "ok", "bits": [4, 8], "reference_perplexity": 30.0, "tolerance_pct": 10.0,
        "variants": [_qat_variant("ptq", 4, 17.0, 40.0), _qat_variant("ptq", 8, -0.8, 0.3),
                     _qat_variant("qat", 4, 2.0, 8.0), _qat_variant("qat", 8, -1.2, -0.6)],
        "precision_range_test": {"ptq": {"b_min": 8, "verdicts": {"4": "fails", "8": "passes"}},
                                 "qat": {"b_min": 4, "verdicts": {"4": "passes", "8": "passes"}}}}]
PRUNE = [{"strategy": s, "status": "ok", "generation_speedup": {"median": m, "ci95": ci, "rounds": 6},
          "pruned": {"perplexity_change": _change(*q)}}
         for s, m, ci, q in (("layers-half", 1.8, [1.6, 1.9], (1600.0, 2900.0)),
                             ("heads-1", 1.2, [1.1, 1.3], (1.0, 4.0)),
                             ("heads-2", 1.05, [0.9, 1.2], (0.5, 2.0)))]


def _search(subject, dimension, measured, whole=False):
    return {"status": "ok", "subject": subject, "kind": "train", "dimension": dimension, "measured_max": measured,
            "whole_range_fits": whole, "first_failing": None if whole or measured is None else (measured or 0) + 1}


CAPACITY = [{"status": "ok", "budget": {"mib": 2048, "source": "capacity.budget_mib.cpu"},
             "fixed": {"train_seq_len": 128},
             "searches": [_search("full", "batch_size", None), _search("lora-r8", "batch_size", 5),
                          _search("lora-r8", "seq_len", 1024, whole=True)]}]


def test_merge_names_the_route_closest_to_the_adapter_and_the_one_better_in_quality(cfg):
    q = _build(cfg, merge=MERGE)["questions"]["merge:qlora-r8"]
    assert q["answer"] == {"closest": "nf4 round-trip base", "best_quality": "original base"}
    assert _option(q, "original base")["axes"]["quality"]["verdict"] == "within"
    assert _option(q, "round-trip merge re-quantized to nf4")["axes"]["quality"]["verdict"] == "beyond"
    line = glance.merge("merge:qlora-r8", q)
    assert "**nf4 round-trip base** is closest to the adapter (mean KL 0.003)" in line
    assert "**original base** has the lower perplexity (-15.0% [-20.0, -10.0] vs the adapter)" in line


def test_qat_is_decided_again_against_the_one_perplexity_tolerance(cfg):
    """The record says 4-bit QAT passes (its old 1.1x threshold); against +5% its interval [+2, +8] holds the
    tolerance: not decided at this size, and B_min with QAT is not decided from 4 bits."""
    made = _build(cfg, qat=QAT)
    q = made["questions"]["qat"]
    assert cfg["tolerance"]["perplexity_pct"] == 5.0
    assert q["answer"] == {"ptq": 8, "qat": None} and q["undecided_at"]["qat"] == 4
    assert {o["name"]: o["verdict"] for o in q["options"]} == {
        "ptq 4 bits": "beyond", "ptq 8 bits": "within", "qat 4 bits": "not decided at this size",
        "qat 8 bits": "within"}
    assert all(o["axes"]["quality"]["verdict"] == o["verdict"] for o in q["options"]), "one verdict, said once"
    line = glance.qat(q)
    assert "quantized after training **8 bits**" in line
    assert "with quantization-aware training not decided at this size from 4 bits" in line
    assert "qat 4 bits +5.0% [+2.0, +8.0], not decided at this size" in line


def test_pruning_answers_the_one_strategy_faster_and_within_the_tolerance(cfg):
    q = _build(cfg, prune=PRUNE)["questions"]["prune"]
    assert q["answer"] == "heads-1"
    verdicts = {o["name"]: (o["axes"]["speed"]["verdict"], o["axes"]["quality"]["verdict"]) for o in q["options"]}
    assert verdicts["layers-half"] == ("faster", "beyond")
    assert verdicts["heads-1"] == ("faster", "within")
    assert verdicts["heads-2"][0].startswith("not decided at this size") and verdicts["heads-2"][1] == "within"
    line = glance.prune(q)
    assert line.startswith("- **Pruning strategy** (vs the base model): **heads-1**.")
    assert "layers-half: generates 1.8× [1.6, 1.9], faster, perplexity +2,250.0% [+1,600, +2,900], beyond" not in line
    assert "perplexity +2,250% [+1,600, +2,900], beyond" in line, "thousands separated, no decimals above 100"


def test_capacity_answers_the_largest_size_that_fits_per_subject_and_nothing_where_nothing_does(cfg):
    full = _ft("full", STEPS, 3215.0, method="full")
    q = _build(cfg, capacity=CAPACITY, finetune=[full])["questions"]["capacity"]
    assert q["answer"] == {"full train batch_size": None, "lora-r8 train batch_size": 5, "lora-r8 train seq_len": 1024}
    line = glance.capacity(q)
    assert line.startswith("- **What fits 2,048 MiB** (`capacity.budget_mib.cpu`): full fine-tuning: no batch of "
                           "128-token rows fits; lora-r8: batch 5, 1,024 tokens or more at batch 1. ([table]")


def test_every_answer_is_a_full_line_and_the_glance_is_short_lines_of_the_same_verdicts(cfg):
    made = _build(cfg, quantize=QUANTIZE, bench_inference=INFERENCE, finetune=FINETUNE, bench_attention=ATTENTION,
                  merge=MERGE, qat=QAT, prune=PRUNE, bench_serving=SERVING, capacity=CAPACITY)
    text = question_facts.every_answer(made)  # the full lines, in details.md
    assert text.count("\n- **") >= len(made["questions"])
    questions = [b for line in glance.lines(made) for b in line.splitlines()]
    assert len(questions) == len(made["questions"]) + bool(made["questions"]["serving"].get("open_loop"))
    short = short_glance.lines(made)  # the glance: at most 10 bullets of at most 200 characters as read
    bullets = [b for line in short.values() for b in line.splitlines()]
    assert len(bullets) <= short_glance.MAX_LINES - 2 and max(map(short_glance.visible, bullets)) <= 200
    assert "_more" in short or len(bullets) == len(questions)
    for key, axis in (("inference", "speed"), ("attention", "speed"), ("serving", "speed"), ("prune", "quality")):
        line = next(line for line in questions if glance.LINKS[key] in line)
        for o in made["questions"][key]["options"]:
            if not o["baseline"] and o["axes"][axis]:
                assert o["axes"][axis]["verdict"] in line, (key, o["name"])
    for word in ("no difference measured", "undecided", "inconclusive", "e-0"):
        assert word not in text and word not in "\n".join(short.values())


@pytest.mark.parametrize(("value", "said"), [(-5.42e-09, "0"), (-0.0, "0"), (81413568, "81,413,568"),
                                             (0.06506, "0.06506"), (2172.567, "2,173")])
def test_numbers_read_without_float_noise_or_exponents(value, said):
    assert writing.number(value) == said
    assert writing.percent(-3.61e-05) == "-0.000036" and writing.percent(2172.5) == "+2,172"  # two digits, no exponent
    assert writing.percent(-4e-09) == "0" and writing.percent(-0.04) == "-0.04" and writing.percent(0.05) == "+0.1"


def _rows(loss):
    return [[10, loss + d] for d in (0.5, -0.5, 0.4, -0.4, 0.3, -0.3, 0.2, -0.2)]


def _run(name, method, steps, memory, loss):
    return _ft(name, steps, memory, method=method) | {"validation_after": {"loss": loss, "per_row": _rows(loss)}}


def _repeated(dimension, first, again):
    """A capacity search whose maximum ran again in its own process: its loaded memory read twice."""
    return {"status": "ok", "subject": "lora-r8", "kind": "train", "dimension": dimension, "measured_max": 3,
            "grid": [[1, 128], [16, 128]] if dimension == "batch_size" else [[1, 128], [1, 1024]],
            "whole_range_fits": False, "first_failing": 4, "timed_in": "a re-run of the maximum",
            "at_max": {"loaded_mib": again, "loaded_shift_mib": again - first}}


def _measured(*searches):
    return [CAPACITY[0] | {"budget": CAPACITY[0]["budget"] | {"memory": "cpu_peak_rss: the cell process's VmHWM"},
                           "searches": CAPACITY[0]["searches"][:1] + list(searches)}]


# Loaded memory read twice per search: 540 then 555 MiB (2.8% apart), 548 then 545; the first cell itself is no pair.
MEASURED = _measured(_repeated("batch_size", 540.0, 555.0), _repeated("seq_len", 548.0, 545.0),
                     _repeated("seq_len", 550.0, 550.0) | {"timed_in": "the search's cell", "measured_max": 128})


def test_each_memory_kind_s_measured_error_is_the_largest_spread_of_its_repeated_readings(cfg):
    errors = _build(cfg, capacity=MEASURED)["memory_error"]
    assert list(errors) == ["cpu_peak_rss"], "the kind the budget holds; none for a kind read once"
    e = errors["cpu_peak_rss"]
    assert e["pct"] == pytest.approx(100 * 15 / 540) and e["pairs"] == 2 and e["largest_mib"] == pytest.approx(15)
    assert e["from"].startswith("capacity:")


def test_a_peak_s_error_comes_from_the_same_work_measured_twice_where_the_records_hold_it():
    """The lora-r8 training cell at its maximum peaked at 1,851.4 MiB in the search and 1,841.5 MiB re-run to be
    timed (0.54%): the error of a training peak, not the loaded model's 0.009% spread."""
    from efflab.stages.report import options

    repeated = _repeated("batch_size", 481.855, 481.859)
    repeated["at_max"] |= {"peak_mib": 1841.5078125}
    old = options.memory_errors(_measured(repeated))["cpu_peak_rss"]
    assert old["from"] == options.LOADED_REPEATS and old["pct"] < 0.01
    error = options.memory_errors(_measured(repeated | {"search_peak_mib": 1851.38671875}))["cpu_peak_rss"]
    assert error["from"] == options.PEAK_REPEATS and error["pct"] == pytest.approx(100 * 9.87890625 / 1841.5078125)


def test_a_memory_gap_beyond_its_measured_error_is_decided_and_one_within_it_is_not(cfg):
    """3,215 against 1,409 MiB, each one measurement, with a measured error of 2.8%: the smaller run has the least
    memory. 3,215 against 3,150 (2% apart) is within that error: no run is named."""
    runs = [_run("full", "full", STEPS, 3215.0, 3.0), _run("lora", "lora", STEPS, 1409.0, 3.0)]
    q = _build(cfg, finetune=runs, capacity=MEASURED)["questions"]["finetune"]
    memory = _option(q, "lora")["axes"]["memory"]
    assert q["answer"]["memory"] == "lora" and memory["verdict"] == "less"
    assert memory["error_pct"] == pytest.approx(100 * 15 / 540) and memory["lo"] == pytest.approx(1409 * (1 - 15 / 540))
    assert q["memory_kind"] == "cpu_peak_rss" and q["memory_error"]["pairs"] == 2
    line = glance.finetune(q)
    assert "least memory **lora** (1,409 MiB, 0.44× full's 3,215)" in line
    assert "(`cpu_peak_rss`, ±2.8% measured error, from 2 pairs of processes)" in line
    close = [runs[0], _run("lora", "lora", STEPS, 3150.0, 3.0)]
    near = _build(cfg, finetune=close, capacity=MEASURED)["questions"]["finetune"]
    assert near["answer"]["memory"] is None and _option(near, "lora")["axes"]["memory"]["verdict"] not in (
        "less", "more")
    assert "least memory not decided: no peak below every other's by more than ±2.8%" in glance.finetune(near)
    alone = _build(cfg, finetune=runs)["questions"]["finetune"]
    assert alone["answer"]["memory"] is None and alone["memory_error"] is None, "no repeat, no error: n=1 decides nothing"


def test_the_frontier_keeps_a_run_with_less_memory_and_a_shorter_step_by_each_pair_s_own_comparison(cfg):
    """lora has less memory and a shorter step than full; lora-gc makes the same updates with less memory still,
    and bench_finetune measured it 1.3x slower than lora, interleaved. Over full's steps their intervals overlap,
    so comparing those would let lora-gc dominate lora: each pair is compared by its own measurement instead."""
    full = _run("full", "full", [2.0] * 7, 3215.0, 2.8)
    lora = _run("lora", "lora", STEPS, 1409.0, 3.0)
    gc = _run("lora-gc", "lora", [1.3 * t for t in reversed(STEPS)], 1200.0, 3.0)
    bench = [{"status": "ok", "pairs": [{"status": "ok", "a": "lora", "b": "lora-gc", "step_time_ratio": {
        "median": 1.3, "ci95": [1.2, 1.4], "rounds": 6, "verdict": "slower"}}]}]
    made = _build(cfg, finetune=[full, lora, gc], bench_finetune=bench, capacity=MEASURED)
    q = made["questions"]["finetune"]
    steps = [_option(q, n)["axes"]["step_ratio"] for n in ("lora", "lora-gc")]
    assert steps[0]["hi"] > steps[1]["lo"], "over full's steps, lora's and lora-gc's intervals overlap"
    assert q["frontier"] == ["full", "lora", "lora-gc"]
    assert q["answer"] == {"memory": "lora-gc", "step_ratio": "lora", "quality": "full"}
    points = pareto.finetune_pareto([full, lora, gc], made["_facts"]["finetune"])
    assert not any(p["dominated"] for p in points) and points[1]["x"]["kind"] == pareto.MEASURED_ERROR
    assert "on the frontier of memory × step time × perplexity: **full**, **lora**, **lora-gc**" in \
        glance.finetune(q)
    table = "\n".join(question_facts.lines(made["_facts"], cfg))
    assert "On the frontier of memory × step time × quality: **full**, **lora**, **lora-gc**." in table
    assert not [line for line in table.splitlines() if line.startswith("| lora") and line.endswith("| no |")]
