"""One table of model kinds (experiment.MODEL_KINDS) says which stage makes each kind, in which folder, and how it
loads; the evaluated models, the variants' folders and the params' check read it."""
from pathlib import Path

import pytest
import yaml

from efflab import config, experiment, registry
from efflab.config import UserError
from efflab.layout import Layout

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("kind", list(experiment.MODEL_KINDS))
def test_each_kind_is_made_by_a_stage_that_writes_its_folder(kind):
    made = experiment.MODEL_KINDS[kind]
    stage = registry.STAGES[made.stage]
    assert made.folder in stage.outputs
    assert (made.of_names is None) == (stage.grid is None)
    of = None if made.of_names is None else "x"
    assert registry.job_of(experiment.model_paths(kind, of)[-1]) == experiment.made_by(kind, of)


def test_an_adapter_loads_its_base_first_and_every_other_kind_its_own_folder():
    layout = Layout(Path("results"))
    assert layout.variant_folders(experiment.ModelRef("adapter", "r8")) == [Path("results/base_model/model"),
                                                                       Path("results/finetune/r8/model")]
    assert layout.variant_folders(experiment.ModelRef("healed", "h")) == [Path("results/prune/h/healed")]
    assert layout.variant_folders(experiment.ModelRef("base")) == [Path("results/base_model/model")]


def test_the_params_kinds_are_model_kinds():
    schema = yaml.safe_load((REPO / "workflow" / "schemas" / "params.schema.yaml").read_text())
    variants = schema["properties"]["bench_inference"]["properties"]["variants"]
    assert set(variants["additionalProperties"]["properties"]["kind"]["enum"]) <= set(experiment.MODEL_KINDS)


def test_evaluate_scores_one_model_of_each_kind_the_experiment_makes_in_the_table_s_order(test_cfg):
    models = experiment.evaluated_models(test_cfg)
    kinds = [m["kind"] for m in models.values()]
    assert set(kinds) <= set(experiment.MODEL_KINDS) and kinds[0] == "base"
    assert all(name == experiment.evaluated_name(m["kind"], m["of"]) for name, m in models.items())


def test_an_evaluated_name_of_no_kind_is_refused_naming_the_key(test_cfg):
    bad = {**test_cfg, "evaluate": {**test_cfg["evaluate"], "models": ["distilled-x"]}}
    with pytest.raises(UserError, match="evaluate.models: 'distilled-x' is not a model this experiment makes"):
        config.validate(bad)
