"""What the tests share besides fixtures: the repository's paths, the CI params, a stage run through its real CLI,
the CI pipeline run in the background, and a simulated clock for timing logic. Imported as `tests.helpers`
(tests/ is a package), never from conftest, so that `pytest`, `python -m pytest` and `make test` collect alike."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

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


class SimulatedClock:
    """A stand-in for measure.clock: time moves only when the simulated work says so (`advance`), so a timing
    verdict or threshold is tested on known durations, never on a race with the real machine."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds
