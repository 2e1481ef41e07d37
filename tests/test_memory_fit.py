"""What will not fit is said before it runs: the dry run's line per job (predicted peak, budget, verdict), the
verdicts from injected predictions and the estimator's error measured from the run's records, and a fine-tuning job
predicted over the budget recorded unavailable without training."""
from __future__ import annotations

import copy
import json

import pytest
from transformers import AutoConfig, AutoModelForCausalLM

from efflab import config
from efflab.estimators import fit
from efflab.layout import Layout
from efflab.models import memory_check
from tests.families import FAMILIES
from tests.helpers import TEST_PARAMS, run_stage

ROOM = {"mib": 1000.0, "source": "runtime.memory_budget"}


def training(weights: float, growth: float | None, floor: float | None = None) -> dict:
    return {"kind": "training", "weights_mib": weights, "growth_mib": growth, "floor_mib": floor,
            "unavailable": None if growth else "not modelled: model type 'gpt2'"}


def test_the_verdict_is_fits_tight_or_will_not_fit_by_the_error_the_run_measured():
    errors = {"training": {"error": 0.1, "n": 4}}
    assert fit.assess(training(400, 500), ROOM, errors)["verdict"] == fit.FITS  # 400 + 550 <= 1000
    assert fit.assess(training(400, 580), ROOM, errors)["verdict"] == fit.TIGHT  # 400 + 638 > 1000 >= 980
    refused = fit.assess(training(400, 620), ROOM, errors)
    assert refused["verdict"] == fit.WILL_NOT_FIT and refused["predicted_mib"] == 1020
    assert fit.refusal(refused) == "predicted 1.00 GiB > 0.98 GiB (runtime.memory_budget)"
    # no record has measured the estimator's error yet: nothing is called tight
    assert fit.assess(training(400, 580), ROOM, {})["verdict"] == fit.FITS
    # a family the estimator does not model: refused on its floor, never said to fit
    assert fit.assess(training(400, None, floor=1200), ROOM, errors)["verdict"] == fit.WILL_NOT_FIT
    assert fit.assess(training(400, None, floor=900), ROOM, errors)["verdict"] is None
    assert fit.refusal(fit.assess(training(400, None, floor=1200), ROOM, errors)).startswith("predicted at least 1.17")


def test_the_error_is_the_largest_one_the_run_records_measured_per_kind(tmp_path):
    def write(stage, name, record):
        (tmp_path / stage / name).mkdir(parents=True)
        (tmp_path / stage / name / "metrics.json").write_text(json.dumps(record))
    write("finetune", "full", {"memory_prediction": {"ratio": 1.02}})
    write("finetune", "lora", {"memory_prediction": {"ratio": 0.95}})
    write("finetune", "gone", {"status": "unavailable"})
    write("bench_inference", "int8", {"cells": [{"memory_prediction": {"ratio": 1.2}}, {"status": "oom"}]})
    errors = fit.measured_error(tmp_path)
    assert errors["training"] == {"error": pytest.approx(0.05), "n": 2}
    assert errors["generation"] == {"error": pytest.approx(0.2), "n": 1}
    assert fit.measured_error(tmp_path / "none") == {}


def test_a_full_fine_tune_whose_adam_state_alone_exceeds_the_budget_is_refused_at_the_dry_run(tmp_path, monkeypatch):
    monkeypatch.setenv("EFFLAB_CACHE_DIR", str(tmp_path / "cache"))
    family = AutoConfig.for_model("llama", vocab_size=1000, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                  **FAMILIES["llama"])
    folder = tmp_path / "llama"
    family.save_pretrained(folder)
    (folder / "tokenizer.json").write_text("{}")
    adam_mib = 8 * sum(p.numel() for p in AutoModelForCausalLM.from_config(family).parameters()) / 2**20
    cfg = copy.deepcopy(config.load(TEST_PARAMS))
    cfg["base_model"] |= {"source": str(folder), "config_overrides": {}}
    cfg["runtime"]["memory_budget"] = 0.9 * adam_mib / 1024
    lines = memory_check.plan(cfg, "cpu", tmp_path / "results")
    full = next(line for line in lines if line.startswith("memory: finetune full: "))
    assert full.startswith("memory: finetune full: will not fit: predicted ")
    assert "runtime.try_anyway" in full and "change finetune.runs.full" in full, full
    assert f"; budget {0.9 * adam_mib / 1024:.2f} GiB (runtime.memory_budget)" in full
    jobs = [line.split(":")[1].strip() for line in lines]
    assert {"finetune lora-r8", "bench_inference baseline"} <= set(jobs), lines
    cfg["runtime"]["memory_budget"] = 1000.0
    assert all(": fits: " in line for line in memory_check.plan(cfg, "cpu", tmp_path / "results"))


