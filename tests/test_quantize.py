import pytest
import torch

from efflab import quality
from efflab.layout import Layout
from efflab.modeling import load_model
from tests.helpers import run_stage


def test_int8_and_4bit_are_bnb_layers_and_shrink_the_footprint(results, write_params):
    # fp4 is not in the CI pipeline's grid (one 4-bit scheme there is enough): it runs here, in-process.
    params = write_params(lambda cfg: cfg["quantize"]["schemes"].update(nf4={"method": "nf4", "double_quant": True},
                                                                       fp4={"method": "fp4", "double_quant": True}))
    baseline = run_stage("quantize", params, results, "baseline")
    int8 = run_stage("quantize", params, results, "int8")
    nf4 = run_stage("quantize", params, results, "nf4")
    fp4 = run_stage("quantize", params, results, "fp4")
    assert baseline["bnb_layer_types"] == [] and baseline["perplexity_change_pct"] == 0
    assert int8["bnb_layer_types"] == ["Linear8bitLt"] and nf4["bnb_layer_types"] == ["Linear4bit"]
    assert nf4["memory_footprint_bytes"] < int8["memory_footprint_bytes"] < baseline["memory_footprint_bytes"]
    assert int8["parameters"] == nf4["parameters"] == baseline["parameters"], "4-bit parameters are counted unpacked"
    assert nf4["base_validation"] == baseline["validation"]
    for scheme in (int8, nf4, fp4):  # the change is paired row by row with the baseline's rows
        paired = scheme["perplexity_change"]
        assert paired == quality.paired_change(baseline["validation"]["per_row"], scheme["validation"]["per_row"])
        assert paired["change_pct"] == pytest.approx(scheme["perplexity_change_pct"], rel=1e-6)
    assert fp4["bnb_layer_types"] == ["Linear4bit"] and fp4["memory_footprint_bytes"] == nf4["memory_footprint_bytes"]
    assert fp4["validation"]["loss"] != nf4["validation"]["loss"], "another 4-bit code book, other rounding"
    reloaded = load_model(Layout(results).model("quantize", "nf4"), "float32", torch.device("cpu"))
    assert any(type(m).__name__ == "Linear4bit" for m in reloaded.modules()), "the saved folder reloads as 4-bit"
