"""The analytic estimator against published parameter counts and hand calculations written out here.

Each hand calculation below is done from the architecture's numbers alone (no efflab code), so a slip in
the estimator's formulas or in a shipped config shows up as a mismatch.
"""
from __future__ import annotations

import math

import pytest

from efflab.config import UserError
from efflab.estimators import analytic as estimate

GiB = 2**30


@pytest.mark.parametrize("name", [n for n in estimate.model_names()
                                  if estimate.load_config(n)["_efflab"]["published_parameters"]])
def test_meta_parameter_counts_equal_published_totals(name):
    assert estimate.parameter_count(name) == estimate.load_config(name)["_efflab"]["published_parameters"]


def test_headline_counts():
    assert estimate.parameter_count("gpt2") == 124_439_808  # tied lm_head counted once
    assert estimate.parameter_count("llama-3.2-1b") == 1_235_814_400
    assert estimate.parameter_count("smollm2-135m") == 134_515_008
    assert estimate.parameter_count("mistral-7b") == 7_241_732_096


def test_t0_3b_by_hand_matches_deepspeed_printout():
    # T5Model (no lm_head): shared embedding, 24 encoder + 24 decoder blocks, gated-GELU FF, d_model 2048,
    # 32 heads x 64, d_ff 5120; relative position bias in the first block of each stack; final norms.
    d, ff, vocab = 2048, 5120, 32128
    attention, gated_ff, norm = 4 * d * d, 3 * d * ff, d
    encoder = 24 * (attention + gated_ff + 2 * norm) + 32 * 32 + norm
    decoder = 24 * (2 * attention + gated_ff + 3 * norm) + 32 * 32 + norm
    total = vocab * d + encoder + decoder
    assert total == 2_783_959_040
    assert estimate.parameter_count("t0-3b") == total
    assert total // 10**6 == 2783  # "Model with 2783M total params" (DeepSpeed truncates to whole millions)
    assert estimate.largest_layer_parameters("t0-3b") == vocab * d == 65_798_144  # "65M largest layer params"


def test_lora_trainable_llama_3_2_1b_q_v_rank_8_by_hand():
    # 16 layers; q_proj 2048 -> 2048; v_proj 2048 -> 8 KV heads x 64 = 512; r (d_in + d_out) each
    r = 8
    by_hand = 16 * (r * (2048 + 2048) + r * (2048 + 512))
    assert by_hand == 851_968
    assert estimate.lora_parameters("llama-3.2-1b", r, ["q_proj", "v_proj"]) == by_hand


def test_lora_gpt2_conv1d_layers_and_all_linear_excludes_head():
    # GPT-2's fused c_attn is a Conv1D 768 -> 2304: peft's well-known 294,912 trainable for r=8
    assert estimate.lora_parameters("gpt2", 8, ["c_attn"]) == 12 * 8 * (768 + 2304) == 294_912
    per_layer = 8 * ((768 + 2304) + (768 + 768) + (768 + 3072) + (3072 + 768))
    assert estimate.lora_parameters("gpt2", 8, "all-linear") == 12 * per_layer
    assert estimate.lora_matrix_parameters(768, 768, 8) == 768 * 8 + 8 * 768 == 12_288


def test_activation_memory_llama_2_13b_by_hand():
    # seed 002: "Llama-2-13B with N_b=2, s=512, b=4: 21 GB"; per layer 34 sbh + 5 a s^2 b at N_b = 2
    s, b, h, a, layers = 512, 4, 5120, 40, 40
    by_hand = layers * (34 * s * b * h + 5 * a * s * s * b)
    assert by_hand == 22_649_241_600
    assert estimate.activation_bytes("llama-2-13b", s, b, 2) == by_hand
    assert by_hand / GiB == pytest.approx(21.09, abs=0.01)  # the seed's 21 "GB" are GiB
    # checkpointing keeps each layer's input: 40 x 2 B x s b h = 800 MiB (the seed's "800 MB")
    assert estimate.activation_bytes("llama-2-13b", s, b, 2, checkpointing=True) == 800 * 2**20
    # FlashAttention drops the s^2 terms, keeping the fp32 log-sum-exp
    assert estimate.activation_bytes("llama-2-13b", s, b, 2, flash=True) == layers * (34 * s * b * h + 4 * a * s * b)


