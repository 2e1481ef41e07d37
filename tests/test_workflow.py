"""End to end: the real snakemake and dvc CLIs on the CI params in temporary folders, and the same pipeline
through a real SLURM cluster. These tests share one local run of the CI pipeline (conftest.local_pipeline), so
they live in one module, which pytest-xdist (--dist loadfile) gives to one worker.

SLURM for real: the CI pipeline through `snakemake --executor slurm` on a one-node cluster that
tests/slurm/cluster.sh starts on this machine (Debian's slurm-wlm, munge, slurmdbd for sacct).

Every cluster call runs under a hard timeout (`timeout -s KILL` around snakemake, whose status polls
could otherwise wait forever), so a hung cluster fails the test instead of stalling CI. To keep CI
short, SLURM runs three jobs (the two first stages and a LoRA fine-tuning run that needs both), and their
results are compared with the session's local run of the same pipeline.
"""
from __future__ import annotations

import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from efflab import config
from efflab.experiment import adapter_runs
from efflab.registry import STAGES
from efflab.registry import names as stage_names
from efflab.tools import dvcgen
from tests.helpers import BIN, REPO, TEST_PARAMS, run_stage, write_experiment

pytestmark = pytest.mark.slow
TIMEOUT = 1200


def sh(cmd: list, cwd: Path, timeout: int = TIMEOUT) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(c) for c in cmd], cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{cmd} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc


def expected_outputs(cfg: dict) -> list[str]:
    outs = ["results/base_model/model/model.safetensors", "results/prepare_data/train.parquet",
            "results/prepare_data/validation.parquet", "results/report/report.md", "results/report/summary.csv"]
    for stage in STAGES:
        outs += [f"results/{stage}/{n + '/' if n else ''}metrics.json" for n in (stage_names(cfg, stage) or [None])]
    outs += [f"results/finetune/{n}/loss.csv" for n in cfg["finetune"]["runs"]]
    return outs


def check_results(work: Path, cfg: dict) -> None:
    missing = [p for p in expected_outputs(cfg) if not (work / p).is_file()]
    assert missing == []
    report = (work / "results/report/report.md").read_text()
    for section in ("## At a glance: your model on your data", "## Published numbers checked", "## In detail",
                    "## Quantization", "## Fine-tuning", "## Merging adapters", "## Attention implementations",
                    "### What each knob costs and buys", "Determinism: ", "## Did not run",
                    "### Memory vs sequence length", "## Inference variants", "## Run size"):
        assert section in report, section
    details = (work / "results/report/details.md").read_text()
    assert "## Provenance" in details and "## Environments" in details, "provenance and environments: details.md"
    # the user's answers come first; the seed texts' claims are a linked page, not the bulk of the report
    assert report.index("## At a glance") < report.index("## Published numbers checked") < report.index("## In detail")
    assert "](../claims/claims.md)" in report and "| claim |" not in report
    assert "## Sample answers" in details and "_Reference answer:_" in details
    assert "Not compared in one table" not in report, "one machine, one stack: one table per stage"
    assert "unavailable: flash_attention_2 needs a CUDA GPU" in report
    pngs = sorted((work / "results/report").glob("*.png"))
    assert len(pngs) >= 5 and all(p.read_bytes()[:4] == b"\x89PNG" for p in pngs)
    summary = pd.read_csv(work / "results/report/summary.csv")
    assert list(summary.columns) == ["stage", "job", "metric", "value", "lower", "upper", "unit", "n"]
    assert {"quantize", "prune", "qat", "finetune", "merge", "bench_attention", "bench_inference", "bench_serving",
            "capacity", "bench_finetune"} <= set(summary.stage) and summary["value"].notna().all()
    assert (summary["lower"].notna() == summary["upper"].notna()).all() and summary["lower"].notna().any()
    # the page stays one a person reads: the seeds' claims and the details are linked pages (32 KB: the decode
    # roofline columns and the quantization schemes' LoRA column took the CI report past the earlier 30 KB)
    assert len((work / "results/report/report.md").read_bytes()) < 32_000
    interleaved = json.loads((work / "results/bench_finetune/metrics.json").read_text())
    assert [(p["a"], p["b"], p["knob"], p["status"]) for p in interleaved["pairs"]] == [
        ("lora-r8", "qlora-r8", "method", "ok"), ("full", "lora-r8", None, "ok"), ("full", "qlora-r8", None, "ok")]
    first, *rest = interleaved["pairs"]  # one cell timed them all: each pair's ratio within the same rounds
    assert all(p["together"] and p["interleaved"]["rounds"] == first["interleaved"]["rounds"] for p in rest)
    kept = [r["seconds"] for r in first["interleaved"]["rounds"] if r["stable"]]
    if "unstable" not in first["interleaved"]:
        assert rest[0]["step_time_ratio"]["median"] == pytest.approx(
            statistics.median(s["lora-r8"] / s["full"] for s in kept))
    decided = json.loads((work / "results/report/decisions.json").read_text())["questions"]["finetune"]["options"]
    # the ratios over the reference run are the interleaved ones (bench_finetune.against_reference); a pair the
    # machine's speed changes left without stable rounds has none, and no other takes its place
    assert all(o["axes"]["step_ratio"]["source"] == "interleaved" for o in decided
               if not o["baseline"] and o["axes"]["step_ratio"]), decided
    for run in cfg["finetune"]["runs"]:
        m = json.loads((work / f"results/finetune/{run}/metrics.json").read_text())
        assert m["validation_after"]["loss"] < m["validation_before"]["loss"], run


