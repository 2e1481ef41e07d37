"""The architecture adapter on tiny models of several families (tests/families.py): shapes read whatever the
family calls its fields, matrix-multiply layers of every layer type, peft's own LoRA defaults, and prune's
layer and head cutting: layers off any family's stack, heads exact on separate and fused q/k/v projections, and
refused, for head strategies only, where the family's config cannot describe fewer heads."""
from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

from efflab import architecture, lora
from efflab.models import pruning
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
    latent = FAMILIES[family].get("qk_nope_head_dim", 0) + FAMILIES[family].get("qk_rope_head_dim", 0)
    assert (a["layers"], a["hidden"], a["heads"], a["head_dim"]) == (2, 64, 4, latent or 16), "DeepSeek's key head"
    widths = [v for k, v in FAMILIES[family].items() if k in ("intermediate_size", "n_inner", "ffn_dim",
                                                              "ffn_hidden_size")]
    assert a["intermediate"] == (widths or [4 * 64])[0], "Bloom has no width field: 4 x hidden"
    assert a["kv_heads"] == FAMILIES[family].get("num_key_value_heads", 1 if family == "falcon" else 4), \
        "Falcon-7B's multi-query attention has one key/value head"
    experts = [FAMILIES[family][f] for f in architecture.EXPERT_FIELDS if f in FAMILIES[family]]
    assert a["experts"] == (experts or [0])[0], "Mixtral's num_local_experts, Qwen3-MoE's num_experts, DeepSeek's ..."
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
    a = architecture.shape(model.config)
    qk, v = a["head_dim"], getattr(model.config, "v_head_dim", None) or a["head_dim"]
    attention = 2 * (qk + v) * 2 * 4 * tokens * tokens / 2  # q·k and p·v of 2 layers x 4 heads, causal half
    counted = counter.get_total_flops() - 2 * attention  # torch counts SDPA's full square
    n = matmul_params(model)["total"]
    experts = architecture.expert_weights(model)
    if experts:  # torch's counter does not see the experts' grouped matmuls: a token runs experts_per_token of them
        routed = sum(w.numel() for w in experts) * a["experts_per_token"] // a["experts"]
        assert routed > 0
        n -= routed
    assert 2 * n * tokens == pytest.approx(counted, rel=0.002), (family, counted, n)


@pytest.mark.parametrize("family, expected", [("llama", ["q_proj", "v_proj"]), ("gpt_neox", ["query_key_value"]),
                                              ("gpt2", ["c_attn"]),
                                              # no peft default: the model's own projections, its fused ones too
                                              ("phi3", ["down_proj", "gate_up_proj", "o_proj", "qkv_proj"])])
def test_lora_targets_default_to_peft_s_choice_for_the_family(folders, family, expected):
    from peft import LoraConfig, get_peft_model

    model = tiny(folders, family)
    targets = lora.lora_targets(model.config, None)
    assert targets == expected
    assert lora.lora_targets(model.config, ["x"]) == ["x"], "the user's names are kept"
    adapted = get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", r=2, target_modules=targets))
    assert adapted.get_nb_trainable_parameters()[0] > 0


def _masked(model, kept: dict, d: int):
    """The base model with the removed heads' output-projection columns zeroed and the removed layers skipped."""
    masked = copy.deepcopy(model)
    heads = pruning.attention_shape(model.config)[1]
    stack = architecture.decoder_layers(masked)
    if kept["heads"] < heads:
        where = pruning.attention_modules(masked)
        for i in range(len(stack)):
            output = masked.get_submodule(f"{where['attention'][i]}.{where['output']}")
            for h in set(range(heads)) - set(kept["kept_heads"].get(i, [])):
                output.weight.data[:, h * d:(h + 1) * d] = 0
    kept_layers = torch.nn.ModuleList([stack[i] for i in kept["kept_layers"]])
    masked.set_submodule(pruning.layer_stack(masked), kept_layers)
    for i, layer in enumerate(kept_layers):
        for m in layer.modules():
            if hasattr(m, "layer_idx"):
                m.layer_idx = i
    masked.config.num_hidden_layers = len(kept_layers)
    return masked


IDS = torch.tensor([[1, 5, 9, 200, 3000, 7]])


