"""The claims registry and the claims stage: schema, coverage of every seed number, one unit convention per seed,
verdicts by equivalence with their evidence, measured claims read from injected results, the compact page."""
from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
import yaml

from efflab.config import UserError
from efflab.config import load as load_params
from efflab.estimators import analytic as estimate
from efflab.layout import Job, Layout
from efflab.stages.claims import readings, stage
from efflab.stages.claims.registry import REGISTRY, load, load_registry, passages, uncovered
from efflab.stages.claims.verdict import EVIDENCE, VERDICTS, Reading, judge, verdict_class
from tests.helpers import REPO, TEST_PARAMS, run_stage, serving_record

SEEDS = Path("/work/shared/seeds")
REFERENCE = REPO / "results" / "reference" / "intel-r-xeon-r-processor-avx512-bf16"


@pytest.fixture(scope="module")
def full() -> dict:
    return load()


@pytest.fixture(scope="module")
def registry(full) -> list[dict]:
    return full["claims"]


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory) -> tuple[dict, pd.DataFrame, Path]:
    """The default registry evaluated against the committed reference results (no model folder: weights and
    configs are not kept there)."""
    out = tmp_path_factory.mktemp("claims") / "out"
    metrics = stage.run(load_params(REPO / "params.yaml"), Job(Layout(REFERENCE), None, out, out))
    return metrics, pd.read_csv(out / "claims.csv"), out


def _write(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))


def _with_base_config(layout: Layout) -> None:
    """The base model's config.json, as base_model leaves it: the shapes the computed causes read."""
    config = {k: v for k, v in estimate.load_config("smollm2-135m").items() if not k.startswith("_")}
    _write(layout.base_model() / "config.json", config)


def test_registry_validates_and_covers_the_seeds(registry):
    assert len(registry) >= 160
    assert {c["kind"] for c in registry} == {"analytic", "measured", "hardware"}
    assert len({c["source"] for c in registry}) == 5
    shipped = set(estimate.model_names())
    for c in registry:
        for spec in (c.get("inputs"), c.get("estimate", {}).get("inputs")):
            if spec and "model" in spec:
                assert spec["model"] in shipped, c["id"]


def test_one_unit_convention_per_seed_with_its_evidence(full, registry):
    """Every byte claim carries its seed's convention, the same for all claims of that seed; the seed records it
    once, with the evidence."""
    seeds = full["seeds"]
    for c in registry:
        if c["reported"]["unit"] in ("KB", "MB", "GB"):
            assert c["units"] == seeds[c["source"]]["units"], c["id"]
    assert {s: seed["units"]["convention"] for s, seed in seeds.items() if "units" in seed} == {
        "000_965e890cecb00a0b.txt": "decimal", "001_d5371e57926c34be.txt": "binary",
        "002_80b60e9b2efd77d3.txt": "decimal", "004_a8bbd29d2539a3ab.txt": "decimal"}


@pytest.mark.skipif(not SEEDS.is_dir(), reason="the seed texts are not on this machine")
def test_quotes_are_verbatim(full):
    reg = full
    for c in reg["claims"]:
        assert c["quote"] in (SEEDS / c["source"]).read_text(), c["id"]
    for entry in reg["not_claims"]:
        text = (SEEDS / entry["source"]).read_text()
        for quote in entry.get("quotes", []):
            assert quote in text, (entry["source"], quote)
        for span in entry.get("spans", []):
            assert passages(text, {"spans": [span]}), (entry["source"], span)


@pytest.mark.skipif(not SEEDS.is_dir(), reason="the seed texts are not on this machine")
def test_every_seed_number_is_a_claim_or_listed_as_not_one(full):
    """Each number of each seed is a claim's figure inside its quote, or lies in a passage listed under
    not_claims with the reason; and no not_claims passage is stale (each still holds a number)."""
    for seed in sorted(SEEDS.glob("*.txt")):
        text = seed.read_text()
        assert uncovered(text, seed.name, full) == [], seed.name
        every = len(uncovered(text, seed.name, {"claims": [], "not_claims": []}))
        for entry in (e for e in full["not_claims"] if e["source"] == seed.name):
            assert len(uncovered(text, seed.name, {"claims": [], "not_claims": [entry]})) < every, entry["reason"]


def test_the_guard_finds_a_number_no_claim_accounts_for(registry):
    """A number inside a claim's quote that is none of its figures is still uncovered."""
    text = "The model has 24 layers and 345M parameters."
    claim = {"source": "x.txt", "quote": "24 layers and 345M", "reported": {"value": 24, "unit": "count"}}
    reg = {"claims": [claim], "not_claims": []}
    assert uncovered(text, "x.txt", reg) == [(1, "345")]
    assert uncovered(text, "x.txt", {"claims": [dict(claim, figures=[345])], "not_claims": []}) == []
    reg["not_claims"] = [{"source": "x.txt", "reason": "a test", "quotes": ["345M parameters"]}]
    assert uncovered(text, "x.txt", reg) == []


