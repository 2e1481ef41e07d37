import json

import pytest
import torch
from transformers import AutoConfig

from efflab.config import UserError, classify_source
from efflab.layout import Layout
from efflab.models.modeling import load_model, load_tokenizer
from tests.helpers import run_stage


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
    assert metrics["dtype"] == metrics["dtype_choice"]["requested"] == test_cfg["base_model"]["dtype"]


def test_auto_dtype_is_the_faster_of_the_measured_matmuls_on_cpu():
    from efflab.measure.flops import resolve_dtype

    chosen, evidence = resolve_dtype("auto", torch.device("cpu"))
    probe = evidence["linear_gflops"]
    assert set(probe) == {"float32", "bfloat16"} and all(v > 0 for v in probe.values())
    assert chosen == max(probe, key=probe.get) and chosen in evidence["reason"]


def test_a_local_folder_is_a_source_and_keeps_its_weights(prepared, tmp_path, write_params):
    from safetensors.torch import load_file

    folder = Layout(prepared).base_model()

    def edit(cfg):
        cfg["base_model"] |= {"source": str(folder), "random_init": False, "config_overrides": {}}
    results = tmp_path / "results"
    metrics = run_stage("base_model", write_params(edit), results)
    assert metrics["source_kind"] == "local"
    original, copied = load_file(folder / "model.safetensors"), load_file(results / "base_model/model/model.safetensors")
    assert original.keys() == copied.keys()
    assert all(torch.equal(original[k].to(copied[k].dtype), copied[k]) for k in original)


def test_sources_are_classified_without_touching_the_network(tmp_path):
    assert classify_source("HuggingFaceTB/SmolLM2-135M-Instruct", "k") == "hub"
    assert classify_source("embedded:smollm2-135m-instruct", "k") == "embedded"
    assert classify_source(str(tmp_path), "k") == "local"
    with pytest.raises(UserError, match="k: './nope' does not exist"):
        classify_source("./nope", "k")
    with pytest.raises(UserError, match="neither an existing path nor a hub id"):
        classify_source("not a model", "k")


def test_the_embedded_gguf_metadata_is_converted_once_then_read_from_the_cache(prepared, tmp_path, monkeypatch):
    """The GGUF tokenizer and config are parsed on the first run (about 12 s of a CPU core) and reloaded from
    the cache afterwards: the same tokenizer, the same config, the same files in the base model folder."""
    from efflab.models.modeling import EMBEDDED_MODELS, gguf_tokenizer_and_config, package_folder

    monkeypatch.setenv("EFFLAB_CACHE_DIR", str(tmp_path / "cache"))
    package, gguf_file, pip_name = EMBEDDED_MODELS["embedded:smollm2-135m-instruct"]
    folder = package_folder(package, pip_name)
    tok1, cfg1, from1 = gguf_tokenizer_and_config(folder, gguf_file)
    tok2, cfg2, from2 = gguf_tokenizer_and_config(folder, gguf_file)
    assert (from1, from2) == ("gguf", "cache")
    assert [p.name for p in (tmp_path / "cache" / "gguf-metadata").iterdir()] != []
    text = "Vad kostar ett bygglov? Étagère, 42 m² — ok."
    assert tok1(text)["input_ids"] == tok2(text)["input_ids"]
    chat = [{"role": "user", "content": "Hej"}]
    assert tok1.apply_chat_template(chat, tokenize=False) == tok2.apply_chat_template(chat, tokenize=False)
    assert cfg1.to_dict() == cfg2.to_dict()
    for i, tok in enumerate((tok1, tok2)):
        tok.save_pretrained(tmp_path / f"saved{i}")
    saved = Layout(prepared).base_model()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (tmp_path / "saved0" / name).read_bytes() == (tmp_path / "saved1" / name).read_bytes() \
            == (saved / name).read_bytes(), name


def test_a_dtype_chosen_on_another_kind_of_cpu_is_refused_by_the_stages_that_read_it(results):
    """Committed or copied base_model metrics whose `auto` probe ran on a CPU with (or without) AVX512-BF16:
    a stage on the other kind stops with one line instead of training in the wrong dtype."""
    import json

    import pytest

    from efflab.config import UserError
    from efflab.layout import Layout
    from efflab.measure import env
    from efflab.models import modeling

    path = results / "base_model" / "metrics.json"
    metrics = json.loads(path.read_text())
    here = env.cpu_isa()
    elsewhere = [f for f in here if f not in env.FAST_BF16_ISA] if env.FAST_BF16_ISA & set(here) \
        else here + ["avx512_bf16"]
    metrics["dtype_choice"] = {"requested": "auto", "reason": "probe"}
    metrics["environment"] |= {"device": "cpu", "cpu_isa": here}
    path.write_text(json.dumps(metrics))
    assert modeling.base_dtype(Layout(results)) == metrics["dtype"], "made here: accepted"
    metrics["environment"]["cpu_isa"] = elsewhere
    path.write_text(json.dumps(metrics))
    with pytest.raises(UserError, match=r"base_model chose \w+ on .* AVX512-BF16/AMX\), this machine is .*rerun "
                                        r"base_model here"):
        modeling.base_dtype(Layout(results))
    metrics["dtype_choice"] = {"requested": "float32"}
    path.write_text(json.dumps(metrics))
    assert modeling.base_dtype(Layout(results)) == metrics["dtype"], "a configured dtype holds anywhere"


def test_random_weights_are_drawn_on_the_run_s_device_seeded(test_cfg):
    """A random-init model is built where the run computes (on a GPU node, not on its CPU: a 1B model took 39 s
    there), and the seed gives the same weights twice on one device."""
    from transformers import LlamaConfig

    from efflab.stages.base_model import materialize

    bm = test_cfg["base_model"] | {"random_init": True, "seed": 3}
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2)
    on_meta = materialize(bm, "embedded", "", {}, config, torch.float32, torch.device("meta"))
    assert {p.device.type for p in on_meta.parameters()} == {"meta"}
    first, second = (materialize(bm, "embedded", "", {}, config, torch.float32, torch.device("cpu"))
                     for _ in range(2))
    for a, b in zip(first.parameters(), second.parameters(), strict=True):
        assert a.device.type == "cpu" and torch.equal(a, b)
