"""The GPU lane, checked on a CPU: the gpu-smoke profile plans every stage on CUDA, the lane's rehearsal params
are a valid experiment, and the lane script parses."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import yaml

from tests.helpers import REPO

STAGES = {"base_model", "prepare_data", "quantize", "prune", "qat", "finetune", "merge", "bench_finetune",
          "bench_attention", "bench_inference", "bench_serving", "capacity", "evaluate", "claims", "report"}


def _plan(*args: str) -> str:
    env = os.environ | {"PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    done = subprocess.run(["snakemake", "-n", "--quiet", "rules", *args], cwd=REPO, capture_output=True, text=True,
                          env=env, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout + done.stderr


def _counts(plan: str) -> dict[str, int]:
    return {m[1]: int(m[2]) for m in re.finditer(r"^(\w+)\s+(\d+)$", plan, re.M)}


def test_gpu_smoke_plans_every_stage_on_cuda_with_the_cuda_branches_in_its_grid():
    counts = _counts(_plan("--profile", "workflow/profiles/gpu-smoke"))
    assert STAGES <= set(counts), STAGES - set(counts)
    params = yaml.safe_load((REPO / "workflow/profiles/gpu-smoke/params.yaml").read_text())
    assert params["runtime"]["device"] == "cuda"
    runs = params["finetune"]["runs"].values()
    assert {r.get("mixed_precision") for r in runs} >= {"fp16", "no"} and any(r.get("tf32") for r in runs)
    assert any(r.get("bf16_weights") for r in runs) and any(r.get("liger_kernel") for r in runs)
    assert {"compiled", "vllm"} <= set(params["bench_inference"]["variants"]["baseline"]["generation"])
    assert {"sdpa_flash", "flash_attention_2", "sdpa_cudnn"} <= set(params["bench_attention"]["implementations"])
    assert "vllm" in params["bench_serving"]["methods"] and params["capacity"]["budget_mib"]["cuda"]
    assert {"int8", "nf4", "torchao-int8", "torchao-int4"} <= set(params["quantize"]["schemes"])
    assert counts["total"] - counts["all"] <= 45  # ~5 s of imports a job: the fixed cost of the 5-minute budget


def test_the_lane_rehearsal_merges_into_a_valid_experiment(tmp_path):
    smoke = yaml.safe_load((REPO / "workflow/profiles/gpu-smoke/params.yaml").read_text())
    lane = (REPO / "benchmarks/gpu_lane.sh").read_text()
    merge_code = lane.split("<<'PY'\n", 1)[1].split("\nPY\n", 1)[0]
    merged = tmp_path / "rehearsal.yaml"
    subprocess.run([sys.executable, "-", str(merged)], input=merge_code, text=True, cwd=REPO, check=True)
    params = yaml.safe_load(merged.read_text())
    assert params["runtime"]["device"] == "cpu" and params["base_model"]["config_overrides"]["hidden_size"] == 64
    assert params["finetune"]["runs"] == smoke["finetune"]["runs"]  # the same grid, only smaller
    counts = _counts(_plan("--profile", "workflow/profiles/gpu-smoke", "--configfile", str(merged)))
    assert STAGES <= set(counts)
    assert subprocess.run(["bash", "-n", str(REPO / "benchmarks/gpu_lane.sh")]).returncode == 0
