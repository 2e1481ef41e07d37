import pytest
import torch

from efflab import quality
from efflab.layout import Layout
from efflab.models.modeling import load_model
from tests.helpers import TEST_DTYPE, rounding_tolerance, run_stage


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


def test_torchao_schemes_are_quantized_weights_whose_bytes_are_computed_exactly_and_reload_in_transformers(
        results, write_params):
    """torchao's int8 weight-only and dynamic-activation schemes: every quantized linear layer holds an Int8Tensor
    after the reload, and the footprint is the bytes computed from the base model's shapes (int8 weights, a scale
    and a zero point per output row, the rest in the compute dtype), to the byte, in fp32 and in bf16 (make
    test-bf16: the scale stays fp32)."""
    from transformers import AutoModelForCausalLM

    from efflab.estimators import analytic

    schemes = {"ao8": {"method": "torchao-int8"}, "ao8dyn": {"method": "torchao-int8-dynamic"}}
    params = write_params(lambda cfg: cfg["quantize"]["schemes"].update(schemes))
    baseline = run_stage("quantize", params, results, "baseline")
    layers = [lay for lay in analytic.linear_layers(str(Layout(results).base_model())) if not lay["head"]]
    for name, scheme in schemes.items():
        m = run_stage("quantize", params, results, name)
        assert m["library"] == "torchao" and m["weight_bits"] == 8
        assert m["quantized_parts"] == {"Int8Tensor": len(layers)}, m["quantized_parts"]
        expected = analytic.quant_footprint(str(Layout(results).base_model()), scheme, m["compute_dtype"])
        assert m["memory_footprint_bytes"] == expected["total"] < baseline["memory_footprint_bytes"]
        shrunk = baseline["memory_footprint_bytes"] - m["memory_footprint_bytes"]
        element = torch.finfo(getattr(torch, m["compute_dtype"])).bits // 8
        assert shrunk == expected["quantized_params"] * (element - 1) - expected["constant_bytes"]  # -> int8 layers
        plain = AutoModelForCausalLM.from_pretrained(Layout(results).model("quantize", name))
        assert type(plain.get_submodule(layers[0]["name"]).weight).__name__ == "Int8Tensor"


def test_bnb_footprints_count_the_quantization_constants_to_the_byte(results, write_params):
    from efflab.estimators import analytic

    params = write_params(lambda cfg: cfg["quantize"]["schemes"].update(nf4={"method": "nf4", "double_quant": True}))
    run_stage("quantize", params, results, "baseline")
    layers = len([lay for lay in analytic.linear_layers(str(Layout(results).base_model())) if not lay["head"]])
    for name in ("int8", "nf4"):
        m = run_stage("quantize", params, results, name)
        scheme = {"method": m["method"], "double_quant": m["double_quant"]}
        computed = analytic.quant_footprint(str(Layout(results).base_model()), scheme, m["compute_dtype"])["total"]
        # (double quantization's fp32 offset, 4 bytes a layer, travels in bitsandbytes' packed metadata entry,
        # which the footprint leaves out with the rest of that serialization-only entry)
        assert m["memory_footprint_bytes"] == computed - (4 * layers if scheme["double_quant"] else 0), name


def test_an_adapter_trains_and_merges_back_on_int8_bases_and_the_check_says_why_where_it_cannot(results, write_params):
    """The adapter check is tried, not assumed: one step moves the adapter, and the merged model's logits are
    nearer the adapter's than the model's own were; a scheme where peft cannot train says why."""
    schemes = {"ao8": {"method": "torchao-int8"}, "ao8dyn": {"method": "torchao-int8-dynamic"}}
    params = write_params(lambda cfg: cfg["quantize"]["schemes"].update(schemes))
    run_stage("quantize", params, results, "baseline")
    for name in ("int8", "ao8", "baseline"):
        adapter = run_stage("quantize", params, results, name)["adapter"]
        assert adapter["trains"] and adapter["merges"], (name, adapter)
        assert 0 <= adapter["merge_error_max_abs_logit"] < adapter["adapter_effect_max_abs_logit"], (name, adapter)
        if name == "baseline":  # merged into the base's weights: their rounding only (LoRA dropout left on: ~10%)
            layers = len(adapter["lora"]["target_modules"]) * 2  # the CI model's 2 layers
            rounding = rounding_tolerance(getattr(torch, TEST_DTYPE), adapter["max_abs_logit"], layers, floor=0)
            assert adapter["merge_error_max_abs_logit"] < max(1e-3 * adapter["adapter_effect_max_abs_logit"],
                                                              rounding), adapter
    dynamic = run_stage("quantize", params, results, "ao8dyn")["adapter"]
    assert dynamic["trains"] or len(dynamic["reason"]) > 20, dynamic