def test_a_run_predicted_over_the_budget_is_unavailable_without_training_unless_tried_anyway(results, write_params):
    params = write_params(lambda cfg: cfg["runtime"].update(memory_budget=0.01))
    m = run_stage("finetune", params, results, "full")
    assert m["status"] == "unavailable" and m["reason"].startswith("predicted ")
    assert m["reason"].endswith("> 0.01 GiB (runtime.memory_budget)"), m["reason"]
    assert m["memory_fit"]["verdict"] == fit.WILL_NOT_FIT
    assert m["memory_fit"]["predicted_mib"] > m["memory_fit"]["budget_mib"] == pytest.approx(0.01 * 1024)
    out = Layout(results).out("finetune", "full")
    assert sorted(p.name for p in out.iterdir()) == ["figures.json", "loss.csv", "metrics.json", "model"]
    assert [p.name for p in (out / "model").iterdir()] == ["NOT_RUN.txt"], "no model saved: nothing trained"
    tried = run_stage("finetune", write_params(lambda cfg: cfg["runtime"].update(memory_budget=0.01, try_anyway=True)),
                      results, "full")
    assert tried["status"] == "ok" and tried["memory_fit"]["verdict"] == fit.WILL_NOT_FIT  # kept beside what ran


def test_an_inference_cell_predicted_over_the_budget_is_unavailable_and_the_others_keep_their_verdict(results,
                                                                                                     write_params):
    def tiny(cfg):
        cfg["runtime"]["memory_budget"] = 0.001
        cfg["bench_inference"]["variants"] = {"baseline": {"kind": "base", "generation": ["dynamic"]}}
    cell, = run_stage("bench_inference", write_params(tiny), results, "baseline")["cells"]
    assert cell["status"] == "unavailable" and cell["reason"].endswith("> 0.00 GiB (runtime.memory_budget)")
    assert cell["memory_fit"]["weights_mib"] > cell["memory_fit"]["budget_mib"]


def test_a_dry_run_over_the_budget_only_on_rows_of_max_length_leaves_the_verdict_to_the_job(tmp_path, monkeypatch):
    monkeypatch.setenv("EFFLAB_CACHE_DIR", str(tmp_path / "cache"))
    f = fit.assess(training(400, 700, floor=500), ROOM, {})
    assert memory_check._line({"job": "finetune lora", "key": "k", "bounded": True}, f).startswith(
        "memory: finetune lora: may not fit (its job decides on the prepared rows): predicted 1.07 GiB")
    refused = memory_check._line({"job": "finetune full", "key": "k", "bounded": True},
                                 fit.assess(training(400, 700, floor=1100), ROOM, {}))
    assert refused.startswith("memory: finetune full: will not fit") and "runtime.try_anyway" in refused


def test_a_family_the_estimator_does_not_model_is_refused_on_its_floor_and_never_said_to_fit(tmp_path, monkeypatch):
    monkeypatch.setenv("EFFLAB_CACHE_DIR", str(tmp_path / "cache"))
    folder = tmp_path / "gpt2"
    AutoConfig.for_model("gpt2", vocab_size=1000, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                         **FAMILIES["gpt2"]).save_pretrained(folder)
    (folder / "tokenizer.json").write_text("{}")
    cfg = copy.deepcopy(config.load(TEST_PARAMS))
    cfg["base_model"] |= {"source": str(folder), "config_overrides": {}}
    cfg["runtime"]["memory_budget"] = 1e-4
    lines = {line.split(":")[1].strip(): line for line in memory_check.plan(cfg, "cpu", tmp_path / "results")}
    assert lines["finetune full"].startswith("memory: finetune full: will not fit: predicted at least ")
    assert "not modelled: model type 'gpt2'" in lines["finetune full"]
    # the CI params' Llama LoRA targets are not GPT-2's: that run is unavailable for it, not for its memory
    assert lines["finetune lora-r8"].startswith("memory: finetune lora-r8: not decided: not predicted: ")