def test_kv_cache_llama_13b_by_hand():
    # 2 (K, V) x 40 layers x 5120 (40 heads x 128) x 2048 tokens x 2 B: the vLLM paper's "1.7GB"
    assert estimate.kv_cache_bytes("llama-13b", 2048, 1, 2) == 2 * 40 * 5120 * 2048 * 2 == 1_677_721_600
    # grouped-query attention caches only the KV heads: Llama-3.1-8B has 8 of 32
    assert estimate.kv_cache_bytes("llama-3.1-8b", 1000, 1, 2) == 2 * 32 * 8 * 128 * 1000 * 2


def test_zero_table_by_hand():
    psi, k, nd = 7.5e9, 12, 64
    assert estimate.zero_model_state_bytes(psi, 0, nd) == (2 + 2 + k) * psi == 120e9
    assert estimate.zero_model_state_bytes(psi, 1, nd) == 2 * psi + 2 * psi + k * psi / nd == 31.40625e9
    assert estimate.zero_model_state_bytes(psi, 2, nd) == 2 * psi + (2 + k) * psi / nd == pytest.approx(16.640625e9)
    assert estimate.zero_model_state_bytes(psi, 3, nd) == (2 + 2 + k) * psi / nd == 1.875e9
    with pytest.raises(UserError, match="ZeRO stage"):
        estimate.zero_model_state_bytes(psi, 4, nd)


def test_deepspeed_zero3_t0_by_hand():
    total, largest = 2_783_959_040, 65_798_144
    all_offload = estimate.deepspeed_zero3_estimate(total, largest, 4, 1, True, True, True)
    assert all_offload["cpu"] == total * 18 * 1.5 and round(all_offload["cpu"] / GiB, 2) == 70.00
    assert all_offload["gpu"] == 4 * largest and round(all_offload["gpu"] / GiB, 2) == 0.25
    none = estimate.deepspeed_zero3_estimate(total, largest, 4, 1, False, False, True)
    assert none["gpu"] == 4 * largest + int(18 * total / 4) and round(none["gpu"] / GiB, 2) == 11.91
    assert round(none["cpu"] / GiB, 2) == 1.47
    optim = estimate.deepspeed_zero3_estimate(total, largest, 4, 1, False, True, False)
    assert round(optim["cpu"] / GiB, 2) == 62.23 and round(optim["gpu"] / GiB, 2) == 1.54


def test_bnb_int8_mistral_by_hand():
    # 32 layers of q 4096x4096, k and v 4096x1024, o 4096x4096, gate/up 4096x14336, down 14336x4096
    rows_per_layer = 4096 + 1024 + 1024 + 4096 + 14336 + 14336 + 4096
    linear = 32 * (4096 * (4096 + 1024 + 1024 + 4096) + 3 * 4096 * 14336)
    kept = 2 * 32000 * 4096 + (2 * 32 + 1) * 4096  # embed_tokens, lm_head, 65 RMSNorms, in fp16
    fp = estimate.bnb_footprint("mistral-7b", "int8")
    assert fp["quantized_params"] == linear == 6_979_321_856
    assert fp["kept_params"] == kept
    assert fp["total"] == linear + 4 * 32 * rows_per_layer + 2 * kept
    assert fp["total"] / 2**20 == pytest.approx(7161.76, abs=0.01)  # seed 001 measured 7363.71 "MB"


def test_bnb_nf4_double_quant_constants_by_hand():
    fp = estimate.bnb_footprint("llama-2-13b", "nf4", double_quant=True)
    shapes = [(5120, 5120)] * 4 + [(5120, 13824)] * 3
    constants = 40 * sum(math.ceil(i * o / 64) + 4 * math.ceil(math.ceil(i * o / 64) / 256) + 4 for i, o in shapes)
    assert fp["constant_bytes"] == constants
    assert fp["weight_bytes"] == fp["quantized_params"] // 2
    # QLoRA paper: double quantization costs 8/64 + 32/(64*256) = 0.127 bits per parameter
    assert 8 * constants / fp["quantized_params"] == pytest.approx(0.127, abs=0.001)
    single = estimate.bnb_footprint("llama-2-13b", "nf4")["constant_bytes"]
    assert 8 * single / fp["quantized_params"] == pytest.approx(0.5)
    # a tied lm_head is the embedding: kept once, never quantized
    tied = estimate.bnb_footprint("llama-3.2-1b", "int8")
    assert tied["kept_params"] == 128256 * 2048 + (2 * 16 + 1) * 2048


