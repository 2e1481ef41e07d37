import shutil

import pytest
import torch
from peft import PeftModel

from efflab import config, quality
from efflab.experiment import finetune_run
from efflab.layout import Layout
from efflab.models.modeling import forward_batches, load_model, load_tokenizer, read_split
from tests.helpers import TEST_DTYPE, TEST_PARAMS, rounding_tolerance, run_stage


def merge_rounding(m: dict, roundings: int, kernel=None) -> float:
    """What the merged model's difference from the adapter's logits may be: the float32 floor of two summation
    orders, or in the base's dtype (make test-bf16) a rounding of each merged layer's output (`roundings`) at the
    scale of the reference's logits; `kernel`: the dtype a 4-bit kernel computes in, where it is another."""
    dtype = kernel or getattr(torch, TEST_DTYPE)
    return rounding_tolerance(dtype, m["merged"]["reference_max_abs_logit"], roundings, floor=1e-4)


def test_merged_logits_equal_adapter_logits(results):
    run_stage("finetune", TEST_PARAMS, results, "lora-r8")
    m = run_stage("merge", TEST_PARAMS, results, "lora-r8")
    layers = 2 * len(finetune_run(config.load(TEST_PARAMS), "lora-r8").lora["target_modules"])  # 2 layers
    tolerance = merge_rounding(m, 2 * layers)  # each merged weight rounded, and the adapter's own path
    assert m["merged"]["max_abs_logit_diff"] < tolerance
    loss = m["adapter_validation"]["loss"]
    assert abs(m["merged"]["validation"]["loss"] - loss) < max(1e-5, tolerance)
    paired = m["merged"]["perplexity_change"]  # row by row against the adapter, on the same rows
    assert paired["n_rows"] == len(m["adapter_validation"]["per_row"])
    assert abs(paired["change_pct"]) < max(1e-3, 100 * tolerance)
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
        assert torch.allclose(a, b, atol=tolerance)
        assert not torch.allclose(a, base, atol=tolerance), "the adapter changed the model beyond rounding"


@pytest.fixture(scope="module")
def qlora_merge(prepared, tmp_path_factory) -> dict:
    """The merge stage's metrics for the CI params' QLoRA run, fine-tuned and merged once for this module."""
    results = tmp_path_factory.mktemp("qlora") / "results"
    shutil.copytree(prepared, results)
    run_stage("finetune", TEST_PARAMS, results, "qlora-r8")
    return run_stage("merge", TEST_PARAMS, results, "qlora-r8")


def test_qlora_merge_into_the_dequantized_base_keeps_the_fine_tune(qlora_merge):
    m = qlora_merge
    from efflab.models.quantization import four_bit_kernel_dtype

    assert m["merge_target"] == "dequantized nf4 base"
    kernel = four_bit_kernel_dtype(getattr(torch, TEST_DTYPE), torch.device("cpu"))
    tolerance = max(1e-3, merge_rounding(m, 2, kernel))  # the 4-bit reference's own output rounding, and the merge's
    assert m["merged"]["max_abs_logit_diff"] < tolerance
    assert abs(m["merged"]["validation"]["loss"] - m["adapter_validation"]["loss"]) < tolerance


def test_only_the_round_trip_merge_keeps_what_the_qlora_adapter_learned(qlora_merge):
    m = qlora_merge
    t = m["targets"]
    original, roundtrip = t["original base"], t["nf4 round-trip base"]
    requantized = t["round-trip merge re-quantized to nf4"]
    assert roundtrip["kl_mean"] < original["kl_mean"] and roundtrip["max_abs_logit_diff"] < original["max_abs_logit_diff"]
    assert roundtrip["kl_mean"] < requantized["kl_mean"], "re-quantizing the merged weights adds new rounding error"
    assert m["closest_target"] == "nf4 round-trip base"
    assert all(r["kl_mean"] > -1e-6 for r in t.values()), "KL is non-negative up to float rounding"


def test_a_family_bitsandbytes_cannot_quantize_is_unavailable_never_recorded_as_quantized(prepared, tmp_path):
    """Falcon's FalconLinear layers are not nn.Linear by type: transformers' bitsandbytes integration leaves them in
    full precision (and its dequantize() then failed on a model with no 4-bit layer). Loading it as nf4 is
    `unavailable` with that reason, so no quantize, QLoRA or merge job records a full-precision model as 4-bit."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from tests.families import family_folder

    folder = family_folder("falcon", tmp_path / "base", prepared / "base_model" / "model")
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder)).save_pretrained(folder)
    with pytest.raises(NotImplementedError, match=r"nf4: transformers' bitsandbytes integration quantized no layer "
                                                  r"of FalconForCausalLM: its linear layers are FalconLinear"):
        load_model(folder, "float32", torch.device("cpu"), quant={"method": "nf4", "double_quant": True})


@pytest.mark.parametrize("family", ["opt", "gpt2"])
def test_the_qlora_round_trip_merge_keeps_the_adapter_s_logits_on_any_family(prepared, tmp_path, family):
    """Without transformers' dequantize(): OPT's nn.Linear layers are 4-bit; GPT-2's Conv1D layers are stored
    transposed. Each merge into the round-trip base gives the adapter's logits within what the 4-bit kernel's
    rounding explains, and the merge into the original base does not."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    from efflab.lora import lora_targets
    from efflab.models.quantization import four_bit_kernel_dtype
    from efflab.stages.merge import merged_into, round_trip_base
    from tests.families import family_folder

    cpu, nf4 = torch.device("cpu"), {"method": "nf4", "double_quant": True}
    folder = family_folder(family, tmp_path / "base", prepared / "base_model" / "model")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder)).save_pretrained(folder)
    four_bit = load_model(folder, "float32", cpu, quant=nf4)
    lora = LoraConfig(task_type="CAUSAL_LM", r=4, lora_alpha=8, init_lora_weights=False,
                      target_modules=lora_targets(four_bit.config, None))
    get_peft_model(four_bit, lora).save_pretrained(tmp_path / "adapter")
    reference = PeftModel.from_pretrained(load_model(folder, "float32", cpu, quant=nf4), tmp_path / "adapter").eval()
    base, replayed = round_trip_base(folder, "float32", cpu, nf4)
    merged = merged_into(base, tmp_path / "adapter", "float32")
    original = merged_into(load_model(folder, "float32", cpu), tmp_path / "adapter", "float32")
    # 2 layers x OPT's q/k/v/out_proj/fc1/fc2, x GPT-2's c_attn/c_proj/c_fc/c_proj
    assert replayed == {"opt": 12, "gpt2": 8}[family]
    ids = torch.tensor([[1, 5, 9, 200, 3000, 7]])
    with torch.no_grad():
        ref = reference(ids).logits
        # every 4-bit layer's output is rounded to the dtype its kernel computes in (bf16 on an AVX512-BF16 CPU)
        kernel = four_bit_kernel_dtype(torch.float32, cpu)
        tolerance = rounding_tolerance(kernel, ref.abs().max().item(), replayed)
        assert (merged(ids).logits - ref).abs().max() < tolerance, kernel
        assert ((original(ids).logits - ref).abs().max() > tolerance) == bool(replayed)
