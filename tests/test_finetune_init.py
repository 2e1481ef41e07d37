"""PEFT's adapter initialisations (finetune.*.lora.init) and the GaLore-class optimizers, on the tiny model: each init
gives an adapter that differs from the default's before any step and trains; each is timed; one peft refuses is
unavailable with peft's reason; a low-rank optimizer trains a full fine-tune and keeps a smaller optimizer state;
a bad value is a one-line error that names the key."""
from __future__ import annotations

import subprocess

import pytest
import torch
import yaml

from efflab import lora, training
from efflab.config import load
from efflab.experiment import finetune_run
from efflab.layout import Layout
from efflab.models.build import build
from tests.helpers import BIN, REPO, run_stage

# eva: peft's SVD loop runs until each layer's components converge, about 2 minutes on the tiny random model
INITS = ["gaussian", "pissa_niter_2", "olora", pytest.param("eva", marks=pytest.mark.integration), "corda", "loftq",
         "orthogonal"]


def _adapter(results, params, run: str) -> dict[str, torch.Tensor]:
    cfg = load(params)
    model = build(finetune_run(cfg, run), Layout(results), "float32", torch.device("cpu"))
    return model, {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}


@pytest.mark.parametrize("init", INITS)
def test_each_init_starts_from_another_adapter_than_the_default_and_trains(results, write_params, init):
    def edit(cfg):
        cfg["finetune"]["runs"] |= {"default": {"method": "lora", "max_steps": 3},
                                    init: {"method": "lora", "max_steps": 3, "lora": {"init": init}}}
    params = write_params(edit)
    if init == "loftq" and not torch.cuda.is_available():  # peft's LoftQ quantizes through bitsandbytes' CUDA path
        m = run_stage("finetune", params, results, init)
        assert m["status"] == "unavailable" and m["reason"].startswith("lora.init loftq: peft refused it")
        assert "CUDA" in m["reason"]
        return
    torch.manual_seed(0)
    _, default = _adapter(results, params, "default")
    torch.manual_seed(0)
    model, chosen = _adapter(results, params, init)
    assert default.keys() == chosen.keys()
    assert any(not torch.equal(default[k], chosen[k]) for k in default), f"{init}: the default's adapter"
    assert model.efflab_init["init"] == init and model.efflab_init["seconds"] > 0
    assert model.efflab_init["rows"] > 0 if init in lora.DATA_DRIVEN else model.efflab_init["rows"] == 0
    m = run_stage("finetune", params, results, init)
    assert m["status"] == "ok" and m["lora_init"]["init"] == init
    points = m["validation_curve"]["points"]
    assert points[0]["step"] == 0 and points[-1]["step"] == 3
    assert m["last_loss"] < m["first_loss"] or m["validation_after"]["loss"] < m["validation_before"]["loss"]
    # what later stages load, the saved adapter on the original base, is the model that was trained (PiSSA, OLoRA
    # and CorDA trained against a residual base: their adapter is saved converted)
    assert _reloaded_loss(results, params, init) == pytest.approx(m["validation_after"]["loss"], abs=1e-4)


def _reloaded_loss(results, params, run: str) -> float:
    from peft import PeftModel

    from efflab.models.modeling import eval_loss, load_model, load_tokenizer, read_split
    layout, settings = Layout(results), finetune_run(load(params), run)
    base = load_model(layout.base_model(), "float32", torch.device("cpu"))
    model = PeftModel.from_pretrained(base, str(layout.model("finetune", run))).eval()
    rows = read_split(layout.split("validation"), settings.eval_rows)
    return eval_loss(model, rows, settings.batch_size, load_tokenizer(layout.base_model()))["loss"]


def test_the_default_init_starts_from_the_base_and_says_so(results, write_params):
    params = write_params(lambda cfg: cfg["finetune"]["runs"].update({"lora-r8": {"method": "lora", "max_steps": 4}}))
    m = run_stage("finetune", params, results, "lora-r8")
    curve = m["validation_curve"]
    assert curve["starts_from_base"] is True and curve["every"] == 2
    assert [p["step"] for p in curve["points"]] == [0, 2, 4], "step 0, every 2 steps, the last"
    assert curve["points"][0]["loss"] == m["validation_before"]["loss"]
    assert curve["points"][-1]["loss"] == m["validation_after"]["loss"]
    times = [p["train_s"] for p in curve["points"]]
    assert times == sorted(times) and times[-1] == pytest.approx(sum([m["step_time"]["first_step_s"]]
                                                                     + m["step_time"]["samples"]))


