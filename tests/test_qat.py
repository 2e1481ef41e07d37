import copy
import json
import math

import pandas as pd
import pytest
import torch
from transformers import AutoModelForCausalLM

from efflab import quality
from efflab.config import UserError
from efflab.models.modeling import load_model, load_tokenizer, read_split
from efflab.stages import qat
from tests.helpers import TEST_PARAMS, run_stage


def json_round_trip(value):
    return json.loads(json.dumps(value))


def _tiny(prepared):
    return load_model(prepared / "base_model" / "model", "float32", torch.device("cpu"))


def test_the_stage_s_perplexities_and_b_min_are_recomputed_from_its_per_row_log(results, test_cfg):
    q = test_cfg["qat"]
    metrics = run_stage("qat", TEST_PARAMS, results)
    evals = pd.read_csv(results / "qat" / qat.EVALS_CSV)
    ppl = {v: math.exp(g.nll_sum.sum() / g.tokens.sum()) for v, g in evals.groupby("variant")}
    assert set(ppl) == {"base", "full precision"} | {f"{m}-int{b}" for b in q["bits"] for m in ("ptq", "qat")}
    assert all(len(g) == q["eval_rows"] for _, g in evals.groupby("variant")), "every model on the same rows"
    assert ppl["base"] == pytest.approx(metrics["base_perplexity"], rel=1e-9)
    reference = ppl["full precision"]
    assert reference == pytest.approx(metrics["reference_perplexity"], rel=1e-9)
    assert reference < ppl["base"], "the fine-tune the tolerance is relative to lowered the validation loss"
    for v in metrics["variants"]:
        assert v["perplexity"] == pytest.approx(ppl[v["variant"]], rel=1e-9)
    fp_rows = evals[evals.variant == "full precision"].sort_values("row")
    for v in metrics["variants"]:
        if v["method"] in ("ptq", "qat"):  # the paired change is recomputed from the per-row log
            rows = evals[evals.variant == v["variant"]].sort_values("row")
            again = quality.paired_change(fp_rows[["tokens", "nll_sum"]].values.tolist(),
                                          rows[["tokens", "nll_sum"]].values.tolist())
            assert v["perplexity_change"]["change_pct"] == pytest.approx(again["change_pct"], rel=1e-9)
    qat8 = next(v for v in metrics["variants"] if v["variant"] == "qat-int8")
    assert abs(qat8["perplexity_change"]["change_pct"]) < 1.0, "8-bit QAT ends within noise of full precision"
    assert qat8["mixed_precision"] == next(v for v in metrics["variants"] if v["variant"] == "full precision")[
        "mixed_precision"] == "no", "every model of the stage trains at the same precision"
    for method in ("ptq", "qat"):
        changes = {v["bits"]: v["perplexity_change"] for v in metrics["variants"] if v["method"] == method}
        tolerance = test_cfg["tolerance"]["perplexity_pct"]
        assert metrics["precision_range_test"][method] == json_round_trip(quality.range_test(changes, tolerance))
    losses = pd.read_csv(results / "qat" / qat.LOSSES_CSV)
    assert set(losses.variant) == {"full precision"} | {f"qat-int{b}" for b in q["bits"]}
    assert all(len(g) == q["train"]["steps"] for _, g in losses.groupby("variant"))
    ll = "efflab_validation_ll"
    for v in metrics["variants"]:  # every model scored by lm-eval in its cell; PTQ and QAT paired with the fine-tune
        assert v["tasks"][ll]["status"] == "ok" and v["tasks"][ll]["n_docs"] == test_cfg["evaluate"]["docs"]
        if v["method"] in ("ptq", "qat"):
            bpb = v["task_changes"][ll]["bits_per_byte"]
            fp = next(f for f in metrics["variants"] if f["variant"] == "full precision")
            assert bpb["change"] == pytest.approx(v["tasks"][ll]["metrics"]["bits_per_byte"]["value"]
                                                  - fp["tasks"][ll]["metrics"]["bits_per_byte"]["value"], abs=1e-9)
            assert v["task_gate"]["verdict"] in ("passes", "fails", "undecided")
    for v in metrics["variants"]:
        if v["method"] == "qat":  # the converted model computes what training's fake-quantized model computed
            assert v["fake_quantized_perplexity"] == pytest.approx(v["perplexity"], rel=1e-5)
            assert v["weight_bytes"]["held_bytes"] < v["weight_bytes"]["fp32_bytes"] / 3


@pytest.mark.integration  # make test's 10 minutes on a 2-core AVX2 CPU: run by make test-integration
def test_ptq_figures_are_recomputed_from_the_kept_fine_tuned_model(results, test_cfg):
    """finetuned/ loads in plain transformers; quantized again, it gives the PTQ rows of evals.csv."""
    q = test_cfg["qat"]
    run_stage("qat", TEST_PARAMS, results)
    folder = results / "qat" / qat.FINETUNED
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    tokenizer = load_tokenizer(folder)
    rows = read_split(results / "prepare_data" / "validation.parquet", q["eval_rows"])
    bits = min(q["bits"])
    qat.quantize(model, bits, q["group_size"])
    again = [r["nll_sum"] for r in qat.per_row_nll(model, rows, tokenizer)]
    evals = pd.read_csv(results / "qat" / qat.EVALS_CSV)
    logged = evals[evals.variant == f"ptq-int{bits}"].sort_values("row").nll_sum.tolist()
    assert again == pytest.approx(logged, rel=1e-5)


