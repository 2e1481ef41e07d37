"""The accelerate config files for multi-GPU fine-tuning (workflow/accelerate/) parse, and ZeRO-2 runs
on CPU where DeepSpeed is installed (`pip install -e '.[deepspeed]'`)."""
from __future__ import annotations

import importlib.util
import json
import subprocess

import pytest
from accelerate.commands.config.config_args import load_config_from_file

from tests.helpers import BIN, REPO

CONFIGS = REPO / "workflow" / "accelerate"


@pytest.mark.parametrize("name, kind", [("zero2_cpu", "DEEPSPEED"), ("zero2", "DEEPSPEED"), ("fsdp", "FSDP")])
def test_config_parses(name, kind):
    config = load_config_from_file(str(CONFIGS / f"{name}.yaml"))
    assert config.distributed_type.name == kind


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                    reason="deepspeed is not installed (pip install -e '.[deepspeed]')")
def test_zero2_trains_on_cpu():
    proc = subprocess.run([BIN / "accelerate", "launch", "--config_file", CONFIGS / "zero2_cpu.yaml",
                           REPO / "tests" / "distributed" / "train_smoke.py"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert (result["engine"], result["zero_stage"]) == ("DeepSpeedEngine", 2)
    assert result["losses"][-1] < result["losses"][0]
