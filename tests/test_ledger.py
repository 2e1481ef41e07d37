"""The statements ledger and its checker (report.ledger), and the physical bounds every figure is held to
(measure.bounds, report.screen): planted records and statements, each bound broken once."""
import json

import pytest

from efflab.measure import bounds
from efflab.stages.report import glance, ledger
from efflab.stages.report.screen import screen
from tests.helpers import REPO

AVX2 = REPO / "results" / "reference" / "amd-epyc-avx2" / "report"


def _s(value, verdict="faster", file="decisions.json", lo=None, hi=None, **kw):
    fields = {"finding": "inference", "subject": "int8", "metric": "speed"} | kw
    return ledger.Statement(value=value, lo=lo, hi=hi, n=6, verdict=verdict, file=file, **fields)


def test_two_statements_of_one_finding_that_differ_fail_and_equal_ones_pass():
    same = [_s(1.2, lo=1.1, hi=1.3), _s(1.2, lo=1.1, hi=1.3, file="report.md")]
    assert ledger.check(same) == []
    for planted in (_s(1.25, lo=1.1, hi=1.3, file="report.md"), _s(1.2, lo=1.1, hi=1.3, verdict="slower"),
                    _s(1.2, lo=1.0, hi=1.3, file="details.md")):
        problems = ledger.check([same[0], planted])
        assert len(problems) == 1 and "inference int8 speed" in problems[0], problems
    why = "not decided: the machine's speed changed"  # a table says the head, decisions.json why after it too
    briefer = [_s(None, verdict=why + ": 10 of 12 rounds had a speed probe outside ±25%"), _s(None, verdict=why)]
    assert ledger.check(briefer) == [] and len(ledger.check([briefer[1], _s(None, verdict="not decided")])) == 0
    assert len(ledger.check([briefer[0], _s(None, verdict="not decided: the machine was busy")])) == 1


def test_a_verdict_outside_the_one_vocabulary_fails():
    for word in ("faster", "same within ±10%", "not decided at this size (n=1, no 95% interval)", "within",
                 "unavailable: NotImplementedError: a torchao kernel this family's layers cannot run",
                 "not decided: the machine's speed changed", "fails the task gate", "not better: than the base"):
        assert ledger.in_vocabulary(word), word
    for word in ("pretty fast", "one run each: no interval", "undecided"):
        assert not ledger.in_vocabulary(word), word
        assert "outside the vocabulary" in ledger.check([_s(1.0, verdict=word)])[0]


@pytest.mark.parametrize("metric, value, top, bad", [
    ("bandwidth_fraction", 1.18, None, True), ("bandwidth_fraction", 0.6, None, False),
    ("compute_fraction", 1.01, None, True), ("mfu", 1.2, None, True), ("mfu", 0.57, None, False),
    ("kl", -3.1e-9, None, False), ("kl", -1e-3, None, True), ("acceptance_rate", 1.5, None, True),
    ("accepted", 21, 20, True), ("accepted", 5, 20, False), ("goodput", 10.7, 8.2, True), ("share", -0.1, None, True)])
def test_each_physical_bound_refuses_what_cannot_be_true(metric, value, top, bad):
    assert (bounds.violation(metric, value, top) is not None) == bad


def test_a_kl_a_rounding_below_zero_is_said_zero_with_its_value_and_never_printed_as_a_bare_zero():
    assert bounds.at_bound("kl", -3.1e-9) and not bounds.at_bound("kl", 0.03)
    assert glance.kl_text(-3.1e-9) == "0 up to float rounding, -3.1e-09"
    assert glance.kl_text(0.0314) == "0.0314"
    assert "below 0" in ledger.check([_s(-0.01, verdict=None, metric="kl")])[0]


def _records(bandwidth=0.5, mfu=0.4, accepted=5, served=1.0, offered=1.2):
    cell = {"status": "ok", "kv_cache": True, "batch_size": 1, "generation": "prompt_lookup",
            "roofline": {"bandwidth_fraction": bandwidth, "compute_fraction": 0.01, "bound": "memory-bound"},
            "speculation": {"steps": 3, "proposed": 20, "accepted": accepted, "acceptance_rate": accepted / 20}}
    rounds = [{"requests_per_s": served, "offered_per_s": offered, "goodput_per_s": served}]
    stats = {"median": served, "ci95_median": None, "n": 1}
    serving = {"name": None, "stage": "bench_serving", "status": "ok", "open_loop": {"cells": [
        {"method": "continuous", "rate": 1, "status": "ok", "requests": 5, "by_round": rounds,
         "requests_per_s": stats, "goodput_per_s": stats, "output_tokens_per_s": stats}]}}
    return {"bench_inference": [{"name": "baseline", "status": "ok", "cells": [cell]}],
            "finetune": [{"name": "full", "status": "ok", "throughput": {"mfu_vs_measured_ceiling": mfu}}],
            "bench_serving": [serving]}


