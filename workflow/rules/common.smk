import json
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

from efflab import config as efflab_config
from efflab import experiment, gpu_slots, layout, registry, zygote
from efflab.models import memory_check, model_check

# The stage CLIs read the params file themselves, so the DAG must be built from that same file alone:
# --configfile FILE names a whole experiment, which replaces params.yaml (Snakemake would otherwise merge it
# key by key over params.yaml, and plan jobs from params the stages never see); --config overrides would
# not reach the stages at all.
PARAMS = os.path.relpath(workflow.overwrite_configfiles[-1]) if workflow.overwrite_configfiles else "params.yaml"
if workflow.config_settings.config:
    sys.exit("efflab: error: --config overrides do not reach the stage commands; "
             "edit params.yaml or pass --configfile FILE")
if len(workflow.overwrite_configfiles) > 1:
    sys.exit("efflab: error: --configfile: give one params file (a whole experiment), not several to merge")
try:
    config.clear()
    config.update(efflab_config.load(PARAMS))
    for note in model_check.check(config, PARAMS):  # the params that depend on the model, where its config is at hand
        print(f"efflab: note: {PARAMS}: {note}", file=sys.stderr)
except efflab_config.UserError as err:
    sys.exit(f"efflab: error: {err}")

SRC = Path(workflow.basedir) / "src" / "efflab"
# Where workflow/envs/efflab.yaml installs efflab from under --sdm conda (Snakemake builds the environment
# from a copy of that file, so it cannot find the project by a relative path); declared, so that
# Snakemake passes it on to remote jobs, which may build the environment themselves.
os.environ["EFFLAB_REPO"] = workflow.basedir


envvars:
    "EFFLAB_REPO",


wildcard_constraints:
    name="[a-z0-9][a-z0-9_-]*",