def test_bad_registry_is_one_line_user_error(tmp_path, registry):
    doc = yaml.safe_load(REGISTRY.read_text())
    path = tmp_path / "claims.yaml"
    path.write_text(yaml.safe_dump({"seeds": doc["seeds"], "claims": [dict(doc["claims"][0], kind="guessed")]}))
    with pytest.raises(UserError, match=r"claims\.0\.kind: 'guessed' is not one of"):
        load_registry(path)
    path.write_text(yaml.safe_dump({"seeds": doc["seeds"], "claims": [doc["claims"][0]] * 2}))
    with pytest.raises(UserError, match="appears twice"):
        load_registry(path)
    gb = next(c for c in doc["claims"] if c["reported"]["unit"] == "GB")
    units = {"convention": "binary", "evidence_kind": "source", "evidence": "a claim of its own convention"}
    path.write_text(yaml.safe_dump({"seeds": doc["seeds"], "claims": [dict(gb, units=units)]}))
    with pytest.raises(UserError, match=r"claims\.0: unknown key 'units'"):
        load_registry(path)  # one convention per seed: a claim cannot choose its own
    seeds = {s: {"title": seed["title"]} for s, seed in doc["seeds"].items()}
    path.write_text(yaml.safe_dump({"seeds": seeds, "claims": [gb]}))
    with pytest.raises(UserError, match=rf"seeds\.{gb['source']}\.units: missing, and claim {gb['id']} reports GB"):
        load_registry(path)


def test_the_reference_results_give_a_row_a_band_and_an_evidence_per_claim(reference_run, registry):
    metrics, df, out = reference_run
    assert list(df["id"]) == [c["id"] for c in registry]
    assert df["verdict"].map(verdict_class).isin(VERDICTS).all() and df["evidence"].isin(EVIDENCE).all()
    assert df["band"].str.len().gt(0).all()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["claims"] == len(df) == sum(sum(v.values()) for v in summary["counts"].values())
    assert summary["by_verdict"] == metrics["by_verdict"] and summary["counts"] == metrics["counts"]
    by_id = df.set_index("id")
    for c in registry:
        row = by_id.loc[c["id"]]
        if c.get("unreproducible"):
            assert row["verdict"] == "not reproducible here"
        elif c["kind"] == "analytic":
            assert row["verdict"] in ("reproduced", "differs") and row["evidence"] != "measured", c["id"]
        if row["evidence"] == "measured" and verdict_class(row["verdict"]) == "reproduced":
            assert not pd.isna(row["ci_low"]), c["id"]  # reproduced by measurement only with an interval
    assert by_id.loc["lora-over-99pct-measured", "evidence"] == "definition"  # a parameter count
    assert by_id.loc["int8-2x-measured", "verdict"] == "differs"  # an exact byte count outside 1.7-2.3x
    serving = by_id.loc["continuous-batching-3-24x"]  # 6 bursts, paired by round: an interval, and its cause
    assert serving["verdict"] == "differs" and not pd.isna(serving["ci_low"]) and serving["ci_high"] < 3
    assert "static batching beat continuous batching at concurrency 4" in serving["finding"]
    assert "the seed credits vLLM" in serving["finding"]
    md = (out / "claims.md").read_text()
    assert md.startswith("# Published numbers: reported vs reproduced") and len(md.encode()) < 50_000
    assert "|  " not in md and "| evidence | reproduced | differs | inconclusive |" in md
    assert md.count("Units: its KB/MB/GB are read as") == 4 and "## `003_6740d5587871bfd4.txt`" in md


def test_measured_claims_without_results_are_not_reproducible_here(tmp_path, registry):
    layout = Layout(tmp_path / "results")
    for c in (c for c in registry if c["kind"] == "measured"):
        row = stage.evaluate(c, layout)
        assert row["verdict"] == "not reproducible here" and row["reason"] and row["evidence"] != "computed", c["id"]


def test_wrong_seed_figures_are_called_out_with_arithmetic(reference_run):
    df = reference_run[1].set_index("id")
    row = df.loc["fp32-mantissa-bits"]
    assert row["verdict"] == "differs" and row["reproduced"] == "23 bits" and "total width" in row["reason"]
    row = df.loc["qlora-13b-base-weights"]
    assert row["verdict"] == "differs" and "block constants" in row["reason"]
    assert df.loc["gradscaler-growth-interval", "reproduced"] == "2,000 count"
    assert df.loc["gpt2-medium-20-layers", "reproduced"] == "24 count"
    assert df.loc["checkpointing-llama-13b-800mb", "verdict"] == "reproduced"  # 838.9 MB, within 10%


def test_each_seed_is_read_in_its_own_convention(reference_run):
    """Seed 001's GB are GiB (its code divides by 1024**2, its DeepSpeed table is DeepSpeed's bytes / 2**30), so
    the ZeRO paper's decimal 120GB it quotes fits only the other reading; seed 002's are decimal (2 bytes * 13B =
    26GB), so its 21 GB of activations, which fits only in binary, differs."""
    df = reference_run[1].set_index("id")
    row = df.loc["t0-3b-zero3-offload-all-init1-cpu"]
    assert row["verdict"] == "reproduced" and row["reproduced"] == "70 GB (binary: GiB)"
    assert row["units"] == "binary (source)" and row["unit_fit"] == "binary"
    row = df.loc["zero-table-baseline"]
    assert row["verdict"] == "differs" and "fits only in decimal: 111.8 GiB = 120 GB" in row["reason"]
    row = df.loc["activations-llama-2-13b-21gb"]
    assert row["verdict"] == "differs" and row["reproduced"] == "22.65 GB" and row["units"] == "decimal (source)"
    assert "fits only in binary: 22.65 GB = 21.09 GiB, but this seed's GB are decimal" in row["reason"]
    assert pd.isna(df.loc["fp16-exponent-bits", "units"])  # a unit without a byte prefix has no convention
    summary = json.loads((reference_run[2] / "summary.json").read_text())
    assert summary["units"]["001_d5371e57926c34be.txt"]["byte_figures"]["binary"] == 12


