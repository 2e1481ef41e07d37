"""The claims registry and the claims stage: schema, coverage, verdicts, measured claims from results."""
from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
import yaml

from efflab import estimate
from efflab.claims import readings, stage
from efflab.claims.registry import load_registry
from efflab.claims.verdict import VERDICTS, judge, verdict_class
from efflab.config import UserError
from efflab.layout import Layout

from tests.helpers import TEST_PARAMS, run_stage

SEEDS = Path("/work/shared/seeds")


@pytest.fixture(scope="module")
def registry() -> list[dict]:
    return load_registry()


@pytest.fixture(scope="module")
def empty_run(tmp_path_factory) -> tuple[dict, pd.DataFrame, Path]:
    root = tmp_path_factory.mktemp("claims")
    out = root / "out"
    metrics = stage.run({}, {"layout": Layout(root / "results"), "name": None, "out": out, "final": out})
    return metrics, pd.read_csv(out / "claims.csv"), out


def test_registry_validates_and_covers_the_seeds(registry):
    assert len(registry) >= 30
    assert len({c["id"] for c in registry}) == len(registry)
    kinds = {c["kind"] for c in registry}
    assert kinds == {"analytic", "measured", "hardware"}
    assert len({c["source"] for c in registry}) == 5
    shipped = set(estimate.model_names())
    for c in registry:
        for spec in (c.get("inputs"), c.get("estimate", {}).get("inputs")):
            if spec and "model" in spec:
                assert spec["model"] in shipped, c["id"]


@pytest.mark.skipif(not SEEDS.is_dir(), reason="the seed texts are not on this machine")
def test_quotes_are_verbatim(registry):
    for c in registry:
        assert c["quote"] in (SEEDS / c["source"]).read_text(), c["id"]


def test_bad_registry_is_one_line_user_error(tmp_path, registry):
    bad = dict(registry[0], kind="guessed")
    path = tmp_path / "claims.yaml"
    path.write_text(yaml.safe_dump({"claims": [bad]}))
    with pytest.raises(UserError, match=r"claims\.0\.kind: 'guessed' is not one of"):
        load_registry(path)
    path.write_text(yaml.safe_dump({"claims": [registry[0], registry[0]]}))
    with pytest.raises(UserError, match="appears twice"):
        load_registry(path)


def test_empty_results_give_a_row_and_a_valid_verdict_per_claim(empty_run, registry):
    metrics, df, out = empty_run
    assert list(df["id"]) == [c["id"] for c in registry]
    assert df["verdict"].map(verdict_class).isin(VERDICTS).all()
    assert sum(metrics["by_verdict"].values()) == metrics["claims"] == len(registry)
    by_id = df.set_index("id")
    for c in registry:
        verdict = by_id.loc[c["id"], "verdict"]
        if c.get("unreproducible"):
            assert verdict == "not reproducible here"
        elif c["kind"] == "analytic":
            assert verdict in ("reproduced", "differs")
        elif c["kind"] == "measured":
            assert verdict == "not reproducible here" and "results" in by_id.loc[c["id"], "reason"]
        elif c.get("estimate", {}).get("sufficient"):  # a footprint whose only missing piece is the real weights
            assert verdict in ("reproduced (analytic)", "differs (analytic)")
        else:
            assert verdict == f"needs GPU: {c['gpu']}"
    md = (out / "claims.md").read_text()
    assert md.startswith("# Published numbers: reported vs reproduced") and "`000_965e890cecb00a0b.txt`: \"Chapter 12" in md \
        and md.count("\n| ") >= len(registry)


def test_wrong_seed_figures_are_called_out_with_arithmetic(empty_run):
    df = empty_run[1].set_index("id")
    row = df.loc["fp32-mantissa-bits"]
    assert row["verdict"] == "differs" and row["reproduced"] == "23 bits" and "total width" in row["reason"]
    row = df.loc["qlora-13b-base-weights"]
    assert row["verdict"] == "differs" and "block constants" in row["reason"]
    assert df.loc["gradscaler-growth-interval", "reproduced"] == "2,000 count"
    assert df.loc["checkpointing-llama-13b-800mb", "verdict"] == "reproduced"
    assert "MiB" in df.loc["checkpointing-llama-13b-800mb", "reason"]


