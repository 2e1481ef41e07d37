"""The report's prose says what its records show and no more (issue 50, points 7 and 10), in the one verdict
vocabulary: planted records rendered through the notes, the tables' constant-column line and the sections."""
import pandas as pd
import pytest

from efflab import config
from efflab.stages.report import notes, sections, task_quality, writing
from efflab.stages.report.templating import render
from tests.helpers import TEST_PARAMS, serving_record

NOT_VERDICTS = ("undecided", "no difference measured")


@pytest.fixture(scope="module")
def cfg():
    return config.load(TEST_PARAMS)


def _run(name, method, peak, delta, live):
    return {"run": name, "method": method, "status": "ok", "first_loss": 2.0, "last_loss": 1.5,
            "validation_after": {"loss": 1.6}, "settings": {"gradient_checkpointing": False, "packing": True},
            "train_memory": {"kind": "cpu_peak_rss", "peak_mib": peak, "delta_mib": delta},
            "memory_prediction": {"measured_mib": live}}


def _notes(finetune=(), bench_attention=(), config=None, claims=()) -> str:
    return "\n".join(notes.lines({"finetune": list(finetune), "bench_attention": list(bench_attention),
                                  "base_model": [{"config": config or {}}], "claims": list(claims)}))


def test_the_qlora_note_with_equal_live_peaks_puts_the_difference_outside_the_live_tensors_and_names_no_library():
    """The reference run's figures: 1,771 vs 1,705 MiB resident, 1,159 vs 1,102 held before, 613 vs 603 added,
    446 vs 446 MiB of live tensors. No bitsandbytes mechanism, no 'small' saving: only what the records show."""
    runs = [_run("lora-r8", "lora", 1704.8, 602.52, 445.93), _run("qlora-r8", "qlora", 1771.4, 612.8, 445.93)]
    note = _notes(runs)
    assert "(1,771 vs 1,705 MiB resident" in note and "held more: 1,159 vs 1,102 MiB" in note
    assert "Training added 613 vs 603 MiB." in note and "peaked at 446 vs 446 MiB: alike" in note
    assert "the 10 MiB more that QLoRA's training added is not in live tensors" in note
    for said in ("bitsandbytes", "dequantiz", "small", "temporar"):
        assert said not in note, said


def test_the_qlora_note_with_different_live_peaks_states_the_figures_and_no_cause():
    runs = [_run("lora-r8", "lora", 11_100, 168.4, 300), _run("qlora-r8", "qlora", 12_345.2, 1352.8, 1310)]
    note = _notes(runs)
    assert "(12,345 vs 11,100 MiB resident" in note and "Training added 1,353 vs 168 MiB." in note
    assert "peaked at 1,310 vs 300 MiB." in note
    assert "not in live tensors" not in note and "bitsandbytes" not in note and "allocator" not in note


CONFIG = {"num_attention_heads": 9, "hidden_size": 576, "intermediate_size": 1536}
EAGER = [{"status": "ok", "implementation": "eager", "rows": [{"seq_len": n} for n in (32, 64, 128)],
          "memory_exponents": [{"mode": "forward_backward", "exponent": 1.072, "points": 3}]}]
CLAIMS = [{"status": "ok", "claims": 3, "by_verdict": {"inconclusive": 1}, "counts": {},
           "differs": [], "inconclusive": [notes.ATTENTION_CLAIM]}]


def test_the_attention_note_gives_the_exponent_as_a_measurement_and_the_claims_page_its_verdict():
    note = _notes(bench_attention=EAGER, config=CONFIG, claims=CLAIMS)
    assert "over 32–128 tokens fits seq_len^k with k = 1.07 (forward_backward, 3 lengths)" in note
    assert "with no interval" in note and "L ≈ 384 tokens" in note and "(0.33 of the rest at 128)" in note
    assert "at most 1.25" in note, "the local exponent of 6912·L + 18·L² at 128 tokens: 1 + s/(1+s), s = 1/3"
    assert f"claim: [`{notes.ATTENTION_CLAIM}`](../claims/claims.md) (inconclusive)" in note and "../claims/claims.md" in note
    for said in ("not k = 2", "not k=2", ", not 2"):
        assert said not in note, said


def test_without_a_claims_record_the_attention_note_states_no_verdict():
    note = _notes(bench_attention=EAGER, config=CONFIG)
    assert f"claim: [`{notes.ATTENTION_CLAIM}`](../claims/claims.md)." in note
    assert not any(v in note for v in ("inconclusive", "differs", "reproduced"))
    assert notes.claim_verdict([{"status": "ok", "differs": [notes.ATTENTION_CLAIM]}], notes.ATTENTION_CLAIM) == "differs"


def test_a_constant_column_is_one_natural_line_above_the_table_and_a_blank_column_goes():
    df = pd.DataFrame([{"scheme": s, "footprint (MiB)": f, "LoRA on it": "not checked", "tail cause": ""}
                       for s, f in (("baseline", 513.1), ("nf4", 158.8))])
    table = writing.markdown(df)
    assert table.startswith("In every row, LoRA on it: not checked.\n\n| scheme | footprint (MiB) |")
    assert "tail cause" not in table and "Every row:" not in table
    some = writing.markdown(pd.DataFrame([{"a": "x", "kind": k, "n": n} for k, n in (("rss", 1), (None, 2), ("rss", 3))]), keys=1)
    assert some.startswith("In every row with a value, kind: rss.")


