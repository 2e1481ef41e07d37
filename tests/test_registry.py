"""One stage registry (efflab.registry.STAGES): every stage with a rule file is in it and every stage in it has one,
and each place that acts per stage covers each stage: its rule, the params schema, its module, its doc page,
dvc.yaml, the GPU slots and the profiler."""
import importlib.util

import pytest
import yaml

from efflab import config, registry
from efflab.registry import STAGES
from tests.helpers import REPO

RULES = REPO / "workflow" / "rules"
SCHEMA = yaml.safe_load((REPO / "workflow" / "schemas" / "params.schema.yaml").read_text())


@pytest.fixture(scope="module")
def jobs():
    """The default experiment's jobs, as Snakemake plans them: one a stage with no grid, the first of a grid's."""
    from efflab.tools import dvcgen

    planned = {}
    for job in dvcgen.snakemake_jobs("params.yaml", REPO):
        planned.setdefault(job["rule"], job)
    return planned


def test_the_rules_are_the_registry_s_rows_and_only_a_hand_written_one_has_its_own_file(jobs):
    assert {p.stem for p in RULES.glob("*.smk")} - {"common", "stages"} == {
        s.name for s in STAGES.values() if s.own_rule}
    cfg = config.load(REPO / "params.yaml")
    assert all(registry.not_asked(cfg, s) for s in STAGES if s not in jobs), "a stage has no rule"


@pytest.mark.parametrize("stage", STAGES)
def test_each_stage_s_job_runs_its_module_on_its_code_and_what_it_reads(stage, jobs):
    if stage not in jobs:
        pytest.skip(f"the default experiment leaves {stage} out")
    job, name = jobs[stage], jobs[stage]["wildcards"].get("name")
    assert job["cmd"].startswith(f"python -m {registry.module(stage)} --params params.yaml")
    assert ("--name" in job["cmd"]) == (STAGES[stage].grid is not None)
    code = REPO / "src" / "efflab" / "stages" / (stage if (REPO / "src/efflab/stages" / stage).is_dir() else f"{stage}.py")
    assert any(i.startswith(str(code)) or i.startswith(str(code.relative_to(REPO))) for i in job["input"]), stage
    reads = registry.reads(config.load(REPO / "params.yaml"), stage, name)
    if reads is not None:
        assert {f"results/{p}" for p in reads} <= set(job["input"])
    assert importlib.util.find_spec(registry.module(stage)) is not None


@pytest.mark.parametrize("stage", [s for s in STAGES if not STAGES[s].own_rule])
def test_each_stage_s_outputs_are_its_rule_s_outputs(stage, jobs):
    """The whole record, the figures DVC shows, and what the registry says the stage writes."""
    if stage not in jobs:
        pytest.skip(f"the default experiment leaves {stage} out")
    name = jobs[stage]["wildcards"].get("name")
    folder = f"results/{stage}/{name}" if name else f"results/{stage}"
    assert set(jobs[stage]["output"]) == {f"{folder}/{o}" for o in ("metrics.json", "figures.json",
                                                                      *STAGES[stage].outputs)}


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