def test_an_init_peft_refuses_is_unavailable_with_peft_s_reason(results, write_params, monkeypatch):
    def refuse(*args, **kwargs):
        raise ValueError("PiSSA cannot decompose this layer type\nmore lines")
    monkeypatch.setattr(lora, "_adapt", refuse)
    params = write_params(lambda cfg: cfg["finetune"]["runs"].update(
        {"pissa": {"method": "lora", "max_steps": 2, "lora": {"init": "pissa"}}}))
    m = run_stage("finetune", params, results, "pissa")
    assert m["status"] == "unavailable"
    assert m["reason"] == "lora.init pissa: peft refused it for this model: PiSSA cannot decompose this layer type"


@pytest.mark.parametrize("optimizer", ["galore_adamw", "apollo_adamw"])
def test_a_low_rank_optimizer_full_fine_tunes_with_a_smaller_optimizer_state(results, write_params, optimizer):
    def edit(cfg):
        cfg["finetune"]["runs"] |= {"adamw": {"method": "full", "optimizer": "adamw_torch", "max_steps": 3},
                                    optimizer: {"method": "full", "optimizer": optimizer, "max_steps": 3}}
    params = write_params(edit)
    adamw = run_stage("finetune", params, results, "adamw")
    low = run_stage("finetune", params, results, optimizer)
    assert low["status"] == "ok" and low["optimizer"] == optimizer
    if optimizer.startswith("galore"):  # APOLLO's default rank (256) is above the tiny model's widths: no saving
        assert low["optimizer_state_bytes"] < adamw["optimizer_state_bytes"]
    assert low["validation_after"]["loss"] < low["validation_before"]["loss"]


def test_a_missing_optimizer_package_is_unavailable_with_the_pip_line(monkeypatch, test_cfg):
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "galore_torch" else real(name))
    run = finetune_run(test_cfg, "full").but(optimizer="galore_adamw")
    assert training.unavailable_knobs(run, torch.device("cpu")) == [
        "optimizer galore_adamw needs the galore-torch package, which is not installed (pip install galore-torch)"]


@pytest.mark.parametrize("edit, message", [
    (lambda cfg: cfg["finetune"]["runs"]["lora-r8"].update({"lora": {"init": "magic"}}),
     "finetune.runs.lora-r8.lora.init"),
    (lambda cfg: cfg["finetune"]["runs"]["full"].update({"optimizer": "galore_sgd"}),
     "finetune.runs.full.optimizer"),
    (lambda cfg: cfg["finetune"]["runs"]["lora-r8"].update({"optimizer": "galore_adamw"}),
     "finetune.runs.lora-r8.optimizer: galore_adamw projects the gradients of full weights; expected method full"),
    (lambda cfg: cfg["finetune"]["target"].update({"every": 0}), "finetune.target.every"),
])
def test_an_unknown_init_or_optimizer_is_a_one_line_error_at_dry_run(tmp_path, test_cfg, edit, message):
    import copy
    cfg = copy.deepcopy(test_cfg)
    edit(cfg)
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(cfg))
    proc = subprocess.run([str(BIN / "snakemake"), "-n", "-s", str(REPO / "Snakefile"), "--directory", str(tmp_path),
                           "--cores", "1"], cwd=tmp_path, capture_output=True, text=True)
    assert proc.returncode != 0
    errors = [line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("efflab: error")]
    assert len(errors) == 1 and message in errors[0], proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


def test_the_validations_between_steps_are_timed_apart_and_counted_nowhere(monkeypatch):
    """ValidationEvery takes the loss every `every` steps (not at the last: the stage takes that one), pauses the
    token and tensor counts around it, and keeps its own seconds, which fit() takes out of the training time."""
    from types import SimpleNamespace

    from efflab.stages.finetune import callbacks

    now = [0.0]
    monkeypatch.setattr(callbacks.time, "perf_counter", lambda: now[0])

    def evaluate(model):
        assert processed.paused and not tensors.counting, "nothing counts the validation"
        now[0] += 5.0
        return {"loss": 1.0}
    processed = SimpleNamespace(paused=False)
    tensors = SimpleNamespace(counting=True, pause=lambda: setattr(tensors, "counting", False),
                              resume=lambda: setattr(tensors, "counting", True))
    step_times = SimpleNamespace(durations=[1.0, 1.0])
    evals = callbacks.ValidationEvery(2, evaluate, step_times, processed, tensors)
    model = torch.nn.Linear(1, 1)
    for step in range(1, 7):
        evals.on_step_end(None, SimpleNamespace(global_step=step, max_steps=6), None, model=model)
    assert [p["step"] for p in evals.curve] == [2, 4] and evals.seconds == 10.0
    assert model.training and not processed.paused and tensors.counting
