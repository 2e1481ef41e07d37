"""What the tests share besides fixtures: the repository's paths, the CI params, a stage run through its real CLI,
the CI pipeline run in the background, and a simulated clock for timing logic. Imported as `tests.helpers`
(tests/ is a package), never from conftest, so that `pytest`, `python -m pytest` and `make test` collect alike."""
from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from efflab import cli, config, registry

REPO = Path(__file__).resolve().parents[1]
CI_PARAMS = REPO / "tests" / "config" / "params.test.yaml"
# The compute dtype the suite's stages run in: float32 (the CI params), or bfloat16 with EFFLAB_TEST_DTYPE=bfloat16
# (`make test-bf16`), so that a CPU whose probe picks fp32 runs the paths a bf16 CPU takes, and every tolerance
# follows the dtype asked for (rounding_tolerance), never the machine.
TEST_DTYPE = os.environ.get("EFFLAB_TEST_DTYPE", "float32")
BIN = Path(sys.executable).parent


def _params_in(dtype: str) -> Path:
    """The CI params with base_model.dtype set to `dtype`, written once (atomically: xdist workers race) under the
    temporary folder, named by their content."""
    import hashlib
    import tempfile

    import yaml

    if dtype == "float32":
        return CI_PARAMS
    if dtype not in ("bfloat16", "float16"):
        raise SystemExit(f"EFFLAB_TEST_DTYPE: {dtype!r} (expected float32, bfloat16 or float16)")
    text = CI_PARAMS.read_text()
    cfg = config.load(CI_PARAMS)  # the whole experiment: the copy is read from elsewhere, where `extends` fails
    cfg["base_model"]["dtype"] = dtype
    digest = hashlib.sha256(text.encode() + dtype.encode()).hexdigest()[:12]
    path = Path(tempfile.gettempdir()) / f"efflab-params-{dtype}-{digest}.yaml"
    if not path.is_file():
        scratch = path.with_suffix(f".{os.getpid()}.tmp")
        scratch.write_text(yaml.safe_dump(cfg, sort_keys=False))
        os.replace(scratch, path)
    return path


TEST_PARAMS = _params_in(TEST_DTYPE)


def run_stage(stage: str, params: Path, results: Path, name: str | None = None) -> dict:
    """Run a stage through its real CLI entry point, in-process, and return its metrics."""
    module = importlib.import_module(registry.module(stage))
    if not hasattr(module, "run"):  # a stage that is a package (report, claims) runs from its stage module
        module = importlib.import_module(f"{registry.module(stage)}.stage")
    argv = ["--params", str(params), "--results", str(results)] + (["--name", name] if name else [])
    cli.main(stage, module.run, argv)
    folder = results / stage / name if name else results / stage
    return json.loads((folder / "metrics.json").read_text())


def rounding_tolerance(dtype, scale: float, roundings: int, floor: float = 1e-3) -> float:
    """The largest difference from a reference of magnitude up to `scale` that `roundings` roundings to `dtype` can
    explain (each at most finfo.eps of the value: a first-order bound), and never below `floor`, the float32
    tolerance of a comparison whose two sides sum in different orders. The dtype is the one the kernel that runs
    computes in (e.g. quantization.four_bit_kernel_dtype), so the tolerance follows the kernel, not the machine."""
    import torch

    return max(floor, roundings * torch.finfo(dtype).eps * scale)


def write_experiment(path: Path) -> Path:
    """The test params as a whole experiment at `path` (a work folder's params.yaml, which DVC reads too): the
    overlay's `extends` names params.yaml by a path from tests/config/, which a copy elsewhere cannot follow. Written
    over params.yaml's own text, so that its comments and flow lists stay where the values do (`dvc exp run` must
    keep them)."""
    from ruamel.yaml import YAML

    yaml = YAML()
    yaml.width = 120
    doc = yaml.load((REPO / "params.yaml").read_text())
    _sync(doc, config.load(TEST_PARAMS))
    with open(path, "w") as out:
        yaml.dump(doc, out)
    return path


def _sync(node, want: dict) -> None:
    """Make the mapping `node` hold `want`, keeping what is already equal (and its comments)."""
    for key in [k for k in node if k not in want]:
        del node[key]
    for key, value in want.items():
        if isinstance(value, dict) and isinstance(node.get(key), dict):
            _sync(node[key], value)
        elif key not in node or node[key] != value:
            node[key] = value


class BackgroundPipeline:
    """The CI pipeline run by `snakemake --cores 2` in a temporary folder, started in the background so that a
    test can do its own work (the SLURM run) meanwhile; `wait()` gives its folder and wall time."""

    def __init__(self, work: Path):
        write_experiment(work / "params.yaml")
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


class SimulatedClock:
    """A stand-in for measure.timing.clock: time moves only when the simulated work says so (`advance`), so a timing
    verdict or threshold is tested on known durations, never on a race with the real machine."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def serving_record(rates: dict[tuple[str, int], list[float]], requests: int = 8) -> dict:
    """A bench_serving record from injected output tokens/s, one per burst round for each (method, concurrency),
    with its ratios paired round by round as the stage pairs them: verdicts on known numbers, no clock."""
    from efflab.measure.stats import summarize
    from efflab.stages.bench_serving import rounds

    cells = [{"method": m, "concurrency": c, "status": "ok", "bursts": len(r), "requests": requests,
              "requests_per_s": summarize([x / 10 for x in r], "requests/s"),
              "output_tokens_per_s": summarize(r, "tokens/s"), "ttft_s": {"p50": 0.1, "p90": 0.2, "p99": 0.3},
              "latency_s": {"p50": 0.5, "p90": 0.8, "p99": 0.9},
              "by_burst": [{"output_tokens_per_s": x} for x in r]} for (m, c), r in rates.items()]
    rounds.compare(cells)
    return {"stage": "bench_serving", "status": "ok", "requests": requests, "bursts": len(next(iter(rates.values()))),
            "prompt_tokens": [40] * requests, "new_tokens": [10] * requests, "cells": cells,
            "environment": {"fingerprint": "e"}}


def progress_then_hang() -> dict:
    """A benchmark cell that shows a progress bar (as transformers' weight loading does) and then never ends: the
    cell run_cell kills at its timeout."""
    import tqdm

    list(tqdm.tqdm(range(3), file=open(os.devnull, "w")))
    time.sleep(600)
    return {}
