"""Shared fixtures: the CI params (tiny random-init SmolLM2-shaped model, real tokenizer, 48 real rows)
and a results folder with the base model and data prepared once per session, in-process."""
from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from efflab import cli

# pytest-xdist runs tests in parallel worker processes. Their torch threads together must not outnumber the
# cores: OpenMP threads spin while they wait for each other, and oversubscribed they made some ops ten times
# slower on a 2-core machine. Subprocesses (stage commands, benchmark cells) inherit OMP_NUM_THREADS.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    _threads = max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    os.environ["OMP_NUM_THREADS"] = str(_threads)
    torch.set_num_threads(_threads)

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


# `make test` runs pytest-xdist with --dist loadfile --no-loadscope-reorder: whole files go to the workers in
# collection order, and this order puts the longest first. test_workflow.py starts the background CI pipeline
# and the SLURM run, which then overlap with the unit tests on the other worker instead of running alone at the
# end (xdist's default order, by number of tests, left them last: 100 s of a 2-core machine half idle).
LONGEST_FIRST = ("test_workflow.py", "test_finetune.py", "test_inputs.py", "test_merge.py", "test_bench.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the other files keep their order


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


class BackgroundPipeline:
    """The CI pipeline run by `snakemake --cores 2` in a temporary folder, started in the background so that a
    test can do its own work (the SLURM run) meanwhile; `wait()` gives its folder and wall time."""

    def __init__(self, work: Path):
        shutil.copy(TEST_PARAMS, work / "params.yaml")
        self.work, self.t0, self.result = work, time.perf_counter(), None
        self.log = open(work / "snakemake.log", "w+")
        # two jobs at a time: the tiny model's jobs are bound by start-up, not by compute
        self.proc = subprocess.Popen([str(BIN / "snakemake"), "-s", str(REPO / "Snakefile"), "--directory",
                                      str(work), "--cores", "2", "--max-threads", "1"], cwd=work,
                                     stdout=self.log, stderr=subprocess.STDOUT, text=True)

    def wait(self) -> dict:
        if self.result is None:
            code = self.proc.wait(timeout=1200)
            self.log.seek(0)
            output = self.log.read()
            assert code == 0, f"local snakemake failed:\n{output[-6000:]}"
            self.result = {"dir": self.work, "wall_s": time.perf_counter() - self.t0, "log": output}
        return self.result


@pytest.fixture(scope="session")
def local_pipeline(tmp_path_factory):
    """The whole CI pipeline, run once per test session (in the background until a test waits for it); shared
    by the end-to-end tests of tests/test_workflow.py, the SLURM one among them."""
    pipeline = BackgroundPipeline(tmp_path_factory.mktemp("local_pipeline"))
    yield pipeline
    if pipeline.proc.poll() is None:
        pipeline.proc.kill()
    pipeline.log.close()
