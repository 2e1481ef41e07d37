"""Bad params: one line naming the key and what was expected, exit code 2, no outputs, no traceback."""
import subprocess
import sys

import pytest
import yaml

from efflab import config, registry, schema
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
SLO_SEARCH = {"methods": ["continuous"], "workloads": ["chat"], "prefix_tokens": 8, "prefix_caching": [False],
              "page_tokens": 16, "concurrency": 2, "percentile": 50, "schedules": 2, "start_rate": 4,
              "range": [0.5, 64], "steps": 0}
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
    (_set(["bench_inference", "variants", "q", ], {"kind": "quantized", "of": "nf3"}),
     "bench_inference.variants.q.of: 'nf3' is not one of quantize.schemes"),
    (_set(["bench_inference", "variants", "q", ], {"kind": "quantized"}),
     "bench_inference.variants.q.of: kind 'quantized' needs the name of one of quantize.schemes"),
    (_set(["bench_inference", "kv_quant"], ["quanto-3"]), "bench_inference.kv_quant.0: 'quanto-3' is not one of"),
    (_set(["bench_inference", "variants", "baseline", "drafts"], ["nope"]),
     "bench_inference.variants.baseline.drafts: 'nope' is not a draft in bench_inference.speculative.drafts"),
    (lambda cfg: (_set(["bench_inference", "speculative", "drafts", "d"], {"kind": "pruned", "of": "nope"})(cfg),
                  _set(["bench_inference", "variants", "baseline", "generation"], ["dynamic", "assisted"])(cfg)),
     "bench_inference.speculative.drafts.d.of: 'nope' is not one of prune.strategies"),
    (lambda cfg: (_set(["bench_inference", "speculative", "drafts", "d"], {"source": "./no/such/draft"})(cfg),
                  _set(["bench_inference", "variants", "baseline", "generation"], ["dynamic", "assisted"])(cfg)),
     "bench_inference.speculative.drafts.d.source: './no/such/draft' does not exist"),
    (lambda cfg: (_set(["bench_inference", "speculative", "drafts"], {})(cfg),
                  _set(["bench_inference", "variants", "baseline", "generation"], ["dynamic", "assisted"])(cfg)),
     "bench_inference.variants.baseline.generation: assisted needs a draft model"),
    (_set(["report", "baseline_scheme"], "int8"), "expected a scheme with method 'none'"),
    (_set(["finetune", "runs", "qlora-r8", "quant"], {"method": "int8", "double_quant": False}),
     "QLoRA needs a 4-bit base"),
    (_set(["finetune", "runs", "lora-r8"], {"method": "lora", "bf16_weights": True, "optimizer": "adamw_bnb_8bit"}),
     "finetune.runs.lora-r8.optimizer: bf16_weights trains with torchao's AdamW"),
    (_set(["finetune", "runs", "full"], {"method": "full", "bf16_weights": True, "mixed_precision": "fp16"}),
     "finetune.runs.full.mixed_precision: bf16_weights computes in bf16"),
    (_set(["runtime", "device"], "tpu"), "runtime.device: 'tpu' is not one of"),
    (_set(["prepare_data", "validation_fraction"], 1.5), "prepare_data.validation_fraction"),
    (_set(["surprise"], 1), "unknown key 'surprise'"),
    (_set(["bench_serving", "slo_search"], SLO_SEARCH | {"range": [8, 2]}),
     "bench_serving.slo_search.range: [8, 2] (expected [lowest, highest] with lowest < highest"),
    (_set(["bench_serving", "slo_search"], SLO_SEARCH | {"start_rate": 100}),
     "bench_serving.slo_search.start_rate: 100 (expected a rate in range [0.5, 64])"),
    (_set(["bench_serving", "slo_search"], SLO_SEARCH | {"percentile": 100}), "bench_serving.slo_search.percentile"),
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


# Each case runs the stage's real CLI, efflab.cli.main, in this process; the first also as
# `python -m efflab.stages.<stage>`, the command the Snakemake rules run (a subprocess pays 4-10 s of imports, the
# rest need not).
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
        proc = subprocess.run([sys.executable, "-m", registry.module(stage), *args, "--name", CLI_ERRORS[0][3]],
                              capture_output=True, text=True, timeout=300)
        code, stderr = proc.returncode, proc.stderr
    else:
        module = __import__(registry.module(stage), fromlist=["run"])
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
    assert "efflab: error: " in proc.stderr and MALFORMED[0][1] in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "results").exists()


