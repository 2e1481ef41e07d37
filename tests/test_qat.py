import copy
import math

import pandas as pd
import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.helpers import TEST_PARAMS, run_stage
from efflab import qat
from efflab.config import UserError
from efflab.modeling import load_model, load_tokenizer, read_split


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
    assert reference < ppl["base"], "the fine-tune the threshold is relative to lowered the validation loss"
    for v in metrics["variants"]:
        assert v["perplexity"] == pytest.approx(ppl[v["variant"]], rel=1e-9)
    for method in ("ptq", "qat"):
        passing = [b for b in sorted(q["bits"]) if ppl[f"{method}-int{b}"] <= q["threshold"] * reference]
        assert metrics["precision_range_test"][method]["b_min"] == (passing[0] if passing else None)
    losses = pd.read_csv(results / "qat" / qat.LOSSES_CSV)
    assert set(losses.variant) == {"full precision"} | {f"qat-int{b}" for b in q["bits"]}
    assert all(len(g) == q["train"]["steps"] for _, g in losses.groupby("variant"))
    for v in metrics["variants"]:
        if v["method"] == "qat":  # the converted model computes what training's fake-quantized model computed
            assert v["fake_quantized_perplexity"] == pytest.approx(v["perplexity"], rel=1e-5)
            assert v["weight_bytes"]["held_bytes"] < v["weight_bytes"]["fp32_bytes"] / 3


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


def test_the_precision_range_test_scans_from_the_lowest_width_up():
    ppl = {2: 900.0, 3: 10.5, 4: 12.0, 8: 10.1}
    test = qat.range_test(ppl, reference=10.0, threshold=1.1)
    assert test == {"b_min": 3, "passing": [3, 8], "fail_above_b_min": [4]}
    assert qat.range_test({2: 50.0, 4: 20.0}, 10.0, 1.1)["b_min"] is None


def test_a_group_size_that_does_not_divide_a_layer_is_one_line_naming_the_key(prepared):
    with pytest.raises(UserError, match=r"qat.group_size: 48 does not divide the 64 input features of model\.layers"):
        qat.check_group_size(qat.shape_only(prepared / "base_model" / "model"), 48)
