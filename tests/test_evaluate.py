"""The evaluate stage: lm-evaluation-harness on the models efflab makes, efflab's own task on the validation split,
the paired changes and the quality gate."""
from __future__ import annotations

import json
import shutil
import subprocess

import pandas as pd
import pytest
import torch
import yaml

from efflab import config
from efflab.config import UserError
from efflab.evaluation import harness, scores
from efflab.evaluation.task import GEN_TASK, LL_TASK
from efflab.layout import Layout
from efflab.modeling import base_dtype, load_model, load_tokenizer
from tests.helpers import BIN, REPO, TEST_PARAMS, run_stage

TASKS = [GEN_TASK, LL_TASK]


def _cli_results(out_dir) -> dict:
    (found,) = out_dir.rglob("results_*.json")
    return json.loads(found.read_text())["results"]


@pytest.mark.integration  # lm-eval's own CLI run beside efflab's: ~35 s (make test-integration)
def test_efflab_s_scores_equal_lm_eval_s_own_cli_on_the_generated_task(results, test_cfg, tmp_path):
    """The task prepare_data writes is a folder lm_eval itself runs; efflab's record of the base model holds the
    same scores as lm_eval's CLI gives on that folder, with the command efflab records for it."""
    record = run_stage("evaluate", TEST_PARAMS, results, "base")
    layout, e = Layout(results), test_cfg["evaluate"]
    (command,) = record["commands"].values()  # efflab's two tasks, in one lm_eval run
    cmd = command.split() + ["--output_path", str(tmp_path / "cli")]
    assert cmd[0] == "lm_eval" and f"--limit {e['docs']}" in command and ",".join(TASKS) in command
    done = subprocess.run([str(BIN / "lm_eval"), *cmd[1:]], capture_output=True, text=True,
                          env={"PATH": str(BIN), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
                               "DISABLE_MULTIPROC": "1", "HOME": str(tmp_path)}, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    theirs = _cli_results(tmp_path / "cli")
    for task in TASKS:
        for metric, mine in record["tasks"][task]["metrics"].items():
            assert theirs[task][f"{metric},none"] == pytest.approx(mine["value"], rel=1e-6, abs=1e-9), (task, metric)
    assert record["tasks"][GEN_TASK]["n_docs"] == e["docs"]
    # the documents are the validation split's, which no fine-tune trains on
    docs = [json.loads(line) for line in (layout.lm_eval_task() / "validation.jsonl").read_text().splitlines()]
    train = set(pd.read_parquet(layout.split("train"))["question"])
    assert docs and not {d["question"] for d in docs} & train
    assert [s["reference"] for s in record["samples"]] == [d["answer"] for d in docs[:e["samples"]]]


def test_a_quantized_model_is_scored_as_its_quantized_modules_and_paired_with_the_base(results, monkeypatch):
    import sys

    monkeypatch.setattr(sys, "dont_write_bytecode", False)  # as under `make`: bytecode kept on first import
    run_stage("quantize", TEST_PARAMS, results, "baseline")
    run_stage("quantize", TEST_PARAMS, results, "int8")
    base = run_stage("evaluate", TEST_PARAMS, results, "base")
    int8 = run_stage("evaluate", TEST_PARAMS, results, "quantized-int8")
    linears = sum(1 for m in load_model(Layout(results).base_model(), "float32", torch.device("cpu")).modules()
                  if isinstance(m, torch.nn.Linear)) - 1  # bitsandbytes keeps the output head in full precision
    assert base["quantized_modules"] == {} and int8["quantized_modules"] == {"Linear8bitLt": linears}
    assert not list((results / "prepare_data").rglob("__pycache__")), "lm-eval's import of the task folder's " \
        "utils.py left bytecode in prepare_data's output, changing its content after its hash was recorded"
    assert int8["reference"] == "base" and int8["gate"]["verdict"] in ("passes", "fails", "undecided")
    bpb = int8["changes"][LL_TASK]["bits_per_byte"]
    assert bpb["n"] == base["tasks"][LL_TASK]["n_docs"] and bpb["ci95"][0] <= bpb["change"] <= bpb["ci95"][1]
    got = int8["tasks"][LL_TASK]["metrics"]["bits_per_byte"]["value"]
    assert bpb["change"] == pytest.approx(got - base["tasks"][LL_TASK]["metrics"]["bits_per_byte"]["value"], abs=1e-9)


def test_a_broken_model_fails_the_gate(results, test_cfg):
    """The same lm-eval run on the base and on the base with its output layer scaled 100-fold (confidently wrong
    next-token distributions): the broken model's drop in the answer's log-likelihood is far beyond the tolerance,
    decided by the interval."""
    layout, e = Layout(results), test_cfg["evaluate"]
    tokenizer = load_tokenizer(layout.base_model())
    model = load_model(layout.base_model(), base_dtype(layout), torch.device("cpu"))
    run = lambda m: harness.evaluate(m, tokenizer, layout.lm_eval_task(), [LL_TASK], e["docs"], e["max_new_tokens"],
                                     e["batch_size"], 0)
    reference = run(model)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(100.0)
    changes = scores.paired_changes(run(model), {"tasks": reference}, e["tolerance"])
    bpb = changes[LL_TASK]["bits_per_byte"]
    assert bpb["ci95"][0] > e["tolerance"]["bits_per_byte"], bpb
    assert scores.gate_verdict(changes) == {"verdict": "fails", "failed": [f"{LL_TASK}/bits_per_byte"]}


@pytest.mark.parametrize(("changes", "tolerance", "higher", "verdict"), [
    ({"change": -12.0, "ci95": [-15.0, -11.0]}, 10.0, True, "fails"),   # chrF fell by more than 10 throughout
    ({"change": -3.0, "ci95": [-6.0, 0.5]}, 10.0, True, "passes"),
    ({"change": -9.0, "ci95": [-14.0, -4.0]}, 10.0, True, "undecided"),
    ({"change": 0.3, "ci95": [0.2, 0.4]}, 0.1, False, "fails"),        # bits per byte rose by more than 0.1
    ({"change": 0.3, "ci95": None}, 0.1, False, "undecided"),           # too few documents for an interval
])
def test_the_gate_is_decided_by_the_interval_of_the_drop(changes, tolerance, higher, verdict):
    assert scores.gate(changes, tolerance, higher) == verdict


def test_paired_mean_change_gives_an_interval_only_from_six_documents():
    from efflab import quality

    assert quality.paired_mean_change([0.0] * 5, [1.0] * 5)["ci95"] is None
    chg = quality.paired_mean_change([0, 0, 0, 0, 0, 0], [1, 2, 1, 2, 1, 2])
    assert chg["change"] == 1.5 and chg["ci95"][0] < 1.5 < chg["ci95"][1]


def test_an_unknown_task_name_is_one_line_naming_the_key(test_cfg, tmp_path):
    cfg = {**test_cfg, "evaluate": {**test_cfg["evaluate"], "tasks": [LL_TASK, "arc_easy", "no_such_task_xyz"]}}
    with pytest.raises(UserError, match=r"evaluate\.tasks: 'no_such_task_xyz' is not an lm-eval task"):
        config.validate(cfg)
    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump(cfg))
    dry = subprocess.run([str(BIN / "snakemake"), "-s", str(REPO / "Snakefile"), "--directory", str(tmp_path),
                          "--configfile", str(params), "--dry-run", "--cores", "1"], capture_output=True, text=True)
    assert dry.returncode != 0 and "evaluate.tasks: 'no_such_task_xyz'" in dry.stdout + dry.stderr
    assert "Traceback" not in dry.stdout + dry.stderr


