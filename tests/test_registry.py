"""One stage registry (efflab.registry.STAGES): every stage with a rule file is in it and every stage in it has one,
and each place that acts per stage covers each stage: its rule, the params schema, its module, its doc page,
dvc.yaml, the GPU slots and the profiler."""
import importlib.util
import re

import pytest
import yaml

from efflab import config, registry
from efflab.registry import STAGES
from tests.helpers import REPO

RULES = REPO / "workflow" / "rules"
SCHEMA = yaml.safe_load((REPO / "workflow" / "schemas" / "params.schema.yaml").read_text())


def rule_text(stage: str) -> str:
    return (RULES / f"{stage}.smk").read_text()


def test_every_rule_file_is_a_registered_stage_and_every_stage_has_one():
    assert {p.stem for p in RULES.glob("*.smk")} - {"common"} == set(STAGES)
    snakefile = (REPO / "Snakefile").read_text()  # a rule file a registered stage, in the registry's order
    assert re.search(r'^for _stage in registry\.STAGES:\n\n    include: f"workflow/rules/\{_stage\}\.smk"$',
                     snakefile, re.M)


@pytest.mark.parametrize("stage", STAGES)
def test_each_stage_s_rule_reads_the_registry_and_runs_its_module(stage):
    text = rule_text(stage)
    assert re.search(rf"^rule {stage}:", text, re.M)
    for helper in ("module", "settings", "mem_mb", "runtime"):
        assert f'{helper}("{stage}")' in text, f"rule {stage} does not call {helper}(\"{stage}\")"
    assert ('**gpu_resources("%s")' % stage in text) == STAGES[stage].gpu
    assert f"python -m {registry.module(stage)} " in text
    assert importlib.util.find_spec(registry.module(stage)) is not None


@pytest.mark.parametrize("stage", STAGES)
def test_each_stage_s_outputs_are_its_rule_s_outputs(stage):
    """The whole record, the figures DVC shows, and what the registry says the stage writes."""
    outputs = re.search(r"^    output:\n(.*?)^    \w+:", rule_text(stage), re.M | re.S).group(1)
    for output in ("metrics.json", "figures.json", *(STAGES[stage].outputs or ())):
        assert re.search(rf'results/{stage}/(\{{name\}}/)?{re.escape(output)}"', outputs), (stage, output)


@pytest.mark.parametrize("stage", STAGES)
def test_each_stage_has_a_params_section_and_a_doc_page(stage):
    assert stage in SCHEMA["properties"] and stage in SCHEMA["required"]
    assert all(key.split(".")[0] in SCHEMA["properties"] for key in STAGES[stage].params)
    assert (REPO / "docs" / "stages" / f"{stage}.md").is_file()


def test_the_profiler_s_stages_are_the_profiled_stages():
    enum = SCHEMA["properties"]["profile"]["properties"]["stages"]["items"]["enum"]
    assert set(enum) == {s.name for s in STAGES.values() if s.profiled}


def test_dvc_yaml_has_every_stage_the_default_experiment_runs():
    cfg = config.load(REPO / "params.yaml")
    dvc = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]
    assert {name.split("-")[0] for name in dvc} == {s for s in STAGES if not registry.not_asked(cfg, s)}


def test_resources_and_settings_are_defined_for_every_stage():
    cfg = config.load(REPO / "params.yaml")
    for stage in STAGES:
        for name in registry.names(cfg, stage) or [None]:
            assert registry.settings(cfg, stage, name)
            assert registry.mem_factor(cfg, stage, name) >= 0
        assert STAGES[stage].runtime_min > 0


def test_capacity_reruns_for_the_runs_and_variants_it_searches_and_not_for_a_cell_dimension(test_cfg):
    """Its params keys are filled in per entry of capacity.runs and capacity.variants: a bench_inference cell
    dimension (kv_cache) leaves its settings alone, a searched variant's kind or an unsearched run does not reach it."""
    import copy

    cfg = copy.deepcopy(test_cfg)
    cfg["capacity"] |= {"runs": ["lora-r8"], "variants": ["baseline"]}
    keys = registry.param_keys(cfg, "capacity")
    assert {"finetune.runs.lora-r8", "bench_inference.variants.baseline.kind"} <= set(keys)
    assert "bench_inference.variants.baseline.of" not in keys  # a base variant has none: DVC would refuse the key
    before = registry.settings(cfg, "capacity")
    cfg["bench_inference"]["variants"]["baseline"]["kv_cache"] = [False]
    cfg["finetune"]["runs"]["full"]["learning_rate"] = 0.1
    assert registry.settings(cfg, "capacity") == before
    cfg["bench_inference"]["variants"]["baseline"]["kind"] = "quantized"
    assert registry.settings(cfg, "capacity") != before