@pytest.mark.parametrize("bits", [3, 4])
def test_quantized_weights_are_b_bit_codes_and_qat_trains_against_that_same_quantizer(prepared, bits):
    base = _tiny(prepared)
    ptq, fake = copy.deepcopy(base), copy.deepcopy(base)
    qat.quantize(ptq, bits, 32)
    layers = qat.quantized_layers(ptq)
    assert layers and "lm_head" not in "".join(layers)
    for layer in layers.values():
        codes = layer.weight.qdata
        assert -2 ** (bits - 1) <= int(codes.min()) and int(codes.max()) <= 2 ** (bits - 1) - 1
        assert codes.reshape(-1, 32).unique(dim=None).numel() <= 2 ** bits
    qat.prepare_qat(fake, bits, 32)
    ids = torch.tensor([read_split(prepared / "prepare_data" / "train.parquet", 1)[0]["input_ids"]])
    with torch.no_grad():
        assert torch.allclose(fake(ids).logits, ptq(ids).logits, atol=1e-4), "fake quantization = the real one"
    fake(ids, labels=ids).loss.backward()
    grads = [m.weight.grad for m in qat.quantized_layers(fake).values()]
    assert all(g is not None and g.abs().sum() > 0 for g in grads), "gradients pass the rounding (straight through)"


def _change(lo: float, hi: float) -> dict:
    return {"change_pct": (lo + hi) / 2, "ci95_change_pct": [lo, hi], "n_rows": 16}


def test_the_precision_range_test_scans_from_the_lowest_width_up_deciding_by_intervals():
    wide_but_below = _change(2.0, 9.0)  # within a +10% tolerance as a whole
    changes = {2: _change(500, 900), 3: wide_but_below, 4: _change(12.0, 30.0), 8: _change(-1.0, 1.0)}
    test = quality.range_test(changes, tolerance_pct=10)
    assert test["b_min"] == 3 and test["passing"] == [3, 8] and test["fail_above_b_min"] == [4]
    assert test["verdicts"] == {2: "fails", 3: "passes", 4: "fails", 8: "passes"}
    assert quality.range_test({2: _change(400, 900), 4: _change(50, 90)}, 10)["b_min"] is None


def test_a_width_whose_interval_straddles_the_tolerance_leaves_b_min_undecided():
    """A point estimate under the tolerance is not a pass when its interval reaches over it."""
    test = quality.range_test({3: _change(100, 200), 4: _change(4.0, 16.0), 8: _change(-1.0, 1.0)},
                              tolerance_pct=10)
    assert test["b_min"] is None and test["undecided_at"] == 4
    assert test["verdicts"][4] == "undecided" and test["passing"] == [8]
    few_rows = {"change_pct": 1.0, "ci95_change_pct": None, "n_rows": 4}
    assert quality.range_test({8: few_rows}, 10)["verdicts"][8] == "undecided", "no interval from 4 rows: no verdict"


def test_a_group_size_that_does_not_divide_a_layer_is_one_line_naming_the_key(prepared):
    with pytest.raises(UserError, match=r"qat.group_size: 48 does not divide the 64 input features of model\.layers"):
        qat.check_group_size(qat.shape_only(prepared / "base_model" / "model"), 48)


def _rows_at(ppl: float, n: int = 8, tokens: int = 10, jitter: float = 0.0) -> list[dict]:
    """n rows of `tokens` tokens whose pooled perplexity is `ppl` (row i's loss shifted by ±jitter, summing to 0)."""
    import math

    shifts = [jitter * (1 if i % 2 else -1) for i in range(n)]
    return [{"row": i, "tokens": tokens, "nll_sum": tokens * (math.log(ppl) + s)} for i, s in enumerate(shifts)]


def test_the_share_of_ptqs_gap_that_qat_recovers_on_planted_perplexities():
    """torchao's figure: (ppl_ptq - ppl_qat) / (ppl_ptq - ppl_fp). Full precision 30, PTQ 40, QAT 34: 60% of the
    gap recovered; rows that move together give an interval around it; a PTQ with no gap has nothing to recover."""
    from efflab import quality

    fp, ptq, qat = _rows_at(30.0, jitter=0.2), _rows_at(40.0, jitter=0.2), _rows_at(34.0, jitter=0.3)
    got = quality.recovered_share(fp, ptq, qat)
    assert got["share"] == pytest.approx(0.6) and got["n_rows"] == 8
    assert got["ci95"][0] < 0.6 < got["ci95"][1]
    assert got["ptq_change_pct"] == pytest.approx(100 / 3) and got["qat_change_pct"] == pytest.approx(100 * 4 / 30)
    none = quality.recovered_share(fp, _rows_at(30.0, jitter=0.2), qat)
    assert none["share"] is None and "nothing to recover" in none["why"]
    few = quality.recovered_share(_rows_at(30.0, n=3), _rows_at(40.0, n=3), _rows_at(34.0, n=3))
    assert few["ci95"] is None
    with pytest.raises(ValueError, match="not over the same rows"):
        quality.recovered_share(fp, ptq, qat[:-1])


def test_the_qat_glance_says_the_recovered_share_from_the_decision():
    from efflab.stages.report import glance

    d = {"answer": {"ptq": 8, "qat": 4}, "undecided_at": {}, "options": [],
         "recovered": {4: {"share": 0.384, "ci95": [0.2, 0.55], "n_rows": 12},
                       8: {"share": None, "n_rows": 12, "why": "PTQ's perplexity change is no difference measured"}}}
    line = glance.qat(d)
    assert ("At 4 bits QAT recovers 38% [20, 55] of PTQ's perplexity gap; at 8 bits PTQ left no gap decided for QAT "
            "to recover.") in line