def test_a_figure_that_fits_only_in_the_other_convention_still_differs(registry):
    by_id = {c["id"]: c for c in registry}
    bare = {k: v for k, v in by_id["activations-llama-2-13b-21gb"].items() if k != "units"}  # the label's word
    row = stage.evaluate(bare, None)
    assert row["verdict"] == "differs" and row["units"] == "decimal (default)"
    assert "fits only in binary: 22.65 GB = 21.09 GiB, but nothing says the seed's GB are binary" in row["reason"]
    flipped = dict(by_id["full-13b-weights-26gb"], units={"convention": "binary", "evidence_kind": "arithmetic",
                                                          "evidence": "a test of the reverse case"})
    row = stage.evaluate(flipped, None)
    assert row["verdict"] == "differs" and "fits only in decimal" in row["reason"]


def test_int8_footprints_get_a_computed_verdict_without_a_gpu(reference_run, registry):
    """The INT8 footprints need only the real weights, whose values do not change the bytes: without a GPU
    they get a verdict from the estimate, its evidence computed; a hardware claim that needs the GPU itself (the
    allocator's rounding) stays "needs GPU"."""
    by_id = reference_run[1].set_index("id")
    row = by_id.loc["vram-int8-llama-3.1-8b"]
    assert row["verdict"] == "reproduced" and row["evidence"] == "computed"
    assert row["reproduced"] == "8,666 MB (binary: MiB)" and "computed verdict" in row["reason"]
    int8 = [c["id"] for c in registry if c["id"].startswith("vram-int8-")]
    assert len(int8) == 6 and (by_id.loc[int8, "evidence"] == "computed").all()
    assert by_id.loc["phi3-16-layers-fp16-reserved", "verdict"].startswith("needs GPU: ")


def test_a_gpu_measurement_takes_precedence_over_the_computed_verdict(tmp_path, registry):
    layout = Layout(tmp_path / "results")
    claim = dict(next(c for c in registry if c["id"] == "vram-int8-llama-3.1-8b"), metric={"kind": "cuda_context"})
    assert stage.evaluate(claim, layout)["evidence"] == "computed"  # no results: the estimate decides
    _write(layout.metrics("base_model"), {"environment": {"device": "cuda", "gpu": "NVIDIA H100 80GB HBM3"},
                                          "cuda_context": {"mib": 7000.0, "nvml_process_mib": 8000.0,
                                                           "torch_reserved_mib": 1000.0}})
    row = stage.evaluate(claim, layout)  # a stand-in metric that reads 7000 MiB once, with no interval
    assert row["evidence"] == "measured" and row["verdict"] == "inconclusive"
    assert row["reproduced"] == "7,000 MB (binary: MiB)" and "outside the tolerance band" in row["reason"]


def test_a_value_is_judged_by_equivalence_with_the_band():
    """Reproduced only with the whole interval inside the band, differs only with it wholly outside, else
    inconclusive; a measurement without an interval decides nothing; a computed value or an exact count stands
    on its own."""
    claim = {"id": "synthetic", "reported": {"value": 30, "unit": "%"}, "tolerance": 0.33}  # band 20.1-39.9 %
    j = judge(30.0, claim, ci=[25.0, 36.0], measured=True)
    assert j["verdict"] == "reproduced" and j["shown"] == "30 % [25, 36]" and "20.1–39.9 %" in j["why"]
    j = judge(36.9, claim, ci=[23.2, 52.6], measured=True)  # the median inside, the interval across the edge
    assert j["verdict"] == "inconclusive" and "crosses an edge of the tolerance band 20.1–39.9 %" in j["why"]
    j = judge(55.0, claim, ci=[45.0, 65.0], measured=True)
    assert j["verdict"] == "differs" and "the whole 95% interval [45, 65] % lies outside the tolerance band" in j["why"]
    j = judge(41.2, claim, ci=[47.9, 35.0], measured=True)  # an interval given high to low reads the same
    assert j["verdict"] == "inconclusive" and j["shown"] == "41.2 % [35, 47.9]"
    j = judge(30.0, claim, measured=True)  # inside the band, but no interval
    assert j["verdict"] == "inconclusive" and "without a 95% interval (30 %, inside" in j["why"]
    assert judge(55.0, claim, measured=True)["verdict"] == "inconclusive"
    assert judge(55.0, claim)["verdict"] == "differs" and judge(30.0, claim)["verdict"] == "reproduced"
    exact = judge(30.0, claim, measured=True, exact=True)  # a count: its value is its interval
    assert exact["verdict"] == "reproduced" and exact["shown"] == "30 %"
    bound = {"id": "bound", "reported": {"value": 99, "unit": "%"}, "compare": "at_least", "tolerance": 0}
    assert judge(98.0, bound, ci=[97.0, 99.5], measured=True)["verdict"] == "inconclusive"
    assert judge(98.0, bound, ci=[97.0, 98.5], measured=True)["verdict"] == "differs"
    assert judge(99.6, bound, ci=[99.2, 99.9], measured=True)["verdict"] == "reproduced"


