import copy
import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from efflab.config import UserError
from efflab.models import pruning
from efflab.models.modeling import load_model, load_tokenizer, read_split
from efflab.stages import prune
from tests.helpers import TEST_PARAMS, run_stage


def test_the_seeds_five_strategies_on_smollm2_135m_respect_grouped_query_attention():
    """9 query heads in 3 key/value groups: only 1, 2, 3, 4, 6 or 9 heads can be kept in every layer."""
    plans = {name: pruning.head_plan(s, heads=9, kv=3) for name, s in {
        "heads-2": {"remove_heads": 2}, "heads-half": {"remove_heads": 0.5}, "heads-1": {"keep_heads": 1}}.items()}
    assert (plans["heads-2"]["heads"], plans["heads-2"]["kv_heads"]) == (6, 3), "7 asked: 6 is nearest, all kv kept"
    assert (plans["heads-half"]["heads"], plans["heads-half"]["kv_heads"]) == (4, 2)
    assert (plans["heads-1"]["heads"], plans["heads-1"]["kv_heads"]) == (1, 1)
    assert pruning.layer_count({"remove_layers": 0.5}, 30) == 15
    with pytest.raises(UserError, match="keeps 20 of 9 query heads"):
        pruning.head_plan({"keep_heads": 20}, heads=9, kv=3)


def test_removing_heads_and_layers_computes_what_masking_them_computes(prepared):
    """The pruned model's logits equal the base model's with the removed heads' o_proj columns zeroed and the
    removed layers skipped: the slicing of q/k/v/o under grouped-query attention is exact."""
    base = load_model(prepared / "base_model" / "model", "float32", torch.device("cpu"))
    tokenizer = load_tokenizer(prepared / "base_model" / "model")
    rows = read_split(prepared / "prepare_data" / "train.parquet", 4)
    scores = prune.importance(base, rows, tokenizer, "activation_norm")
    assert all(s > 0 for layer in scores["heads"] for s in layer) and all(s > 0 for s in scores["layers"])
    pruned, kept = pruning.prune(base, {"remove_heads": 0.5, "remove_layers": 1}, scores)
    _, heads, _, d = pruning.attention_shape(base.config)
    masked = copy.deepcopy(base)
    for i, layer in enumerate(masked.model.layers):
        for h in set(range(heads)) - set(kept["kept_heads"].get(i, [])):
            layer.self_attn.o_proj.weight.data[:, h * d:(h + 1) * d] = 0
    masked.model.layers = torch.nn.ModuleList([masked.model.layers[i] for i in kept["kept_layers"]])
    for i, layer in enumerate(masked.model.layers):
        layer.self_attn.layer_idx = i
    masked.config.num_hidden_layers = len(kept["kept_layers"])
    ids = torch.tensor([rows[0]["input_ids"]])
    with torch.no_grad():
        assert torch.allclose(pruned(ids).logits, masked(ids).logits, atol=1e-5)
    assert sum(p.numel() for p in pruned.parameters()) < sum(p.numel() for p in base.parameters())


def test_a_pruned_folder_loads_in_plain_transformers_with_the_parameters_the_table_gives(results, test_cfg):
    (name,) = test_cfg["prune"]["strategies"]
    metrics = run_stage("prune", TEST_PARAMS, results, name)
    model = AutoModelForCausalLM.from_pretrained(results / "prune" / name / "model")
    assert sum(p.numel() for p in model.parameters()) == metrics["pruned"]["parameters"] < metrics["base"]["parameters"]
    config = json.loads((results / "prune" / name / "model" / "config.json").read_text())
    assert (config["num_hidden_layers"], config["num_attention_heads"]) == (metrics["kept"]["layers"],
                                                                            metrics["kept"]["heads"])
    assert metrics["footprint_ratio"] < 1 and metrics["pruned"]["validation"]["perplexity"] > 0
    assert metrics["pruned"]["generation_s"]["median"] > 0 and isinstance(metrics["pruned"]["sample"], str)
    assert metrics["generation_speedup"]["verdict"].startswith(
        ("faster", "slower", "same within ±10%", "not a verdict", "not decided at this size"))


def test_healing_lowers_the_pruned_model_s_loss_and_keeps_its_shape(results, test_cfg):
    """The LoRA-healed model is merged into a folder of the pruned shape that plain transformers loads, and its
    validation loss is below the pruned model's."""
    (name,) = test_cfg["prune"]["strategies"]
    metrics = run_stage("prune", TEST_PARAMS, results, name)
    healing = metrics["healing"]
    assert healing["status"] == "ok" and healing["steps"] == test_cfg["prune"]["heal"]["steps"]
    assert healing["last_loss"] < healing["first_loss"]
    assert healing["validation"]["loss"] < metrics["pruned"]["validation"]["loss"]
    model = AutoModelForCausalLM.from_pretrained(results / "prune" / name / "healed")
    assert sum(p.numel() for p in model.parameters()) == healing["parameters"] == metrics["pruned"]["parameters"]
    assert not any("lora" in n for n, _ in model.named_parameters()), "merged: a plain model"


def test_healing_off_is_recorded_as_disabled(results, write_params, test_cfg):
    (name,) = test_cfg["prune"]["strategies"]
    params = write_params(lambda cfg: cfg["prune"]["heal"].update(steps=0))
    metrics = run_stage("prune", params, results, name)
    assert metrics["healing"] == {"status": "disabled", "reason": "prune.heal.steps is 0"}
    assert (results / "prune" / name / "healed" / "NOT_RUN.txt").read_text().startswith("disabled")
