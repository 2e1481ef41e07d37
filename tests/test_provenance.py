"""The DAG is described once, by the stage registry's reads: the rules' inputs, DVC's deps, each job's provenance and
its skipped check all derive from it, so a replaced base model or dataset marks its numbers stale in the report."""
import json
from pathlib import Path

import yaml

from efflab import config, registry
from efflab.layout import Layout
from efflab.provenance import ARTIFACTS

REPO = Path(__file__).resolve().parents[1]
def test_dvc_deps_and_provenance_are_what_the_registry_says_each_job_reads():
    """dvc.yaml is Snakemake's DAG for params.yaml (test_dvc checks that): each job's deps under results/ are its
    reads (every earlier job's record, for a stage that reads them all), and its provenance names the job of each."""
    cfg = config.load(str(REPO / "params.yaml"))
    dvc = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]
    checked = 0
    for stage in registry.STAGES:
        for name in registry.names(cfg, stage) or [None]:
            read = registry.reads(cfg, stage, name)
            if read is None:
                read = registry.earlier_records(cfg, stage)
                deps = {d for d in dvc[stage]["deps"] if d.startswith("results/") and d.endswith("/metrics.json")}
                assert deps == {f"results/{p}" for p in read}, stage
                continue
            deps = {d for d in dvc[f"{stage}-{name}" if name else stage]["deps"] if d.startswith("results/")}
            assert deps == {f"results/{p}" for p in read}, (stage, name)
            assert set(registry.upstream_jobs(cfg, stage, name)) == {registry.job_of(p) for p in read}
            checked += 1
    assert checked > 20


def test_what_a_job_reads_of_another_is_what_that_job_writes():
    """Every path a job reads is a record, or an artifact its maker hashes into its provenance."""
    for params in ("params.yaml", "workflow/profiles/gpu/params.yaml", "tests/config/params.test.yaml"):
        cfg = config.load(str(REPO / params))
        for stage in registry.STAGES:
            for name in registry.names(cfg, stage) or [None]:
                for path in registry.reads(cfg, stage, name) or []:
                    job = registry.job_of(path)
                    file = path[len(job) + 1:]
                    assert file == "metrics.json" or file in ARTIFACTS[job.split("/")[0]], (stage, name, path)


def test_a_job_whose_model_was_not_built_is_skipped_naming_why(tmp_path, test_cfg):
    layout = Layout(tmp_path)
    for job, status in (("finetune/lora-r8", "failed"), ("base_model", "ok"), ("prepare_data", "ok")):
        layout.job_metrics(job).parent.mkdir(parents=True)
        layout.job_metrics(job).write_text(json.dumps({"status": status, "reason": "out of memory"}))
    for stage, name in (("evaluate", "adapter-lora-r8"), ("merge", "lora-r8")):
        assert registry.built_on(test_cfg, stage, name) == ["finetune/lora-r8"]
        assert layout.skipped_because(registry.built_on(test_cfg, stage, name)) == {
            "status": "skipped", "reason": "finetune lora-r8 is failed: out of memory"}
    assert registry.built_on(test_cfg, "evaluate", "base") == []  # the base model's failure stops the run instead