def test_a_torchao_compression_claim_on_a_float32_baseline_is_re_expressed_at_16_bits_with_its_kept_tensors(
        tmp_path, registry):
    """torchao-int8 measured against a float32 base (a CPU without fast bf16): the seed's ~2x is of 16-bit weights,
    so what the scheme keeps in float32 (the unquantized embedding and norms, its per-row scales) is re-expressed
    at 16 bits by the estimator's difference between the two dtypes; the cause names the kept tensors."""
    from efflab.estimators import analytic

    layout = Layout(tmp_path / "results")
    _with_base_config(layout)
    name, quant = str(layout.base_model()), {"method": "torchao-int8"}
    fp32, fp16 = analytic.quant_footprint(name, quant, "float32"), analytic.quant_footprint(name, quant, "float16")
    params = fp32["quantized_params"] + fp32["kept_params"]
    _write(layout.metrics("quantize", "torchao-int8"), {
        "method": "torchao-int8", "library": "torchao", "compute_dtype": "float32",
        "base_memory_footprint_bytes": 4 * params, "memory_footprint_bytes": fp32["total"],
        "footprint_ratio_vs_base": 4 * params / fp32["total"]})
    claim = next(c for c in registry if c["id"] == "int8-2x-measured-torchao-int8")
    reading = stage.evaluate(claim, layout)
    assert reading["reproduced"] == f"{2 * params / fp16['total']:.4g} x"
    assert "torchao kept in float32: model.embed_tokens.weight" in reading["finding"]
    assert f"against the measured {fp32['total']:,} B" in reading["finding"]
    assert stage.evaluate(next(c for c in registry if c["id"] == "int4-4x-measured-hqq-4bit"), layout)[
        "verdict"] == "not reproducible here", "no hqq-4bit record: not checked, not guessed"


def test_measured_claims_read_this_pipelines_results(tmp_path, registry):
    layout = Layout(tmp_path / "results")
    _with_base_config(layout)
    _write(layout.metrics("base_model"), {"source": "embedded:smollm2-135m-instruct", "parameters": 134_515_008,
                                          "dtype": "bfloat16", "environment": {"device": "cpu"}})
    # the reference run's INT8 footprint: the tied embedding and the norms stay in bfloat16
    _write(layout.metrics("quantize", "int8"), {
        "method": "int8", "compute_dtype": "bfloat16", "footprint_ratio_vs_base": 269_030_272 / 162_861_952,
        "base_memory_footprint_bytes": 269_030_272, "memory_footprint_bytes": 162_861_952})
    settings = {"lr": 1e-3, "gradient_checkpointing": False, "method": "lora"}
    for run, extra, step_s in (("lora", {}, 1.0), ("lora-ckpt", {"gradient_checkpointing": True}, 1.3)):
        _write(layout.metrics("finetune", run), {"run": run, "method": "lora", "settings": {**settings, **extra},
                                                 "step_s": step_s, "tokens_per_s": 100 / step_s,
                                                 "parameters": {"trainable": 9, "total": 1000, "trainable_pct": 0.9}})
    by_id = {c["id"]: c for c in registry}
    int8 = stage.evaluate(by_id["int8-2x-measured"], layout)
    assert int8["verdict"] == "differs" and int8["reproduced"] == "1.652 x" and "exact count" in int8["reason"]
    assert "kept in bfloat16: model.embed_tokens.weight (28,311,552 params)" in int8["finding"]
    assert "56,693,376 B = 34.8% of the quantized footprint" in int8["finding"]
    assert "alone shrink 2.00x" in int8["finding"] and "against the measured 162,861,952 B" in int8["finding"]
    runs = ["lora", "lora-ckpt"]  # the fine-tuning jobs of the grid (registry.names(cfg, "finetune"))
    ckpt = stage.evaluate(by_id["checkpointing-30pct-slowdown"], layout, finetune=runs)  # whole-run figures only
    assert ckpt["verdict"] == "inconclusive" and ckpt["reproduced"] == "30 %"
    assert stage.evaluate(by_id["checkpointing-30pct-slowdown"], layout, finetune=["lora"])["reason"] == (
        "no pair of finetune runs that differ only in gradient_checkpointing (True vs False) among the finetune runs "
        "that trained (lora); add one to finetune.runs"), "a run left out of the grid is not read, its folder or not"
    lora = stage.evaluate(by_id["lora-over-99pct-measured"], layout, finetune=runs)
    assert lora["reproduced"] == "99.1 %" and lora["verdict"] == "reproduced" and lora["evidence"] == "definition"
    qlora = stage.evaluate(by_id["qlora-throughput-30pct-worse"], layout, finetune=[*runs, "qlora"])
    assert qlora["verdict"] == "not reproducible here" and "no trained record of qlora" in qlora["reason"]
    assert stage.evaluate(by_id["flash-attention-2-4x"], layout)["verdict"].startswith("needs GPU: ")
    # bench_finetune timed the pair interleaved: its per-round ratio (checkpointing's step over the plain one's)
    # and interval take precedence over the runs' own figures, in the claim's orientation
    pair = {"status": "ok", "knob": "gradient_checkpointing", "a": "lora", "b": "lora-ckpt",
            "step_time_ratio": {"median": 1.5, "ci95": [1.45, 1.6], "rounds": 6, "verdict": "slower"}}
    _write(layout.metrics("bench_finetune"), {"status": "ok", "pairs": [pair]})
    ckpt = stage.evaluate(by_id["checkpointing-30pct-slowdown"], layout, finetune=runs)
    assert ckpt["verdict"] == "differs" and ckpt["reproduced"].startswith("50 % [45, 60]")
    assert "6 interleaved rounds" in ckpt["reason"] and ckpt["ci_low"] == pytest.approx(45)
    pair["step_time_ratio"] = {"median": 1.3, "ci95": None, "rounds": 4, "verdict": "inconclusive: 4 rounds"}
    _write(layout.metrics("bench_finetune"), {"status": "ok", "pairs": [pair]})
    assert stage.evaluate(by_id["checkpointing-30pct-slowdown"], layout, finetune=runs)["verdict"] == "inconclusive"
    pair["step_time_ratio"] = {"median": None, "ci95": None, "rounds": 1,
                               "verdict": "not a verdict: the machine's speed changed"}
    _write(layout.metrics("bench_finetune"), {"status": "ok", "pairs": [pair]})
    ckpt = stage.evaluate(by_id["checkpointing-30pct-slowdown"], layout, finetune=runs)
    assert ckpt["verdict"] == "not reproducible here" and "machine's speed changed" in ckpt["reason"]


