"""The evaluate stage: lm-evaluation-harness on the models efflab makes, efflab's own task on the validation split,
the paired changes and the quality gate."""
from __future__ import annotations

import json
import subprocess

import pandas as pd
import pytest
import torch
import yaml

from efflab import config, experiment
from efflab.config import UserError
from efflab.evaluation import harness, scores, task
from efflab.evaluation.task import GEN_TASK, LL_TASK
from efflab.layout import Layout
from efflab.models.modeling import base_dtype, load_model, load_tokenizer
from tests.helpers import BIN, REPO, TEST_PARAMS, run_stage

TASKS = [GEN_TASK, LL_TASK]


def _cli_results(out_dir) -> dict:
    (found,) = out_dir.rglob("results_*.json")
    return json.loads(found.read_text())["results"]


def answering(model, tokenizer):
    """The tiny random model answers blank lines alone, whose chrF is 0 at any length: no generation setting could be
    told apart by its scores. Given an output layer of its own with the rows of the line break and of " the"
    swapped, it answers words instead, whose chrF changes with their length (1.27 at 1 token, 1.28 at 4, 4.4 at 64)."""
    model.config.tie_word_embeddings = False
    model.lm_head = torch.nn.Linear(model.config.hidden_size, model.config.vocab_size, bias=False)
    model.lm_head.weight.data = model.get_input_embeddings().weight.data.clone()
    (line_break,), (the,) = tokenizer.encode("\n"), tokenizer.encode(" the")
    weight = model.lm_head.weight.data
    weight[[line_break, the]] = weight[[the, line_break]]
    return model


