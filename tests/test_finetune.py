import pandas as pd
import pytest
import torch

from efflab.experiment import finetune_run
from efflab.layout import Layout
from efflab.stages.report import tables
from tests.helpers import TEST_DTYPE, TEST_PARAMS, run_stage


def _lora_param_count(cfg, name):
    """r * (in + out) for every targeted projection, from the model config: an independent count."""
    c, run = cfg["base_model"]["config_overrides"], finetune_run(cfg, name)
    hidden, head, layers = c["hidden_size"], c["head_dim"], c["num_hidden_layers"]
    shapes = {"q_proj": (hidden, c["num_attention_heads"] * head), "k_proj": (hidden, c["num_key_value_heads"] * head),
              "v_proj": (hidden, c["num_key_value_heads"] * head), "o_proj": (c["num_attention_heads"] * head, hidden)}
    return layers * sum(run.lora["r"] * sum(shapes[t]) for t in run.lora["target_modules"])


def test_lora_trains_only_the_adapter_and_loss_goes_down(results, test_cfg):
    m = run_stage("finetune", TEST_PARAMS, results, "lora-r8")
    assert m["parameters"]["trainable"] == _lora_param_count(test_cfg, "lora-r8")
    assert m["validation_after"]["loss"] < m["validation_before"]["loss"]
    energy = m["energy"]  # joules per training token where a counter can be read, else the reason
    assert (energy.get("joules_per_token", 0) > 0 and energy["tokens"] == m["tokens_seen"]) or energy["unavailable"]
    curve = pd.read_csv(Layout(results).out("finetune", "lora-r8") / "loss.csv")
    assert len(curve) == m["steps"] == test_cfg["finetune"]["defaults"]["max_steps"]
    assert curve.loss.iloc[-3:].mean() < curve.loss.iloc[:3].mean()
    assert (Layout(results).model("finetune", "lora-r8") / "adapter_config.json").is_file()
    assert 0 < m["tokens_seen"] <= m["steps"] * 4 * test_cfg["prepare_data"]["max_length"]
    assert m["train_memory"]["kind"] == "cpu_peak_rss" and m["train_memory"]["peak_mib"] > 0
    tensors = m["train_memory"]["tensors"]  # the batch order foretold: the longest micro-batch counted, no more
    assert tensors["longest_expected"] == tensors["longest_seen"] == tensors["longest_counted"]
    assert "missed" not in tensors and tensors["counted_steps"][0] == 1 and len(tensors["counted_steps"]) <= 2
    steps = m["step_time"]
    assert steps["n"] == m["steps"] - 1 and steps["first_step_s"] > 0, "every step timed, the first apart"
    assert steps["min"] <= steps["median"] <= steps["max"] and sum(steps["samples"]) < m["train_s"]


def test_qlora_trains_on_a_4bit_base_and_full_trains_everything(results, test_cfg):
    q = run_stage("finetune", TEST_PARAMS, results, "qlora-r8")
    full = run_stage("finetune", TEST_PARAMS, results, "full")
    assert q["parameters"]["trainable"] == _lora_param_count(test_cfg, "qlora-r8")
    assert q["parameters"]["total"] == full["parameters"]["total"] + q["parameters"]["trainable"]
    assert q["validation_after"]["loss"] < q["validation_before"]["loss"]
    assert full["parameters"]["trainable"] == full["parameters"]["total"]
    assert full["validation_after"]["loss"] < full["validation_before"]["loss"]
    assert (Layout(results).model("finetune", "full") / "model.safetensors").is_file()


def test_qlora_gradients_do_not_depend_on_an_earlier_validation_pass(results, test_cfg):
    """bitsandbytes repacks 4-bit weights for its AVX512-BF16 CPU inference kernel on the first eval-mode,
    no-grad forward and then uses that kernel, which has no backward, in training too: the gradient through
    the frozen base layers was silently dropped after the validation pass that precedes training. With
    the layers kept on the differentiable path, a QLoRA gradient is the same with or without that pass."""
    import warnings

    from efflab.models.build import build

    run = finetune_run(test_cfg, "qlora-r8")
    run = run.but(lora=run.lora | {"dropout": 0.0})
    ids = torch.tensor([[1, 5, 9, 200, 31, 7, 64, 2] * 4])

    def gradients(validate_first: bool) -> dict:
        torch.manual_seed(0)
        model = build(run, Layout(results), "float32", torch.device("cpu"))
        if validate_first:
            model.eval()
            with torch.no_grad():
                model(input_ids=ids)
        model.train()
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # "an autograd kernel was not registered" would fail here
            model(input_ids=ids, labels=ids).loss.backward()
        return {n: p.grad for n, p in model.named_parameters() if p.requires_grad}

    fresh, validated = gradients(False), gradients(True)
    first = next(n for n in fresh if "layers.0." in n and "lora_B" in n)  # reached only through later layers
    assert fresh[first].abs().max() > 0
    for name in fresh:
        assert torch.allclose(fresh[name], validated[name], rtol=1e-4, atol=1e-7), name