@pytest.mark.parametrize("scheme, reason", [
    ({"method": "torchao-int4", "group_size": 32}, "CUDA"),
    ({"method": "hqq", "bits": 2}, "hqq"),
    ({"method": "gptq", "bits": 4, "calibration_rows": 8}, "gptqmodel package, which is not installed"),
])
def test_a_scheme_this_machine_cannot_run_is_unavailable_with_the_reason_and_the_others_run(
        scheme, reason, results, write_params):
    params = write_params(lambda cfg: cfg["quantize"]["schemes"].update(other=scheme))
    run_stage("quantize", params, results, "baseline")
    m = run_stage("quantize", params, results, "other")
    assert m["status"] == "unavailable" and reason.lower() in m["reason"].lower(), m
    assert (Layout(results).model("quantize", "other") / "NOT_RUN.txt").read_text().startswith("unavailable: ")
    assert run_stage("quantize", params, results, "int8")["status"] == "ok"


def test_a_torchao_scheme_flows_through_inference_and_evaluation_as_its_quantized_weights(results, write_params):
    """bench_inference generates with the torchao folder (its footprint is quantize's), and evaluate scores it as
    Int8Tensor weights, paired with the base."""
    def edit(cfg):
        cfg["quantize"]["schemes"] = {"baseline": {"method": "none"}, "ao8": {"method": "torchao-int8"}}
        cfg["bench_inference"]["variants"] = {"ao8": {"kind": "quantized", "of": "ao8"}}
        cfg["capacity"]["variants"] = []
        cfg["evaluate"]["models"] = ["quantized-ao8"]
    params = write_params(edit)
    run_stage("quantize", params, results, "baseline")
    quantized = run_stage("quantize", params, results, "ao8")
    bench = run_stage("bench_inference", params, results, "ao8")
    assert bench["cells"] and all(c["status"] == "ok" for c in bench["cells"]), bench["cells"]
    assert {c["memory_footprint_bytes"] for c in bench["cells"]} == {quantized["memory_footprint_bytes"]}
    run_stage("evaluate", params, results, "base")
    scored = run_stage("evaluate", params, results, "quantized-ao8")
    assert scored["quantized_modules"] == quantized["quantized_parts"] and scored["reference"] == "base"


def test_the_scheme_table_is_the_schema_s_methods_and_each_row_s_builder_and_footprint_exist():
    """A new scheme is a row of schemes.SCHEMES and its name in the schema's enum: nothing else names methods."""
    from efflab import schemes
    from efflab.estimators import analytic
    from efflab.models import quantization
    from efflab.schema import load_schema

    method = load_schema()["$defs"]["quant"]["properties"]["method"]["enum"]
    assert set(method) == set(schemes.SCHEMES) | {schemes.FULL_PRECISION}
    for row in schemes.SCHEMES.values():
        assert callable(getattr(quantization, row.builder)), row
        assert row.footprint is None or callable(getattr(analytic, row.footprint)), row
        assert row.settings <= set(load_schema()["$defs"]["quant"]["properties"]), row
    assert schemes.weight_bits({"method": "hqq"}) == schemes.DEFAULT_BITS
    assert schemes.weight_bits({"method": "gptq", "bits": 3}) == 3 and schemes.weight_bits({"method": "none"}) is None