@pytest.mark.integration  # lm-eval's own CLI run beside efflab's: ~50 s (make test-integration)
def test_the_rerun_line_of_the_task_file_gives_efflab_s_scores_with_lm_eval_s_own_cli(results, test_cfg, tmp_path):
    """One score, one recipe: the task file the evaluate job scored with states, in its comment, the lm_eval command
    that reruns it; that very line (the record's command too, with no --gen_kwargs), run by lm_eval's own CLI, gives
    the scores efflab recorded for the base model, generated (chrF, exact match) and log-likelihood (bits per byte,
    acc) alike."""
    layout, e = Layout(results), test_cfg["evaluate"]
    tokenizer = load_tokenizer(layout.base_model())
    answering(load_model(layout.base_model(), "float32", torch.device("cpu")), tokenizer).save_pretrained(
        layout.base_model())  # answers whose chrF depends on their length
    record = run_stage("evaluate", TEST_PARAMS, results, "base")
    assert record["tasks"][GEN_TASK]["metrics"]["chrf"]["value"] > 0
    line = task.rerun_line(layout.lm_eval_task("base") / f"{GEN_TASK}.yaml")
    assert line == task.rerun_line(layout.lm_eval_task("base") / f"{LL_TASK}.yaml")
    assert list(record["commands"].values()) == [line]  # efflab's two tasks, in one lm_eval run
    assert line.startswith("lm_eval ") and "--gen_kwargs" not in line and f"--limit {e['docs']}" in line
    assert f"--include_path {layout.lm_eval_task('base')} " in line and f"--tasks {','.join(TASKS)} " in line
    done = subprocess.run([str(BIN / "lm_eval"), *line.split()[1:], "--output_path", str(tmp_path / "cli")],
                          capture_output=True, text=True,
                          env={"PATH": str(BIN), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
                               "DISABLE_MULTIPROC": "1", "HOME": str(tmp_path)}, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    theirs = _cli_results(tmp_path / "cli")
    for t, metrics in {GEN_TASK: ("chrf", "exact_match"), LL_TASK: ("bits_per_byte", "acc")}.items():
        mine = record["tasks"][t]["metrics"]
        assert set(metrics) <= set(mine), (t, mine)
        for metric, value in mine.items():
            assert theirs[t][f"{metric},none"] == pytest.approx(value["value"], rel=1e-6, abs=1e-9), (t, metric)
    assert record["tasks"][GEN_TASK]["n_docs"] == e["docs"]
    # the documents are the validation split's, which no fine-tune trains on
    docs = [json.loads(line) for line in (layout.lm_eval_docs() / "validation.jsonl").read_text().splitlines()]
    train = set(pd.read_parquet(layout.split("train"))["question"])
    assert docs and not {d["question"] for d in docs} & train
    assert [s["reference"] for s in record["samples"]] == [d["answer"] for d in docs[:e["samples"]]]


def test_the_task_file_carries_every_generation_setting_efflab_scores_with(results, test_cfg, tmp_path):
    """efflab passes lm-eval no generation settings of its own: the task file's generation_kwargs are what it
    generates with (a file that says 1 token gives the first word of what one that says evaluate.max_new_tokens
    gives, and another chrF), and the evaluate job's file says evaluate.max_new_tokens, greedy, up to the end of
    turn."""
    layout, e = Layout(results), test_cfg["evaluate"]
    tokenizer = load_tokenizer(layout.base_model())
    model = answering(load_model(layout.base_model(), "float32", torch.device("cpu")), tokenizer)
    answers, chrf = {}, {}
    for n in (1, e["max_new_tokens"]):
        folder = task.write_task(tmp_path / str(n), layout.lm_eval_docs(), task.generation_kwargs(n, tokenizer.eos_token))
        out = harness.evaluate(model, tokenizer, folder, [GEN_TASK], e["docs"], e["batch_size"], 0)[GEN_TASK]
        answers[n], chrf[n] = [d["response"] for d in out["docs"]], out["metrics"]["chrf"]["value"]
    assert all(long.startswith(short) and long != short for short, long in zip(*answers.values())), answers
    assert 0 < chrf[1] < chrf[e["max_new_tokens"]], chrf
    written = task.write_task(tmp_path / "job", layout.lm_eval_docs(),
                              task.generation_kwargs(e["max_new_tokens"], tokenizer.eos_token),
                              {GEN_TASK: "lm_eval --tasks x"})
    gen = yaml.load((written / f"{GEN_TASK}.yaml").read_text(), Loader=yaml.BaseLoader)["generation_kwargs"]
    assert gen == {"max_gen_toks": str(e["max_new_tokens"]), "until": [tokenizer.eos_token], "do_sample": "false"}
    assert task.rerun_line(written / f"{GEN_TASK}.yaml") == "lm_eval --tasks x"
    assert "<model folder>" in task.rerun_line(written / f"{LL_TASK}.yaml")  # no command of its own: the form


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
    assert not list(results.rglob("__pycache__")), "lm-eval's import of the task folder's utils.py left bytecode " \
        "in the job's output, changing its content after its hash was recorded"
    for name, record in (("base", base), ("quantized-int8", int8)):  # the task folder it scored with, in its folder
        (command,) = record["commands"].values()
        assert task.rerun_line(Layout(results).lm_eval_task(name) / f"{GEN_TASK}.yaml") == command
        assert "--gen_kwargs" not in command and f"--include_path {Layout(results).lm_eval_task(name)} " in command
    assert int8["reference"] == "base" and int8["gate"]["verdict"] in ("passes", "fails", "undecided")
    bpb = int8["changes"][LL_TASK]["bits_per_byte"]
    assert bpb["n"] == base["tasks"][LL_TASK]["n_docs"] and bpb["ci95"][0] <= bpb["change"] <= bpb["ci95"][1]
    got = int8["tasks"][LL_TASK]["metrics"]["bits_per_byte"]["value"]
    assert bpb["change"] == pytest.approx(got - base["tasks"][LL_TASK]["metrics"]["bits_per_byte"]["value"], abs=1e-9)


def test_a_broken_model_fails_the_gate(results, test_cfg, tmp_path):
    """The same lm-eval run on the base and on the base with its output layer scaled 100-fold (confidently wrong
    next-token distributions): the broken model's drop in the answer's log-likelihood is far beyond the tolerance,
    decided by the interval."""
    layout, e = Layout(results), test_cfg["evaluate"]
    tokenizer = load_tokenizer(layout.base_model())
    model = load_model(layout.base_model(), base_dtype(layout), torch.device("cpu"))
    folder = task.write_task(tmp_path / "lm_eval", layout.lm_eval_docs(),
                             task.generation_kwargs(e["max_new_tokens"], tokenizer.eos_token))
    run = lambda m: harness.evaluate(m, tokenizer, folder, [LL_TASK], e["docs"], e["batch_size"], 0)
    reference = run(model)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(100.0)
    changes = scores.paired_changes(run(model), {"tasks": reference}, config.task_tolerance(test_cfg))
    bpb = changes[LL_TASK]["bits_per_byte"]
    assert bpb["ci95"][0] > test_cfg["tolerance"]["bits_per_byte"], bpb
    assert scores.gate_verdict(changes) == {"verdict": "fails", "failed": [f"{LL_TASK}/bits_per_byte"]}


@pytest.mark.parametrize(("changes", "tolerance", "higher", "verdict"), [
    ({"change": -12.0, "ci95": [-15.0, -11.0]}, 10.0, True, "fails"),   # chrF fell by more than 10 throughout
    ({"change": -3.0, "ci95": [-6.0, 0.5]}, 10.0, True, "passes"),
    ({"change": -9.0, "ci95": [-14.0, -4.0]}, 10.0, True, "not decided at this size"),
    ({"change": 0.3, "ci95": [0.2, 0.4]}, 0.1, False, "fails"),        # bits per byte rose by more than 0.1
    ({"change": 0.3, "ci95": None}, 0.1, False, "not decided at this size"),  # too few documents for an interval
])
def test_the_gate_is_decided_by_the_interval_of_the_drop(changes, tolerance, higher, verdict):
    assert scores.gate(changes, tolerance, higher) == verdict


def _gen(responses, exact, chrf):
    docs = [{"doc_id": i, "target": "t", "response": r, "scores": {"exact_match": e, "chrf": c}}
            for i, (r, e, c) in enumerate(zip(responses, exact, chrf))]
    return {"status": "ok", "metrics": {"exact_match": {"value": sum(exact) / len(exact)},
                                        "chrf": {"value": sum(chrf) / len(chrf)}},
            "higher_is_better": {"exact_match": True, "chrf": True}, "docs": docs}


def test_a_gate_counts_only_what_the_base_resolves_fails_on_empty_answers_and_else_cannot_tell():
    """Six documents: the base matches none exactly (exact_match 0: nothing to lose), so exact_match cannot tell; a
    model that answers nothing fails whatever chrF's interval says; where no metric resolves, the gate cannot tell."""
    base = {"tasks": {GEN_TASK: _gen(["a b"] * 6, [0] * 6, [12.0, 14.0, 10.0, 13.0, 11.0, 12.0])}}
    tolerance = {"exact_match": 0.1, "chrf": 10.0}
    same = scores.paired_changes({GEN_TASK: _gen(["a b"] * 6, [0] * 6, [12.0, 13.0, 11.0, 13.0, 11.0, 12.0])},
                                 base, tolerance)
    assert same[GEN_TASK]["exact_match"]["gate"].startswith("cannot tell at this size: the base model scores 0")
    assert same[GEN_TASK]["chrf"]["gate"] == "passes" and scores.gate_verdict(same)["verdict"] == "passes"
    silent = scores.paired_changes({GEN_TASK: _gen([""] * 6, [0] * 6, [0.0] * 6)}, base, tolerance)
    assert silent[GEN_TASK]["empty answers"]["gate"] == "fails: all 6 answers empty"
    assert scores.gate_verdict(silent)["verdict"] == "fails" and f"{GEN_TASK}/empty answers" in scores.gate_verdict(
        silent)["failed"]
    only_shares = scores.paired_changes({GEN_TASK: _gen(["a"] * 6, [0] * 6, [12.0] * 6)}, base, {"exact_match": 0.1})
    assert scores.gate_verdict(only_shares)["verdict"] == "cannot tell at this size"
    old = {"model": "m", "tasks": {GEN_TASK: _gen([""] * 6, [0] * 6, [0.0] * 6)},
           "changes": {GEN_TASK: {k: {x: y for x, y in c.items() if x not in ("unresolved", "reference_value")}
                                  for k, c in silent[GEN_TASK].items() if k != "empty answers"}}}
    again = scores.with_resolution(old, base)  # a record made before: the same from the base's record
    assert again[GEN_TASK]["empty answers"]["gate"] == "fails: all 6 answers empty"
    assert again[GEN_TASK]["exact_match"]["unresolved"].startswith("cannot tell")


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
    models = experiment.evaluated_models(cfg)
    assert models["base"]["reference"] is None
    for name, scheme in cfg["quantize"]["schemes"].items():
        assert (f"quantized-{name}" in models) == (scheme["method"] != "none")
    for name in experiment.merge_runs(cfg):
        assert models[f"merged-{name}"]["reference"] == f"adapter-{name}"
    chosen = {**cfg, "evaluate": {**cfg["evaluate"], "models": [f"merged-{experiment.merge_runs(cfg)[0]}"]}}
    assert set(experiment.evaluated_models(chosen)) == {f"merged-{experiment.merge_runs(cfg)[0]}",
                                                    f"adapter-{experiment.merge_runs(cfg)[0]}"}
    with pytest.raises(UserError, match=r"evaluate\.models: 'quantised-int8' is not a model"):
        config.validate({**cfg, "evaluate": {**cfg["evaluate"], "models": ["quantised-int8"]}})
    # a model of a scheme or strategy this experiment does not have is left out, as that stage's job is
    unmade = {**cfg, "evaluate": {**cfg["evaluate"], "models": ["quantized-nope", "quantized-int8"]}}
    assert set(experiment.evaluated_models(config.validate(unmade))) == {"base", "quantized-int8"}


@pytest.mark.integration  # make test's 10 minutes on a 2-core AVX2 CPU: run by make test-integration
def test_a_task_whose_data_cannot_be_loaded_is_unavailable_and_the_others_run(results, test_cfg, tmp_path,
                                                                              monkeypatch):
    """A task named in evaluate.tasks whose dataset is not at hand (offline: a hub dataset) is a cell with its
    reason; efflab's own task beside it still runs."""
    layout, e = Layout(results), test_cfg["evaluate"]
    folder = task.write_task(tmp_path / "tasks", layout.lm_eval_docs(), task.generation_kwargs(e["max_new_tokens"], None))
    (folder / "hub_only.yaml").write_text("task: hub_only\ndataset_path: efflab-tests/no-such-dataset\n"
                                          "output_type: loglikelihood\ntest_split: test\ndoc_to_text: '{{q}}'\n"
                                          "doc_to_target: '{{a}}'\nmetric_list: [{metric: acc}]\n")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    model = load_model(layout.base_model(), base_dtype(layout), torch.device("cpu"))
    out = harness.evaluate(model, load_tokenizer(layout.base_model()), folder, [LL_TASK, "hub_only"], e["docs"],
                           e["batch_size"], 0)
    assert out[LL_TASK]["status"] == "ok" and out[LL_TASK]["n_docs"] == e["docs"]
    assert out["hub_only"]["status"] == "unavailable" and len(out["hub_only"]["reason"]) > 20


def test_without_lm_eval_installed_a_model_s_evaluation_is_unavailable_with_its_reason(results, monkeypatch):
    """An offline node's bundle may leave lm-eval out (its pyarrow alone is 55 MB): the job is a cell saying so,
    with its stage's outputs in place, and nothing is loaded."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "lm_eval" else real(name, *a))
    record = run_stage("evaluate", TEST_PARAMS, results, "base")
    assert record["status"] == "unavailable" and "lm-eval is not installed" in record["reason"]
    assert record["model"] == "base"


def test_a_task_tolerance_is_held_to_its_share_of_the_base_score_and_the_gate_can_fail():
    base = {"tasks": {"gen": {"status": "ok", "metrics": {"chrf": {"value": 12.05}},
                              "docs": [{"doc_id": i, "scores": {"chrf": 12.05 + (i % 3)}} for i in range(12)]}}}
    worse = {"gen": {"status": "ok", "metrics": {"chrf": {"value": 9.0}}, "higher_is_better": {"chrf": True},
                     "docs": [{"doc_id": i, "scores": {"chrf": 9.0 + (i % 3) + (i % 2) * 0.2}} for i in range(12)]}}
    absolute = scores.paired_changes(worse, base, {"chrf": 10.0})["gen"]["chrf"]
    relative = scores.paired_changes(worse, base, {"chrf": 10.0}, relative=0.1)["gen"]["chrf"]
    assert absolute["ci95"][1] < -1.205, absolute  # a fall of about 3 points, its whole interval below -1.2
    assert absolute["tolerance"] == 10.0 and absolute["gate"] == "passes"  # 10 points of 12: most of it may go
    assert relative["tolerance"] == pytest.approx(1.205) and relative["gate"] == "fails"
    assert scores.tolerance_of(0.02, 1.5, 0.1) == 0.02  # the metric's own where it is the less