def test_binary_convention_claims_compare_like_with_like(empty_run, registry):
    """A seed's GB that its source shows are GiB (DeepSpeed prints bytes / 2**30 as 'GB') or that only reproduce
    as GiB are read as GiB, with the convention and its evidence in the row."""
    df = empty_run[1].set_index("id")
    row = df.loc["t0-3b-zero3-offload-all-init1-cpu"]
    assert row["verdict"] == "reproduced" and row["reproduced"] == "70 GB (binary: GiB)"
    assert row["units"] == "binary (source)" and "2**30" in row["reason"]
    assert (df.loc[[c["id"] for c in registry if c["id"].startswith("t0-3b-zero3-")], "verdict"] == "reproduced").all()
    row = df.loc["activations-llama-2-13b-21gb"]
    assert row["verdict"] == "reproduced" and row["reproduced"] == "21.09 GB (binary: GiB)"
    assert row["units"] == "binary (arithmetic)" and row["ratio"] == pytest.approx(21.09 / 21, abs=1e-3)
    assert df.loc["gpt2-1.5b-weights-3gb", "units"] == "decimal (default)"
    assert pd.isna(df.loc["fp16-exponent-bits", "units"])  # a unit without a byte prefix has no convention


def test_a_figure_that_fits_only_in_the_other_convention_still_differs(registry):
    by_id = {c["id"]: c for c in registry}
    # decimal by default: the seed's 21 GB without the recorded evidence is 22.65 GB and differs, saying why
    bare = {k: v for k, v in by_id["activations-llama-2-13b-21gb"].items() if k != "units"}
    row = stage.evaluate(bare, None)
    assert row["verdict"] == "differs" and row["reproduced"] == "22.65 GB" and row["units"] == "decimal (default)"
    assert "fits only in binary: 22.65 GB = 21.09 GiB" in row["reason"] and "nothing in the seed says" in row["reason"]
    # recorded decimal (the slide's own 0.5 bytes * 13B = 6.5GB): 7.20 GB = 6.71 GiB would fit, but differs
    row = stage.evaluate(by_id["qlora-13b-base-weights"], None)
    assert row["verdict"] == "differs" and row["units"] == "decimal (source)"
    assert "block constants" in row["reason"] and "recorded as decimal" in row["reason"]
    # and the other way: a binary record whose figure fits only in decimal
    flipped = dict(by_id["full-13b-weights-26gb"], units={"convention": "binary", "evidence_kind": "arithmetic",
                                                          "evidence": "a test of the reverse case"})
    row = stage.evaluate(flipped, None)
    assert row["verdict"] == "differs" and "fits only in decimal" in row["reason"]
    assert "recorded as binary" in row["reason"]


def test_unit_convention_only_for_byte_units(tmp_path, registry):
    claim = next(c for c in registry if c["reported"]["unit"] == "bits")
    path = tmp_path / "claims.yaml"
    units = {"convention": "binary", "evidence_kind": "source", "evidence": "the seed's code divides by 1024"}
    path.write_text(yaml.safe_dump({"claims": [dict(claim, units=units)]}))
    with pytest.raises(UserError, match=r"units: a unit convention applies to KB"):
        load_registry(path)
    gb = next(c for c in registry if c["reported"]["unit"] == "GB")
    path.write_text(yaml.safe_dump({"claims": [dict(gb, units=dict(units, convention="guessed"))]}))
    with pytest.raises(UserError, match=r"claims\.0\.units\.convention: 'guessed' is not one of"):
        load_registry(path)


def test_int8_footprints_get_an_analytic_verdict_without_results(empty_run, registry):
    """The INT8 footprints need only the real weights, whose values do not change the bytes: with no results at
    all they get a verdict from the estimate, labelled analytic and counted with reproduced, in claims.csv and in
    the markdown; a hardware claim that needs the GPU itself (the allocator's rounding) stays "needs GPU"."""
    metrics, df, out = empty_run
    by_id = df.set_index("id")
    row = by_id.loc["vram-int8-llama-3.1-8b"]
    assert row["verdict"] == "reproduced (analytic)" and verdict_class(row["verdict"]) == "reproduced"
    assert row["reproduced"] == "8,666 MB (binary: MiB)" and "analytic verdict" in row["reason"]
    assert row["ratio"] == pytest.approx(8666 / 8679.11, abs=2e-4)
    int8 = [c["id"] for c in registry if c["id"].startswith("vram-int8-")]
    assert len(int8) == 6 and by_id.loc[int8, "verdict"].str.endswith("(analytic)").all()
    assert by_id.loc["phi3-16-layers-fp16-reserved", "verdict"].startswith("needs GPU: ")
    assert metrics["by_verdict"]["reproduced"] == (df["verdict"].map(verdict_class) == "reproduced").sum()
    assert "| reproduced (analytic) " in (out / "claims.md").read_text()