def test_training_flops_follow_palm_and_mfu_is_a_fraction_of_the_measured_ceiling(results, write_params, test_cfg):
    """One epoch, so every training row is seen once: attention FLOPs per token then follow each row's own
    length, sum(len^2) / sum(len), not the mean length."""
    from efflab.models.modeling import read_split

    lengths = [len(r["input_ids"]) for r in read_split(Layout(results).split("train"))]
    epoch = len(lengths) // test_cfg["finetune"]["defaults"]["batch_size"]
    full = run_stage("finetune", write_params(lambda cfg: cfg["finetune"]["runs"]["full"].update(max_steps=epoch)),
                     results, "full")
    c = test_cfg["base_model"]["config_overrides"]
    h, hd, layers, vocab = c["hidden_size"], c["head_dim"], c["num_hidden_layers"], 49152
    heads, kv, inter = c["num_attention_heads"], c["num_key_value_heads"], c["intermediate_size"]
    per_layer = h * heads * hd + 2 * h * kv * hd + heads * hd * h + 3 * h * inter
    n = layers * per_layer + vocab * h  # every matmul weight, the (tied) LM head included
    t = full["throughput"]
    assert full["tokens_seen"] == sum(lengths) and len(lengths) % epoch == 0
    seq = sum(x * x for x in lengths) / sum(lengths)
    assert seq > sum(lengths) / len(lengths), "rows of different lengths: above the mean length"
    assert t["flops"]["seq_len"] == pytest.approx(seq)
    assert t["flops"]["matmul_params"] == n
    assert t["flops"]["model_flops_per_token"] == pytest.approx(6 * n + 12 * layers * heads * hd * seq)
    assert 0 < t["mfu_vs_measured_ceiling"] < 1
    assert t["matmul_ceiling"]["dtype"] == TEST_DTYPE and t["published_peak"]["tflops"] is None


@pytest.mark.integration  # two DDP processes through accelerate launch: ~18 s of a worker, make test keeps its 10 minutes
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
    assert sorted(p.name for p in out.iterdir()) == ["figures.json", "loss.csv", "metrics.json", "model"]
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