def _qat_job(failed_qat: bool = False) -> dict:
    trained = {"status": "ok", "first_loss": 4.2, "last_loss": 3.9}
    variants = [{"variant": "full precision", "method": "full precision", "bits": None} | trained]
    for b in (4, 8):
        variants.append({"variant": f"ptq-int{b}", "method": "ptq", "bits": b, "status": "ok"})
        variants.append({"variant": f"qat-int{b}", "method": "qat", "bits": b}
                        | ({"status": "failed"} if failed_qat and b == 8 else trained))
    test = {"b_min": None, "undecided_at": 4, "fail_above_b_min": []}
    return {"status": "ok", "bits": [4, 8], "variants": variants, "base_perplexity": 38.1,
            "reference_perplexity": 33.8, "tolerance_pct": 5.0, "quantized": "every linear layer", "eval_rows": 16,
            "precision_range_test": {"ptq": test | {"b_min": 8, "undecided_at": None}, "qat": test}}


@pytest.mark.parametrize(("failed_qat", "count", "widths"), [(False, "Three models train", "one per width (4, 8 bits)"),
                                                             (True, "Two models train", "and one (4 bits)")])
def test_the_qat_section_counts_the_models_that_trained(cfg, failed_qat, count, widths):
    """The full-precision fine-tune (the PTQ source) and one QAT model per width train; PTQ models do not."""
    text = sections.qat_body(cfg, {"qat": [_qat_job(failed_qat)]}, lambda key: "")
    assert text.startswith(f"{count} {cfg['qat']['train']['steps']} steps each on the same batches") and widths in text
    assert "not decided at this size otherwise" in text and "undecided" not in text
    assert "Perplexity on 16 validation rows" in text, "the rows the record was measured on, not params.yaml's"


def test_the_evaluate_section_says_not_decided_at_this_size_in_its_prose(cfg):
    job = {"status": "ok", "model": "int8", "reference": "base", "gate": {"verdict": "undecided", "failed": []},
           "tasks": {"efflab_validation_ll": {"status": "ok", "metrics": {"bits_per_byte": {"value": 1.2}}}},
           "changes": {"efflab_validation_ll": {"bits_per_byte": {"change": 0.01, "ci95": [-0.02, 0.04], "n": 8,
                                                                  "gate": "undecided"}}}}
    facts = task_quality.facts(cfg, [job])
    facts["resolution"] = [{"metric": "bits_per_byte", "tolerance": 0.1, "docs": [8], "half_width": 0.03}]
    prose = render("sections/evaluate.md.j2", **facts | {"table": ""})
    assert "else **not decided at this size**" in prose and "**Not decided at this size:** **int8**" in prose
    assert not any(word in prose.lower() for word in NOT_VERDICTS)
    details = render("answers.md.j2", answers=[], max_new_tokens=16, resolution=facts["resolution"], commands={})
    assert "of the tolerance is not decided at this size" in details  # what the documents decide: in details.md
    assert not any(word in details.lower() for word in NOT_VERDICTS)


def _serving(sentinel: dict | None) -> str:
    record = serving_record({("naive", 1): [10.0] * 6, ("static", 4): [25.0] * 6, ("continuous", 4): [30.0] * 6})
    if sentinel is not None:
        record |= {"sentinel": sentinel, "sentinel_tolerance": 0.25, "round_orders": [
            ["naive@1", "static@4", "continuous@4"], ["continuous@4", "static@4", "naive@1"],
            ["static@4", "continuous@4", "naive@1"], ["naive@1", "continuous@4", "static@4"],
            ["continuous@4", "naive@1", "static@4"], ["static@4", "naive@1", "continuous@4"],
            ["naive@1", "static@4", "continuous@4"]]}
    return sections.serving_body({}, {"bench_serving": [record]}, lambda key: "")


def test_the_serving_prose_says_what_the_order_and_the_speed_probe_do_and_no_more():
    rounds = [{"burst": i, "stable": i != 2} for i in range(7)]
    text = _serving({"rounds": rounds, "set_aside": 1, "stable_rounds": 6, "figures_of_bursts": [0, 1, 3, 4, 5, 6]})
    assert "hits every cell alike" not in text and "drift" not in text
    assert "balanced order" in text and "bench_serving.md#what-it-does" in text
    assert "beyond ±25% of their median is set aside" in text and "at most 6 more times" in text
    assert "served 7 times by every cell" in text and "Here 1 of 7 bursts was set aside." in text
    assert "medians over the stable bursts" in text and "requests of all 6 burst(s) kept, pooled" in text
    unstable = _serving({"rounds": rounds, "set_aside": 4, "stable_rounds": 3, "figures_of_bursts": list(range(7)),
                         "unstable": "the machine's speed changed"})
    assert "too many: the machine's speed changed; the figures are of every burst, and no ratio has a verdict" in unstable
    assert "medians over the bursts" in unstable and "requests of all 7 burst(s), pooled" in unstable


def test_a_serving_record_without_the_speed_probe_says_it_has_none():
    text = _serving(None)
    assert "in reverse order every other round" in text and "this record has no speed probe between its bursts" in text
    assert "hits every cell alike" not in text and "set aside" not in text


def test_the_vocabulary_names_the_gate_words_and_no_other_verdict(cfg):
    text = sections.how_to_read(cfg)
    assert "**passes** or **fails**" in text and "**not decided at this size**" in text
    assert not any(word in text for word in NOT_VERDICTS + ("inconclusive",))