# `dvc exp run -S` rewrites params.yaml without its comments: every key is described in the schema instead.
PARAMS_FILES = ["params.yaml", "tests/config/params.test.yaml", "workflow/profiles/gpu/params.yaml"]
SCHEMA_KEYWORDS = {"$schema", "title", "description", "type", "properties", "additionalProperties", "required",
                   "propertyNames", "minProperties", "$defs", "$ref", "allOf", "oneOf", "not", "enum", "const",
                   "pattern", "minLength", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "items",
                   "minItems", "maxItems", "uniqueItems"}


def _key_paths(node: dict, prefix: str = ""):
    """Every key of a params mapping as a dotted path, mapping-valued keys and their keys too."""
    for key, value in node.items():
        yield prefix + key
        if isinstance(value, dict):
            yield from _key_paths(value, f"{prefix}{key}.")


@pytest.mark.parametrize("params", PARAMS_FILES)
def test_every_shipped_params_file_validates(params):
    """The GPU profile's experiment is not run by the tests: the schema is what keeps it in step with the code
    (it had fallen behind capacity.warmup's {train, generate} form)."""
    assert config.load(config.REPO_ROOT / params)


@pytest.mark.parametrize("params", PARAMS_FILES)
def test_every_key_of_the_shipped_params_files_is_described(params):
    cfg = config.load(config.REPO_ROOT / params)
    keys = list(_key_paths(cfg))
    assert "finetune.runs.lora-r8.method" in keys and "base_model.config_overrides" in keys
    assert [k for k in keys if not config.describe(k).strip()] == []


def test_every_key_of_the_schema_is_described():
    described = config.descriptions()
    assert [k for k, text in described.items() if not text.strip()] == []
    assert {"finetune.defaults.packing", "finetune.runs.<name>.lora.target_modules", "quantize.schemes.<name>.method",
            "prune.strategies.<name>.keep_heads", "bench_inference.variants.<name>.kind",
            "bench_inference.prompts.validation_rows"} <= set(described)
    assert all(config.describe(k) == text for k, text in described.items())


def test_the_schema_holds_no_stray_keys():
    """A comma or ': ' in an unquoted flow-style description splits it into a stray key the validator ignores."""
    def walk(node, path):
        if isinstance(node, list):
            for i, item in enumerate(node):
                yield from walk(item, f"{path}.{i}")
        elif isinstance(node, dict):
            for key, value in node.items():
                if key not in SCHEMA_KEYWORDS:
                    yield f"{path}.{key}"
                elif key in ("properties", "$defs"):
                    for name, sub in value.items():
                        yield from walk(sub, f"{path}.{key}.{name}")
                elif key == "description" and not isinstance(value, str):
                    yield f"{path}.{key}"
                elif key not in ("description", "title", "enum", "required", "const"):
                    yield from walk(value, f"{path}.{key}")

    assert list(walk(config.load_schema(), "")) == []


def test_describe_follows_grids_refs_and_branches():
    assert "padding-free" in config.describe("finetune.defaults.packing")
    assert config.describe("finetune.runs.any-name.packing") == config.describe("finetune.defaults.packing")
    assert "rank" in config.describe("finetune.runs.any-name.lora.r")  # allOf, then $ref to $defs/lora
    assert "bitsandbytes" in config.describe("quantize.schemes.mine.double_quant")
    assert "adapter" in config.describe("bench_inference.variants.mine.kind")
    assert "drawn with" in config.describe("bench_inference.prompts.validation_rows")  # oneOf
    assert "the model's transformers config" in config.describe("base_model.config_overrides.num_hidden_layers")


@pytest.mark.parametrize("key,expected", [
    ("finetune.defaults.rank", "finetune.defaults has no key 'rank' (expected one of: method, "),
    ("surprise", "the top level has no key 'surprise' (expected one of: runtime, "),
    ("runtime.device.cuda", "runtime.device has no key 'cuda' (a value, with no keys under it)"),
])
def test_describing_an_unknown_key_names_it(key, expected):
    with pytest.raises(schema.UnknownKey) as err:
        config.describe(key)
    message = str(err.value)
    assert message.startswith(f"{key!r} is not a params key: ") and expected in message
    assert "\n" not in message