def test_a_gpu_measurement_takes_precedence_over_the_analytic_verdict(tmp_path, registry):
    layout = Layout(tmp_path / "results")
    claim = dict(next(c for c in registry if c["id"] == "vram-int8-llama-3.1-8b"), metric={"kind": "cuda_context"})
    assert stage.evaluate(claim, layout)["verdict"] == "reproduced (analytic)"  # no results: the estimate decides
    _write(layout.metrics("base_model"), {"environment": {"device": "cuda", "gpu": "NVIDIA H100 80GB HBM3"},
                                          "cuda_context": {"mib": 7000.0, "nvml_process_mib": 8000.0,
                                                           "torch_reserved_mib": 1000.0}})
    row = stage.evaluate(claim, layout)  # a stand-in metric that reads 7000 MiB from the GPU
    assert row["verdict"] == "differs" and row["reproduced"] == "7,000 MB (binary: MiB)"


def _write(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))


def test_measured_claims_read_this_pipelines_results(tmp_path):
    layout = Layout(tmp_path / "results")
    config = {k: v for k, v in estimate.load_config("smollm2-135m").items() if not k.startswith("_")}
    _write(layout.base_model() / "config.json", config)
    _write(layout.metrics("base_model"), {"source": "embedded:smollm2-135m-instruct", "parameters": 134_515_008,
                                          "dtype": "float32", "environment": {"device": "cpu"}})
    # a float32 baseline: 4 B/param; int8 keeps the tied embedding and the norms in float32
    kept = estimate.bnb_footprint(str(layout.base_model()), "int8")["kept_params"]
    quantized = 134_515_008 - kept
    _write(layout.metrics("quantize", "int8"), {"compute_dtype": "float32", "footprint_ratio_vs_base": 2.9,
                                                "base_memory_footprint_bytes": 4 * 134_515_008,
                                                "memory_footprint_bytes": quantized + 4 * kept})
    settings = {"lr": 1e-3, "gradient_checkpointing": False, "method": "lora"}
    for run, extra, step_s in (("lora", {}, 1.0), ("lora-ckpt", {"gradient_checkpointing": True}, 1.3)):
        _write(layout.metrics("finetune", run), {"run": run, "method": "lora", "settings": {**settings, **extra},
                                                 "step_s": step_s, "tokens_per_s": 100 / step_s,
                                                 "parameters": {"trainable": 9, "total": 1000, "trainable_pct": 0.9}})
    registry = {c["id"]: c for c in load_registry()}
    int8 = stage.evaluate(registry["int8-2x-measured"], layout)
    assert float(int8["reproduced"].split()[0]) == pytest.approx(2 * 134_515_008 / (quantized + 2 * kept), rel=1e-3)
    assert "re-expressed at 16 bits" in int8["reason"] and "134,515,008 params" in int8["reason"]
    ckpt = stage.evaluate(registry["checkpointing-30pct-slowdown"], layout)
    assert ckpt["verdict"] == "reproduced" and ckpt["reproduced"] == "30 %"
    assert stage.evaluate(registry["lora-over-99pct-measured"], layout)["reproduced"] == "99.1 %"
    assert stage.evaluate(registry["qlora-throughput-30pct-worse"], layout)["verdict"] == "not reproducible here"
    assert stage.evaluate(registry["flash-attention-2-4x"], layout)["verdict"].startswith("needs GPU: ")
    # bench_finetune timed the pair interleaved: its per-round ratio (checkpointing's step over the plain one's)
    # and interval take precedence over the runs' own figures, in the claim's orientation
    pair = {"status": "ok", "knob": "gradient_checkpointing", "a": "lora", "b": "lora-ckpt",
            "step_time_ratio": {"median": 1.5, "ci95": [1.45, 1.6], "rounds": 6, "verdict": "slower"}}
    _write(layout.metrics("bench_finetune"), {"status": "ok", "pairs": [pair]})
    ckpt = stage.evaluate(registry["checkpointing-30pct-slowdown"], layout)
    assert ckpt["verdict"] == "differs" and ckpt["reproduced"].startswith("50 % [45, 60]")
    assert "6 interleaved rounds" in ckpt["reason"]
    pair["step_time_ratio"] = {"median": None, "ci95": None, "rounds": 1,
                               "verdict": "not a verdict: the machine's speed changed"}
    _write(layout.metrics("bench_finetune"), {"status": "ok", "pairs": [pair]})
    ckpt = stage.evaluate(registry["checkpointing-30pct-slowdown"], layout)
    assert ckpt["verdict"] == "not reproducible here" and "machine's speed changed" in ckpt["reason"]


