"""The supported-architecture matrix (tests/test_families_*.py, two files so that pytest-xdist can give them to
both workers): every stage on a tiny random-init model of each family in tests/families.py
(the family's own config class and module names, the embedded tokenizer), with the default LoRA targets (null:
peft's choice for the family). Each stage either produces its results or records `unavailable` naming what the
family lacks; none crashes, and the report renders. The family x stage table in docs/reference/families.md is
generated from these results: the tests fail when it has drifted (EFFLAB_UPDATE_DOCS=1 rewrites it)."""
from __future__ import annotations

import copy
import json
import os

import pytest
import yaml

from efflab import config, registry
from efflab.models import model_check
from tests.families import FAMILIES, family_folder
from tests.helpers import REPO, TEST_PARAMS, run_stage

DOC = REPO / "docs" / "reference" / "families.md"
# The families of each test file; together, every family of tests/families.py.
# Llama's row is the CI pipeline itself (tests/test_workflow.py runs every stage on a tiny SmolLM2 config); with
# EFFLAB_UPDATE_DOCS=1 it runs here too, to write its row.
GROUPS = {"a": ["qwen2", "gemma2", "phi3", "opt", "falcon", "qwen3_moe"],
          "b": ["mixtral", "deepseek_v3", "gpt_neox", "gpt2", "bloom"]}
if os.environ.get("EFFLAB_UPDATE_DOCS"):
    GROUPS["a"].insert(0, "llama")
assert sorted(sum(GROUPS.values(), [])) == sorted(set(FAMILIES) - ({"llama"} - set(GROUPS["a"]))), \
    "tests/matrix.py GROUPS must cover tests/families.py"
# The smallest grid that still takes every family-specific path: bitsandbytes' layer replacement (int8, nf4),
# head and layer pruning (and layers alone, which any stack of decoder layers can lose), fake-quantized training,
# LoRA and QLoRA with their merges (the QLoRA merge replays the 4-bit round trip), eager and SDPA attention
# (unavailable where the family lacks it), generation from every kind of variant, the serving scheduler, the capacity
# search's estimator, and the report.
GRID = {
    "quantize": {"eval_rows": 4, "batch_size": 4,
                 "schemes": {"baseline": {"method": "none"}, "int8": {"method": "int8"},
                             "nf4": {"method": "nf4", "double_quant": True}}},
    "prune": {"calibration_rows": 4, "eval_rows": 4, "max_new_tokens": 4, "repeats": 2,
              "strategies": {"heads-half-layers-half": {"remove_heads": 0.5, "remove_layers": 0.5},
                             "layers-half": {"remove_layers": 0.5}}},
    "qat": {"bits": [4], "eval_rows": 4},
    "finetune": {"runs": {"lora": {"method": "lora"}, "qlora": {"method": "qlora"}}},
    "merge": {"runs": None, "eval_rows": 4},
    "bench_finetune": {"rounds": 2},
    "bench_attention": {"seq_lens": [16, 32, 64], "modes": ["forward"], "repeats": 2},
    "bench_inference": {"repeats": 2, "variants": {
        "baseline": {"kind": "base"}, "nf4": {"kind": "quantized", "of": "nf4"},
        "merged-qlora": {"kind": "merged", "of": "qlora"}, "adapter-lora": {"kind": "adapter", "of": "lora"}}},
    "bench_serving": {"requests": 3, "methods": ["naive", "continuous"], "bursts": 2},
    "capacity": {"runs": ["lora"], "variants": [], "max_batch_size": 1, "max_seq_len": 64},
    # lm-eval wrapping a 4-bit model, an adapter on it and its merge (+ the base they are paired with)
    "evaluate": {"models": ["quantized-nf4", "merged-qlora"]},
}


def family_params(base: dict, source: str) -> dict:
    cfg = copy.deepcopy(base)
    cfg["base_model"] |= {"source": source, "config_overrides": {}}
    cfg["runtime"]["isolation"] = "inprocess"
    cfg["finetune"]["defaults"] |= {"max_steps": 2, "eval_rows": 4}
    cfg["finetune"]["defaults"]["lora"]["target_modules"] = None  # the shipped default: peft's choice
    cfg["qat"]["train"]["steps"] = 1
    cfg["prune"]["heal"]["steps"] = 1
    for stage, settings in GRID.items():
        cfg[stage] = {**cfg[stage], **settings}
    cfg["bench_attention"]["implementations"] = ["eager", "sdpa"]
    return cfg


