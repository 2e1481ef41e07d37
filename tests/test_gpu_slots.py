"""GPU slots on a workstation, with fake GPU counts: parallel GPU jobs each get their own device."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from efflab import gpu_slots

CUDA = {"device": "cuda", "threads": None}


@pytest.fixture
def env(tmp_path):
    return {"EFFLAB_GPU_LOCK_DIR": str(tmp_path / "slots")}


def test_parallel_jobs_get_distinct_gpus_and_a_freed_gpu_is_reused(env):
    jobs = [dict(env) for _ in range(3)]
    first = gpu_slots.assign("finetune", CUDA, jobs[0], gpu_count=2)
    second = gpu_slots.assign("quantize", CUDA, jobs[1], gpu_count=2)
    assert {jobs[0]["CUDA_VISIBLE_DEVICES"], jobs[1]["CUDA_VISIBLE_DEVICES"]} == {"0", "1"}
    with pytest.raises(TimeoutError):
        gpu_slots.claim(["0", "1"], first.path.parent, timeout_s=0.3, poll_s=0.1)
    first.release()
    third = gpu_slots.assign("merge", CUDA, jobs[2], gpu_count=2)
    assert jobs[2]["CUDA_VISIBLE_DEVICES"] == first.device
    second.release(), third.release()


def test_existing_cuda_visible_devices_is_the_pool(env):
    env["CUDA_VISIBLE_DEVICES"] = "2,3"
    other = dict(env)
    a = gpu_slots.assign("bench_inference", CUDA, env, gpu_count=4)
    b = gpu_slots.assign("bench_attention", CUDA, other, gpu_count=4)
    assert {env["CUDA_VISIBLE_DEVICES"], other["CUDA_VISIBLE_DEVICES"]} == {"2", "3"}
    a.release(), b.release()


def test_jobs_per_gpu_allows_sharing_when_configured(env):
    env["EFFLAB_JOBS_PER_GPU"] = "2"
    other = dict(env)
    a = gpu_slots.assign("finetune", CUDA, env, gpu_count=1)
    b = gpu_slots.assign("finetune", CUDA, other, gpu_count=1)
    assert env["CUDA_VISIBLE_DEVICES"] == other["CUDA_VISIBLE_DEVICES"] == "0"
    a.release(), b.release()


@pytest.mark.parametrize("stage, runtime, extra, gpus", [
    ("finetune", {"device": "cpu", "threads": None}, {}, 2),      # a CPU run
    ("prepare_data", CUDA, {}, 2),                                 # a CPU-only stage
    ("finetune", CUDA, {"SLURM_JOB_ID": "42"}, 2),                 # SLURM's gres binding decides
    ("finetune", {"device": "auto", "threads": None}, {}, 0),      # no GPU on the machine
])
def test_no_claim_where_the_job_needs_no_slot(env, stage, runtime, extra, gpus):
    env |= extra
    before = dict(env)
    assert gpu_slots.assign(stage, runtime, env, gpu_count=gpus) is None
    assert env == before


def test_separate_processes_never_share_a_gpu(tmp_path):
    """Four processes on two fake GPUs: at most one holds a GPU at a time, and a crash frees it."""
    job = textwrap.dedent(f"""
        import os, sys, time
        from efflab import gpu_slots
        env = {{"EFFLAB_GPU_LOCK_DIR": {str(tmp_path / "slots")!r}}}
        gpu_slots.assign("finetune", {{"device": "cuda"}}, env, gpu_count=2)
        start = time.time(); time.sleep(0.4)
        print(env["CUDA_VISIBLE_DEVICES"], start, time.time())
        sys.exit(1 if sys.argv[1] == "0" else 0)  # the first job crashes: its lock must still go
    """)
    procs = [subprocess.Popen([sys.executable, "-c", job, str(i)], stdout=subprocess.PIPE, text=True)
             for i in range(4)]
    spans = [p.communicate(timeout=60)[0].split() for p in procs]
    by_gpu: dict[str, list[tuple[float, float]]] = {}
    for device, start, end in spans:
        by_gpu.setdefault(device, []).append((float(start), float(end)))
    assert set(by_gpu) <= {"0", "1"} and sum(map(len, by_gpu.values())) == 4
    for intervals in by_gpu.values():
        intervals.sort()
        assert all(prev_end <= start for (_, prev_end), (start, _) in zip(intervals, intervals[1:]))


def test_gpu_count_falls_back_to_nvidia_smi(tmp_path, monkeypatch):
    fake = tmp_path / "nvidia-smi"
    fake.write_text('#!/bin/sh\necho "GPU 0: NVIDIA H100 (UUID: GPU-a)"\necho "GPU 1: NVIDIA H100 (UUID: GPU-b)"\n')
    fake.chmod(0o755)
    monkeypatch.setattr(gpu_slots, "NVIDIA_PROC", tmp_path / "no-driver")
    monkeypatch.setenv("PATH", str(tmp_path), prepend=":")
    assert gpu_slots.driver_gpu_count() == 2



PROBE = textwrap.dedent("""
    import json, runpy, sys, traceback
    import torch
    from efflab import gpu_slots, registry

    calls = []

    def recorded(name, fn):
        def wrapper(*args, **kwargs):
            calls.append(name + " from " + traceback.format_stack(limit=2)[0].strip().splitlines()[0])
            return fn(*args, **kwargs)
        return wrapper

    for name in ("is_available", "device_count", "init", "_lazy_init", "current_device", "get_device_capability",
                 "get_device_properties", "get_device_name", "is_bf16_supported", "mem_get_info"):
        setattr(torch.cuda, name, recorded(name, getattr(torch.cuda, name)))

    class Assigned(Exception):
        pass

    def assign(stage, runtime, *args, **kwargs):
        raise Assigned()

    gpu_slots.assign = assign
    params, results, jobs = sys.argv[1], sys.argv[2], sys.argv[3:]
    before = {}
    for job in jobs:
        stage, name = job.split("/")
        sys.argv = [registry.module(stage), "--params", params, "--name", name, "--results", results]
        try:
            runpy.run_module(registry.module(stage), run_name="__main__", alter_sys=True)
        except Assigned:
            before[job] = list(calls)
    print(json.dumps(before))
""")
GPU_JOBS = ("finetune/lora-r8", "quantize/baseline", "merge/lora-r8", "bench_attention/eager", "bench_inference/baseline")


def test_a_gpu_stage_asks_cuda_nothing_before_its_gpu_slot_is_assigned(tmp_path):
    """CUDA reads CUDA_VISIBLE_DEVICES once, when it starts, and any query starts it (bitsandbytes asks for the
    device capability when it is imported): a stage's imports and its CLI up to gpu_slots.assign must not
    ask. One process runs every GPU stage's entry point, finetune's (the heaviest imports) first."""
    from tests.helpers import TEST_PARAMS

    proc = subprocess.run([sys.executable, "-c", PROBE, str(TEST_PARAMS), str(tmp_path), *GPU_JOBS],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    before = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(before) == set(GPU_JOBS), "every stage reached gpu_slots.assign"
    assert before == {job: [] for job in GPU_JOBS}, "CUDA was asked before the GPU slot was assigned"