def copy_project(work: Path) -> None:
    for item in ("Snakefile", "workflow", "src"):
        src = REPO / item
        (shutil.copytree if src.is_dir() else shutil.copy)(src, work / item)
    write_experiment(work / "params.yaml")


# SLURM: first in the module, so its cluster runs while the local pipeline runs in the background -----------

CLUSTER = REPO / "tests" / "slurm" / "cluster.sh"
STATE = Path(os.environ.get("EFFLAB_SLURM_DIR", "/tmp/efflab-slurm"))
PIPELINE_TIMEOUT = 480
# Fields that legitimately differ between two runs of the same job: where and how fast it ran.
VOLATILE = re.compile(r"environment|(^|_)(s|ms|wall|time|seconds|latency|ttft|tokens_per_s|per_s|throughput|gflops|"
                      r"rss|peak|memory|allocated|reserved|bytes_per_s)($|_)|dtype_choice")


def run_timed(cmd: list, timeout: float, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout, **kwargs)


@pytest.fixture(scope="session")
def slurm_cluster():
    """A running cluster for the session; stopped at the end if this session started it."""
    if os.geteuid() != 0:
        pytest.skip("the SLURM test needs root (it installs slurm-wlm and starts munged and the SLURM daemons)")
    if not shutil.which("slurmctld") and not shutil.which("apt-get"):
        pytest.skip("the SLURM test needs Debian's slurm-wlm installed, or apt-get to install it")
    env = dict(os.environ, EFFLAB_SLURM_DIR=str(STATE))
    was_up = run_timed([CLUSTER, "status"], 30, env=env).returncode == 0
    t0 = time.perf_counter()
    start = run_timed(["timeout", "-s", "KILL", 900, CLUSTER, "start"], 930, env=env)
    if start.returncode != 0:
        run_timed(["timeout", "-s", "KILL", 120, CLUSTER, "stop"], 150, env=env)  # whatever did start
        pytest.skip(f"the local SLURM cluster could not start (rc {start.returncode}): "
                    f"{start.stderr.strip().splitlines()[-1:] or start.stdout[-300:]}")
    bring_up_s = time.perf_counter() - t0
    try:
        yield {"env": dict(env, SLURM_CONF=str(STATE / "slurm.conf")), "bring_up_s": bring_up_s}
    finally:
        if not was_up:
            run_timed(["timeout", "-s", "KILL", 120, CLUSTER, "stop"], 150, env=env)


def comparable(metrics):
    """The metrics without timings, memory peaks and the environment block."""
    if isinstance(metrics, dict):
        return {k: comparable(v) for k, v in metrics.items() if not VOLATILE.search(k)}
    if isinstance(metrics, list):
        return [comparable(v) for v in metrics]
    return metrics