def test_the_screen_withholds_each_figure_beyond_its_bound_from_every_record_and_says_why():
    assert screen(_records())[1] == []
    for planted, metric in ((dict(bandwidth=1.18), "bandwidth_fraction"), (dict(mfu=1.3), "mfu_vs_measured_ceiling"),
                            (dict(accepted=21), "acceptance_rate"), (dict(served=1.3, offered=1.2), "goodput")):
        records = _records(**planted)
        screened, withheld = screen(records)
        assert metric in [w["metric"] for w in withheld], planted
        assert records == _records(**planted), "the records read are left as they were"
    screened, _ = screen(_records(bandwidth=1.18, served=1.3))
    cell = screened["bench_inference"][0]["cells"][0]
    assert cell["roofline"]["bandwidth_fraction"] is None and cell["roofline"]["bound"] == "withheld"
    assert screened["bench_serving"][0]["open_loop"]["cells"][0]["goodput_per_s"]["median"] is None


def test_a_glance_line_may_say_only_the_verdicts_its_finding_holds():
    held = [_s(0.44, verdict="slower"), _s(3.1, verdict="not decided at this size", metric="quality")]
    fine = {"inference": "no variant shown both faster than the base and within +5% perplexity. int8 0.44×, slower, "
                         "perplexity +3.1% (not decided at this size)"}
    assert ledger.check_lines(held, fine, "report.md") == []
    planted = {"inference": fine["inference"].replace("slower", "faster")}
    assert ledger.check_lines(held, planted, "report.md") == [
        "inference (report.md): says 'faster' of int8, which no statement of it holds"]


def test_a_flipped_verdict_in_the_decisions_is_followed_by_the_glance_and_caught_where_a_line_keeps_the_old_one():
    """The AVX2 reference's decisions: int8's quality verdict planted as 'within'. The glance re-rendered from them
    says it, the checker passes; the line rendered before the change no longer matches what the ledger holds."""
    made = json.loads((AVX2 / "decisions.json").read_text())
    before = glance.by_question(made)
    int8 = next(o for o in made["questions"]["quantize"]["options"] if o["name"] == "int8")
    int8["axes"]["quality"]["verdict"], int8["status"] = "beyond", "beyond"
    book = ledger.Ledger()
    book.from_decisions(made)
    assert ledger.check(book.statements) == []
    assert ledger.check_lines(book.statements, glance.by_question(made), "report.md") == []
    stale = ledger.check_lines(book.statements, {"quantize": before["quantize"]}, "report.md")
    assert stale == ["quantize (report.md): says 'not decided at this size' of int8, which no statement of it holds"]


def test_every_reference_run_s_statements_hold_together():
    for path in sorted((REPO / "results" / "reference").glob("*/report/statements.jsonl")):
        statements = [ledger.Statement(**json.loads(line)) for line in path.read_text().splitlines()]
        assert statements and ledger.check(statements) == [], path


def test_an_interval_end_near_its_verdict_s_bound_keeps_the_digits_that_set_it_apart():
    """A ratio decided faster on a lower end of 1.0011 is not printed [1, ...], nor a change reaching -0.04% [0, ...];
    float noise on the bound stays the bound."""
    from efflab.stages.report.templating import value_text

    assert value_text({"value": 1.2, "lo": 1.0011, "hi": 1.27, "n": 6}, "×") == "1.2× [1.001, 1.27]"
    assert value_text({"value": 3.1, "lo": -0.04, "hi": 6.4, "n": 16}, "%", signed=True) == "+3.1% [-0.04, +6.4]"
    assert value_text({"value": 0.6, "lo": 0.55, "hi": 0.7, "n": 6}, "×") == "0.6× [0.55, 0.7]"
    assert value_text({"value": 1.0, "lo": 1 + 1e-9, "hi": 1.2, "n": 6}, "×") == "1× [1, 1.2]"


def test_each_reference_glance_is_read_in_a_minute_scale_first_then_short_lines():
    """At most 12 lines (the scale, the answers, the pointer to the full ones), each at most 200 characters as read."""
    from efflab.stages.report.short_glance import MAX_CHARS, MAX_LINES, visible

    for path in sorted((REPO / "results" / "reference").glob("*/report/report.md")):
        glance_text = path.read_text().split("## At a glance: your model on your data\n")[1].split("\n### ")[0]
        lines = [line for line in glance_text.split("\n**Withheld**")[0].splitlines() if line.strip()]
        assert lines[0].startswith("**Scale**: a 134.5M-parameter llama on 2 CPU cores"), path
        assert len(lines) <= MAX_LINES and max(map(visible, lines)) <= MAX_CHARS, (path, lines)
        details = (path.parent / "details.md").read_text()
        assert "## Every answer in full" in details and "| TTFT |" in details