def test_finetune_pairs_carry_an_interval_from_six_paired_steps(tmp_path, monkeypatch, registry):
    by_id = {c["id"]: c for c in registry}
    monkeypatch.setitem(readings.FINETUNE_METRICS, "finetune_pair",
                        lambda layout, metric, names: Reading(41.2, "a stand-in", (35.0, 47.9)))
    row = stage.evaluate(by_id["checkpointing-30pct-slowdown"], Layout(tmp_path / "results"))
    assert row["verdict"] == "inconclusive" and row["reproduced"] == "41.2 % [35, 47.9]"
    assert "a stand-in" in row["reason"]
    monkeypatch.undo()
    layout, runs = Layout(tmp_path / "results"), ["lora", "lora-ckpt", "qlora"]
    settings = {"lr": 1e-3, "gradient_checkpointing": False, "method": "lora"}
    steps = {"lora": [1.0] * 6, "lora-ckpt": [1.3, 1.35, 1.3, 1.25, 1.3, 1.3], "qlora": [1.4] * 6}

    def write(count):
        for run, extra in (("lora", {}), ("lora-ckpt", {"gradient_checkpointing": True}),
                           ("qlora", {"method": "qlora"})):
            _write(layout.metrics("finetune", run), {
                "run": run, "method": extra.get("method", "lora"), "settings": {**settings, **extra},
                "tokens_seen": 500, "step_s": sum(steps[run][:count]) / count,
                "tokens_per_s": 100 / (sum(steps[run][:count]) / count),
                "step_time": {"n": count, "samples": steps[run][:count]}})
    write(5)  # 5 paired steps give no 95% interval: the median alone decides nothing
    ckpt = stage.evaluate(by_id["checkpointing-30pct-slowdown"], layout, finetune=runs)
    assert ckpt["verdict"] == "inconclusive" and "5 steps give no 95% interval" in ckpt["reason"]
    write(6)
    ckpt = stage.evaluate(by_id["checkpointing-30pct-slowdown"], layout, finetune=runs)  # paired ratios 1.25 .. 1.35
    assert ckpt["verdict"] == "reproduced" and ckpt["reproduced"] == "30 % [25, 35]"
    assert "6 paired steps" in ckpt["reason"] and "96.9% interval" in ckpt["reason"]
    qlora = stage.evaluate(by_id["qlora-throughput-30pct-worse"], layout, finetune=runs)  # tokens/s: 1 / 1.4 each step
    assert qlora["reproduced"] == f"{100 * (1 - 1 / 1.4):.4g} % [{100 * (1 - 1 / 1.4):.4g}, {100 * (1 - 1 / 1.4):.4g}]"


def test_attention_memory_claims_read_the_measured_exponents(tmp_path, registry):
    """The O(n) and O(n²) claims read bench_attention's fitted exponents (no interval: inconclusive), with the
    exponent the activation formula gives this model at the measured lengths as the computed cause."""
    layout = Layout(tmp_path / "results")
    _with_base_config(layout)
    for impl, exponent in (("eager", 1.225), ("sdpa", 1.0006)):
        rows = [{"mode": "forward_backward", "batch_size": 1, "seq_len": s, "status": "ok"} for s in (64, 128, 256)]
        _write(layout.metrics("bench_attention", impl), {
            "status": "ok", "rows": rows, "memory_exponents": [{
                "mode": "forward_backward", "batch_size": 1, "memory_kind": "cpu_peak_rss", "exponent": exponent,
                "points": 3, "r2": 0.9997}]})
    by_id = {c["id"]: c for c in registry}
    eager = stage.evaluate(by_id["eager-attention-quadratic-memory"], layout)
    assert eager["verdict"] == "inconclusive" and eager["reproduced"] == "1.225 exponent"
    assert "exponent between 64 and 256 tokens is 1.235 (with the s² attention term)" in eager["finding"]
    flash = stage.evaluate(by_id["flash-attention-linear-memory"], layout)
    assert flash["verdict"] == "inconclusive" and "sdpa stands in for FlashAttention" in flash["reason"]
    assert "flash_attention_2: no " in stage.evaluate(dict(by_id["flash-attention-linear-memory"], metric=dict(
        by_id["flash-attention-linear-memory"]["metric"], impl=["flash_attention_2"])), layout)["reason"]


