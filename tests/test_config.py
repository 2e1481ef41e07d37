"""Bad params: one line naming the key and what was expected, exit code 2, no outputs, no traceback."""
import subprocess
import sys

import pytest
import yaml

from efflab import config
from efflab.config import UserError

REPO_PARAMS = "params.yaml"


def _set(path, value):
    def edit(cfg):
        *parents, last = path
        node = cfg
        for key in parents:
            node = node[key]
        node[last] = value
    return edit


def _del(path):
    def edit(cfg):
        *parents, last = path
        node = cfg
        for key in parents:
            node = node[key]
        del node[last]
    return edit


# (edit, text the one-line error must contain)
MALFORMED = [
    (_set(["quantize", "schemes", "int8", "method"], "int9"), "quantize.schemes.int8.method: 'int9' is not one of"),
    (_set(["finetune", "defaults", "learning_rate"], "fast"), "finetune.defaults.learning_rate"),
    (_set(["finetune", "defaults", "max_steps"], 0), "finetune.defaults.max_steps"),
    (_set(["finetune", "runs", "lora-r8", "rank"], 8), "unknown key 'rank'"),
    (_del(["prepare_data", "max_length"]), "'max_length' is a required property"),
    (_set(["bench_attention", "implementations"], ["eager", "xformers"]), "bench_attention.implementations.1"),
    (_set(["quantize", "schemes", "Bad Name!"], {"method": "nf4"}), "quantize.schemes: 'Bad Name!' is not valid: expected a run name"),
    (_set(["bench_inference", "variants", "baseline", "of"], "lora-r8"), "kind 'base' takes no 'of'"),
    (_set(["bench_inference", "variants", "m", ], {"kind": "merged", "of": "full"}),
     "'full' is not a lora/qlora run"),
    (_set(["report", "baseline_scheme"], "int8"), "expected a scheme with method 'none'"),
    (_set(["finetune", "runs", "qlora-r8", "quant"], {"method": "int8", "double_quant": False}),
     "QLoRA needs a 4-bit base"),
    (_set(["runtime", "device"], "tpu"), "runtime.device: 'tpu' is not one of"),
    (_set(["prepare_data", "validation_fraction"], 1.5), "prepare_data.validation_fraction"),
    (_set(["surprise"], 1), "unknown key 'surprise'"),
]


def test_the_shipped_params_files_are_valid():
    config.load(REPO_PARAMS)
    config.load("tests/config/params.test.yaml")


@pytest.mark.parametrize("edit,expected", MALFORMED)
def test_malformed_params_name_the_key(write_params, edit, expected):
    with pytest.raises(UserError) as err:
        config.load(write_params(edit))
    message = str(err.value)
    assert expected in message
    assert "\n" not in message


# Each case runs the stage's real CLI, efflab.cli.main, in this process; the first also as `python -m efflab.<stage>`,
# the command the Snakemake rules run (a subprocess pays 4-10 s of imports, the rest need not).
CLI_ERRORS = [
    (MALFORMED[0][0], MALFORMED[0][1], "quantize", "int8"),
    (MALFORMED[3][0], MALFORMED[3][1], "finetune", "lora-r8"),
    (_set(["prepare_data", "source"], "missing/rows.jsonl"), "prepare_data.source: 'missing/rows.jsonl' does not exist",
     "prepare_data", None),
    (_set(["base_model", "config_overrides"], {"num_hidden_layerz": 2}), "'num_hidden_layerz' is not a field",
     "base_model", None),
    (None, "--name: 'nf5' is not one of the quantize jobs", "quantize", "nf5"),
    (None, "base_model/model does not exist: expected the output of an earlier stage", "prepare_data", None),
]


@pytest.mark.parametrize("edit,expected,stage,name", CLI_ERRORS + [(*CLI_ERRORS[0][:3], "subprocess")],
                         ids=[f"{c[2]}-{c[1][:40]}" for c in CLI_ERRORS] + ["python -m"])
def test_cli_user_errors_are_one_line_exit_2_and_leave_no_outputs(write_params, tmp_path, capsys, edit, expected,
                                                                  stage, name):
    from efflab import cli

    params = write_params(edit)
    results = tmp_path / "out"
    args = ["--params", str(params), "--results", str(results)]
    if name == "subprocess":
        proc = subprocess.run([sys.executable, "-m", f"efflab.{stage}", *args, "--name", CLI_ERRORS[0][3]],
                              capture_output=True, text=True, timeout=300)
        code, stderr = proc.returncode, proc.stderr
    else:
        module = __import__(f"efflab.{stage}", fromlist=["run"])
        with pytest.raises(SystemExit) as exit_:
            cli.main(stage, module.run, args + (["--name", name] if name else []))
        code, stderr = exit_.value.code, capsys.readouterr().err
    assert code == 2, stderr
    errors = [line for line in stderr.splitlines() if "error" in line.lower()]
    assert errors == [f"efflab {stage}: error: " + errors[0].split(": error: ", 1)[1]]
    assert expected in errors[0]
    assert "Traceback" not in stderr
    leftovers = [p for p in results.rglob("*") if p.is_file()] if results.exists() else []
    assert leftovers == []


def test_missing_and_unparsable_params_files(tmp_path):
    with pytest.raises(UserError, match="params file not found"):
        config.load(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("runtime: [unclosed\n")
    with pytest.raises(UserError, match=r"not valid YAML \(line"):
        config.load(bad)


def test_snakemake_refuses_bad_params_with_one_line(write_params, tmp_path):
    params = write_params(MALFORMED[0][0])
    proc = subprocess.run([sys.executable, "-m", "snakemake", "-s", str(config.REPO_ROOT / "Snakefile"),
                           "--configfile", str(params), "--directory", str(tmp_path), "-n", "--cores", "1"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert f"efflab: error: " in proc.stderr and MALFORMED[0][1] in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "results").exists()
