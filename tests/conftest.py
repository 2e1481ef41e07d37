"""Shared fixtures: the CI params (tiny random-init SmolLM2-shaped model, real tokenizer, 48 real rows)
and a results folder with the base model and data prepared once per session, in-process."""
from __future__ import annotations

import copy
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from efflab import cli

REPO = Path(__file__).resolve().parents[1]
TEST_PARAMS = REPO / "tests" / "config" / "params.test.yaml"
BIN = Path(sys.executable).parent


def run_stage(stage: str, params: Path, results: Path, name: str | None = None) -> dict:
    """Run a stage through its real CLI entry point, in-process, and return its metrics."""
    module = __import__(f"efflab.{stage}", fromlist=["run"])
    argv = ["--params", str(params), "--results", str(results)] + (["--name", name] if name else [])
    cli.main(stage, module.run, argv)
    folder = results / stage / name if name else results / stage
    return json.loads((folder / "metrics.json").read_text())


@pytest.fixture(scope="session")
def test_cfg() -> dict:
    return yaml.safe_load(TEST_PARAMS.read_text())


@pytest.fixture(scope="session")
def prepared(tmp_path_factory) -> Path:
    """A results folder holding the tiny base model and the tokenized splits."""
    results = tmp_path_factory.mktemp("results")
    run_stage("base_model", TEST_PARAMS, results)
    run_stage("prepare_data", TEST_PARAMS, results)
    return results


@pytest.fixture
def results(prepared, tmp_path) -> Path:
    """A private copy of the prepared results, so a test's stages cannot disturb another test."""
    target = tmp_path / "results"
    shutil.copytree(prepared, target)
    return target


@pytest.fixture
def write_params(tmp_path, test_cfg):
    """Write a modified copy of the test params: write_params(lambda cfg: ...) -> path."""
    def write(edit=None) -> Path:
        cfg = copy.deepcopy(test_cfg)
        if edit:
            edit(cfg)
        path = tmp_path / "params.yaml"
        path.write_text(yaml.safe_dump(cfg))
        return path
    return write


@pytest.fixture(scope="session")
def local_pipeline(tmp_path_factory) -> dict:
    """The whole CI pipeline run once by `snakemake --cores 2` in a temporary folder: its folder and
    wall time. Shared by the end-to-end test and the SLURM test, which compares its results with it."""
    work = tmp_path_factory.mktemp("local_pipeline")
    shutil.copy(TEST_PARAMS, work / "params.yaml")
    t0 = time.perf_counter()
    proc = subprocess.run([str(BIN / "snakemake"), "-s", str(REPO / "Snakefile"), "--directory", str(work),
                           "--cores", "2"], cwd=work, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, f"local snakemake failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return {"dir": work, "wall_s": time.perf_counter() - t0, "log": proc.stderr}
