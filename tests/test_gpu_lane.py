"""The GPU lane, checked on a CPU: the gpu-smoke profile plans every stage on CUDA, the lane's rehearsal params
are a valid experiment, and the lane script parses."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import yaml

from efflab import config
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
    params = config.load(REPO / "workflow/profiles/gpu-smoke/params.yaml")
    assert params["runtime"]["device"] == "cuda"
    runs = params["finetune"]["runs"].values()
    assert {r.get("mixed_precision") for r in runs} >= {"fp16", "no"} and any(r.get("tf32") for r in runs)
    assert any(r.get("bf16_weights") for r in runs) and any(r.get("liger_kernel") for r in runs)
    assert {"compiled", "vllm"} <= set(params["bench_inference"]["variants"]["baseline"]["generation"])
    assert {"sdpa_flash", "flash_attention_2", "sdpa_cudnn"} <= set(params["bench_attention"]["implementations"])
    assert "vllm" in params["bench_serving"]["methods"] and params["capacity"]["budget_mib"]["cuda"]
    assert {"int8", "nf4", "torchao-int8", "torchao-int4"} <= set(params["quantize"]["schemes"])
    assert counts["total"] - counts["all"] <= 45  # ~5 s of imports a job: the fixed cost of the 5-minute budget


def _lane_params(tmp_path, name: str, *files: str) -> tuple[Path, dict]:
    out = tmp_path / f"{name}.yaml"
    subprocess.run([sys.executable, "benchmarks/lane_params.py", str(out), *files], cwd=REPO, check=True,
                   env=os.environ | {"PYTHONPATH": str(REPO / "src")})
    return out, yaml.safe_load(out.read_text())


def test_the_lane_rehearsal_merges_into_a_valid_experiment(tmp_path):
    smoke = config.load(REPO / "workflow/profiles/gpu-smoke/params.yaml")
    merged, params = _lane_params(tmp_path, "rehearsal", "workflow/profiles/gpu-smoke/params.yaml",
                                  "benchmarks/gpu_lane_rehearsal.yaml")
    assert params["runtime"]["device"] == "cpu" and params["base_model"]["config_overrides"]["hidden_size"] == 64
    assert params["finetune"]["runs"] == smoke["finetune"]["runs"]  # the same grid, only smaller
    counts = _counts(_plan("--profile", "workflow/profiles/gpu-smoke", "--configfile", str(merged)))
    assert STAGES <= set(counts)
    assert subprocess.run(["bash", "-n", str(REPO / "benchmarks/gpu_lane.sh")]).returncode == 0


def test_the_headline_grid_replaces_the_gpu_profile_s_sections_it_names_and_plans_on_the_1b_configuration(tmp_path):
    """The headline params: the GPU profile's 1B model and sizes, its grids cut by replacement (a merge would keep
    every scheme and run of the profile), and a valid experiment whose targets the lane names plan."""
    gpu = config.load(REPO / "workflow/profiles/gpu/params.yaml")
    merged, params = _lane_params(tmp_path, "headline", "workflow/profiles/gpu/params.yaml",
                                  "benchmarks/gpu_lane_headline.yaml")
    assert params["base_model"] == gpu["base_model"] and params["runtime"]["device"] == "cuda"
    assert list(params["quantize"]["schemes"]) == ["baseline", "int8", "nf4", "torchao-int8", "torchao-int4"]
    assert list(params["finetune"]["runs"]) == ["full", "lora-r8"] and "replace" not in params
    assert params["finetune"]["defaults"]["optimizer"] == gpu["finetune"]["defaults"]["optimizer"]  # merged, kept
    assert params["bench_attention"]["seq_lens"][0] == 512 and params["bench_attention"]["seq_lens"][-1] == 8192
    lane = (REPO / "benchmarks/gpu_lane.sh").read_text()
    targets = [t for line in lane.splitlines() if line.startswith("headline ") for t in line.split()[3:]]
    expanded = [subprocess.run(["bash", "-c", f"echo {t}"], capture_output=True, text=True).stdout.split()
                for t in targets]
    counts = _counts(_plan("--configfile", str(merged), "--cores", "1", *[t for ts in expanded for t in ts]))
    assert {"finetune", "bench_attention", "bench_inference", "quantize"} <= set(counts)
    assert "bench_serving" not in counts and "report" not in counts
