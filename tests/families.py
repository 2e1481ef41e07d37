"""Tiny random-init models of several transformers families, with the embedded tokenizer beside each: the
supported-architecture matrix (tests/test_families.py). Built from each family's own config class, so
module names, fused projections, norms and attention variants are the family's own; the weights mean
nothing."""
from __future__ import annotations

from pathlib import Path

# model_type -> config fields at test size (what each family calls its sizes differs: the point of the matrix)
FAMILIES = {
    "llama": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16),
    "qwen2": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2),  # q/k/v projections with biases
    "gemma2": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16, sliding_window=32),
    "phi3": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2),  # fused qkv_proj and gate_up_proj
    "mixtral": dict(hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                    sliding_window=None),  # mixture of experts
    # mixture of experts with fused 3-D expert weights (parameters, not layers) and q/k norms; peft has no default
    "qwen3_moe": dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4,
                      num_experts_per_tok=2),
    # DeepSeek-V3's layout: multi-head latent attention (q_a/q_b, kv_a_proj_with_mqa/kv_b projections, a decoupled
    # rotary part), a dense first layer, then routed fused experts beside a shared expert
    # (widths of 64 in and 32 out: bitsandbytes' 4-bit CPU kernel packs blocks of 64 inputs and 32 outputs, so the
    # rotary part is 32 wide and a key head 64 = 32 + 32, where every other family's head is 16)
    "deepseek_v3": dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2,
                        n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=64, kv_lora_rank=64,
                        qk_rope_head_dim=32, qk_nope_head_dim=32, v_head_dim=16, n_group=1, topk_group=1),
    "gpt_neox": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4),
    "gpt2": dict(n_embd=64, n_layer=2, n_head=4, n_inner=128),  # Conv1D projections, not nn.Linear
    # separate q/k/v with out_proj, the stack at model.decoder.layers, learned positions, biases, ffn_dim
    "opt": dict(hidden_size=64, word_embed_proj_dim=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4),
    # Falcon-7B's layout: multi-query query_key_value and dense as FalconLinear, parallel attention, rotary
    "falcon": dict(hidden_size=64, ffn_hidden_size=128, num_hidden_layers=2, num_attention_heads=4),
    # per-head interleaved query_key_value, ALiBi, n_layer/n_head, no MLP width field (4 x hidden)
    "bloom": dict(hidden_size=64, n_layer=2, n_head=4),
}


def family_folder(model_type: str, folder: Path, tokenizer_folder: Path) -> Path:
    """A model folder (config.json and the tokenizer) of `model_type` at test size."""
    from transformers import AutoConfig, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_folder)
    special = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
               "pad_token_id": tokenizer.pad_token_id}
    config = AutoConfig.for_model(model_type, vocab_size=len(tokenizer), max_position_embeddings=1024,
                                  **FAMILIES[model_type], **special)
    if model_type == "gpt2":
        config.n_positions = 1024
    folder.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