def test_int8_speed_claims_read_bench_inference(tmp_path, registry):
    layout = Layout(tmp_path / "results")
    cell = {"status": "ok", "kv_cache": True, "batch_size": 1, "vs_base": {
        "generation_speedup": {"median": 0.577, "ci95": None, "rounds": 2, "verdict": "inconclusive: 2 rounds"},
        "rounds": [{"seconds": {"int8": 2.70, "base": 1.54}}, {"seconds": {"int8": 2.75, "base": 1.60}}]}}
    _write(layout.metrics("bench_inference", "int8"), {"status": "ok", "dtype": "bfloat16", "new_tokens": 12,
                                                       "cells": [cell]})
    claim = next(c for c in registry if c["id"] == "int8-faster-inference")
    row = stage.evaluate(claim, layout)
    assert row["verdict"] == "inconclusive" and "per round: 0.57, 0.582" in row["reason"]
    cell["vs_base"]["generation_speedup"] = {"median": 0.58, "ci95": [0.55, 0.61], "rounds": 6, "verdict": "slower"}
    _write(layout.metrics("bench_inference", "int8"), {"status": "ok", "cells": [cell]})
    row = stage.evaluate(claim, layout)
    assert row["verdict"] == "differs" and row["band"] == "≥ 1 x" and row["evidence"] == "measured"
    # A machine that never settled: the sentinel set aside every round, and the speedup has no median at all.
    cell["vs_base"]["generation_speedup"] = {"median": None, "ci95": None, "rounds": 0,
                                             "verdict": "not a verdict: the machine never settled"}
    _write(layout.metrics("bench_inference", "int8"), {"status": "ok", "cells": [cell]})
    row = stage.evaluate(claim, layout)
    assert row["verdict"] == "not reproducible here" and "the machine never settled" in row["reason"]


def test_prune_claims_read_the_prune_records(tmp_path, registry):
    """A footprint ratio is an exact count, its miss explained by what pruning cannot cut; a speedup of three
    rounds has no interval and decides nothing."""
    layout = Layout(tmp_path / "results")
    _with_base_config(layout)
    _write(layout.metrics("prune", "layers-half"), {
        "status": "ok", "kept": {"layers": 15, "heads": 9, "kv_heads": 3}, "new_tokens": 16,
        "footprint_ratio": 0.6052, "base": {"parameters": 134_515_008, "memory_footprint_bytes": 269_030_016},
        "pruned": {"parameters": 81_413_568, "memory_footprint_bytes": 162_827_136},
        "generation_speedup": {"median": 1.658, "ci95": None, "rounds": 3, "verdict": "inconclusive: 3 rounds"}})
    by_id = {c["id"]: c for c in registry}
    memory = stage.evaluate(by_id["prune-half-layers-memory"], layout)
    assert memory["verdict"] == "differs" and memory["ci_low"] == memory["ci_high"] == pytest.approx(0.6052)
    assert "outside them sit model.embed_tokens.weight (28,311,552 params)" in memory["finding"]
    assert "21.0% of the base's 134,515,008 parameters" in memory["finding"]
    time = stage.evaluate(by_id["prune-half-layers-time"], layout)
    assert time["verdict"] == "inconclusive" and "inconclusive: 3 rounds" in time["reason"]


def test_stage_runs_through_its_cli_and_a_failed_job_leaves_a_readable_summary(tmp_path):
    results = tmp_path / "results"
    metrics = run_stage("claims", TEST_PARAMS, results)
    assert metrics["stage"] == "claims" and metrics["claims"] == sum(metrics["by_verdict"].values())
    summary = json.loads((results / "claims" / "summary.json").read_text())
    assert summary["counts"] == metrics["counts"] and (results / "claims" / "claims.csv").is_file()
    failed = tmp_path / "failed"
    failed.mkdir()
    Layout.write_not_run("claims", failed, "failed", "a test")
    assert json.loads((failed / "summary.json").read_text()) == {"status": "failed", "reason": "a test"}


def test_the_serving_claim_is_judged_on_the_interval_of_paired_bursts(tmp_path, registry):
    """Continuous batching's throughput over naive, paired burst round by burst round: inside the 3-24x band
    with an interval, reproduced; the same median from 5 rounds, inconclusive; the cause says from the paired
    rounds whether continuous batching beat static batching, and that vLLM, which the seed credits, did not run."""
    claim = next(c for c in registry if c["id"] == "continuous-batching-3-24x")
    layout = Layout(tmp_path / "results")
    drift = [1.0, 1.4, 0.9, 2.0, 1.2, 0.8]
    naive, static = [10 * d for d in drift], [30 * d for d in drift]
    continuous = [x * f for x, f in zip(static, (1.2, 1.3, 1.25, 1.3, 1.2, 1.35))]  # 3.6-4.05x naive's

    def judged(rounds: int) -> dict:
        rates = {("naive", 1): naive, ("static", 4): static, ("continuous", 4): continuous}
        _write(layout.metrics("bench_serving"), serving_record({k: v[:rounds] for k, v in rates.items()}))
        return stage.evaluate(claim, layout)

    row = judged(6)
    assert row["verdict"] == "reproduced" and row["reproduced"].startswith("3.825 x [3.6, 4.05]"), row["reproduced"]
    assert "6 burst round(s) of 8 requests: continuous at concurrency 4" in row["reason"]
    row = judged(5)
    assert row["verdict"] == "inconclusive" and row["ci_low"] is None
    assert "a measurement without a 95% interval" in row["finding"]
    continuous[:] = [x * f for x, f in zip(static, (0.9, 1.25, 1.0, 1.15, 0.85, 1.1))]  # 2.55-3.75x naive's
    row = judged(6)
    assert row["verdict"] == "inconclusive" and "crosses an edge" in row["finding"]
    assert "this run cannot tell continuous from static batching at concurrency 4 (1.05x [0.85, 1.25]" in row["finding"]
    assert "the seed credits vLLM (PagedAttention with continuous batching), which did not run here" in row["finding"]
    continuous[:] = [x * 0.7 for x in static]  # 2.1x naive's: the whole interval below the band
    row = judged(6)
    assert row["verdict"] == "differs" and "static batching beat continuous batching at concurrency 4" in row["finding"]
    assert "static 3x [3, 3] at concurrency 4" in row["finding"]