def test_the_evaluated_models_are_every_model_the_run_makes_and_a_list_keeps_what_it_is_paired_with(test_cfg):
    cfg = {**test_cfg, "evaluate": {**test_cfg["evaluate"], "models": None}}
    models = config.evaluated_models(cfg)
    assert models["base"]["reference"] is None
    for name, scheme in cfg["quantize"]["schemes"].items():
        assert (f"quantized-{name}" in models) == (scheme["method"] != "none")
    for name in config.merge_runs(cfg):
        assert models[f"merged-{name}"]["reference"] == f"adapter-{name}"
    chosen = {**cfg, "evaluate": {**cfg["evaluate"], "models": [f"merged-{config.merge_runs(cfg)[0]}"]}}
    assert set(config.evaluated_models(chosen)) == {f"merged-{config.merge_runs(cfg)[0]}",
                                                    f"adapter-{config.merge_runs(cfg)[0]}"}
    with pytest.raises(UserError, match=r"evaluate\.models: 'quantised-int8' is not a model"):
        config.validate({**cfg, "evaluate": {**cfg["evaluate"], "models": ["quantised-int8"]}})
    # a model of a scheme or strategy this experiment does not have is left out, as that stage's job is
    unmade = {**cfg, "evaluate": {**cfg["evaluate"], "models": ["quantized-nope", "quantized-int8"]}}
    assert set(config.evaluated_models(config.validate(unmade))) == {"base", "quantized-int8"}


def test_a_task_whose_data_cannot_be_loaded_is_unavailable_and_the_others_run(results, test_cfg, tmp_path,
                                                                              monkeypatch):
    """A task named in evaluate.tasks whose dataset is not at hand (offline: a hub dataset) is a cell with its
    reason; efflab's own task beside it still runs."""
    layout, e = Layout(results), test_cfg["evaluate"]
    folder = tmp_path / "tasks"
    shutil.copytree(layout.lm_eval_task(), folder)
    (folder / "hub_only.yaml").write_text("task: hub_only\ndataset_path: efflab-tests/no-such-dataset\n"
                                          "output_type: loglikelihood\ntest_split: test\ndoc_to_text: '{{q}}'\n"
                                          "doc_to_target: '{{a}}'\nmetric_list: [{metric: acc}]\n")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    model = load_model(layout.base_model(), base_dtype(layout), torch.device("cpu"))
    out = harness.evaluate(model, load_tokenizer(layout.base_model()), folder, [LL_TASK, "hub_only"], e["docs"],
                           e["max_new_tokens"], e["batch_size"], 0)
    assert out[LL_TASK]["status"] == "ok" and out[LL_TASK]["n_docs"] == e["docs"]
    assert out["hub_only"]["status"] == "unavailable" and len(out["hub_only"]["reason"]) > 20