def test_a_measured_figure_with_a_ci_is_judged_by_equivalence_with_the_band():
    """The claim's tolerance band decides by equivalence: the whole 95% CI inside it is reproduced, the whole
    CI outside it differs, and a CI across either edge is inconclusive (its own verdict class), wherever the
    median lies."""
    claim = {"id": "synthetic", "reported": {"value": 30, "unit": "%"}, "tolerance": 0.33}  # band 20.1-39.9 %
    j = judge(30.0, claim, ci=[25.0, 36.0])
    assert j["verdict"] == "reproduced" and j["reproduced"] == "30 % [25, 36]" and "20.1–39.9 %" in j["why"]
    j = judge(36.9, claim, ci=[23.2, 52.6])  # the median inside, the interval across the upper edge
    assert j["verdict"] == "inconclusive" and "crosses an edge of the tolerance band 20.1–39.9 %" in j["why"]
    j = judge(55.0, claim, ci=[45.0, 65.0])
    assert j["verdict"] == "differs" and "the whole 95% CI [45, 65] % lies outside the tolerance band" in j["why"]
    j = judge(41.2, claim, ci=[47.9, 35.0])  # an interval given high to low reads the same
    assert j["verdict"] == "inconclusive" and j["reproduced"] == "41.2 % [35, 47.9]"
    assert "the 95% CI [35, 47.9] % crosses an edge of the tolerance band" in j["why"]
    assert verdict_class(j["verdict"]) == "inconclusive" and "inconclusive" in VERDICTS
    bound = {"id": "bound", "reported": {"value": 99, "unit": "%"}, "compare": "at_least", "tolerance": 0}
    assert judge(98.0, bound, ci=[97.0, 99.5])["verdict"] == "inconclusive"
    assert judge(98.0, bound, ci=[97.0, 98.5])["verdict"] == "differs"
    assert judge(99.2, bound, ci=[97.0, 99.5])["verdict"] == "inconclusive"
    assert judge(99.6, bound, ci=[99.2, 99.9])["verdict"] == "reproduced"
    assert judge(55.0, claim)["verdict"] == "differs"  # without a CI the median alone decides