def _evaluated(layout, model: str, reference, lls: list[tuple[float, int]]) -> None:
    """An evaluate record whose bits_per_byte items are (log-likelihood, bytes) per document."""
    docs = [{"doc_id": i, "target": "", "response": None, "scores": {"bits_per_byte": list(item)}}
            for i, item in enumerate(lls)]
    _write(layout.metrics("evaluate", model), {"status": "ok", "model": model, "reference": reference, "tasks": {
        "efflab_validation_ll": {"status": "ok", "metrics": {}, "docs": docs}}})


def test_quality_claims_read_the_paired_task_scores(tmp_path, registry):
    """"Minimal accuracy loss" holds where the whole interval of the answers' bits-per-byte change is within 0.1;
    "corrupted output" where the whole interval is beyond it; NF4's "larger loss" is NF4 paired with INT8."""
    layout = Layout(tmp_path / "results")
    base = [(-100.0 - i, 80 + i) for i in range(8)]
    _evaluated(layout, "base", None, base)
    _evaluated(layout, "quantized-int8", "base", [(ll - 0.5 - 0.1 * (i % 2), n) for i, (ll, n) in enumerate(base)])
    _evaluated(layout, "quantized-nf4", "base", [(ll - 3 - 0.5 * (i % 3), n) for i, (ll, n) in enumerate(base)])
    _evaluated(layout, "pruned-layers-half", "base", [(ll - 200 - 9 * (i % 2), n) for i, (ll, n) in enumerate(base)])
    by_id = {c["id"]: c for c in registry}
    int8 = stage.evaluate(by_id["int8-minimal-accuracy-loss"], layout)
    assert int8["verdict"] == "reproduced" and 0 < int8["ci_low"] <= int8["ci_high"] < 0.1
    assert stage.evaluate(by_id["nf4-larger-accuracy-loss"], layout)["verdict"] == "reproduced"
    pruned = stage.evaluate(by_id["prune-half-layers-corrupted"], layout)
    assert pruned["verdict"] == "reproduced" and pruned["ci_low"] > 0.1
    lora = stage.evaluate(by_id["lora-minimal-quality-loss"], layout)  # no fine-tune evaluated here
    assert lora["verdict"] == "not reproducible here"


@pytest.mark.parametrize(("record", "says", "caveat"), [
    ({"source": "embedded:smollm2-135m-instruct", "random_init": False, "parameters": 134_515_008,
      "environment": {"device": "cpu"}}, "measured here on embedded:smollm2-135m-instruct (134,515,008 params", True),
    ({"source": "embedded:smollm2-135m-instruct", "random_init": True, "parameters": 1_073_809_408,
      "environment": {"device": "cuda", "gpu": "NVIDIA H200"}},
     "a random-init model of the run's config with embedded:smollm2-135m-instruct's tokenizer (1,073,809,408", False),
])
def test_the_scale_note_names_a_random_init_model_as_such_and_drops_the_caveat_at_the_seeds_scale(tmp_path, record,
                                                                                                  says, caveat):
    """On the H200 lane a 1B random-init model was called 'embedded:smollm2-135m-instruct (1,073,809,408 params)'
    and its GPU numbers were said to be unlike the seeds' 'billion-parameter models on GPUs'."""
    layout = Layout(tmp_path)
    layout.metrics("base_model").parent.mkdir(parents=True)
    layout.metrics("base_model").write_text(json.dumps(record | {"dtype": "bfloat16"}))
    note = readings.scale_note(layout)
    assert says in note and ("billion-parameter models on GPUs" in note) == caveat


def _kv_cache_memory_record(layout: Layout, full_mib: float) -> None:
    """A bench_inference baseline record with a quanto-4 cell: the full-precision cache held at 256 and 1024
    tokens (float32)."""
    memory = [{"context": 256, "full_mib": full_mib / 4, "quantized_mib": 2.11, "ratio": 0.1875,
               "kind": "cpu_tensor_held"},
              {"context": 1024, "full_mib": full_mib, "quantized_mib": 8.44, "ratio": 0.1875, "kind": "cpu_tensor_held"}]
    _write(layout.metrics("bench_inference", "baseline"), {"status": "ok", "dtype": "float32", "cells": [
        {"status": "ok", "kv_cache": True, "batch_size": 1, "generation": "dynamic"},
        {"status": "ok", "kv_cache": True, "batch_size": 1, "generation": "dynamic", "kv_quant": "quanto-4",
         "quantized_cache": {"cache": "quanto-4", "memory_by_context": memory, "contexts_left_out": []}}]})