def test_describe_cli(capsys):
    proc = subprocess.run([sys.executable, "-m", "efflab.config", "describe", "finetune.defaults.packing"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == config.describe("finetune.defaults.packing") + "\n"
    assert "DataCollatorWithFlattening" in proc.stdout

    config.main(["describe"])
    lines = capsys.readouterr().out.splitlines()
    assert "finetune.defaults.packing: " + config.describe("finetune.defaults.packing") in lines
    assert len(lines) == len(config.descriptions())

    with pytest.raises(SystemExit) as exit_:
        config.main(["describe", "finetune.defaults.rank"])
    stderr = capsys.readouterr().err
    assert exit_.value.code == 2
    assert stderr.splitlines() == [stderr.strip()]
    assert stderr.startswith("efflab config: error: 'finetune.defaults.rank' is not a params key")


def test_a_bare_no_written_back_by_dvc_still_reads_as_the_word(tmp_path):
    """`dvc exp run -S` rewrites params.yaml in YAML 1.2, where "no" needs no quotes; PyYAML (YAML 1.1) would read
    the bare word as False and the schema would refuse it."""
    text = (config.REPO_ROOT / "params.yaml").read_text().replace('mixed_precision: "no"', "mixed_precision: no")
    assert "mixed_precision: no " in text
    (tmp_path / "params.yaml").write_text(text)
    assert config.load(tmp_path / "params.yaml")["qat"]["train"]["mixed_precision"] == "no"


def _overlay(tmp_path, text: str, name: str = "overlay.yaml"):
    path = tmp_path / name
    path.write_text(text.replace("BASE", str(config.REPO_ROOT / "params.yaml")))
    return path


def test_an_overlay_merges_settings_key_by_key_and_replaces_a_grid_whole(tmp_path):
    path = _overlay(tmp_path, "extends: BASE\nfinetune:\n  defaults: {max_steps: 3}\n"
                              "  runs: {lora-r8: {method: lora}}\nmerge: {runs: [lora-r8]}\ncapacity: {runs: [lora-r8]}\n")
    base, cfg = config.load(config.REPO_ROOT / "params.yaml"), config.load(path)
    assert cfg["finetune"]["defaults"] == base["finetune"]["defaults"] | {"max_steps": 3}
    assert cfg["finetune"]["runs"] == {"lora-r8": {"method": "lora"}}  # not the base's runs beside it
    assert cfg["merge"] == base["merge"] | {"runs": ["lora-r8"]}
    assert {k: v for k, v in cfg.items() if k not in ("finetune", "merge", "capacity")} == {
        k: v for k, v in base.items() if k not in ("finetune", "merge", "capacity")}
    assert config.files(path) == [str(path), str(config.REPO_ROOT / "params.yaml")]


def test_the_shipped_overlays_carry_fewer_lines_than_the_experiments_they_make():
    for params in PARAMS_FILES[1:]:
        text = (config.REPO_ROOT / params).read_text()
        assert text.startswith("#") and "\nextends: " in text
        assert len(config.files(config.REPO_ROOT / params)) >= 2


@pytest.mark.parametrize("text,expected", [
    ("extends: nowhere.yaml\n", "extends: nowhere.yaml: params file not found"),
    ("extends: overlay.yaml\n", "extends: overlay.yaml extends"),
    ("extends: [BASE]\n", "extends: expected the path of the params file it overlays"),
    ("extends: BASE\nfinetune: {defaults: {max_steps: many}}\n", "finetune.defaults.max_steps"),
])
def test_a_bad_overlay_is_one_line_naming_the_file_and_key(tmp_path, text, expected):
    path = _overlay(tmp_path, text)
    with pytest.raises(UserError) as err:
        config.load(path)
    assert str(err.value).startswith(str(path)) and expected in str(err.value)


def test_resolve_prints_the_whole_experiment_an_overlay_makes():
    proc = subprocess.run([sys.executable, "-m", "efflab.config", "resolve", "tests/config/params.test.yaml"],
                          cwd=config.REPO_ROOT, capture_output=True, text=True, check=True)
    assert yaml.safe_load(proc.stdout) == config.load(config.REPO_ROOT / "tests/config/params.test.yaml")