def phi(heads: int = 4, kv_heads: int = 2):
    """A tiny Phi-2-style model: separate biased q/k/v with a `dense` output projection and partial rotary, whose
    config, unlike OPT's, takes a head size of its own. Not in the matrix: it stands for the out_proj/dense
    naming on a family whose heads can be cut."""
    from transformers import AutoConfig

    torch.manual_seed(0)
    config = AutoConfig.for_model("phi", vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=heads, num_key_value_heads=kv_heads)
    return AutoModelForCausalLM.from_config(config).eval()


@pytest.mark.parametrize("family", ["qwen2", "phi3", "gemma2", "mixtral", "phi"])
def test_pruning_heads_is_exact_on_separate_biased_and_fused_projections(folders, family):
    """Qwen2's biased q/k/v, Phi-3's fused qkv_proj, Gemma-2's soft-capped attention, Mixtral's experts, Phi's
    `dense` output projection: the pruned model computes what the base computes with the removed heads masked,
    under grouped-query attention."""
    model = phi() if family == "phi" else tiny(folders, family)
    scores = {"heads": [[4.0, 3.0, 2.0, 1.0]] * 2, "layers": [2.0, 1.0]}
    pruned, kept = pruning.prune(model, {"remove_heads": 0.5, "remove_layers": 1}, scores)
    assert (kept["heads"], kept["kv_heads"], kept["layers"]) == (2, 2, 1), "one query head of each group"
    with torch.no_grad():
        torch.testing.assert_close(pruned(IDS).logits, _masked(model, kept, 16)(IDS).logits, atol=1e-5, rtol=1e-4)
    assert sum(p.numel() for p in pruned.parameters()) < sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("family", ["opt", "falcon", "bloom", "gpt_neox", "gpt2"])
def test_removing_half_the_layers_needs_only_a_stack_of_decoder_layers(folders, family, tmp_path):
    """layers-half on families whose heads prune cannot cut (OPT's model.decoder.layers, Falcon's and Bloom's
    transformer.h, GPT-NeoX, GPT-2's Conv1D): half the layers are left, the smaller config (its own layer-count
    field: num_hidden_layers or n_layer) reloads in plain transformers, and the model computes what the base
    computes with the removed layer skipped."""
    model = tiny(folders, family)
    pruned, kept = pruning.prune(model, {"remove_layers": 0.5}, {"heads": None, "layers": [1.0, 2.0]})
    assert (kept["layers"], kept["kept_layers"], kept["heads"]) == (1, [1], 4)
    pruned.save_pretrained(tmp_path, safe_serialization=True)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    field = "n_layer" if family in ("bloom", "gpt2") else "num_hidden_layers"
    assert reloaded.config.to_dict()[field] == architecture.shape(reloaded.config)["layers"] == 1
    assert len(architecture.decoder_layers(reloaded)) == 1
    with torch.no_grad():
        logits = reloaded(IDS).logits
        assert logits.shape == (1, IDS.shape[1], model.config.vocab_size)
        torch.testing.assert_close(logits, _masked(model, kept, 16)(IDS).logits, atol=1e-5, rtol=1e-4)
    assert sum(p.numel() for p in reloaded.parameters()) < sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("family", ["opt", "falcon", "bloom", "gpt_neox", "gpt2"])
def test_a_family_whose_config_cannot_hold_fewer_heads_refuses_head_strategies_only(folders, family):
    """OPT (separate q/k/v and out_proj), Falcon and Bloom (fused query_key_value and dense), GPT-NeoX and GPT-2
    (Conv1D c_attn and c_proj): prune finds their attention, but their configs derive the head size from
    hidden_size, so no config describes fewer heads of the same size. A strategy that removes heads is refused
    saying so; one that removes only layers is not."""
    model = tiny(folders, family)
    for strategy in ({"remove_heads": 2}, {"keep_heads": 1, "remove_layers": 1}):
        with pytest.raises(pruning.Unprunable, match="config cannot describe fewer heads of the same size: with [12] query heads"):
            pruning.cut_plan(model, strategy)
    for strategy in ({"remove_layers": 0.5}, {"remove_heads": 0, "remove_layers": 1}):
        plan, layers = pruning.cut_plan(model, strategy)
        assert (plan["heads"], layers) == (4, 1)
    where = pruning.attention_modules(model)
    assert where["output"] == {"opt": "out_proj", "gpt2": "c_proj"}.get(family, "dense")
