"""Resources every rule declares, read from Snakemake's dry run: CPU runs ask for no GPU; GPU runs give
each GPU stage one GPU and its share of the cores."""
from __future__ import annotations

import re
import subprocess

import yaml

from efflab import config
from efflab.registry import STAGES
from tests.helpers import BIN, REPO, TEST_PARAMS

GPU_STAGES = [s.name for s in STAGES.values() if s.gpu]


def dry_run(tmp_path, device: str, *args: str) -> dict[str, list[dict]]:
    """rule -> the threads and resources of each of its jobs."""
    cfg = config.load(TEST_PARAMS)
    cfg["runtime"]["device"] = device
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(cfg))
    proc = subprocess.run([BIN / "snakemake", "-s", REPO / "Snakefile", "--directory", tmp_path, "-n", *args],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    jobs: dict[str, list[dict]] = {}
    for block in re.split(r"\n(?=\[[^\n]*\]\nrule )", proc.stdout):
        rule = re.search(r"^rule (\w+):", block, re.M)
        if not rule or rule.group(1) == "all":
            continue
        threads = re.search(r"^\s+threads: (\d+)", block, re.M)
        resources = dict(re.findall(r"(\w+)=([^,\s]+)", re.search(r"^\s+resources: (.*)$", block, re.M).group(1)))
        name = re.search(r"^\s+wildcards: name=(\S+)", block, re.M)
        jobs.setdefault(rule.group(1), []).append({"name": name and name.group(1), **resources,
                                                   "threads": int(threads.group(1)) if threads else 1})
    return jobs


def test_cpu_run_asks_for_no_gpu_and_cpu_stages_take_every_core(tmp_path):
    """A stage whose numbers are timings takes every core, so it runs alone; evaluate (it times nothing) half."""
    jobs = dry_run(tmp_path, "cpu", "--cores", "4")
    assert set(jobs) == set(STAGES)  # the test params ask for every stage
    for rule, entries in jobs.items():
        for job in entries:
            assert {"mem_mb", "runtime"} <= job.keys() and "gpu" not in job, (rule, job)
            want = 1 if rule in ("prepare_data", "claims", "report") else 4 if STAGES[rule].timed else 2
            assert job["threads"] == want, (rule, job)


def test_gpu_run_gives_each_gpu_stage_one_gpu_and_its_share_of_the_cores(tmp_path):
    jobs = dry_run(tmp_path, "cuda", "--cores", "8", "--resources", "gpu=2")
    for rule in GPU_STAGES:
        for job in jobs[rule]:
            assert (job["gpu"], job["cpus_per_gpu"], job["threads"]) == ("1", "4", 4), (rule, job)
    assert "gpu" not in jobs["base_model"][0] and jobs["base_model"][0]["threads"] == 8
    mem = {job["name"]: int(job["mem_mb"]) for job in jobs["finetune"]}
    full, lora = mem["full"], mem["lora-r8"]
    assert full > lora, "full fine-tuning holds gradients and optimizer state for every weight"