def assert_same(a, b, where=""):
    if isinstance(a, float) and isinstance(b, float):
        assert math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-9) or (math.isnan(a) and math.isnan(b)), f"{where}: {a} != {b}"
    elif isinstance(a, dict) and isinstance(b, dict):
        assert a.keys() == b.keys(), f"{where}: keys differ: {a.keys() ^ b.keys()}"
        for k in a:
            assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, list) and isinstance(b, list):
        assert len(a) == len(b), f"{where}: lengths differ"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def slurm_jobs(cfg: dict) -> dict:
    """The jobs SLURM runs: two single-job stages side by side, then a grid job (a wildcard) that reads both
    and asks for the most memory and time: what the executor does with every other job too (each stage's
    resources are checked in tests/test_resources.py from the dry run). Each DAG level costs the executor's
    submit and status-poll round trip, and each job about 10 CPU-seconds, hence not one of every stage."""
    return {"base_model": [None], "prepare_data": [None], "finetune": [adapter_runs(cfg)[0]]}


def job_files(stage, name):
    folder = f"results/{stage}/{name}" if name else f"results/{stage}"
    return f"{folder}/metrics.json", f"results/logs/{stage}/{name or stage}.log"


@pytest.mark.slurm
@pytest.mark.integration
def test_pipeline_through_slurm_equals_a_local_run(local_pipeline, slurm_cluster, test_cfg, tmp_path):
    jobs = slurm_jobs(test_cfg)
    targets = [job_files(stage, name)[0] for stage, names in jobs.items() for name in names]
    work = tmp_path / "repo"
    work.mkdir()
    for item in ("Snakefile", "workflow", "src"):
        (shutil.copytree if (REPO / item).is_dir() else shutil.copy)(REPO / item, work / item)
    write_experiment(work / "params.yaml")
    env = dict(slurm_cluster["env"], PATH=f"{BIN}{os.pathsep}{os.environ['PATH']}")

    t0 = time.perf_counter()
    proc = run_timed(["timeout", "-s", "KILL", PIPELINE_TIMEOUT, BIN / "snakemake", "--executor", "slurm",
                "--profile", "workflow/profiles/slurm", "--cores", "2", "--jobs", "4", "--retries", "0",
                "--slurm-init-seconds-before-status-checks", "1", "--seconds-between-status-checks", "1",
                "--latency-wait", "5", "--slurm-keep-successful-logs", *targets],
               PIPELINE_TIMEOUT + 30, cwd=work, env=env)
    slurm_wall_s = time.perf_counter() - t0
    assert proc.returncode == 0, f"snakemake --executor slurm failed (rc {proc.returncode}, -9 = hung and " \
                                 f"killed after {PIPELINE_TIMEOUT} s):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"

    job_ids = {}
    for stage, names in jobs.items():
        for name in names:
            metrics, log = job_files(stage, name)
            found = re.findall(r": start in SLURM job (\d+)", (work / log).read_text())
            assert len(found) == 1, f"{log} does not name the SLURM job it ran in"
            job_ids[f"{stage}/{name or ''}"] = found[0]
            local = json.loads((local_pipeline.wait()["dir"] / metrics).read_text())
            assert_same(comparable(json.loads((work / metrics).read_text())), comparable(local), metrics)
    assert len(set(job_ids.values())) == len(job_ids), f"jobs shared a SLURM job: {job_ids}"

    sacct_cmd = ["timeout", "-s", "KILL", 10, "sacct", "-X", "-n", "-P", "-o", "JobID,State,ExitCode,Comment",
                 "-j", ",".join(job_ids.values())]
    deadline = time.monotonic() + 30  # slurmdbd records a finished job within a second or two
    while True:
        sacct = run_timed(sacct_cmd, 20, env=env)
        rows = {row.split("|")[0]: row.split("|")[1:] for row in sacct.stdout.splitlines() if row}
        if set(rows) >= set(job_ids.values()) or time.monotonic() > deadline:
            break
        time.sleep(1)
    for job, jid in job_ids.items():
        assert jid in rows, f"sacct does not list SLURM job {jid} ({job}):\n{sacct.stdout}{sacct.stderr}"
        state, exit_code, comment = rows[jid]
        assert (state, exit_code) == ("COMPLETED", "0:0"), f"{job}: SLURM job {jid} {state} {exit_code}"
        assert comment.startswith(f"rule_{job.split('/')[0]}"), f"{job}: SLURM job {jid} comment {comment!r}"

    evidence = {"bring_up_s": round(slurm_cluster["bring_up_s"], 1), "slurm_wall_s": round(slurm_wall_s, 1),
                "local_pipeline_wall_s": round(local_pipeline.wait()["wall_s"], 1), "jobs": job_ids,
                "sacct": sacct.stdout.splitlines()}
    (STATE / "last_test_evidence.json").write_text(json.dumps(evidence, indent=2) + "\n")
    print(json.dumps(evidence, indent=2))