def test_the_questions_table_is_the_one_place_a_question_is_defined():
    """decisions.json's keys, the glance's links, both glances' renderers and the short glance's order all derive
    from efflab.questions: an unknown key fails loudly rather than dropping out of the glance."""
    from efflab import questions
    from efflab.stages.report import short_glance

    made = json.loads((AVX2 / "decisions.json").read_text())
    assert {questions.kind_of(k) for k in made["questions"]} <= set(questions.BY_KIND)
    assert all(made["questions"][k]["objective"] == questions.of(k).objective for k in made["questions"])
    assert set(glance.LINKS) == set(questions.BY_KIND)
    assert [k for k in short_glance.ORDER if k not in ("open_loop", "slo_search")] == list(questions.ORDER)
    with pytest.raises(KeyError, match="not in efflab.questions"):
        short_glance.lines(made | {"questions": made["questions"] | {"mystery": {"answer": None}}})
    with pytest.raises(KeyError, match="not in efflab.questions"):
        glance.lines(made | {"questions": made["questions"] | {"mystery": {"answer": None}}})
    assert set(glance.SAYS) == set(short_glance.SAYS) == set(questions.BY_KIND)  # a line of each length per question


def test_a_ratio_decided_on_its_extreme_rounds_says_so():
    """From 6 to 8 rounds the median's 95% interval is their range: faster means faster in every round."""
    from efflab.measure.stats import interval_is_range
    from efflab.stages.report.short_glance import _said

    assert [n for n in range(3, 12) if interval_is_range(n)] == [6, 7, 8]
    assert _said({"value": 1.2, "lo": 1.0011, "hi": 1.27, "n": 6, "verdict": "faster"}) == \
        "1.2× [1.001, 1.27], faster in all 6 rounds"
    assert _said({"value": 1.2, "lo": 1.05, "hi": 1.27, "n": 12, "verdict": "faster"}) == "1.2× [1.05, 1.27], faster"


FLIP = {"faster": "slower", "slower": "faster", "within": "beyond", "beyond": "within", "less": "more",
        "more": "less"}


def _flips(made: dict):
    """Every (question, option, axis) of the decisions whose verdict has an opposite."""
    for key, q in made["questions"].items():
        for i, o in enumerate(q.get("options", [])):
            for axis, a in (o.get("axes") or {}).items():
                if a and a.get("verdict") in FLIP:
                    yield key, i, axis


@pytest.mark.parametrize("run", ["amd-epyc-avx2", "intel-r-xeon-r-processor-avx512-bf16"])
def test_each_finding_s_flipped_verdict_is_followed_by_every_line_that_states_it(run):
    """Planted: each option's verdict on each axis turned to its opposite, one at a time, in a reference's decisions.
    The ledger re-read from them, the glance's full and short lines re-rendered from them hold together; the line
    rendered before a flip, where it said the old word and nothing else holds it, no longer does."""
    import copy

    from efflab.stages.report import short_glance

    made = json.loads((REPO / "results" / "reference" / run / "report" / "decisions.json").read_text())
    flips = list(_flips(made))
    assert len(flips) >= 8, flips
    caught = 0
    for key, i, axis in flips:
        planted = copy.deepcopy(made)
        a = planted["questions"][key]["options"][i]["axes"][axis]
        old, a["verdict"] = a["verdict"], FLIP[a["verdict"]]
        book = ledger.Ledger()
        book.from_decisions(planted)
        assert ledger.check(book.statements) == [], (key, axis)
        assert ledger.check_lines(book.statements, glance.by_question(planted), "details.md") == [], (key, axis)
        assert ledger.check_lines(book.statements, short_glance.lines(planted), "report.md") == [], (key, axis)
        before = glance.by_question(made)[key]
        name = planted["questions"][key]["options"][i]["name"]
        still = {w for st in book.statements if st.finding == key and st.subject in (name, "-")
                 for w in ledger.stated_words(st.verdict or "")}  # its status may still say the old word
        names = [o["name"] for o in planted["questions"][key]["options"]]
        said = old not in still and any(ledger._named_in(c, names) == [name] and old in ledger.stated_words(c)
                                        for c in ledger._clauses(before))  # a clause of this option alone
        stale = ledger.check_lines(book.statements, {key: before}, "details.md")
        assert bool(stale) == said or not said, (key, name, axis, stale)
        caught += bool(stale)
    assert caught >= 8, (caught, len(flips))  # the flips whose old word a line printed beside the option


