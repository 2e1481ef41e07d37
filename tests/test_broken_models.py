"""A broken base_model.source is one line naming the key and the file, never a traceback: at the dry run (what
workflow/rules/common.smk runs while it plans: model_check.check) where the folder tells, and by the base_model
stage command, which exits 2 and leaves no results behind. The corpus: one tiny real model folder, broken one way
per case (src/efflab/models/model_folder.py)."""
from __future__ import annotations

import importlib
import json
import shutil
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest
import transformers.utils.hub
import yaml
from huggingface_hub import errors as hub_errors

from efflab import config
from efflab.config import UserError
from efflab.models import model_check, model_folder
from tests.helpers import BIN, REPO, TEST_PARAMS, run_stage

TRANSFORMERS = version("transformers")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    """A real model folder (the CI params' tiny model, its weights and the embedded tokenizer), made once."""
    results = tmp_path_factory.mktemp("tiny")
    run_stage("base_model", TEST_PARAMS, results)
    return results / "base_model" / "model"


def _edit_config(folder: Path, **fields) -> None:
    path = folder / "config.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | fields))


def _truncate(path: Path, size: int) -> None:
    with open(path, "r+b") as f:
        f.truncate(size)


def _overwrite(path: Path, at: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        f.write(data)


AUTO_MAP = {"AutoConfig": "configuration_mine.MineConfig", "AutoModelForCausalLM": "modeling_mine.MineForCausalLM"}

# name: (how the folder is broken, the line after "<params>: " or "efflab base_model: error: ", caught at the dry
# run too). {f} is the folder.
CASES = {
    "empty-folder": (lambda f: [p.unlink() for p in f.iterdir()],
                     "base_model.source: '{f}' is not a model folder (expected a folder with config.json)", True),
    "config-not-json": (lambda f: (f / "config.json").write_text('{"model_type": "llama",\n'),
                        "base_model.source: {f}/config.json is not valid JSON (Expecting property name enclosed in "
                        "double quotes at line 2 column 1)", True),
    "unknown-architecture-with-code": (
        lambda f: _edit_config(f, model_type="efflab_mine", auto_map=AUTO_MAP),
        f"base_model.trust_remote_code: {{f}}/config.json declares model_type 'efflab_mine', which transformers "
        f"{TRANSFORMERS} does not know, with auto_map (the model's own code): base_model.trust_remote_code: true "
        "would run that code", True),
    "unknown-architecture": (
        lambda f: _edit_config(f, model_type="efflab_mine"),
        f"base_model.source: {{f}}/config.json declares model_type 'efflab_mine', which transformers {TRANSFORMERS} "
        "does not know, and no auto_map (its own code), so base_model.trust_remote_code: true would not help: a "
        "newer transformers may know it", True),
    "no-weights": (lambda f: (f / "model.safetensors").unlink(),
                   "base_model.source: {f} has no weights (no model.safetensors beside its config.json; "
                   "base_model.random_init: true builds the model without them)", True),
    "bin-only": (lambda f: (f / "model.safetensors").rename(f / "pytorch_model.bin"),
                 "base_model.source: {f} holds pytorch_model.bin but no model.safetensors: efflab loads safetensors "
                 "only (load the model in transformers and save_pretrained it, which writes safetensors)", True),
    "truncated-safetensors": (lambda f: _truncate(f / "model.safetensors", 1_000_000),
                              "base_model.source: {f}/model.safetensors is truncated: its header describes "
                              "{data:,} bytes of tensor data, the file holds {held:,}", True),
    "corrupt-safetensors-header": (lambda f: _overwrite(f / "model.safetensors", 8, b"garbage!"),
                                   "base_model.source: {f}/model.safetensors is corrupt: its header is not a "
                                   "safetensors JSON header", True),
    "tokenizer-not-json": (lambda f: (f / "tokenizer.json").write_text('{"version": "1.0", "model": {\n'),
                           "base_model.source: {f}/tokenizer.json is not valid JSON (Expecting property name enclosed "
                           "in double quotes at line 2 column 1): the tokenizer cannot load", True),
    "no-tokenizer": (lambda f: [(f / n).unlink() for n in ("tokenizer.json", "tokenizer_config.json")],
                     "base_model.source: {f} has no tokenizer (expected tokenizer.json, or tokenizer.model, vocab.json "
                     "and merges.txt, ...: save the model's tokenizer there with save_pretrained)", True),
    "config-of-a-masked-lm": (lambda f: _edit_config(f, model_type="bert", architectures=["BertForMaskedLM"]),
                              "base_model.source: {f}/config.json names BertForMaskedLM, not a causal language "
                              "model: efflab needs BertLMHeadModel, the causal LM class of bert", True),
    # only loading tells these
    # Qwen2's attention projections have biases, the Llama weights none: loaded, they would stay at random init
    "config-of-another-family": (lambda f: _edit_config(f, model_type="qwen2", architectures=["Qwen2ForCausalLM"]),
                                 "base_model.source: the weights of {f} do not fit its config: 6 parameters of the "
                                 "model are not in them (first: model.layers.0.self_attn.k_proj.bias) (a config.json "
                                 "of another model beside these weights?)", False),
    "tokenizer-of-another-shape": (lambda f: (f / "tokenizer.json").write_text('{"model": {"type": "Nonesuch"}}'),
                                   "base_model.source: cannot load the tokenizer of '{f}' from {f}/tokenizer.json: "
                                   "...", False),  # then transformers' own words (KeyError: 'added_tokens')
    "weights-of-another-shape": (lambda f: _edit_config(f, intermediate_size=256),
                                 "base_model.source: the weights in {f}/model.safetensors do not fit its config.json "
                                 "(transformers' report above lists the tensors of other shapes)", False),
}


def _broken(tiny_model: Path, where: Path, case: str) -> tuple[Path, str]:
    """A copy of the tiny model broken as `case` says, and the line expected for it."""
    folder = where / case
    shutil.copytree(tiny_model, folder)
    header = 8 + int.from_bytes((tiny_model / "model.safetensors").read_bytes()[:8], "little")
    data = (tiny_model / "model.safetensors").stat().st_size - header
    CASES[case][0](folder)
    return folder, CASES[case][1].format(f=folder, data=data, held=1_000_000 - header)


def _params(path: Path, source: str, **base_model) -> Path:
    cfg = config.load(TEST_PARAMS)
    cfg["base_model"] |= {"source": source, "random_init": False, "config_overrides": {}, **base_model}
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def _is(actual: str, expected: str) -> bool:
    """`actual` is the `expected` line (up to its end where that is "...": a library's own words follow)."""
    return actual.startswith(expected[:-3]) if expected.endswith("...") else actual == expected


def _no_files(results: Path) -> bool:
    return not [p for p in results.rglob("*") if p.is_file()]


@pytest.mark.parametrize("case", CASES)
def test_a_broken_model_folder_is_one_line_at_the_dry_run_and_in_the_stage(case, tiny_model, tmp_path, capsys):
    folder, line = _broken(tiny_model, tmp_path, case)
    params = _params(tmp_path / "params.yaml", str(folder))
    cfg = config.load(params)
    if CASES[case][2]:  # what common.smk runs while Snakemake plans, and the line it exits with
        with pytest.raises(UserError) as err:
            model_check.check(cfg, "params.yaml")
        assert f"efflab: error: {err.value}" == f"efflab: error: params.yaml: {line}"
    with pytest.raises(SystemExit) as exit_:
        run_stage("base_model", params, tmp_path / "results")
    assert exit_.value.code == 2
    stderr = capsys.readouterr().err
    assert _is(stderr.strip().splitlines()[-1], f"efflab base_model: error: {line}"), stderr[-3000:]
    assert "Traceback" not in stderr
    assert _no_files(tmp_path / "results")


@pytest.mark.slow
@pytest.mark.integration  # real dry runs and a stage process: make test keeps its 10 minutes
def test_the_dry_run_and_the_stage_command_stop_on_a_broken_folder_with_one_line(tiny_model, tmp_path):
    """End to end: `snakemake -n --configfile` and `python -m efflab.stages.base_model` as a user runs them."""
    for case in ("truncated-safetensors", "unknown-architecture-with-code"):
        folder, line = _broken(tiny_model, tmp_path, case)
        _params(tmp_path / "broken.yaml", str(folder))
        proc = subprocess.run([BIN / "snakemake", "-s", REPO / "Snakefile", "--directory", tmp_path, "--cores", "1",
                               "-n", "--configfile", "broken.yaml"], cwd=tmp_path, capture_output=True, text=True,
                              timeout=300)
        assert proc.returncode != 0
        assert proc.stderr.strip().splitlines() == [f"efflab: error: broken.yaml: {line}"], proc.stderr[-3000:]
        assert not (tmp_path / "results").exists()
    folder, line = _broken(tiny_model, tmp_path, "no-weights")
    proc = subprocess.run([sys.executable, "-m", "efflab.stages.base_model", "--params",
                           _params(tmp_path / "broken.yaml", str(folder)), "--results", tmp_path / "results"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == f"efflab base_model: error: {line}"
    assert "Traceback" not in proc.stderr
    assert _no_files(tmp_path / "results")


def _hub_error(kind: str, url: str) -> Exception:
    """huggingface_hub's error for `kind`, as its download raises it."""
    if kind == "offline":
        return hub_errors.LocalEntryNotFoundError("An error happened while trying to locate the file on the Hub and "
                                                  "we cannot find the requested files in the local cache.")
    http = importlib.import_module(hub_errors.Response.__module__.split(".")[0])  # httpx, as huggingface_hub has it
    response = hub_errors.Response(401 if kind == "gated" else 404, request=http.Request("GET", url))
    error = {"gated": hub_errors.GatedRepoError, "missing": hub_errors.RepositoryNotFoundError,
             "revision": hub_errors.RevisionNotFoundError}[kind]
    return error(f"{response.status_code} Client Error for url: {url}", response=response)


@pytest.mark.parametrize("kind,line", [
    ("gated", "base_model.source: 'org/gated' is a gated model: accept its terms at https://huggingface.co/org/gated "
              "and set HF_TOKEN to a token of that account (or run `hf auth login`)"),
    ("missing", "base_model.source: 'org/missing' is not a model on the Hugging Face hub (a private one needs HF_TOKEN "
                "set to a token with access)"),
    ("revision", "base_model.revision: 'v9' is not a branch, tag or commit of 'org/revision'"),
    ("offline", "base_model.source: cannot load 'org/offline': We couldn't connect to 'https://huggingface.co' to "
                "load the files, and couldn't find them in the cached files.")])
def test_a_gated_missing_or_unreachable_hub_id_is_one_line(kind, line, tmp_path, monkeypatch, capsys):
    def download(repo_id, filename, **kwargs):
        raise _hub_error(kind, f"https://huggingface.co/{repo_id}/resolve/main/{filename}")
    monkeypatch.setattr(transformers.utils.hub, "hf_hub_download", download)  # what transformers downloads with
    params = _params(tmp_path / "params.yaml", f"org/{kind}", revision="v9" if kind == "revision" else None)
    with pytest.raises(SystemExit) as exit_:
        run_stage("base_model", params, tmp_path / "results")
    assert exit_.value.code == 2
    stderr = capsys.readouterr().err
    assert stderr.strip().splitlines()[-1] == f"efflab base_model: error: {line}"
    assert "Traceback" not in stderr
    assert _no_files(tmp_path / "results")


def test_a_sharded_folder_needs_every_shard_its_index_names_whole(tiny_model, tmp_path):
    folder = tmp_path / "sharded"
    shutil.copytree(tiny_model, folder)
    (folder / "model.safetensors").rename(folder / "model-00001-of-00002.safetensors")
    index = {"metadata": {}, "weight_map": {"a": "model-00001-of-00002.safetensors",
                                            "b": "model-00002-of-00002.safetensors"}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    bm = {"source": str(folder), "random_init": False, "trust_remote_code": False}
    with pytest.raises(UserError, match=rf"^base_model.source: {folder}/model.safetensors.index.json names "
                                        rf"{folder}/model-00002-of-00002.safetensors, which does not exist$"):
        model_folder.check(bm)
    shutil.copy(folder / "model-00001-of-00002.safetensors", folder / "model-00002-of-00002.safetensors")
    model_folder.check(bm)
    with open(folder / "model-00002-of-00002.safetensors", "ab") as f:
        f.write(b"\0" * 4)  # bytes no header describes: safetensors refuses the file
    with pytest.raises(UserError, match=rf"^base_model.source: {folder}/model-00002-of-00002.safetensors is corrupt: "
                                        r"its header describes [\d,]+ bytes of tensor data, the file holds [\d,]+$"):
        model_folder.check(bm)