@pytest.fixture(scope="module")
def test_cfg_module():

    return config.load(TEST_PARAMS)


def test_snakemake_runs_every_stage(local_pipeline, test_cfg_module):
    work = local_pipeline.wait()["dir"]
    check_results(work, test_cfg_module)
    for stage in STAGES:
        assert list((work / "results/logs" / stage).glob("*.log")), f"no log for {stage}"
    again = sh([BIN / "snakemake", "-s", REPO / "Snakefile", "--directory", work, "-n", "--cores", "2"], work)
    assert "Nothing to be done" in again.stdout + again.stderr


def test_the_family_matrix_row_of_llama_is_what_the_ci_pipeline_ran(local_pipeline, test_cfg_module):
    """docs/reference/families.md's Llama row, checked against the CI pipeline's own records (every stage on a
    tiny Llama-family model), so that the matrix tests need not run Llama again."""
    from efflab.models.engines import ENGINES
    from tests.matrix import documented, outcome, summary

    results = local_pipeline.wait()["dir"] / "results"
    seen = {}
    for stage in STAGES:
        for name in stage_names(test_cfg_module, stage) or [None]:
            if stage == "bench_attention" and name not in ("eager", "sdpa"):
                continue  # flash_attention_2 is unavailable for want of a GPU, not for the family
            record = json.loads((results / stage / (name or "") / "metrics.json").read_text())
            if isinstance(record.get("cells"), list):  # vLLM's cells: unavailable for want of vLLM and a GPU
                record["cells"] = [c for c in record["cells"]
                                   if not {c.get("method"), c.get("generation")} & set(ENGINES)]
            seen[f"{stage}/{name}" if name else stage] = outcome(record)
    assert summary(seen) == documented()["llama"]


def test_snakemake_writes_its_html_report_with_the_plots_by_category(local_pipeline, tmp_path):
    work = local_pipeline.wait()["dir"]
    html = tmp_path / "report.html"
    sh([BIN / "snakemake", "-s", REPO / "Snakefile", "--directory", work, "--cores", "2", "--report", html], work)
    text = html.read_text()
    assert text.lstrip().lower().startswith("<!doctype html")
    for needle in ("Fine-tuning", "Inference", "Attention", "Quantization", "finetune_pareto.png",
                   "on the frontier of decisions.json"):
        assert needle in text, f"{needle!r} is not in the HTML report"


def _dvc_view(repo: Path) -> set:
    from dvc.repo import Repo

    with Repo(str(repo)) as dvc_repo:
        return {(s.cmd, frozenset(o.def_path for o in s.outs)) for s in dvc_repo.index.stages}


def _snakemake_view(params: str, workdir: Path) -> set:
    return {(j["cmd"], frozenset(j["output"])) for j in dvcgen.snakemake_jobs(params, workdir)}


def test_committed_dvc_yaml_is_in_step_with_snakemake():
    assert (REPO / "dvc.yaml").read_text() == dvcgen.render("params.yaml", REPO), "run `make dvc.yaml`"
    assert _dvc_view(REPO) == _snakemake_view("params.yaml", REPO)


# `dvc exp show` on the CI params: at most this many figure columns (about 2,400 when every metrics.json was a DVC
# metric; 156 at this commit), beside DVC's own columns for every param (about 290) and every stage dependency
# (about 120); after a one-key experiment, `--only-changed` keeps that key and the figures that moved.
FIGURE_COLUMNS = 200
ONLY_CHANGED_COLUMNS = 60


def dvc_csv(cmd: list, work: Path) -> list[dict]:
    import csv
    import io

    return list(csv.DictReader(io.StringIO(sh([BIN / "dvc", *cmd, "--csv"], work).stdout)))