def test_every_link_of_each_reference_report_and_details_lands_on_a_heading():
    """A link from report.md or details.md to a section of either ('#x', 'details.md#x', 'report.md#x') names a
    heading that file has: the full answers moved to details.md keep their links working from there."""
    import re

    from efflab.stages.report.writing import anchor

    for folder in sorted(p.parent for p in (REPO / "results" / "reference").glob("*/report/report.md")):
        heads = {f: {anchor(h) for h in re.findall(r"^#+ (.+)$", (folder / f).read_text(), re.M)}
                 for f in ("report.md", "details.md")}
        for name in heads:
            for target, fragment in re.findall(r"\]\(((?:report|details)\.md)?#([a-z0-9-]+)\)",
                                               (folder / name).read_text()):
                assert fragment in heads[target or name], (folder.parent.name, name, target, fragment)


def test_a_table_s_verdict_column_is_held_to_the_decisions_verdict_of_its_finding():
    import pandas as pd

    from efflab.stages.report.parts import PARTS

    made = json.loads((AVX2 / "decisions.json").read_text())
    prune = pd.DataFrame([{"strategy": "layers-half", "verdict vs base": "faster"}])
    cell = made["questions"]["attention"]["cell"]
    attention = pd.DataFrame([{"implementation": "sdpa", "mode": cell["mode"], "seq len": float(cell["seq_len"]),
                               "batch": cell["batch"], "verdict vs eager": "same within ±10%"}])
    book = ledger.Ledger()
    book.from_decisions(made)
    book.from_tables({"prune": prune, "bench_attention": attention}, PARTS)
    assert ledger.check(book.statements) == []  # the committed run's table verdicts are its decisions'
    planted = {"prune": prune.assign(**{"verdict vs base": "slower"}),
               "bench_attention": attention.assign(**{"verdict vs eager": "faster"})}
    for name, table in planted.items():
        flipped = ledger.Ledger()
        flipped.from_decisions(made)
        flipped.from_tables({name: table}, PARTS)
        problems = ledger.check(flipped.statements)
        assert len(problems) == 1 and f"report.md#{name} states no value (" in problems[0], problems


def test_a_verdict_word_in_the_prose_of_report_or_details_is_held_to_the_statements_of_the_options_it_names():
    statements = [ledger.Statement(**json.loads(line)) for line in (AVX2 / "statements.jsonl").read_text().splitlines()]
    for name in ("report.md", "details.md"):
        assert ledger.check_document(statements, (AVX2 / name).read_text(), name) == [], name
    text = (AVX2 / "report.md").read_text()
    line = next(x for x in text.splitlines() if x.startswith("- **Serving**: **static**"))
    planted = text.replace(line, line.replace("faster", "slower"))
    problems = ledger.check_document(statements, planted, "report.md")
    assert len(problems) == 1 and "says 'slower' of static" in problems[0], problems
    rule = "A width passes where the whole 95% interval of its change is within +5% (fails where it is wholly above)."
    assert ledger.check_document(statements, f"For full: {rule}", "report.md") == []  # a rule, not a verdict


def test_a_claim_s_reading_of_a_decided_quantity_is_held_to_the_question_s_figure():
    made = json.loads((AVX2 / "decisions.json").read_text())
    claims = json.loads((AVX2.parent / "claims" / "metrics.json").read_text())
    assert any(r["metric"]["kind"] == "inference_speedup" for r in claims["readings"])
    book = ledger.Ledger()
    book.from_decisions(made)
    book.from_claims([claims])
    cited = [s for s in book.statements if s.file == "claims.md"]
    assert cited and ledger.check(book.statements) == []
    first = next(r for r in claims["readings"] if r["metric"]["kind"] == "inference_speedup")
    planted = dict(claims, readings=[dict(first, value=first["value"] * 1.1)])  # a second measurement of it
    book = ledger.Ledger()
    book.from_decisions(made)
    book.from_claims([planted])
    problems = ledger.check(book.statements)
    assert len(problems) == 1 and f"claims.md#{first['id']}" in problems[0], problems


def test_the_claims_page_says_only_the_claims_verdicts():
    page = (AVX2.parent / "claims" / "claims.md").read_text()
    words = list(json.loads((AVX2.parent / "claims" / "metrics.json").read_text())["by_verdict"])
    assert ledger.check_claims_page(page, words) == []
    row = next(x for x in page.splitlines() if x.startswith("| int8-faster-inference |"))
    planted = page.replace(row, row.replace("| differs |", "| faster |"))
    problems = ledger.check_claims_page(planted, words)
    assert len(problems) == 1 and "verdict 'faster' is none of the claims' words" in problems[0], problems
