import os
import sys
from pathlib import Path

from efflab import config as efflab_config
from efflab.cli import stage_names

# The stage CLIs read the params file themselves, so it must be the file Snakemake validated:
# choose it with --configfile; --config overrides would not reach them.
PARAMS = os.path.relpath(workflow.overwrite_configfiles[-1]) if workflow.overwrite_configfiles else "params.yaml"
if workflow.config_settings.config:
    sys.exit("efflab: error: --config overrides do not reach the stage commands; "
             "edit params.yaml or pass --configfile FILE")
try:
    efflab_config.validate(config, PARAMS)
except efflab_config.UserError as err:
    sys.exit(f"efflab: error: {err}")

SRC = Path(workflow.basedir) / "src" / "efflab"
HEAVY = max(workflow.cores, 1)


wildcard_constraints:
    name="[a-z0-9][a-z0-9_-]*",


def module(stage):
    """The stage's own module: an input, so that editing it reruns the stage."""
    return str(SRC / f"{stage}.py")


def settings(stage):
    """The params a stage's job reads; Snakemake reruns the job when they change."""
    return lambda wildcards: efflab_config.stage_settings(config, stage, wildcards.get("name"))


def names(stage):
    return stage_names(config, stage)


def quantize_reference(wildcards):
    """Every scheme is compared with the baseline scheme, so it waits for the baseline's metrics."""
    baseline = config["report"]["baseline_scheme"]
    return [] if wildcards.name == baseline else [f"results/quantize/{baseline}/metrics.json"]


def inference_inputs(wildcards):
    """The model folder a bench_inference variant loads."""
    variant = config["bench_inference"]["variants"][wildcards.name]
    kind, of = variant["kind"], variant.get("of")
    folder = {
        "base": "results/base_model/model",
        "quantized": f"results/quantize/{of}/model",
        "merged": f"results/merge/{of}/model",
        "adapter": f"results/finetune/{of}/model",
    }[kind]
    return {"model": folder}