@pytest.mark.integration
def test_dvc_tracks_the_snakemake_run_and_reruns_what_a_param_change_touches(local_pipeline, tmp_path,
                                                                             test_cfg_module):
    """DVC's stages are Snakemake's jobs (same commands, same outputs), so DVC can take over the outputs of the
    Snakemake run as they are (`dvc commit -f`), and `dvc exp run -S` then reruns the job the changed param
    reaches, and what depends on it, with the real stage command: nothing else. What DVC shows of an experiment
    is each job's figures.json, not its whole record."""
    copy_project(tmp_path)
    shutil.copy(REPO / ".gitignore", tmp_path)  # as in a checkout: results/ in git holds only the metrics
    shutil.copytree(local_pipeline.wait()["dir"] / "results", tmp_path / "results")
    sh(["git", "init", "-q"], tmp_path)
    sh([BIN / "dvc", "init", "-q"], tmp_path)
    shutil.copy(REPO / ".dvc" / "config", tmp_path / ".dvc" / "config")  # the checkout's: its cache link types
    sh([sys.executable, "-m", "efflab.tools.dvcgen"], tmp_path)
    assert _dvc_view(tmp_path) == _snakemake_view("params.yaml", tmp_path)

    sh([BIN / "dvc", "commit", "-f", "-q"], tmp_path)  # adopt what Snakemake produced
    assert json.loads(sh([BIN / "dvc", "status", "--json"], tmp_path).stdout) == {}
    weights = tmp_path / "results/base_model/model/model.safetensors"
    check_linked_not_copied(weights, tmp_path)
    sh([BIN / "dvc", "commit", "-f", "-q"], tmp_path)  # again, over its own links: still linked, the cache intact
    check_linked_not_copied(weights, tmp_path)
    metrics = json.loads(sh([BIN / "dvc", "metrics", "show", "--json"], tmp_path).stdout)
    shown = json.dumps(metrics)
    assert "figures.json" in shown and "metrics.json" not in shown, "the DVC metrics are the jobs' figures"
    plots = json.loads(sh([BIN / "dvc", "plots", "show", "--json"], tmp_path).stdout)
    for title in ("Training loss by fine-tuning run", "Fine-tuning: speed against peak memory",
                  "Inference: generation speed against footprint"):
        assert title in json.dumps(plots), f"dvc plots show has no plot titled {title!r}"
    assert "results/report/quantize.png" in json.dumps(plots), "the report's figures are DVC image plots"
    sh([BIN / "dvc", "plots", "show", "-o", tmp_path / "dvc_plots"], tmp_path)
    page = (tmp_path / "dvc_plots" / "index.html").read_text()
    assert page.lstrip().lower().startswith("<!doctype html") and "Training loss by fine-tuning run" in page

    sh(["git", "add", "-A"], tmp_path)
    sh(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "snakemake run"], tmp_path)
    finetuned = (tmp_path / "results/finetune/lora-r8/metrics.json").read_text()
    exp = sh([BIN / "dvc", "exp", "run", "-n", "kv", "-S", "bench_inference.variants.baseline.kv_cache=[true]"],
             tmp_path)
    ran = set(re.findall(r"Running stage '([^']+)'", exp.stdout + exp.stderr))
    # claims reads the measured quantities of bench_inference's records, so the rerun baseline reaches it too;
    # capacity generates with the baseline too, but reads only its kind (not its cells' kv_cache): not rerun
    assert ran == {"bench_inference-baseline", "claims", "report"}, ran
    cells = json.loads((tmp_path / "results/bench_inference/baseline/metrics.json").read_text())["cells"]
    assert cells and all(c["kv_cache"] for c in cells), "the rerun used the changed param"
    assert (tmp_path / "results/finetune/lora-r8/metrics.json").read_text() == finetuned, "finetune did not rerun"
    check_experiment_tables(tmp_path)

    # One driver per workspace: what dvc ran here is named, and Snakemake warns before it runs beside it ...
    from efflab.provenance import written_by_dvc
    assert written_by_dvc(tmp_path / "results") == ["bench_inference/baseline", "claims", "report"]
    # (--touch: the warning comes before any job; DVC's checkout left every output with a new mtime, so a real run
    # here would redo the whole pipeline, which is what the warning is about)
    run = sh([BIN / "snakemake", "--cores", "1", "--touch", "--forcerun", "report"], tmp_path)
    assert "3 results here were written by dvc repro / dvc exp run" in run.stderr
    # ... and `dvc exp run --temp` runs an experiment without touching the workspace (params.yaml's comments
    # and flow lists included): a second experiment, beside the first in `dvc exp show`
    sh(["git", "add", "-A"], tmp_path)
    sh(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "exp applied"], tmp_path)
    params, report = (tmp_path / "params.yaml").read_text(), (tmp_path / "results/report/metrics.json").read_text()
    sh([BIN / "dvc", "exp", "run", "--temp", "-n", "no-kv", "-S", "bench_inference.variants.baseline.kv_cache=[false]"],
       tmp_path)
    assert (tmp_path / "params.yaml").read_text() == params and "  # " in params
    assert (tmp_path / "results/report/metrics.json").read_text() == report
    rows = dvc_csv(["exp", "show"], tmp_path)
    assert "no-kv" in {r["Experiment"] for r in rows}, [r["Experiment"] for r in rows]
    check_cache_intact(tmp_path)  # the reruns replaced linked outputs: no cache object changed under its hash
    figures = leaves(json.loads(sh([BIN / "dvc", "metrics", "show", "--json"], tmp_path).stdout))
    assert 0 < figures <= FIGURE_COLUMNS, f"dvc exp show has {figures} figure columns"