def test_metrics_may_return_a_ci_and_finetune_pairs_carry_one(tmp_path, monkeypatch):
    registry = {c["id"]: c for c in load_registry()}
    monkeypatch.setitem(readings.METRICS, "finetune_pair", lambda layout, metric: (41.2, "a stand-in", [35.0, 47.9]))
    row = stage.evaluate(registry["checkpointing-30pct-slowdown"], Layout(tmp_path / "results"))
    assert row["verdict"] == "inconclusive" and row["reproduced"] == "41.2 % [35, 47.9]"
    assert "crosses an edge of the tolerance band" in row["reason"] and "a stand-in" in row["reason"]
    monkeypatch.undo()
    layout = Layout(tmp_path / "results")
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
    write(5)  # 5 paired steps give no 95% interval: the median alone, the range named as such
    ckpt = stage.evaluate(registry["checkpointing-30pct-slowdown"], layout)
    assert ckpt["reproduced"] == "30 %" and "5 steps give no 95% interval" in ckpt["reason"]
    write(6)
    ckpt = stage.evaluate(registry["checkpointing-30pct-slowdown"], layout)  # paired ratios 1.25 .. 1.35
    assert ckpt["verdict"] == "reproduced" and ckpt["reproduced"] == "30 % [25, 35]"
    assert "6 paired steps" in ckpt["reason"] and "96.9% interval" in ckpt["reason"]
    qlora = stage.evaluate(registry["qlora-throughput-30pct-worse"], layout)  # tokens/s: 1 / 1.4 each step
    assert qlora["reproduced"] == f"{100 * (1 - 1 / 1.4):.4g} % [{100 * (1 - 1 / 1.4):.4g}, {100 * (1 - 1 / 1.4):.4g}]"
    record = json.loads(layout.metrics("finetune", "qlora").read_text())
    _write(layout.metrics("finetune", "qlora"), dict(record, tokens_seen=499))  # other batches: no pairing, no CI
    qlora = stage.evaluate(registry["qlora-throughput-30pct-worse"], layout)
    assert qlora["reproduced"] == f"{100 * (1 - 1 / 1.4):.4g} %" and "paired" not in qlora["reason"]


def test_hardware_claims_are_evaluated_on_results_from_a_gpu(tmp_path):
    """GPU results (the base_model metrics of a CUDA run: its matmul rates and CUDA context, and attention
    cells measured on CUDA) turn "needs GPU" into verdicts; the same claims on CPU results stay "needs GPU"."""
    layout = Layout(tmp_path / "results")
    env = {"device": "cuda", "gpu": "NVIDIA H100 80GB HBM3"}
    rates = {"float32": 51.0, "tf32": 378.0, "bfloat16": 728.0, "float16": 745.0}
    _write(layout.metrics("base_model"), {
        "environment": env, "gpu_matmul_tflops": {d: {"tflops": t, "size": 8192} for d, t in rates.items()},
        "cuda_context": {"mib": 520.0, "nvml_process_mib": 1544.0, "torch_reserved_mib": 1024.0}})
    row = lambda seq, s: {"seq_len": seq, "status": "ok", "latency": {"median": s}}  # noqa: E731
    _write(layout.metrics("bench_attention", "eager"), {"status": "ok", "environment": env,
                                                        "rows": [row(1024, 0.030), row(8192, 0.90)]})
    _write(layout.metrics("bench_attention", "flash_attention_2"), {"status": "unavailable", "reason": "no flash-attn",
                                                                    "environment": env, "rows": []})
    _write(layout.metrics("bench_attention", "sdpa_flash"), {"status": "ok", "environment": env,
                                                             "rows": [row(1024, 0.010), row(8192, 0.30)]})
    registry = {c["id"]: c for c in load_registry()}
    verdicts = {i: stage.evaluate(registry[i], layout) for i in
                ("tensor-core-2-4x", "fp16-speedup-2-3x", "fp16-2x-tf32", "cuda-kernels-1gb", "flash-attention-2-4x")}
    assert not any(v["verdict"].startswith("needs GPU") for v in verdicts.values()), verdicts
    flash = verdicts["flash-attention-2-4x"]
    assert flash["verdict"] == "reproduced" and flash["reproduced"] == "3 x" and "sdpa_flash" in flash["reason"]
    assert verdicts["tensor-core-2-4x"]["verdict"] == "differs"  # 728 / 51 = 14.3x, outside 2-4x
    assert verdicts["fp16-2x-tf32"]["reproduced"] == "1.971 x"  # 745 / 378
    assert verdicts["cuda-kernels-1gb"]["verdict"] == "reproduced"  # 520 MiB = 0.545 GB, at most 1 GB
    _write(layout.metrics("base_model"), {"environment": {"device": "cpu"}})
    assert stage.evaluate(registry["tensor-core-2-4x"], layout)["verdict"].startswith("needs GPU")


def test_stage_runs_through_its_cli(tmp_path):
    results = tmp_path / "results"
    metrics = run_stage("claims", TEST_PARAMS, results)
    assert metrics["stage"] == "claims" and metrics["claims"] == sum(metrics["by_verdict"].values())
    assert (results / "claims" / "claims.md").is_file() and (results / "claims" / "claims.csv").is_file()