@pytest.mark.integration  # make test's 10 minutes on a 2-core AVX2 CPU: run by make test-integration
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
    cmd = [sys.executable, "-m", "efflab.stages.finetune", "--params", str(params), "--results", str(results),
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


@pytest.mark.integration  # make test's 10 minutes on a 2-core AVX2 CPU: run by make test-integration
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


def test_packed_rows_see_only_themselves_and_keep_the_loss(results, write_params, test_cfg):
    """Padding-free batches: the logits of rows laid end to end equal those of each row alone (no attention
    across rows), and a packed run trains on the same real tokens with the same loss as a padded one."""
    from efflab.models.modeling import load_model, load_tokenizer, read_split
    from efflab.training import StepRun, collator

    layout = Layout(results)
    model = load_model(layout.base_model(), "float32", torch.device("cpu"))
    rows = read_split(layout.split("train"), 3)
    packed = collator(StepRun(steps=1, batch_size=2, learning_rate=1e-3, packing=True), load_tokenizer(layout.base_model()))(rows)
    with torch.no_grad():
        together = model(input_ids=packed["input_ids"], position_ids=packed["position_ids"], use_cache=False).logits[0]
        alone = torch.cat([model(input_ids=torch.tensor([r["input_ids"]]), use_cache=False).logits[0] for r in rows])
    assert together.shape == alone.shape
    assert (together - alone).abs().max().item() < 1e-4

    def edit(cfg):
        for name, packing in (("packed", True), ("padded", False)):
            cfg["finetune"]["runs"][name] = {"method": "lora", "packing": packing, "max_steps": 3,
                                             "mixed_precision": "no"}
    params = write_params(edit)
    a, b = run_stage("finetune", params, results, "packed"), run_stage("finetune", params, results, "padded")
    assert a["tokens_seen"] == b["tokens_seen"], "the same rows, the same real tokens"
    assert a["pad_fraction"] == 0 and a["tokens_processed"] == a["tokens_seen"]
    assert b["pad_fraction"] > 0.05 and b["tokens_processed"] > b["tokens_seen"]
    curve = lambda run: pd.read_csv(Layout(results).out("finetune", run) / "loss.csv").loss  # noqa: E731
    diff = (curve("packed") - curve("padded")).abs()
    # Step 1 is the same maths on the same weights; later steps differ only by the bf16 rounding of the tiny
    # model's weights in differently shaped matmuls, carried through the updates.
    assert diff.iloc[0] < 1e-5 and diff.max() < 2e-3


def test_gradient_accumulation_keeps_the_effective_batch(results, write_params):
    def edit(cfg):
        cfg["finetune"]["runs"]["batch4"] = {"method": "lora", "batch_size": 4, "max_steps": 3, "mixed_precision": "no"}
        cfg["finetune"]["runs"]["batch2x2"] = {"method": "lora", "batch_size": 2, "gradient_accumulation_steps": 2,
                                               "max_steps": 3, "mixed_precision": "no"}
    params = write_params(edit)
    one, two = run_stage("finetune", params, results, "batch4"), run_stage("finetune", params, results, "batch2x2")
    assert one["effective_batch"] == two["effective_batch"] == 4
    assert one["samples_per_s"] * one["train_s"] == pytest.approx(12) == two["samples_per_s"] * two["train_s"]
    assert one["tokens_seen"] == two["tokens_seen"], "the same rows reach each optimizer step"
    curve = lambda run: pd.read_csv(Layout(results).out("finetune", run) / "loss.csv").loss  # noqa: E731
    diff = (curve("batch4") - curve("batch2x2")).abs()
    assert diff.iloc[0] < 1e-5 and diff.max() < 2e-3, "the loss is over the whole effective batch"


def test_gradient_checkpointing_lowers_the_training_memory(results, write_params):
    """A deeper tiny model, so that the kept activations stand well above the noise of the RSS peak."""
    deep = {"num_hidden_layers": 8, "hidden_size": 256, "intermediate_size": 1024, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 64}

    def edit(cfg):
        cfg["base_model"]["config_overrides"] = deep
        for name, gc in (("kept", False), ("recomputed", True)):
            cfg["finetune"]["runs"][name] = {"method": "lora", "gradient_checkpointing": gc, "max_steps": 1,
                                             "batch_size": 8, "mixed_precision": "no", "checkpoint_every": 0,
                                             "eval_rows": 1}  # the losses compared are the training step's
    params = write_params(edit)
    run_stage("base_model", params, results)
    kept, recomputed = run_stage("finetune", params, results, "kept"), run_stage("finetune", params, results, "recomputed")
    # Kept activations of 8 layers x the step's tokens: checkpointing keeps only each layer's input.
    tokens = kept["tokens_processed"] / kept["steps"]
    per_layer_mib = tokens * deep["intermediate_size"] * 4 * 3 / 2**20  # at least the MLP's three fp32 tensors
    # The live-tensor peak (the allocator's own count, the same on every rerun), not the RSS peak: glibc's
    # arenas keep and return freed pages at their own pace, and the RSS difference ranged 27-170 MiB
    # over four runs against 178 MiB of tensors every time.
    tensors = [r["train_memory"]["tensors"]["delta_mib"] for r in (kept, recomputed)]
    saved = tensors[0] - tensors[1]
    assert saved > deep["num_hidden_layers"] * per_layer_mib, f"checkpointing saved only {saved:.0f} MiB"
    assert abs(kept["last_loss"] - recomputed["last_loss"]) < 1e-4, "recomputation does not change the maths"


def test_knobs_a_cpu_cannot_honour_are_unavailable_and_the_grid_goes_on(results, write_params):

    def edit(cfg):
        cfg["finetune"]["runs"]["fp16"] = {"method": "lora", "mixed_precision": "fp16"}
        cfg["finetune"]["runs"]["tf32-pinned"] = {"method": "lora", "tf32": True, "pin_memory": True,
                                                   "liger_kernel": True}
        cfg["bench_inference"]["variants"] = {"adapter-fp16": {"kind": "adapter", "of": "fp16"}}
        cfg["capacity"]["variants"] = []
    params = write_params(edit)
    fp16 = run_stage("finetune", params, results, "fp16")
    both = run_stage("finetune", params, results, "tf32-pinned")
    assert fp16["status"] == "unavailable" and "fp16" in fp16["reason"] and "CUDA" in fp16["reason"]
    assert both["status"] == "unavailable" and "tf32" in both["reason"] and "pin_memory" in both["reason"]
    assert "liger_kernel: Liger's kernels are Triton kernels for CUDA GPUs" in both["reason"]
    out = Layout(results).out("finetune", "fp16")
    assert sorted(p.name for p in out.iterdir()) == ["figures.json", "loss.csv", "metrics.json", "model"]
    merged = run_stage("merge", params, results, "fp16")
    assert merged["status"] == "skipped" and "finetune fp16 is unavailable" in merged["reason"]
    inference = run_stage("bench_inference", params, results, "adapter-fp16")
    assert inference["status"] == "skipped" and inference["cells"] == []
    table = tables.not_run_table({"finetune": [fp16, both], "merge": [merged]})
    assert list(table["status"]) == ["unavailable", "unavailable", "skipped"]


@pytest.mark.parametrize("error, status", [("CUDA out of memory. Tried to allocate 2.00 GiB", "oom"),
                                           ("this combination is not supported", "failed")])
def test_a_run_that_fails_is_recorded_with_its_reason(results, monkeypatch, error, status):
    from efflab.stages import finetune

    def fail(cfg, job, run_cfg):
        (job.out / "half-written.bin").write_bytes(b"x")
        raise (torch.OutOfMemoryError if status == "oom" else RuntimeError)(error)
    monkeypatch.setattr(finetune, "train", fail)
    m = run_stage("finetune", TEST_PARAMS, results, "lora-r8")
    assert m["status"] == status and error in m["reason"]
    out = Layout(results).out("finetune", "lora-r8")
    assert sorted(p.name for p in out.iterdir()) == ["figures.json", "loss.csv", "metrics.json", "model"], "no partial outputs"


def test_the_validation_loss_avoids_kernels_that_have_no_deterministic_cuda_version():
    """`deterministic: true` (torch.use_deterministic_algorithms) raises on CUDA in any op without a
    deterministic kernel. cross_entropy over (batch, classes, positions) dispatches to nll_loss2d, whose CUDA
    sum has none; one row per position (classes last) dispatches to nll_loss, which has. The CPU cannot raise,
    so the test reads which aten ops the loss dispatches to, and checks the sum against cross_entropy."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from efflab.models.modeling import summed_nll

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.add(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 7, 11, generator=gen)
    labels = torch.randint(0, 11, (3, 7), generator=gen)
    labels[0, :4] = -100
    with Ops() as ops:
        total, count = summed_nll(logits, labels)
    assert "nll_loss_forward" in ops.names and not any(n.startswith("nll_loss2d") for n in ops.names), ops.names
    expected = torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), labels[:, 1:], reduction="sum")
    assert count == int((labels[:, 1:] != -100).sum()) and abs(total - expected.item()) < 1e-4


def test_the_live_tensor_peak_counted_on_the_longest_steps_is_the_peak_counted_on_every_step(tmp_path):
    """CountLongestSteps counts the first step and each step longer than every counted one, and leaves the
    others to run without the profiler: the peak it finds is the one a count of every step finds."""
    import gc

    from datasets import Dataset
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

    from efflab.measure.memory import CpuTensorPeak
    from efflab.stages.finetune.callbacks import CountLongestSteps

    lengths = [8, 32, 16, 24, 256, 8]  # batch 1, in order: steps 1, 2 and 5 can hold the peak (5 holds it)
    rows = [{"input_ids": [i % 60 + 1 for i in range(n)], "labels": [i % 60 + 1 for i in range(n)]} for n in lengths]

    def peak(sampled: bool, expected: int | None = None) -> tuple[float, list[int]]:
        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=2, num_key_value_heads=2)
        args = TrainingArguments(tmp_path / str(sampled), per_device_train_batch_size=1, max_steps=len(rows),
                                 train_sampling_strategy="sequential", report_to=[], save_strategy="no",
                                 use_cpu=True, disable_tqdm=True)
        trainer = Trainer(model=LlamaForCausalLM(config), args=args, train_dataset=Dataset.from_list(rows))
        tensors = CpuTensorPeak()
        counted = CountLongestSteps(tensors, trainer, expected) if sampled else None
        if counted:
            trainer.add_callback(counted)
        gc.collect()  # garbage from an earlier count in this process (another test's) would report its frees here
        tensors.start()
        trainer.train()
        return tensors.stop()["delta_mib"], counted.record() if counted else {}

    every, _ = peak(sampled=False)
    longest, seen = peak(sampled=True)
    assert seen["counted_steps"] == [1, 2, 5] and "missed" not in seen
    assert longest == pytest.approx(every, abs=0.01) and every > 0
    foretold, seen = peak(sampled=True, expected=256)  # the run's longest micro-batch known: steps 1 and 5 alone
    assert seen["counted_steps"] == [1, 5] and foretold == pytest.approx(every, abs=0.01)
    _, seen = peak(sampled=True, expected=300)  # an order that did not come: the longest step is said to be missed
    assert seen["counted_steps"] == [1] and "256 token positions" in seen["missed"]


@pytest.mark.integration  # make test's 10 minutes on a 2-core AVX2 CPU: run by make test-integration
def test_bf16_weights_train_in_bf16_with_fp32_adam_moments(results, write_params, test_cfg):
    def edit(cfg):
        # bf16 matmuls are slow on an AVX2-only CPU: few, short steps
        cfg["finetune"]["runs"]["bf16w"] = {"method": "lora", "bf16_weights": True, "max_steps": 3, "batch_size": 2,
                                            "eval_rows": 4}
    m = run_stage("finetune", write_params(edit), results, "bf16w")
    trainable = m["parameters"]["trainable"]
    assert trainable == _lora_param_count(test_cfg, "lora-r8")
    assert m["trainable_dtype"] == "bfloat16" and m["mixed_precision"] == "no"
    assert m["optimizer"].startswith("torchao AdamW")
    tensors = 2 * test_cfg["base_model"]["config_overrides"]["num_hidden_layers"] * len(
        finetune_run(test_cfg, "lora-r8").lora["target_modules"])
    assert m["optimizer_state_bytes"] == 2 * 4 * trainable + 4 * tensors, "two fp32 moments and a step count"
    assert m["validation_after"]["loss"] < m["validation_before"]["loss"]
    assert "bf16_weights" in m["memory_prediction"]["unavailable"]


def test_stochastic_rounding_keeps_the_small_updates_that_round_to_nearest_bf16_drops():
    """Adam's update (about lr per step) is smaller than half a bf16 step at |w| ~ 0.05: rounded to nearest it is
    mostly lost; rounded stochastically it is kept on average, as the fp32 optimizer keeps it."""
    from efflab.training import StepRun, optimizer_cls_and_kwargs

    gen = torch.Generator().manual_seed(0)
    start = (torch.randn(64, 256, generator=gen) * 0.05).to(torch.bfloat16)
    grad = torch.randn(64, 256, generator=gen)
    lr, steps = 5e-5, 20
    args = type("Args", (), {"learning_rate": lr, "adam_beta1": 0.9, "adam_beta2": 0.999, "adam_epsilon": 1e-8})
    cls, kwargs = optimizer_cls_and_kwargs(StepRun(steps=1, batch_size=1, learning_rate=1e-3, bf16_weights=True), args)

    def moved(weight, optimizer_cls, **kw) -> float:
        """The mean distance each weight moved against its gradient's sign."""
        p = torch.nn.Parameter(weight.clone())
        opt = optimizer_cls([p], weight_decay=0.0, **kw)
        for _ in range(steps):
            p.grad = grad.to(p.dtype)
            opt.step()
        if optimizer_cls is cls:  # fp32 moments, and still fp32 and the same when a resumed run loads them
            resumed = cls([torch.nn.Parameter(weight.clone())], weight_decay=0.0, **kw)
            resumed.load_state_dict(opt.state_dict())
            for state in (opt.state[p], next(iter(resumed.state.values()))):
                assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.float32
            assert torch.equal(next(iter(resumed.state.values()))["exp_avg_sq"], opt.state[p]["exp_avg_sq"])
        return float(((weight.float() - p.detach().float()) * grad.sign()).mean())

    reference = moved(start.float(), torch.optim.AdamW, lr=lr)
    stochastic = moved(start, cls, **kwargs)
    nearest = moved(start, torch.optim.AdamW, lr=lr)
    assert reference == pytest.approx(steps * lr, rel=0.05)
    assert stochastic == pytest.approx(reference, rel=0.1)
    assert nearest < 0.5 * reference
