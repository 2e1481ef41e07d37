"""End to end: the real snakemake and dvc CLIs on the CI params in temporary folders."""
from __future__ import annotations

import copy
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from efflab import dvcgen
from efflab.cli import STAGES

from conftest import BIN, REPO, TEST_PARAMS

pytestmark = pytest.mark.slow
TIMEOUT = 1200


def sh(cmd: list, cwd: Path, timeout: int = TIMEOUT) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(c) for c in cmd], cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{cmd} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc


def expected_outputs(cfg: dict) -> list[str]:
    from efflab.cli import stage_names

    outs = ["results/base_model/model/model.safetensors", "results/prepare_data/train.parquet",
            "results/prepare_data/validation.parquet", "results/report/report.md", "results/report/summary.csv"]
    for stage in STAGES:
        outs += [f"results/{stage}/{n + '/' if n else ''}metrics.json" for n in (stage_names(cfg, stage) or [None])]
    outs += [f"results/finetune/{n}/loss.csv" for n in cfg["finetune"]["runs"]]
    return outs


def check_results(work: Path, cfg: dict) -> None:
    missing = [p for p in expected_outputs(cfg) if not (work / p).is_file()]
    assert missing == []
    report = (work / "results/report/report.md").read_text()
    for section in ("## Quantization", "## Fine-tuning", "## Merging adapters", "## Attention implementations",
                    "### What each knob costs and buys", "### Determinism", "## Cells that did not run",
                    "### Memory vs sequence length", "## Inference variants", "## Reported vs reproduced",
                    "## Environments"):
        assert section in report
    assert "Not compared in one table" not in report, "one machine, one stack: one table per stage"
    assert "unavailable: flash_attention_2 needs a CUDA GPU" in report
    pngs = sorted((work / "results/report").glob("*.png"))
    assert len(pngs) >= 5 and all(p.read_bytes()[:4] == b"\x89PNG" for p in pngs)
    summary = pd.read_csv(work / "results/report/summary.csv")
    qlora = any(r["method"] == "qlora" for r in cfg["finetune"]["runs"].values())
    assert set(summary.stage) - {"finetune_knobs"} == {"quantize", "finetune", "merge", "bench_attention", "attention_memory_exponent",
                                  "bench_inference"} | ({"merge_targets"} if qlora else set())
    for run in cfg["finetune"]["runs"]:
        m = json.loads((work / f"results/finetune/{run}/metrics.json").read_text())
        assert m["validation_after"]["loss"] < m["validation_before"]["loss"], run


def copy_project(work: Path) -> None:
    for item in ("Snakefile", "workflow", "src"):
        src = REPO / item
        (shutil.copytree if src.is_dir() else shutil.copy)(src, work / item)
    shutil.copy(TEST_PARAMS, work / "params.yaml")


@pytest.fixture(scope="module")
def test_cfg_module():
    import yaml

    return yaml.safe_load(TEST_PARAMS.read_text())


def test_snakemake_runs_every_stage(local_pipeline, test_cfg_module):
    work = local_pipeline["dir"]
    check_results(work, test_cfg_module)
    for stage in STAGES:
        assert list((work / "results/logs" / stage).glob("*.log")), f"no log for {stage}"
    again = sh([BIN / "snakemake", "-s", REPO / "Snakefile", "--directory", work, "-n", "--cores", "2"], work)
    assert "Nothing to be done" in again.stdout + again.stderr


def _dvc_view(repo: Path) -> set:
    from dvc.repo import Repo

    with Repo(str(repo)) as dvc_repo:
        return {(s.cmd, frozenset(o.def_path for o in s.outs)) for s in dvc_repo.index.stages}


def _snakemake_view(params: str, workdir: Path) -> set:
    return {(j["cmd"], frozenset(j["output"])) for j in dvcgen.snakemake_jobs(params, workdir)}


def test_committed_dvc_yaml_is_in_step_with_snakemake():
    assert (REPO / "dvc.yaml").read_text() == dvcgen.render("params.yaml", REPO), "run `make dvc.yaml`"
    assert _dvc_view(REPO) == _snakemake_view("params.yaml", REPO)


def smaller_grid(cfg: dict) -> dict:
    """The CI experiment with one job per grid where one will do: the DVC test checks DVC's wiring, the
    Snakemake test already ran every job of the full CI grid."""
    cfg = copy.deepcopy(cfg)
    cfg["quantize"]["schemes"] = {k: cfg["quantize"]["schemes"][k] for k in ("baseline", "nf4")}
    cfg["finetune"]["runs"] = {"lora-r8": cfg["finetune"]["runs"]["lora-r8"]}
    cfg["bench_attention"]["implementations"] = ["eager", "flash_attention_2"]
    cfg["bench_inference"]["variants"] = {"baseline": {"kind": "base"},
                                          "merged-lora-r8": cfg["bench_inference"]["variants"]["merged-lora-r8"]}
    return cfg


def test_dvc_repro_runs_the_same_jobs_as_snakemake(tmp_path, test_cfg_module):
    import yaml

    copy_project(tmp_path)
    cfg = smaller_grid(test_cfg_module)
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    sh(["git", "init", "-q"], tmp_path)
    sh([BIN / "dvc", "init", "-q"], tmp_path)
    sh([sys.executable, "-m", "efflab.dvcgen"], tmp_path)
    assert _dvc_view(tmp_path) == _snakemake_view("params.yaml", tmp_path)

    sh([BIN / "dvc", "repro"], tmp_path)
    check_results(tmp_path, cfg)
    metrics = json.loads(sh([BIN / "dvc", "metrics", "show", "--json"], tmp_path).stdout)
    assert metrics, "dvc metrics show lists the stages' metrics"
    status = sh([BIN / "dvc", "status", "--json"], tmp_path)
    assert json.loads(status.stdout) == {}, "everything is up to date after repro"

    sh(["git", "add", "-A"], tmp_path)
    sh(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "repro"], tmp_path)
    exp = sh([BIN / "dvc", "exp", "run", "-S", "bench_inference.max_new_tokens=3"], tmp_path)
    assert "bench_inference-baseline" in exp.stdout + exp.stderr
    ran = json.loads((tmp_path / "results/bench_inference/baseline/metrics.json").read_text())
    assert ran["new_tokens"] == 3
