"""Shared fixtures: the CI params (tiny random-init SmolLM2-shaped model, real tokenizer, 48 real rows)
and a results folder with the base model and data prepared once per session, in-process."""
from __future__ import annotations

import copy
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
import yaml

from efflab import config, zygote
from tests.helpers import TEST_PARAMS, BackgroundPipeline, run_stage

pytest_plugins = ["tests.fake_cuda"]  # the fake_cuda fixture: CUDA branches driven on a CPU

# pytest-xdist runs tests in parallel worker processes. Their torch threads together must not outnumber the
# cores: OpenMP threads spin while they wait for each other, and oversubscribed they made some ops ten times
# slower on a 2-core machine. Subprocesses (stage commands, benchmark cells) inherit OMP_NUM_THREADS.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    _threads = max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    os.environ["OMP_NUM_THREADS"] = str(_threads)
    torch.set_num_threads(_threads)

# `make test` runs pytest-xdist with --dist loadfile --no-loadscope-reorder: whole files go to the workers in
# collection order, and this order puts the longest first. test_workflow.py starts the background CI pipeline
# and the SLURM run, which then overlap with the unit tests on the other worker instead of running alone at the
# end (xdist's default order, by number of tests, left them last: 100 s of a 2-core machine half idle).
LONGEST_FIRST = ("test_workflow.py", "test_families_a.py", "test_families_b.py", "test_finetune.py", "test_inputs.py",
                 "test_merge.py", "test_bench.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the other files keep their order


@pytest.fixture(scope="session", autouse=True)
def job_server(tmp_path_factory):
    """One job server (efflab.zygote) per test worker, named in the worker's environment: the stage commands the
    tests' snakemake, dvc and subprocess runs start fork from it, as they do from the one a `snakemake` run starts,
    instead of paying ~10 s of imports each. Where the server is not wanted (a GPU machine) nothing is started."""
    if zygote.why_not_fork() is not None:
        yield None
        return
    path = Path(tempfile.mkdtemp(prefix="efflab-zygote-")) / "z.sock"  # short: a socket path is at most 107 bytes
    log = open(tmp_path_factory.mktemp("job_server") / "server.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "efflab.zygote", "--socket", str(path)], stdout=log,
                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    os.environ[zygote.ENV] = str(path)
    yield path
    os.environ.pop(zygote.ENV, None)
    proc.terminate()
    proc.wait()
    log.close()
    shutil.rmtree(path.parent, ignore_errors=True)


@pytest.fixture(scope="session")
def test_cfg() -> dict:
    return config.load(TEST_PARAMS)


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
def local_pipeline(tmp_path_factory):
    """The whole CI pipeline, run once per test session (in the background until a test waits for it); shared
    by the end-to-end tests of tests/test_workflow.py, the SLURM one among them."""
    pipeline = BackgroundPipeline(tmp_path_factory.mktemp("local_pipeline"))
    yield pipeline
    if pipeline.proc.poll() is None:
        pipeline.proc.kill()
    pipeline.log.close()
