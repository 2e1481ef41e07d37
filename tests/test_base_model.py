import json

from transformers import AutoConfig

from efflab.modeling import load_model, load_tokenizer
from efflab.layout import Layout

import torch


def test_tiny_base_model_is_built_from_the_real_config_and_tokenizer(prepared, test_cfg):
    metrics = json.loads((prepared / "base_model" / "metrics.json").read_text())
    folder = Layout(prepared).base_model()
    cfg = AutoConfig.from_pretrained(folder)
    overrides = test_cfg["base_model"]["config_overrides"]
    assert cfg.num_hidden_layers == overrides["num_hidden_layers"] and cfg.hidden_size == overrides["hidden_size"]
    assert cfg.vocab_size == 49152, "the real SmolLM2 vocabulary is kept"
    tok = load_tokenizer(folder)
    assert tok.chat_template and tok.eos_token == "<|im_end|>"
    model = load_model(folder, metrics["dtype"], torch.device("cpu"))
    assert metrics["parameters"] == sum(p.numel() for p in model.parameters())
    assert (folder / "model.safetensors").is_file() and not list(folder.glob("*.bin"))
    assert metrics["bytes_on_disk"] > 0 and metrics["load_s"] > 0
    assert metrics["dtype_choice"]["requested"] == "auto"