def start_job_server():
    """A warm process the jobs fork from (efflab.zygote): each job skips ~10 s of imports. Where it is not wanted
    (a GPU, SLURM, not Linux), the jobs run elsewhere (an executor plugin) or in another environment (--sdm conda
    or apptainer), the jobs run as their own processes."""
    if zygote.why_not_fork() or workflow.remote_exec or not workflow.local_exec or \
            workflow.deployment_settings.deployment_method:
        return
    log = Path(".snakemake") / "efflab-zygote.log"
    log.parent.mkdir(exist_ok=True)
    if zygote.serving(os.environ.get(zygote.ENV)):  # one started around this run (a test session's) serves it too
        log.write_text(f"the jobs use the job server already at {os.environ[zygote.ENV]} ({zygote.ENV})\n")
        return
    path = Path(tempfile.gettempdir()) / f"efflab-zygote-{os.getpid()}.sock"
    path.unlink(missing_ok=True)
    with open(log, "w") as out:
        subprocess.Popen([sys.executable, "-m", "efflab.zygote", "--socket", str(path)], stdout=out,
                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    os.environ[zygote.ENV] = str(path)


def warn_mixed_drivers():
    """One driver per workspace (README, "Two drivers"): say so when DVC wrote results here."""
    from efflab.provenance import written_by_dvc

    jobs = written_by_dvc(Path("results"))
    if jobs:
        print(f"efflab: warning: {len(jobs)} results here were written by dvc repro / dvc exp run ({', '.join(jobs[:3])}"
              f"{', ...' if len(jobs) > 3 else ''}): Snakemake has no record of their params and code and will not "
              "rerun them when those change. Take them over with `snakemake --forceall --cores all`, and run DVC "
              "experiments with `dvc exp run --temp`, which leaves this workspace alone (README, \"Two drivers\").",
              file=sys.stderr)


def fail_if_jobs_failed():
    """Every job wrote its record and the report rendered around the failed ones (README, "Did not run"), but
    the run's exit status must still say that jobs failed."""
    from efflab.cli import failed_jobs

    failed = failed_jobs(config, Path("results"))
    if failed:
        print(f"efflab: error: {len(failed)} job(s) failed; the report lists them under \"Did not run\": "
              + "; ".join(failed[:5]) + (" ..." if len(failed) > 5 else ""), file=sys.stderr)
        sys.exit(1)


def code(stage):
    """The stage's own code (its module, or its package's files) and the project files it reads (Stage.code):
    inputs, so that editing one reruns the stage."""
    paths = [SRC / "stages" / stage] + [Path(workflow.basedir) / path for path in registry.STAGES[stage].code]
    paths[0] = paths[0] if paths[0].is_dir() else paths[0].with_suffix(".py")
    return [str(f) for p in paths for f in (sorted(q for q in p.rglob("*") if q.suffix in (".py", ".j2", ".json"))
                                             if p.is_dir() else [p])]


def local_source(stage):
    """The local data file, or the files of the local model folder, that the stage's `source` names ([] for
    embedded and hub sources, and for a stage without one): inputs, so that editing one reruns the stage and
    everything downstream. A missing one stops the dry run with one line."""
    if not registry.STAGES[stage].sourced:
        return []
    try:
        return efflab_config.local_source_files(stage, config[stage]["source"])
    except efflab_config.UserError as err:
        sys.exit(f"efflab: error: {PARAMS}: {err}")


def settings(stage):
    """The params a stage's job reads; Snakemake reruns the job when they change."""
    return lambda wildcards: registry.settings(config, stage, wildcards.get("name"))


def reads(stage):
    """What a job reads of earlier jobs (registry.Stage.reads; every earlier job's record where that is None): its
    inputs, the base model's record named `base` (its size scales the job's resources)."""
    def inputs(wildcards):
        read = registry.reads(config, stage, wildcards.get("name"))
        paths = [str(Path("results") / p) for p in (registry.earlier_records(config, stage) if read is None else read)]
        base = "results/base_model/metrics.json"
        return {"base": base, "reads": [p for p in paths if p != base]} if base in paths else {"reads": paths}
    return inputs


def folder(stage):
    """Where a job of the stage writes: results/<stage>/{name} for a stage with a grid, results/<stage> without."""
    return f"results/{stage}/{{name}}" if registry.STAGES[stage].grid else f"results/{stage}"


def outputs(stage):
    """The rule's outputs: the job's record, its figures (its DVC metric) and what the registry says it writes
    (Stage.outputs), a folder as directory(); each named after its file."""
    files = {f.replace(".", "_"): f for f in (*registry.STAGES[stage].outputs, "metrics.json", "figures.json")}
    return {key: directory(f"{folder(stage)}/{f}") if f in layout.FOLDERS else f"{folder(stage)}/{f}"
            for key, f in files.items()}


def log_file(stage):
    return f"results/logs/{stage}/{{name}}.log" if registry.STAGES[stage].grid else f"results/logs/{stage}/{stage}.log"


def job_args(stage):
    """What names a job of the stage on its CLI: ` --name <grid entry>`, quoted (nothing for a stage without a
    grid)."""
    if registry.STAGES[stage].grid is None:
        return lambda wildcards: ""
    return lambda wildcards: f" --name {shlex.quote(wildcards.name)}"


# Resources, under the standard names that both the local scheduler and the SLURM executor read:
# threads, mem_mb, runtime (minutes), gpu. Cluster specifics (partition, account, GPU model) live in
# workflow/profiles/, never here or in params.yaml.
#
# A CPU stage takes every core it is given (--cores; under SLURM the per-job cap in the profile):
# its timings are the measurement, so two of them must not share the CPU. A GPU stage takes one GPU
# and its share of the cores, so one job per GPU runs at once and CPU-only stages run alongside.
# GPU resources are only requested when the run uses a GPU (runtime.device: cuda, or auto on a machine
# with one), so CPU runs schedule exactly as before.
HEAVY = max(workflow.cores, 1)
_GPUS = gpu_slots.visible_gpus(os.environ, gpu_slots.driver_gpu_count())
USE_GPU = config["runtime"]["device"] == "cuda" or (config["runtime"]["device"] == "auto" and bool(_GPUS))
try:  # every fine-tuning, inference and capacity job's predicted peak against the device's memory, once the sources
    for _stage in registry.STAGES:  # are known to exist (local_source says so per rule, after these lines)
        if registry.STAGES[_stage].sourced:
            efflab_config.local_source_files(_stage, config[_stage]["source"])
    for line in memory_check.plan(config, "cuda" if USE_GPU else "cpu"):
        print(f"efflab: {line}", file=sys.stderr)
except efflab_config.UserError as err:
    sys.exit(f"efflab: error: {PARAMS}: {err}")
_gpu_limit = workflow.global_resources.get("gpu")
GPU_JOBS = max(1, (_gpu_limit.value if _gpu_limit is not None else None) or len(_GPUS))
GPU_THREADS = max(1, HEAVY // GPU_JOBS)

# Host memory: MEM_BASE_MB for Python, torch and the data, plus the stage's registry.Stage.mem_factor times the
# base model's in-memory size (weights in the compute dtype). Wall time: the stage's runtime_min for a model of up
# to 1 GB, linear in size above.
MEM_BASE_MB = 2000
# Before base_model has run (dry runs, DAG planning) its size is not known yet; Snakemake evaluates
# resources again when a job's inputs exist, and then the measured size is used.
MODEL_MB_UNKNOWN = 1000


def model_mb(input):
    """The base model's in-memory size in MB, from base_model's metrics once they exist."""
    metrics = Path(input.base) if "base" in input.keys() else None
    if metrics is None or not metrics.is_file():
        return MODEL_MB_UNKNOWN
    return json.loads(metrics.read_text())["memory_footprint_bytes"] / 1e6


def threads_for(stage):
    if registry.STAGES[stage].threads:
        return registry.STAGES[stage].threads
    if USE_GPU and registry.STAGES[stage].gpu:
        return GPU_THREADS
    return HEAVY if registry.STAGES[stage].timed else max(1, HEAVY // 2)


def mem_mb(stage):
    """Host memory that scales with the model and doubles on each retry (an OOM kill is the usual cause)."""
    def estimate(wildcards, input, attempt):
        factor = registry.mem_factor(config, stage, wildcards.get("name"))
        return int((MEM_BASE_MB + factor * model_mb(input)) * 2 ** (attempt - 1))
    return estimate


def runtime(stage):
    """Wall-time limit in minutes: scales with the model and, for fine-tuning, max_steps; doubles on each retry."""
    def estimate(wildcards, input, attempt):
        minutes = registry.STAGES[stage].runtime_min * max(1.0, model_mb(input) / 1000)
        if stage == "finetune":
            minutes *= max(1.0, experiment.finetune_run(config, wildcards.name).max_steps / 100)
        return int(minutes * 2 ** (attempt - 1))
    return estimate


def gpu_resources(stage):
    """gpu and cpus_per_gpu for a GPU stage on a GPU run; nothing otherwise."""
    if USE_GPU and registry.STAGES[stage].gpu:
        return {"gpu": 1, "cpus_per_gpu": GPU_THREADS}
    return {}
