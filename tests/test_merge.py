import shutil

import pytest
import torch
from peft import PeftModel

from efflab import quality
from efflab.layout import Layout
from efflab.modeling import forward_batches, load_model, load_tokenizer, read_split
from tests.helpers import TEST_PARAMS, run_stage


def test_merged_logits_equal_adapter_logits(results):
    run_stage("finetune", TEST_PARAMS, results, "lora-r8")
    m = run_stage("merge", TEST_PARAMS, results, "lora-r8")
    assert m["merged"]["max_abs_logit_diff"] < 1e-4
    assert abs(m["merged"]["validation"]["loss"] - m["adapter_validation"]["loss"]) < 1e-5
    paired = m["merged"]["perplexity_change"]  # row by row against the adapter, on the same rows
    assert paired["n_rows"] == len(m["adapter_validation"]["per_row"]) and abs(paired["change_pct"]) < 1e-3
    assert quality.paired_change(m["adapter_validation"]["per_row"], m["merged"]["validation"]["per_row"]) == paired

    # Independently of the stage: reload the saved merged folder and the adapter, compare logits.
    layout, cpu = Layout(results), torch.device("cpu")
    tok = load_tokenizer(layout.base_model())
    rows = read_split(layout.split("validation"), 4)
    merged = load_model(layout.model("merge", "lora-r8"), "float32", cpu)
    adapter = PeftModel.from_pretrained(load_model(layout.base_model(), "float32", cpu),
                                        layout.model("finetune", "lora-r8")).eval()
    base_logits = [logits for _, logits in forward_batches(load_model(layout.base_model(), "float32", cpu), rows, 4, tok)]
    for (_, a), (_, b), base in zip(forward_batches(adapter, rows, 4, tok), forward_batches(merged, rows, 4, tok),
                                    base_logits):
        assert torch.allclose(a, b, atol=1e-4)
        assert not torch.allclose(a, base, atol=1e-4), "the adapter changed the model"


@pytest.fixture(scope="module")
def qlora_merge(prepared, tmp_path_factory) -> dict:
    """The merge stage's metrics for the CI params' QLoRA run, fine-tuned and merged once for this module."""
    results = tmp_path_factory.mktemp("qlora") / "results"
    shutil.copytree(prepared, results)
    run_stage("finetune", TEST_PARAMS, results, "qlora-r8")
    return run_stage("merge", TEST_PARAMS, results, "qlora-r8")


def test_qlora_merge_into_the_dequantized_base_keeps_the_fine_tune(qlora_merge):
    m = qlora_merge
    assert m["merge_target"] == "dequantized nf4 base"
    assert m["merged"]["max_abs_logit_diff"] < 1e-3
    assert abs(m["merged"]["validation"]["loss"] - m["adapter_validation"]["loss"]) < 1e-3


def test_only_the_round_trip_merge_keeps_what_the_qlora_adapter_learned(qlora_merge):
    m = qlora_merge
    t = m["targets"]
    original, roundtrip = t["original base"], t["nf4 round-trip base"]
    requantized = t["round-trip merge re-quantized to nf4"]
    assert roundtrip["kl_mean"] < original["kl_mean"] and roundtrip["max_abs_logit_diff"] < original["max_abs_logit_diff"]
    assert roundtrip["kl_mean"] < requantized["kl_mean"], "re-quantizing the merged weights adds new rounding error"
    assert m["closest_target"] == "nf4 round-trip base"
    assert all(r["kl_mean"] > -1e-6 for r in t.values()), "KL is non-negative up to float rounding"
