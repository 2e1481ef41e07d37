import pandas as pd
import pytest

from efflab.config import finetune_run
from efflab.layout import Layout

from conftest import TEST_PARAMS, run_stage


def _lora_param_count(cfg, name):
    """r * (in + out) for every targeted projection, from the model config: an independent count."""
    c, run = cfg["base_model"]["config_overrides"], finetune_run(cfg, name)
    hidden, head, layers = c["hidden_size"], c["head_dim"], c["num_hidden_layers"]
    shapes = {"q_proj": (hidden, c["num_attention_heads"] * head), "k_proj": (hidden, c["num_key_value_heads"] * head),
              "v_proj": (hidden, c["num_key_value_heads"] * head), "o_proj": (c["num_attention_heads"] * head, hidden)}
    return layers * sum(run["lora"]["r"] * sum(shapes[t]) for t in run["lora"]["target_modules"])


def test_lora_trains_only_the_adapter_and_loss_goes_down(results, test_cfg):
    m = run_stage("finetune", TEST_PARAMS, results, "lora-r8")
    assert m["parameters"]["trainable"] == _lora_param_count(test_cfg, "lora-r8")
    assert m["validation_after"]["loss"] < m["validation_before"]["loss"]
    curve = pd.read_csv(Layout(results).out("finetune", "lora-r8") / "loss.csv")
    assert len(curve) == m["steps"] == test_cfg["finetune"]["defaults"]["max_steps"]
    assert curve.loss.iloc[-3:].mean() < curve.loss.iloc[:3].mean()
    assert (Layout(results).model("finetune", "lora-r8") / "adapter_config.json").is_file()
    assert 0 < m["tokens_seen"] <= m["steps"] * 4 * test_cfg["prepare_data"]["max_length"]
    assert m["train_memory"]["kind"] == "cpu_peak_rss" and m["train_memory"]["peak_mib"] > 0


def test_qlora_trains_on_a_4bit_base_and_full_trains_everything(results, test_cfg):
    q = run_stage("finetune", TEST_PARAMS, results, "qlora-r8")
    full = run_stage("finetune", TEST_PARAMS, results, "full")
    assert q["parameters"]["trainable"] == _lora_param_count(test_cfg, "qlora-r8")
    assert q["parameters"]["total"] == full["parameters"]["total"] + q["parameters"]["trainable"]
    assert q["validation_after"]["loss"] < q["validation_before"]["loss"]
    assert full["parameters"]["trainable"] == full["parameters"]["total"]
    assert full["validation_after"]["loss"] < full["validation_before"]["loss"]
    assert (Layout(results).model("finetune", "full") / "model.safetensors").is_file()


def test_training_flops_follow_palm_and_mfu_is_a_fraction_of_the_measured_ceiling(results, test_cfg):
    full = run_stage("finetune", TEST_PARAMS, results, "full")
    c = test_cfg["base_model"]["config_overrides"]
    h, hd, layers, vocab = c["hidden_size"], c["head_dim"], c["num_hidden_layers"], 49152
    heads, kv, inter = c["num_attention_heads"], c["num_key_value_heads"], c["intermediate_size"]
    per_layer = h * heads * hd + 2 * h * kv * hd + heads * hd * h + 3 * h * inter
    n = layers * per_layer + vocab * h  # every matmul weight, the (tied) LM head included
    t = full["throughput"]
    seq = full["tokens_seen"] / (full["steps"] * test_cfg["finetune"]["defaults"]["batch_size"])
    assert t["flops"]["matmul_params"] == n
    assert t["flops"]["model_flops_per_token"] == pytest.approx(6 * n + 12 * layers * heads * hd * seq)
    assert 0 < t["mfu_vs_measured_ceiling"] < 1
    assert t["matmul_ceiling"]["dtype"] == "float32" and t["published_peak"]["tflops"] is None


def test_two_cpu_processes_train_in_sync_through_accelerate_and_write_once(results, write_params):
    def edit(cfg):
        cfg["finetune"]["runs"]["lora-ddp"] = {"method": "lora", "num_processes": 2}
    params = write_params(edit)
    m = run_stage("finetune", params, results, "lora-ddp")
    assert m["processes"] == 2 and [r["rank"] for r in m["ranks"]] == [0, 1]
    assert len({r["weights_sha256"] for r in m["ranks"]}) == 1, "DDP synchronised the gradients"
    assert all(r["validation_after"] < m["validation_before"]["loss"] for r in m["ranks"]), "both ranks trained"
    samples = m["steps"] * 2 * m["settings"]["batch_size"]
    assert m["samples_per_s"] == pytest.approx(samples / m["train_s"]), "throughput counts every rank"
    out = Layout(results).out("finetune", "lora-ddp")
    assert sorted(p.name for p in out.iterdir()) == ["loss.csv", "metrics.json", "model"]
    assert (out / "model" / "adapter_model.safetensors").is_file()
