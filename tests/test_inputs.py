"""Local sources are inputs: a local data file (prepare_data.source) or model folder (base_model.source) is
a Snakemake input and a DVC dependency, so editing it reruns its stage and what follows; a missing one
stops the dry run with one line."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from efflab import config
from efflab.config import DATA_SUFFIXES, UserError, classify_source, local_source_files
from efflab.stages.prepare_data import READERS
from tests.helpers import BIN, REPO, TEST_PARAMS, run_stage


def test_hub_ids_with_version_dots_are_hub_ids_and_missing_file_names_are_errors(tmp_path, monkeypatch):
    for hub_id in ("Qwen/Qwen2.5-0.5B-Instruct", "meta-llama/Llama-3.2-1B", "tatsu-lab/alpaca"):
        assert classify_source(hub_id, "k") == "hub"
    monkeypatch.chdir(tmp_path)
    for missing in ("data/rows.csv", "rows.jsonl", "data/rows.txt"):
        with pytest.raises(UserError, match=f"^k: '{missing}' does not exist in {tmp_path} "):
            classify_source(missing, "k")


def test_local_source_files_are_the_data_file_or_the_model_folders_files(tmp_path):
    assert tuple(READERS) == DATA_SUFFIXES
    assert local_source_files("prepare_data", "embedded:zaragoza-construction-faq") == []
    assert local_source_files("base_model", "HuggingFaceTB/SmolLM2-135M-Instruct") == []
    data = tmp_path / "rows.csv"
    data.write_text("instruction,input,output\n")
    assert local_source_files("prepare_data", str(data)) == [str(data)]
    model = tmp_path / "model"
    model.mkdir()
    for name in ("config.json", "model.safetensors", "tokenizer.json", ".cache"):
        (model / name).write_text("{}")
    (model / "subfolder").mkdir()
    assert local_source_files("base_model", str(model)) == [str(model / n) for n in
                                                            ("config.json", "model.safetensors", "tokenizer.json")]
    (model / "config.json").unlink()
    with pytest.raises(UserError, match=r"base_model.source: '.*' is not a model folder \(expected a folder with"):
        local_source_files("base_model", str(model))
    for not_data in (model, tmp_path / "rows.tsv"):
        not_data.touch()
        with pytest.raises(UserError, match=r"prepare_data.source: '.*' is not a data file \(expected a .jsonl/"):
            local_source_files("prepare_data", str(not_data))


def test_the_base_model_cli_refuses_a_folder_without_a_model_in_one_line(tmp_path, write_params, capsys):
    (tmp_path / "not-a-model").mkdir()

    def edit(cfg):
        cfg["base_model"] |= {"source": str(tmp_path / "not-a-model"), "random_init": False, "config_overrides": {}}
    with pytest.raises(SystemExit) as exit_:
        run_stage("base_model", write_params(edit), tmp_path / "results")
    assert exit_.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert errors == [f"efflab base_model: error: base_model.source: '{tmp_path / 'not-a-model'}' is not a model "
                      "folder (expected a folder with config.json)"]
    assert not list((tmp_path / "results").rglob("*.*"))


def _sh(cmd: list, cwd: Path, ok: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(c) for c in cmd], cwd=cwd, capture_output=True, text=True, timeout=600)
    assert (proc.returncode == 0) == ok, f"{cmd}: exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def _snakemake(work: Path, *args, ok: bool = True) -> subprocess.CompletedProcess:
    return _sh([BIN / "snakemake", "-s", REPO / "Snakefile", "--directory", work, "--cores", "2", *args], work, ok)


def _planned(work: Path, target: str) -> dict[str, str]:
    """rule -> the reason `snakemake -n` gives for running it."""
    out = _snakemake(work, "-n", target).stdout
    plan, rule = {}, None
    for line in out.splitlines():
        if line.startswith(("rule ", "localrule ")):
            rule = line.split()[1].rstrip(":")
        elif rule and line.strip().startswith("reason: "):
            plan[rule] = line.strip()[len("reason: "):]
    return plan


def _write_rows(path: Path, answer: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = ["question,answer"] + [f"How do I fix crack {i}?,{answer} {i}." for i in range(32)]
    path.write_text("\n".join(lines) + "\n")


@pytest.mark.slow
@pytest.mark.integration  # snakemake and dvc reruns: ~40 s of a worker, make test keeps its 10 minutes
def test_editing_a_local_data_file_or_model_folder_reruns_its_stage_in_snakemake_and_dvc(prepared, tmp_path):
    work = tmp_path
    for item in ("Snakefile", "workflow", "src"):  # the DVC stages' code deps are the project's own files
        (shutil.copytree if (REPO / item).is_dir() else shutil.copy)(REPO / item, work / item)
    shutil.copytree(prepared / "base_model" / "model", work / "models" / "tiny")
    _write_rows(work / "data" / "rows.csv", "Fill it")
    cfg = config.load(TEST_PARAMS)
    cfg["base_model"] |= {"source": "models/tiny", "random_init": False, "config_overrides": {}}
    cfg["prepare_data"] |= {"source": "data/rows.csv", "max_rows": None,
                            "columns": {"instruction": "question", "input": None, "output": "answer"}}
    (work / "params.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    target = "results/prepare_data/metrics.json"

    _snakemake(work, target)
    assert json.loads((work / target).read_text())["raw_rows"] == 32
    assert _planned(work, target) == {}, "up to date after the run"
    _sh(["git", "init", "-q"], work)
    _sh([BIN / "dvc", "init", "-q"], work)
    _sh([sys.executable, "-m", "efflab.tools.dvcgen"], work)
    stages = yaml.safe_load((work / "dvc.yaml").read_text())["stages"]
    assert "data/rows.csv" in stages["prepare_data"]["deps"]
    assert {"models/tiny/config.json", "models/tiny/model.safetensors"} <= set(stages["base_model"]["deps"])
    _sh([BIN / "dvc", "commit", "-f", "--with-deps", "prepare_data"], work)  # adopt what Snakemake produced
    assert json.loads(_sh([BIN / "dvc", "status", "--json", "prepare_data"], work).stdout) == {}

    _write_rows(work / "data" / "rows.csv", "Fill it with mortar")
    assert _planned(work, target) == {"prepare_data": "Updated input files: data/rows.csv"}
    status = json.loads(_sh([BIN / "dvc", "status", "--json", "prepare_data"], work).stdout)
    assert status == {"prepare_data": [{"changed deps": {"data/rows.csv": "modified"}}]}
    repro = _sh([BIN / "dvc", "repro", "prepare_data"], work).stdout
    assert "Running stage 'prepare_data'" in repro and "Running stage 'base_model'" not in repro
    assert "mortar" in json.loads((work / target).read_text())["example"]

    model_config = work / "models" / "tiny" / "config.json"
    model_config.write_text(json.dumps(json.loads(model_config.read_text()), indent=4))
    assert _planned(work, target) == {
        "base_model": "Updated input files: models/tiny/config.json",
        "prepare_data": "Input files updated by another job: results/base_model/metrics.json"}
    status = json.loads(_sh([BIN / "dvc", "status", "--json", "base_model"], work).stdout)
    assert status == {"base_model": [{"changed deps": {"models/tiny/config.json": "modified"}}]}


@pytest.mark.slow
@pytest.mark.parametrize("key,source", [("prepare_data.source", "data/missing.csv"),
                                        ("base_model.source", "/nonexistent/model-folder")])
def test_a_missing_local_source_stops_the_dry_run_with_one_line(tmp_path, key, source):
    cfg = config.load(TEST_PARAMS)
    stage = key.split(".")[0]
    cfg[stage]["source"] = source
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    proc = _snakemake(tmp_path, "-n", ok=False)
    where = "" if source.startswith("/") else f" in {tmp_path}"
    assert proc.stderr.strip().splitlines() == [
        f"efflab: error: params.yaml: {key}: '{source}' does not exist{where} (expected an existing local path, "
        "a hub id org/name, or an embedded: source)"]
    assert not (tmp_path / "results").exists()


@pytest.mark.slow
def test_a_configfile_is_the_whole_experiment_the_dag_and_the_stages_read(tmp_path):
    """--configfile replaces params.yaml: its grids alone are planned (not merged over params.yaml's), and a
    partial file is refused in one line naming what it lacks, before anything runs."""
    cfg = config.load(TEST_PARAMS)
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    cfg["prune"]["strategies"] = {"layers-1": {"remove_layers": 1}}  # params.yaml's strategy is not asked for
    (tmp_path / "mine.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    plan = _snakemake(tmp_path, "-n", "--configfile", "mine.yaml", "--quiet", "rules").stdout
    jobs = {tuple(line.split()) for line in plan.splitlines() if line.split()[:1] == ["prune"]}
    assert jobs == {("prune", "1")}, plan
    (tmp_path / "partial.yaml").write_text(yaml.safe_dump({"quantize": cfg["quantize"]}))
    proc = _snakemake(tmp_path, "-n", "--configfile", "partial.yaml", ok=False)
    assert proc.stderr.strip().splitlines() == ["efflab: error: partial.yaml: <top level>: 'runtime' is a required "
                                                "property"]
    assert not (tmp_path / "results").exists()
