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


def test_dora_adds_magnitude_vectors_and_rslora_rescales(results, write_params, test_cfg):
    def edit(cfg):
        cfg["finetune"]["runs"]["dora"] = {"method": "lora", "lora": {"use_dora": True}, "max_steps": 2}
        cfg["finetune"]["runs"]["rslora"] = {"method": "lora", "lora": {"use_rslora": True}, "max_steps": 2}
    params = write_params(edit)
    dora = run_stage("finetune", params, results, "dora")
    rslora = run_stage("finetune", params, results, "rslora")
    c, lora = test_cfg["base_model"]["config_overrides"], test_cfg["finetune"]["defaults"]["lora"]
    outs = {"q_proj": c["num_attention_heads"] * c["head_dim"], "k_proj": c["num_key_value_heads"] * c["head_dim"],
            "v_proj": c["num_key_value_heads"] * c["head_dim"], "o_proj": c["hidden_size"]}
    magnitudes = c["num_hidden_layers"] * sum(outs[t] for t in lora["target_modules"])
    assert dora["parameters"]["trainable"] == _lora_param_count(test_cfg, "lora-r8") + magnitudes
    assert dora["lora_scaling"] == lora["alpha"] / lora["r"]
    assert rslora["lora_scaling"] == pytest.approx(lora["alpha"] / lora["r"] ** 0.5)


def test_8bit_adam_keeps_a_quarter_of_the_optimizer_state(results, write_params, test_cfg):
    def edit(cfg):
        for name, optim in (("adam32", "adamw_torch"), ("adam8", "adamw_bnb_8bit")):
            cfg["finetune"]["runs"][name] = {"method": "full", "optimizer": optim, "max_steps": 2}
    params = write_params(edit)
    adam32 = run_stage("finetune", params, results, "adam32")
    adam8 = run_stage("finetune", params, results, "adam8")
    assert adam32["optimizer_state_bytes"] >= 8 * adam32["parameters"]["trainable"], "two fp32 moments"
    # The Trainer keeps the embedding's Adam states in 32 bits (bitsandbytes' stability advice), and
    # bitsandbytes keeps tensors under 4096 elements in 32 bits; every other weight trades two fp32 moments
    # (8 bytes) for two 8-bit ones (2 bytes + block constants): a saving of just under 6 bytes each.
    c = test_cfg["base_model"]["config_overrides"]
    h, hd = c["hidden_size"], c["head_dim"]
    shapes = [h * c["num_attention_heads"] * hd] * 2 + [h * c["num_key_value_heads"] * hd] * 2 \
        + [h * c["intermediate_size"]] * 3
    eligible = c["num_hidden_layers"] * sum(n for n in shapes if n >= 4096)
    saving = adam32["optimizer_state_bytes"] - adam8["optimizer_state_bytes"]
    assert 5 * eligible < saving <= 6 * eligible
    assert adam8["validation_after"]["loss"] < adam8["validation_before"]["loss"]


def _weights(results, run):
    from safetensors.torch import load_file

    return load_file(Layout(results).model("finetune", run) / "adapter_model.safetensors")


def test_a_killed_run_resumes_from_its_last_checkpoint_and_ends_where_an_uninterrupted_one_does(
        results, write_params):
    import os
    import subprocess
    import sys

    def edit(cfg):
        for name in ("whole", "killed"):
            cfg["finetune"]["runs"][name] = {"method": "lora", "max_steps": 8, "checkpoint_every": 2}
    params = write_params(edit)
    whole = run_stage("finetune", params, results, "whole")
    cmd = [sys.executable, "-m", "efflab.finetune", "--params", str(params), "--results", str(results),
           "--name", "killed"]
    killed = subprocess.run(cmd, env=os.environ | {"EFFLAB_KILL_AFTER_CHECKPOINT": "4"}, capture_output=True)
    assert killed.returncode == -9, "kill -9 after the step-4 checkpoint"
    out = Layout(results).out("finetune")
    assert not (out / "killed").exists() and (out / ".killed.checkpoints" / "checkpoint-4").is_dir()
    resumed = run_stage("finetune", params, results, "killed")
    assert resumed["resumed_from"] == 4 and resumed["steps"] == 4 and resumed["total_steps"] == 8
    assert abs(resumed["last_loss"] - whole["last_loss"]) < 1e-6
    assert abs(resumed["validation_after"]["loss"] - whole["validation_after"]["loss"]) < 1e-6
    a, b = _weights(results, "whole"), _weights(results, "killed")
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-6
    assert not (out / ".killed.checkpoints").exists(), "a finished run clears its checkpoints"


def test_the_same_params_train_bitwise_identically_on_cpu(results, write_params):
    def edit(cfg):
        for name in ("one", "two"):
            cfg["finetune"]["runs"][name] = {"method": "lora", "max_steps": 4}
    params = write_params(edit)
    one, two = run_stage("finetune", params, results, "one"), run_stage("finetune", params, results, "two")
    curve = lambda run: (Layout(results).out("finetune", run) / "loss.csv").read_text()  # noqa: E731
    assert curve("one") == curve("two")
    assert one["ranks"][0]["weights_sha256"] == two["ranks"][0]["weights_sha256"]
    a, b = _weights(results, "one"), _weights(results, "two")
    assert all(a[k].equal(b[k]) for k in a)