def outcome(record: dict) -> str:
    """A job's cell in the matrix: ok, or its status and reason; a job that ran with cells it could not measure
    (a serving method, a generation mode), their status, names and reason, the worst status first."""
    status = record.get("status", "ok")
    if status != "ok":
        return f"{status}: {record.get('reason', '')}"
    by_reason: dict[tuple[str, str], list[str]] = {}
    for c in record.get("cells") or []:
        if isinstance(c, dict) and c.get("status", "ok") != "ok":
            name = c.get("name") or "@".join(str(c[k]) for k in ("method", "generation", "concurrency", "batch_size")
                                             if k in c)
            by_reason.setdefault((c["status"], c.get("reason", "")), []).append(name or "a cell")
    said = [f"{s}: {', '.join(names)}: {why}" for (s, why), names in sorted(by_reason.items())]
    return "; ".join(said) if said else "ok"


@pytest.fixture(scope="module")
def tokenizer_folder(tmp_path_factory):
    results = tmp_path_factory.mktemp("tokenizer")
    run_stage("base_model", TEST_PARAMS, results)
    return results / "base_model" / "model"


def run_family(family: str, work, tokenizer) -> dict[str, str]:
    """Every job of every stage on `family`, in DAG order, in-process through the stages' CLI: job -> outcome."""

    folder = family_folder(family, work / "model", tokenizer)
    cfg = family_params(config.load(TEST_PARAMS), str(folder))
    params = work / "params.yaml"
    params.write_text(yaml.safe_dump(cfg, sort_keys=False))
    model_check.check(config.load(params), params)  # the dry-run check passes with the defaults
    results, seen = work / "results", {}
    for stage in registry.STAGES:
        for name in registry.names(cfg, stage) or [None]:
            record = run_stage(stage, params, results, name)
            seen[f"{stage}/{name}" if name else stage] = outcome(record)
    seen["report"] = "ok" if (results / "report" / "report.md").read_text().startswith("# efflab report") else "?"
    check_memory_predictions(family, results)
    check_measured_speeds_are_said(family, results)
    return seen


def check_measured_speeds_are_said(family: str, results) -> None:
    """Every bench_inference variant whose compared cell ran has its speed in decisions.json and in the glance, never
    'not measured' (issue 50, point 9: a run on another family read "It decodes at not measured ...")."""
    from efflab import records

    decisions = json.loads((results / "report" / "decisions.json").read_text())
    said = {o["name"]: o["axes"].get("speed")
            for q in ("inference", "quantize") for o in (decisions["questions"].get(q) or {}).get("options", [])}
    for path in (results / "bench_inference").glob("*/metrics.json"):
        job = json.loads(path.read_text())
        cell = records.reference_cell(job) if records.is_ok(job) else None
        if cell and job["variant"] in said:
            speed = said[job["variant"]]  # a figure, or none where the sentinel set every round aside, and why
            assert speed is not None, (family, job["variant"], "ran, yet its speed is not measured")
            ratio = (cell.get("vs_base") or {}).get("generation_speedup") or {}
            assert speed["verdict"] != "not measured", (family, job["variant"], speed)
            if job["kind"] != "base":
                assert (speed["value"] is None) == (ratio.get("median") is None), (family, job["variant"], speed)
    assert "decodes at not measured" not in (results / "report" / "report.md").read_text(), family


def check_memory_predictions(family: str, results) -> None:
    """The memory estimator reads every family's shape through efflab.architecture; its prediction, recorded
    beside the measured live-tensor peak, is checked per family. Training's per-layer count is modelled for the
    Llama-style decoders only: any other family says so instead of a number. Generation's is for every family;
    at this size (about 1.5 MiB, mostly vocabulary-sized logits buffers) it is known to run 25% under."""
    from efflab.estimators.training_memory import DECODERS

    train = json.loads((results / "finetune" / "lora" / "metrics.json").read_text())["memory_prediction"]
    if family in DECODERS:
        # The prediction counts the three fp32 vocabulary-sized loss tensors; whether the logits' fp32 copy is
        # still alive at the backward's start depends on when Python frees it: at most one tensor more.
        one_logits = train["batch"]["rows"] * train["batch"]["padded_length"] * json.loads(
            (results / "base_model" / "metrics.json").read_text())["config"]["vocab_size"] * 4 / 2**20
        assert 0.98 <= train["ratio"] and train["measured_mib"] <= 1.02 * (train["total_mib"] + one_logits), train
    else:
        assert train["total_mib"] is None and f"model type {family!r}" in train["unavailable"], (family, train)
    for cell in json.loads((results / "bench_inference" / "baseline" / "metrics.json").read_text())["cells"]:
        generation = cell["memory_prediction"]
        assert generation["measured_mib"] > 0 and 0.8 <= generation["ratio"] <= 1.35, (family, generation)