def test_the_kv_cache_formula_is_checked_against_the_measured_cache_and_its_heads(tmp_path, registry):
    """The seed's batch × heads × seq_len × dim × layers × 2 against generate()'s measured full-precision cache:
    SmolLM2's 9 query heads share 3 key/value heads, so the formula over-states the cache 3x and the cause says
    so; a model with as many key/value heads as query heads holds what the formula says."""
    claim = next(c for c in registry if c["id"] == "kv-cache-formula-measured")
    layout = Layout(tmp_path / "results")
    _kv_cache_memory_record(layout, 45.0)  # 2 × 30 layers × 3 kv heads × 64 × 1024 × 4 B = 45 MiB
    assert "config.json" in stage.evaluate(claim, layout)["reason"]  # no base model shapes here: not decided
    _with_base_config(layout)
    row = stage.evaluate(claim, layout)
    assert row["verdict"] == "differs" and row["value"] == pytest.approx(1 / 3) and row["evidence"] == "measured"
    assert "9 query heads share 3 key/value heads" in row["finding"] and "over-state the cache 3x" in row["finding"]
    assert "1 × 9 heads × 1024 × 64 × 30 layers × 2 × 4 bytes (float32) = 141,557,760 B" in row["reason"]
    config = json.loads((layout.base_model() / "config.json").read_text()) | {"num_key_value_heads": 9}
    _write(layout.base_model() / "config.json", config)
    _kv_cache_memory_record(layout, 135.0)
    row = stage.evaluate(claim, layout)
    assert row["verdict"] == "reproduced" and row["value"] == pytest.approx(1.0), row["reason"]
    _write(layout.metrics("bench_inference", "baseline"), {"status": "ok", "dtype": "float32", "cells": [
        {"status": "ok", "kv_cache": True, "batch_size": 1, "generation": "dynamic"}]})
    row = stage.evaluate(claim, layout)
    assert row["verdict"] == "not reproducible here" and "no full-precision KV cache memory" in row["reason"]


def test_the_kv_cache_speedup_reads_the_cells_with_and_without_it(tmp_path, registry):
    """Decode tokens/s with the KV cache over without it, from two cells timed apart: their own intervals'
    far ends give the interval; without a cell lacking the cache (the CPU default), not decided here."""
    claim = next(c for c in registry if c["id"] == "kv-cache-avoids-recompute")
    layout = Layout(tmp_path / "results")

    def decode(median, lo, hi):
        return {"n": 6, "median": median, "ci95_median": [lo, hi]}
    _write(layout.metrics("bench_inference", "baseline"), {"status": "ok", "cells": [
        {"status": "ok", "kv_cache": True, "batch_size": 1, "generation": "dynamic",
         "decode_tokens_per_s": decode(40.0, 38.0, 42.0)}]})
    row = stage.evaluate(claim, layout)
    assert row["verdict"] == "not reproducible here" and "without the KV cache" in row["reason"]
    assert "baseline-no-kv-cache: no record" in row["reason"]
    _write(layout.metrics("bench_inference", "baseline-no-kv-cache"), {"status": "ok", "cells": [
        {"status": "ok", "kv_cache": False, "batch_size": 1, "generation": "dynamic",
         "decode_tokens_per_s": decode(20.0, 19.0, 21.0)}]})
    row = stage.evaluate(claim, layout)
    assert row["verdict"] == "reproduced" and row["value"] == pytest.approx(2.0)
    assert (row["ci_low"], row["ci_high"]) == (pytest.approx(38 / 21), pytest.approx(42 / 19))


def test_one_seed_sentence_gets_one_verdict_its_strongest_reading_s():
    """INT8's "~2x memory savings" is computed (reproduced) and measured on schemes this run did not quantize (not
    reproducible here): the sentence is reproduced, on its computed reading; a measured reading that decides would
    take precedence over the computation."""
    import pandas as pd

    from efflab.stages.claims.sentences import sentence_counts, with_sentences
    from efflab.stages.claims.verdict import EVIDENCE, VERDICTS

    def row(claim, evidence, verdict, quote="INT8: ~2x memory savings"):
        return {"id": claim, "source": "s", "quote": quote, "evidence": evidence, "verdict": verdict}
    df = with_sentences(pd.DataFrame([row("int8-2x", "computed", "reproduced"),
                                      row("int8-2x-measured", "measured", "not reproducible here"),
                                      row("other", "definition", "differs", quote="another sentence")]))
    assert df["sentence_verdict"].tolist() == ["reproduced", "reproduced", "differs"]
    assert df["sentence_claim"].tolist() == ["int8-2x", "int8-2x", "other"]
    counts = sentence_counts(df, VERDICTS, EVIDENCE)
    assert counts["sentences"] == 2 and counts["by_sentence_verdict"]["reproduced"] == 1
    measured = with_sentences(pd.DataFrame([row("int8-2x", "computed", "reproduced"),
                                            row("int8-2x-measured", "measured", "differs")]))
    assert measured["sentence_verdict"].tolist() == ["differs", "differs"], "a measurement decides before arithmetic"
    for report in sorted((REPO / "results" / "reference").glob("*/report/report.md")):  # the re-rendered runs
        kept = pd.read_csv(path := report.parent.parent / "claims" / "claims.csv")
        assert (kept.groupby(["source", "quote"])["sentence_verdict"].nunique() == 1).all(), path


def test_a_kept_run_s_pruning_cause_is_computed_from_its_records_where_whole_layers_were_removed():
    from efflab.stages.claims import causes

    # SmolLM2-135M's sizes: 30 layers, a tied 49,152 x 576 embedding and a final norm outside them
    outside, layer = 49152 * 576 + 576, 3_540_096
    base = outside + 30 * layer
    config = {"num_hidden_layers": 30, "num_attention_heads": 9}
    m = {"kept": {"layers": 15, "heads": 9}, "base": {"parameters": base}, "pruned": {"parameters": outside + 15 * layer}}
    said = causes._prune_shares_recorded(config, m)
    assert f"outside them sit {outside:,} parameters" in said and f"{outside / base:.1%}" in said
    heads_cut = m | {"kept": {"layers": 15, "heads": 6}}  # heads cut too: what it removed is not whole layers
    assert causes._prune_shares_recorded(config, heads_cut) == causes.NO_SHAPES