def check_linked_not_copied(path, work) -> None:
    """A DVC-tracked output is the cache's file (hard link or symlink: the checkout's .dvc/config), read-only, not a
    second copy of it."""
    assert path.is_symlink() or path.stat().st_nlink > 1, f"{path} was copied into .dvc/cache, not linked"
    assert not os.access(path, os.W_OK) or os.geteuid() == 0, f"{path} is linked but writable"


def check_cache_intact(work) -> None:
    """Every object in .dvc/cache still holds what its name (its md5) says."""
    import hashlib

    objects = [p for p in (work / ".dvc" / "cache" / "files" / "md5").rglob("*")
               if p.is_file() and not p.name.endswith(".dir")]
    assert objects
    for p in objects:
        assert hashlib.md5(p.read_bytes()).hexdigest() == p.parent.name + p.name, f"cache object {p} changed"


def leaves(shown: dict) -> int:
    """The figures in `dvc metrics show --json`'s workspace entry: one column each in `dvc exp show`."""
    def count(node):
        return sum(count(v) for v in node.values()) if isinstance(node, dict) else 1
    return sum(count(data.get("data", {})) for data in shown[""]["data"].values())


def check_experiment_tables(work: Path) -> None:
    """After a one-key experiment: `dvc exp show --only-changed` is that key and the figures that moved, with no
    record's environment or settings among them; `dvc metrics diff` is a short table of the same figures."""
    changed = dvc_csv(["exp", "show", "--only-changed"], work)
    columns = list(changed[0])
    assert "bench_inference.variants.baseline.kv_cache" in columns, columns
    # (DVC names a figure's file in the first column of that file's figures)
    assert any(c.startswith("results/bench_inference/baseline/figures.json:") for c in columns), columns
    assert any("decode_tokens_per_s.median" in c for c in columns), columns
    assert len(columns) <= ONLY_CHANGED_COLUMNS, f"{len(columns)} columns: {columns}"
    assert not [c for c in columns if "environment" in c or "provenance" in c or "settings" in c], columns
    diff = sh([BIN / "dvc", "metrics", "diff", "HEAD", "--md"], work).stdout.splitlines()
    assert any("decode_tokens_per_s" in line for line in diff) and len(diff) <= ONLY_CHANGED_COLUMNS, diff


def test_verdict_stability_compares_two_runs_and_fails_on_a_flipped_verdict(local_pipeline, tmp_path):
    """benchmarks/verdict_stability.py on the session's pipeline: against itself nothing flips; against a copy
    whose one claim reads otherwise, that claim is FLIPPED and the script exits 1."""
    results = local_pipeline.wait()["dir"] / "results"
    script = [sys.executable, str(REPO / "benchmarks" / "verdict_stability.py")]
    same = subprocess.run(script + [results, results, "--out", tmp_path / "same"], capture_output=True, text=True)
    assert same.returncode == 0, same.stderr
    rows = json.loads((tmp_path / "same" / "verdict_stability.json").read_text())
    assert rows and {r["outcome"] for r in rows} == {"same"} and any(r["what"].startswith("knob ") for r in rows)
    other = tmp_path / "other"
    shutil.copytree(results / "claims", other / "claims")
    claims = pd.read_csv(other / "claims" / "claims.csv")
    flipped = claims.index[claims.verdict == "reproduced"][0]
    claims.loc[flipped, "verdict"] = "differs"
    claims.to_csv(other / "claims" / "claims.csv", index=False)
    differ = subprocess.run(script + [results, other, "--out", tmp_path / "differ"], capture_output=True, text=True)
    assert differ.returncode == 1, differ.stderr
    rows = json.loads((tmp_path / "differ" / "verdict_stability.json").read_text())
    assert [r["what"] for r in rows if r["outcome"] == "FLIPPED"] == [f"claim {claims.id[flipped]}"]
    assert "1 FLIPPED" in (tmp_path / "differ" / "verdict_stability.md").read_text()