def check_family(family: str, work, tokenizer) -> None:
    """The matrix test of one family: every job ran or is unavailable with a reason, and the docs agree."""
    seen = run_family(family, work, tokenizer)
    # skipped is fine only where what it builds on was unavailable for the family (Falcon's nf4: no layer quantized)
    crashed = {job: why for job, why in seen.items() if why.startswith(("failed", "oom", "timeout"))
               or why.startswith("skipped") and "unavailable" not in why}
    assert not crashed, f"{family}: jobs that neither ran nor were unavailable: {crashed}"
    for job, why in seen.items():
        if why.startswith("unavailable"):
            assert len(why) > len("unavailable: ") + 20, f"{family} {job}: unavailable without a reason"
    if os.environ.get("EFFLAB_UPDATE_DOCS"):
        write_doc(family, seen)
    else:
        assert documented().get(family) == summary(seen), (
            f"{DOC} is out of date for {family}: rerun with EFFLAB_UPDATE_DOCS=1 pytest -m matrix"
            f"\nmeasured: {summary(seen)}")


def summary(seen: dict[str, str]) -> dict[str, str]:
    """Per stage: ok, or each job's unavailable reason."""
    out: dict[str, list[str]] = {}
    for job, why in seen.items():
        stage, _, name = job.partition("/")
        out.setdefault(stage, []).append("ok" if why == "ok" else f"{name + ' ' if name else ''}{why}")
    return {s: "ok" if all(w == "ok" for w in ws) else "; ".join(w for w in ws if w != "ok") for s, ws in out.items()}


def documented() -> dict[str, dict[str, str]]:
    """The table's data, kept in the page as a JSON comment so that the test compares data, not markdown."""
    if not DOC.is_file():
        return {}
    text = DOC.read_text()
    start = text.index("<!-- matrix\n") + len("<!-- matrix\n")
    return json.loads(text[start:text.index("\n-->", start)])


def write_doc(family: str, seen: dict[str, str]) -> None:
    data = documented() | {family: summary(seen)}
    data = {f: data[f] for f in FAMILIES if f in data}
    stages = list(registry.STAGES)
    notes, rows = [], []
    for f, cells in data.items():
        row = []
        for s in stages:
            cell = cells.get(s, "-")
            if cell != "ok":
                notes.append(f"{len(notes) + 1}. **{f}, {s}**: {cell}")
                cell = f"unavailable [{len(notes)}]"
            row.append(cell)
        rows.append(f"| {f} | " + " | ".join(row) + " |")
    DOC.parent.mkdir(parents=True, exist_ok=True)
    DOC.write_text(
        "# Supported architectures\n\n"
        "Every stage on a tiny random-init model of each family, built from the family's own config class with the "
        "embedded tokenizer and efflab's default parameters for LoRA targets (peft's choice for the family, else "
        "the model's own projections). "
        "Generated by `EFFLAB_UPDATE_DOCS=1 pytest -m matrix` from that test's results; the test fails "
        "when this page drifts from them. *unavailable* is recorded in the job's metrics and listed in the report's "
        "*Did not run* section, and the rest of the run goes on. bench_attention runs eager and, where the family "
        "offers it, sdpa (Gemma-2 and Bloom do not: their jobs record unavailable, and the dry run says so first).\n\n"
        "| family | " + " | ".join(stages) + " |\n|---|" + "---|" * len(stages) + "\n" + "\n".join(rows) + "\n\n"
        + "\n".join(notes) + "\n\n<!-- matrix\n" + json.dumps(data, indent=1) + "\n-->\n")