def test_phi3_16_layers_fp16_weights_by_hand():
    # seed 001: "Allocated memory in bytes: 4018347520" for Phi-3-mini cut to 16 layers, fp16
    layer = 3072 * 9216 + 3072 * 3072 + 3072 * 16384 + 8192 * 3072 + 2 * 3072
    params = 2 * 32064 * 3072 + 16 * layer + 3072
    assert estimate.parameter_count("phi-3-mini", num_hidden_layers=16) == params
    assert 2 * params == 4_018_083_840
    assert abs(2 * params / 4_018_347_520 - 1) < 1e-4


def test_flops_float_formats_and_training_memory():
    assert estimate.flops_per_token(10, checkpointing=True) / estimate.flops_per_token(10) == pytest.approx(4 / 3)
    assert estimate.flops_per_token(10, training=False) == 20
    assert estimate.float_format("float32") == {"bits": 32, "sign": 1, "exponent": 8, "mantissa": 23}
    assert estimate.float_format("bfloat16")["mantissa"] == 7
    m = estimate.training_memory("gpt2-xl", "full-mixed", 1024, 1)
    assert m["weights"] + m["gradients"] + m["optimizer"] == 16 * 1_557_611_200


def test_unknown_model_and_dtype_are_user_errors():
    with pytest.raises(UserError, match="no workflow/models/nope.json"):
        estimate.parameter_count("nope")
    with pytest.raises(UserError, match="dtype 'int3'"):
        estimate.bytes_per_element("int3")
    with pytest.raises(UserError, match="match no linear layer"):
        estimate.lora_parameters("gpt2", 8, ["q_proj"])


def _bnb_constants(model) -> int:
    """Bytes of the quantization constants a loaded bitsandbytes model holds: INT8 row scales (SCB),
    4-bit absmax, and with double quantization the second-level absmax and offset."""
    total = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if getattr(weight, "SCB", None) is not None:
            total += weight.SCB.numel() * weight.SCB.element_size()
        state = getattr(weight, "quant_state", None)
        if state is not None:
            total += state.absmax.numel() * state.absmax.element_size()
            if state.state2 is not None:
                total += state.state2.absmax.numel() * state.state2.absmax.element_size()
                total += state.offset.numel() * state.offset.element_size()
    return total


@pytest.mark.parametrize("method,double_quant", [("int8", False), ("nf4", True), ("nf4", False)])
def test_bnb_footprint_matches_bitsandbytes_on_a_tiny_model(tmp_path, method, double_quant):
    """The estimator against real bitsandbytes (CPU backend) loading a tiny Llama through transformers."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, BitsAndBytesConfig

    fields = {k: v for k, v in estimate.load_config("smollm2-135m").items() if not k.startswith("_")}
    fields.update(num_hidden_layers=2, hidden_size=128, intermediate_size=320, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=1000)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.for_model(**fields), dtype=torch.float16).save_pretrained(tmp_path)
    quant = (BitsAndBytesConfig(load_in_8bit=True) if method == "int8" else
             BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=method, bnb_4bit_use_double_quant=double_quant,
                                bnb_4bit_compute_dtype=torch.float16))
    model = AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=quant, dtype=torch.float16,
                                                 device_map={"": "cpu"})
    est = estimate.bnb_footprint(str(tmp_path), method, double_quant=double_quant)
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())  # rotary inv_freq
    assert model.get_memory_footprint() - buffers == est["weight_bytes"] + est["kept_bytes"]
    assert _bnb_constants(model) == est["constant_bytes"]


@pytest.mark.parametrize("targets", [["q_proj", "v_proj"], ["q_proj", "k_proj", "v_proj", "o_proj"], "all-linear"])
def test_lora_count_matches_peft(tmp_path, targets):
    """The meta-model LoRA count against peft's own trainable count on a real tiny model."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = {k: v for k, v in estimate.load_config("smollm2-135m").items() if not k.startswith("_")}
    fields.update(num_hidden_layers=2, hidden_size=96, intermediate_size=256, num_attention_heads=6,
                  num_key_value_heads=2, vocab_size=500)
    config = AutoConfig.for_model(**fields)
    config.save_pretrained(tmp_path)
    torch.manual_seed(0)
    model = get_peft_model(AutoModelForCausalLM.from_config(config), LoraConfig(r=4, target_modules=targets))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert estimate.lora_parameters(str(tmp_path), 4, targets) == trainable
