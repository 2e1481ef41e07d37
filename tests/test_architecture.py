"""The architecture adapter on tiny models of several families (tests/families.py): shapes read whatever the
family calls its fields, matrix-multiply layers of every layer type, peft's own LoRA defaults, and prune's
head cutting, exact on separate and fused q/k/v projections."""
from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

from efflab import architecture
from efflab.stages import prune
from tests.families import FAMILIES, family_folder


@pytest.fixture(scope="module")
def folders(prepared, tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {f: family_folder(f, root / f, prepared / "base_model" / "model") for f in FAMILIES}


def tiny(folders, family):
    torch.manual_seed(0)
    from transformers import AutoConfig

    return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folders[family])).eval()


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_s_shape_is_read_through_one_adapter(folders, family):
    model = tiny(folders, family)
    a = architecture.shape(model.config)
    assert (a["layers"], a["hidden"], a["heads"], a["head_dim"]) == (2, 64, 4, 16)
    assert a["intermediate"] == FAMILIES[family].get("intermediate_size", FAMILIES[family].get("n_inner"))
    assert a["kv_heads"] == FAMILIES[family].get("num_key_value_heads", 4)
    assert a["experts"] == FAMILIES[family].get("num_local_experts", 0)
    assert len(architecture.decoder_layers(model)) == 2
    layers = architecture.matmul_layers(model)
    assert layers and all(i > 0 and o > 0 for i, o in layers.values())
    assert (family == "gpt2") == any(n.endswith("c_attn") for n in layers), "GPT-2's Conv1D layers are counted"


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_token_s_matmul_weights_are_what_torch_counts_in_its_forward(folders, family):
    """N in efflab's FLOPs per token (2N + attention) against torch's own FLOP counter over one forward: every
    family's projections (Conv1D, fused, biased) and, for a mixture of experts, the experts a token is routed
    to, not all of them."""
    from torch.utils.flop_counter import FlopCounterMode

    from efflab.measure.flops import matmul_params

    model, tokens = tiny(folders, family), 8
    ids = torch.randint(0, model.config.vocab_size, (1, tokens))
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(input_ids=ids)
    attention = 4 * 2 * 4 * 16 * tokens * tokens / 2  # q·k and p·v of 2 layers x 4 heads x 16, causal half
    counted = counter.get_total_flops() - 2 * attention  # torch counts SDPA's full square
    n = matmul_params(model)["total"]
    experts = architecture.expert_weights(model)
    if experts:  # torch's counter does not see the experts' grouped matmuls: a token runs experts_per_token of them
        routed = sum(w.numel() for w in experts) * model.config.num_experts_per_tok // model.config.num_local_experts
        assert routed > 0.01 * n
        n -= routed
    assert 2 * n * tokens == pytest.approx(counted, rel=0.002), (family, counted, n)


@pytest.mark.parametrize("family, expected", [("llama", ["q_proj", "v_proj"]), ("gpt_neox", ["query_key_value"]),
                                              ("gpt2", ["c_attn"]), ("phi3", "all-linear")])
def test_lora_targets_default_to_peft_s_choice_for_the_family(folders, family, expected):
    from peft import LoraConfig, get_peft_model

    model = tiny(folders, family)
    targets = architecture.lora_targets(model.config, None)
    assert targets == expected
    assert architecture.lora_targets(model.config, ["x"]) == ["x"], "the user's names are kept"
    adapted = get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", r=2, target_modules=targets))
    assert adapted.get_nb_trainable_parameters()[0] > 0


def _masked(model, kept: dict, d: int):
    """The base model with the removed heads' output-projection columns zeroed and the removed layers skipped."""
    masked = copy.deepcopy(model)
    where = prune.attention_modules(masked)
    heads = prune.attention_shape(model.config)[1]
    for i in range(len(architecture.decoder_layers(masked))):
        output = masked.get_submodule(f"{where['attention'][i]}.{prune.OUTPUT}")
        for h in set(range(heads)) - set(kept["kept_heads"].get(i, [])):
            output.weight.data[:, h * d:(h + 1) * d] = 0
    stack = architecture.decoder_layers(masked)
    kept_layers = torch.nn.ModuleList([stack[i] for i in kept["kept_layers"]])
    parent, _, name = where["layers"].rpartition(".")
    setattr(masked.get_submodule(parent), name, kept_layers)
    for i, layer in enumerate(kept_layers):
        for m in layer.modules():
            if hasattr(m, "layer_idx"):
                m.layer_idx = i
    masked.config.num_hidden_layers = len(kept_layers)
    return masked


@pytest.mark.parametrize("family", ["qwen2", "phi3", "gemma2", "mixtral"])
def test_pruning_heads_is_exact_on_separate_biased_and_fused_projections(folders, family):
    """Qwen2's biased q/k/v, Phi-3's fused qkv_proj, Gemma-2's soft-capped attention, Mixtral's experts: the
    pruned model computes what the base computes with the removed heads masked, under grouped-query attention."""
    model = tiny(folders, family)
    scores = {"heads": [[4.0, 3.0, 2.0, 1.0]] * 2, "layers": [2.0, 1.0]}
    pruned, kept = prune.prune(model, {"remove_heads": 0.5, "remove_layers": 1}, scores)
    assert (kept["heads"], kept["kv_heads"], kept["layers"]) == (2, 2, 1), "one query head of each group"
    ids = torch.tensor([[1, 5, 9, 200, 3000, 7]])
    with torch.no_grad():
        torch.testing.assert_close(pruned(ids).logits, _masked(model, kept, 16)(ids).logits, atol=1e-5, rtol=1e-4)
    assert sum(p.numel() for p in pruned.parameters()) < sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("family", ["gpt_neox", "gpt2"])
def test_a_family_whose_attention_prune_cannot_cut_says_what_it_lacks(folders, family):
    with pytest.raises(prune.Unprunable, match="has no nn.Linear q_proj/k_proj/v_proj or qkv_proj"):
        prune.attention_modules(tiny(folders, family))