def test_failed_jobs_are_results_the_jobs_after_them_skip_and_the_report_still_renders(
        local_pipeline, tmp_path, monkeypatch, test_cfg_module):
    """A job that fails or runs out of memory outside any cell (quantize loading its scheme, a fine-tuning
    run, an attention implementation) is a result with its reason, written like any other; the jobs that
    build on it record "skipped: <upstream> <status>", and the report renders them all in its table of
    jobs that did not run."""
    import torch

    from efflab.stages import bench_attention, finetune, quantize

    results = tmp_path / "results"
    shutil.copytree(local_pipeline.wait()["dir"] / "results", results)

    def oom(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    def broken(*args, **kwargs):
        raise RuntimeError("an unexpected failure")
    monkeypatch.setattr(quantize, "load_model", oom)
    monkeypatch.setattr(finetune, "train", broken)
    monkeypatch.setattr(bench_attention, "unavailable_reason", broken)
    failed = {("quantize", "int8"): "oom", ("finetune", "qlora-r8"): "failed", ("bench_attention", "eager"): "failed"}
    for (stage, name), status in failed.items():
        m = run_stage(stage, TEST_PARAMS, results, name)
        assert m["status"] == status and m["reason"] and m["traceback"], (stage, m)
    assert sorted(p.name for p in (results / "quantize/int8").iterdir()) == ["figures.json", "metrics.json", "model"]
    assert (results / "quantize/int8/model/NOT_RUN.txt").read_text().startswith("oom: OutOfMemoryError")
    skipped = {("merge", "qlora-r8"): "finetune qlora-r8 is failed", ("bench_inference", "int8"): "quantize int8 is oom",
               ("evaluate", "quantized-int8"): "quantize int8 is oom"}
    for (stage, name), reason in skipped.items():
        m = run_stage(stage, TEST_PARAMS, results, name)
        assert m["status"] == "skipped" and m["reason"].startswith(reason), (stage, m)
    run_stage("claims", TEST_PARAMS, results)
    run_stage("report", TEST_PARAMS, results)
    report = (results / "report/report.md").read_text()
    section = report[report.index("## Did not run"):]
    for stage, name in [*failed, *skipped]:
        assert re.search(rf"\| *{stage} *\| *{name} *\|", section), f"{stage} {name} is not in the report's table"


@pytest.mark.integration  # a stage run and a whole snakemake run: ~20 s of a worker, make test keeps its 10 minutes
def test_a_single_job_stage_that_raises_is_a_result_and_snakemake_still_exits_non_zero(
        local_pipeline, tmp_path, monkeypatch):
    """Any stage job that raises (a bug, or a user error that slipped past the checks) writes its record, failed
    with the reason, and its outputs empty; the report renders around it; and the run's exit status still says
    that a job failed, naming it."""
    from efflab.config import UserError
    from efflab.stages import bench_serving

    work = tmp_path / "run"
    shutil.copytree(local_pipeline.wait()["dir"], work, symlinks=True)
    results = work / "results"

    def slipped(*args, **kwargs):
        raise UserError("bench_serving.concurrency: a check that should have come earlier")
    monkeypatch.setattr(bench_serving, "load_model", slipped)
    m = run_stage("bench_serving", work / "params.yaml", results)
    assert m["status"] == "failed" and m["reason"].startswith("UserError: bench_serving.concurrency"), m
    assert (results / "bench_serving" / "requests.csv").read_text() == ""
    proc = subprocess.run([str(BIN / "snakemake"), "-s", str(REPO / "Snakefile"), "--cores", "2"], cwd=work,
                          capture_output=True, text=True, timeout=TIMEOUT, env={**os.environ, "PATH": f"{BIN}:"
                                                                               f"{os.environ['PATH']}"})
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "efflab: error: 1 job(s) failed" in proc.stderr and "bench_serving: failed: UserError" in proc.stderr
    report = (results / "report" / "report.md").read_text()
    assert re.search(r"\| *bench_serving *\| *- *\| *failed *\|", report[report.index("## Did not run"):]), report
    assert "## Serving: naive vs static vs continuous batching\n\n_No job of this stage produced numbers" in report


@pytest.mark.integration  # dry runs and a report: ~20 s of a worker, make test keeps its 10 minutes
def test_stages_left_out_plan_no_jobs_and_the_report_says_they_were_not_asked_for(local_pipeline, tmp_path):
    """An empty grid switches a stage off: the dry run plans none of its jobs (nor the jobs that need them),
    the stage command refuses to run it, and the report renders with "Not asked for" in its section."""
    import yaml

    work = tmp_path / "run"
    shutil.copytree(local_pipeline.wait()["dir"], work, symlinks=True)
    cfg = yaml.safe_load((work / "params.yaml").read_text())
    cfg["prune"]["strategies"], cfg["qat"]["bits"], cfg["bench_serving"]["methods"] = {}, [], []
    cfg["capacity"]["runs"], cfg["capacity"]["variants"] = [], []
    (work / "off.yaml").write_text(yaml.safe_dump(cfg))
    plan = sh([BIN / "snakemake", "-s", REPO / "Snakefile", "-n", "--forceall", "--cores", "1", "--configfile",
               "off.yaml", "--quiet", "rules"], work).stdout
    planned = {line.split()[0] for line in plan.splitlines() if line.strip() and line.split()[-1].isdigit()}
    assert {"prune", "qat", "bench_serving", "capacity"}.isdisjoint(planned) and "report" in planned, plan
    with pytest.raises(SystemExit) as exit_:
        run_stage("qat", work / "off.yaml", work / "results")
    assert exit_.value.code == 2
    run_stage("report", work / "off.yaml", work / "results")
    report = (work / "results" / "report" / "report.md").read_text()
    for title, why in [("## Structured pruning", "prune.strategies is empty"), ("## Quantization-aware training",
                       "qat.bits is empty"), ("## Serving", "bench_serving.methods is empty"),
                       ("## Capacity", "capacity.runs, capacity.variants and capacity.kv_quant are empty")]:
        section = report[report.index(title):]
        assert section.split("\n\n")[1] == f"_Not asked for: {why}._", (title, section[:300])


def test_every_number_carries_the_hashes_of_the_artifacts_it_was_measured_on(local_pipeline, tmp_path, capsys):
    """Provenance: the chain dataset -> adapter -> merged model -> benchmark is in the benchmark's metrics,
    each hash recomputes from the artifact on disk, and a report over results that mix chains (a merged model
    replaced after it was benchmarked) is refused in one line."""
    from efflab.provenance import chain, content_sha256

    results = tmp_path / "results"
    shutil.copytree(local_pipeline.wait()["dir"] / "results", results)
    read = lambda job: json.loads((results / job / "metrics.json").read_text())  # noqa: E731
    bench = read("bench_inference/merged-lora-r8")["provenance"]
    links = [line.split()[0] for line in chain(bench)]
    assert links == ["base_model", "prepare_data", "merge/lora-r8", "finetune/lora-r8"], links
    merge, finetune = read("merge/lora-r8")["provenance"], read("finetune/lora-r8")["provenance"]
    assert bench["inputs"]["merge/lora-r8"]["sha256"] == merge["outputs_sha256"] == \
        content_sha256([results / "merge/lora-r8/model"])
    assert merge["inputs"]["finetune/lora-r8"]["sha256"] == finetune["outputs_sha256"] == \
        content_sha256([results / "finetune/lora-r8/model"])
    assert read("prepare_data")["provenance"]["outputs_sha256"] == content_sha256(
        [results / "prepare_data/train.parquet", results / "prepare_data/validation.parquet",
         results / "prepare_data/lm_eval"])

    m = read("merge/lora-r8")
    m["provenance"]["outputs_sha256"] = "0" * 64  # the merged model was rebuilt after the benchmark ran
    (results / "merge/lora-r8/metrics.json").write_text(json.dumps(m))
    with pytest.raises(SystemExit) as exit_:
        run_stage("report", TEST_PARAMS, results)
    assert exit_.value.code == 2
    assert re.search(r"error: results mix artifacts: bench_inference/merged-lora-r8 was measured on merge/lora-r8 "
                     r"[0-9a-f]{12}, which is now 000000000000", capsys.readouterr().err)
