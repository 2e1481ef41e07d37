"""The GPU-only claim readings on planted GPU records: what an H100 run's base_model and bench_attention write (device
cuda, the GPU's name, the matmul ceilings of each precision, the CUDA context, SDPA's flash kernel timed interleaved
with eager), read by the claims stage's real readings and judged against the registry's bands
(workflow/claims.yaml). The attention records' speedups come out of the real interleaving (measure.timing) on a
simulated clock, so a known per-round ratio goes through the same statistics a GPU run's would."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from efflab.layout import Layout
from efflab.measure import flops, timing
from efflab.measure.stats import speedup, summarize
from efflab.measure.timing import INTERLEAVE_RECORD
from efflab.stages.claims import readings, stage
from efflab.stages.claims.registry import load
from efflab.stages.claims.verdict import NotHere
from tests.helpers import SimulatedClock

H100 = "NVIDIA H100 80GB HBM3"
CUDA_ENV = {"device": "cuda", "gpu": H100, "gpu_memory_mib": 81_559.0, "cuda": "12.8", "fingerprint": "h100"}
CPU = torch.device("cpu")  # the interleaving's own device: its probe is simulated, its clock too


@pytest.fixture(scope="module")
def by_id() -> dict:
    return {c["id"]: c for c in load()["claims"]}


@pytest.fixture
def layout(tmp_path) -> Layout:
    return Layout(tmp_path / "results")


@pytest.fixture
def quiet_machine(monkeypatch) -> SimulatedClock:
    clock = SimulatedClock()
    monkeypatch.setattr(timing, "clock", clock)
    monkeypatch.setattr(timing, "speed_probe", lambda device: 100.0)
    return clock


def _write(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))


def _interleaved_row(clock: SimulatedClock, impl: str, seq_len: int, eager_s: float, ratios: list[float]) -> dict:
    """A bench_attention cell as attention_cell records it, its rounds timed by timing.interleave: eager takes
    `eager_s` a round, `impl` eager's time over the round's ratio (a ratio of 2: twice as fast)."""
    work = lambda seconds: lambda r: clock.advance(seconds(r))  # noqa: E731
    timed = timing.interleave({impl: work(lambda r: eager_s / ratios[r]), "eager": work(lambda r: eager_s)},
                              len(ratios), CPU, warmup=0)
    return {"implementation": impl, "mode": "forward", "seq_len": seq_len, "batch_size": 1, "status": "ok",
            "latency": timed["variants"][impl] | {"interleaved_with": "eager"},
            "vs_eager": {"speedup": speedup(timed, impl, "eager"), "eager_latency": timed["variants"]["eager"],
                         **{k: timed[k] for k in INTERLEAVE_RECORD}}}


def _attention(layout: Layout, impl: str, rows: list[dict], env: dict = CUDA_ENV) -> None:
    _write(layout.metrics("bench_attention", impl), {"stage": "bench_attention", "status": "ok", "implementation": impl,
                                                     "dtype": "bfloat16", "rows": rows, "environment": env})


def _flash_attention_2_not_installed(layout: Layout) -> None:
    """What bench_attention writes for flash_attention_2 on a GPU without the flash-attn package."""
    reason = "the flash-attn package is not installed (README, Install: FlashAttention-2)"
    _write(layout.metrics("bench_attention", "flash_attention_2"), {
        "status": "unavailable", "implementation": "flash_attention_2", "reason": reason,
        "rows": [{"seq_len": 4096, "status": "unavailable", "reason": reason}], "environment": CUDA_ENV})


def test_a_2x_faster_flash_kernel_reads_2_with_the_bands_verdict(layout, quiet_machine, by_id):
    """SDPA's flash kernel twice as fast as eager in each of 6 interleaved rounds at the longest length both ran
    (eager ran out of memory at 16k there); flash_attention_2 not installed, so sdpa_flash stands for it."""
    _flash_attention_2_not_installed(layout)
    oom = {"implementation": "sdpa_flash", "mode": "forward", "seq_len": 16384, "batch_size": 1, "status": "ok",
           "latency": summarize([0.030] * 6), "vs_eager": {"unavailable": "eager ran out of memory here: CUDA out of "
                                                                          "memory. Tried to allocate 32.00 GiB"}}
    _attention(layout, "sdpa_flash", [_interleaved_row(quiet_machine, "sdpa_flash", 1024, 0.004, [1.5] * 6),
                                      _interleaved_row(quiet_machine, "sdpa_flash", 4096, 0.040, [2.0] * 6), oom])
    claim = by_id["flash-attention-2-4x"]
    reading = readings.METRICS["attention_speedup"](Layout(layout.root), claim["metric"])
    assert reading.value == pytest.approx(2.0) and reading.ci == pytest.approx((2.0, 2.0))
    assert "over sdpa_flash's at seq 4096, 6 interleaved rounds" in reading.how
    row = stage.evaluate(claim, layout)
    assert row["band"] == "2–4 x" and row["evidence"] == "measured"
    assert row["verdict"] == "reproduced" and row["reproduced"] == "2 x [2, 2]"
    assert row["ci_low"] == pytest.approx(2.0) and row["ratio"] is None  # a range has no single reported value


@pytest.mark.parametrize("ratios, verdict, said", [
    ([2.4, 2.6, 2.5, 2.7, 2.45, 2.55], "reproduced", "the 95% interval [2.4, 2.7] x lies inside the tolerance band"),
    ([1.45, 1.5, 1.55, 1.6, 1.4, 1.5], "differs", "the whole 95% interval [1.4, 1.6] x lies outside the tolerance"),
    ([1.8, 2.2, 1.9, 2.1, 2.3, 1.95], "inconclusive", "the 95% interval [1.8, 2.3] x crosses an edge of the tolerance"),
])
def test_the_flash_speedups_interval_decides_against_the_2_to_4x_band(layout, quiet_machine, by_id, ratios, verdict,
                                                                      said):
    _attention(layout, "sdpa_flash", [_interleaved_row(quiet_machine, "sdpa_flash", 8192, 0.12, ratios)])
    row = stage.evaluate(by_id["flash-attention-2-4x"], layout)
    ordered = sorted(ratios)
    assert row["value"] == pytest.approx((ordered[2] + ordered[3]) / 2), "the median of the per-round ratios"
    assert (row["ci_low"], row["ci_high"]) == pytest.approx((ordered[0], ordered[-1])), "6 rounds: min and max"
    assert row["verdict"] == verdict and said in row["reason"]
    assert "measured here on None" not in row["reason"]


def test_too_few_rounds_read_as_undecided(layout, quiet_machine, by_id):
    """3 interleaved rounds give no 95% interval: the reading falls back to the two implementations' own cells
    (eager timed in its own job, at the same length), a ratio with no interval, which decides nothing."""
    _attention(layout, "sdpa_flash", [_interleaved_row(quiet_machine, "sdpa_flash", 4096, 0.040, [2.0] * 3)])
    row_of = lambda s, median: {"implementation": "eager", "mode": "forward", "seq_len": s,  # noqa: E731
                                "batch_size": 1, "status": "ok", "latency": summarize([median] * 3)}
    _attention(layout, "eager", [row_of(1024, 0.004), row_of(4096, 0.041)])
    row = stage.evaluate(by_id["flash-attention-2-4x"], layout)
    assert row["verdict"] == "inconclusive" and row["value"] == pytest.approx(0.041 / 0.020)
    assert row["ci_low"] is None and "a measurement without a 95% interval (2.05 x, inside" in row["reason"]
    assert "median latency at seq 4096: eager / sdpa_flash, timed in separate cells" in row["reason"]


def test_flash_attention_2_is_read_before_sdpas_flash_kernel_and_a_cpu_run_is_not_read(layout, quiet_machine,
                                                                                       by_id):
    claim = by_id["flash-attention-2-4x"]
    _attention(layout, "sdpa_flash", [_interleaved_row(quiet_machine, "sdpa_flash", 4096, 0.04, [2.0] * 6)],
               env={"device": "cpu"})
    row = stage.evaluate(claim, layout)  # sdpa_flash off a GPU is not the claim's kernel, and nothing else ran
    assert row["verdict"] == f"needs GPU: {claim['gpu']}" and row["evidence"] == "measured"
    with pytest.raises(NotHere, match="sdpa_flash: not run on a CUDA GPU"):
        readings.METRICS["attention_speedup"](layout, claim["metric"])
    _attention(layout, "flash_attention_2", [_interleaved_row(quiet_machine, "flash_attention_2", 4096, 0.04,
                                                              [3.0] * 6)])
    row = stage.evaluate(claim, layout)
    assert row["verdict"] == "reproduced" and row["value"] == pytest.approx(3.0)
    assert "over flash_attention_2's at seq 4096" in row["reason"]


def _ceiling(dtype: str, tflops: float, size: int = 8192) -> dict:
    """measure.flops.matmul_ceiling's record of a matmul that ran at `tflops` (its best repeat)."""
    best = 2 * size**3 / (tflops * 1e12)
    return {"tflops": tflops, "dtype": dtype, "size": size, "best_s": best, "median_s": best * 1.02,
            "median_tflops": tflops / 1.02, "threads": 16}


def _h100_base_model(layout: Layout, rates: dict, context: dict | None = None) -> None:
    _write(layout.metrics("base_model"), {
        "stage": "base_model", "status": "ok", "source": "meta-llama/Llama-3.2-1B", "parameters": 1_235_814_400,
        "dtype": "bfloat16", "environment": CUDA_ENV,
        "gpu_matmul_tflops": {dtype: _ceiling(dtype, tflops) for dtype, tflops in rates.items()},
        "cuda_context": context or {"mib": 540.0, "nvml_process_mib": 1_564.0, "torch_reserved_mib": 1_024.0}})


@pytest.fixture
def h100_rates(monkeypatch) -> dict:
    """An H100's matmul ceilings at 75% of NVIDIA's published dense peaks (efflab.measure.flops), TF32 at half the
    16-bit rate as in the datasheet; the published peak looked up by the GPU's name as a CUDA run looks it up."""
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: H100)
    peak = {dtype: flops.published_peak_tflops(torch.device("cuda"), dtype) for dtype in ("bfloat16", "float32")}
    assert peak["bfloat16"] == {"tflops": 989.4, "gpu": "H100", "source": "NVIDIA datasheet, dense"}
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 PCIe")
    assert flops.published_peak_tflops(torch.device("cuda"), "bfloat16")["tflops"] == 756.5, "the PCIe card's own"
    half = 0.75 * peak["bfloat16"]["tflops"]
    return {"float32": 0.75 * peak["float32"]["tflops"], "tf32": half / 2, "bfloat16": half, "float16": half}


def test_matmul_ratios_read_the_h100s_ceilings_and_decide_nothing_without_an_interval(layout, by_id, h100_rates):
    """The matmul readings are one best rate per precision, no interval: inconclusive wherever they lie, the
    reason saying on which side of the band. fp16 over TF32 is 2x, inside 1.7-2.3x; bf16 or fp16 over IEEE fp32 is
    989.4 / 66.9 = 14.8x on an H100's tensor cores, far outside the seeds' 2-4x and 2-3x (those are of a training
    step, not of a matmul)."""
    _h100_base_model(layout, h100_rates)
    assert h100_rates["bfloat16"] / flops.PUBLISHED_PEAK_TFLOPS["H100"]["bfloat16"] == pytest.approx(0.75)
    fp16_tf32 = stage.evaluate(by_id["fp16-2x-tf32"], layout)
    assert fp16_tf32["value"] == pytest.approx(2.0) and fp16_tf32["verdict"] == "inconclusive"
    assert "a measurement without a 95% interval (2 x, inside the tolerance band 1.7–2.3 x)" in fp16_tf32["reason"]
    assert f"{H100}: 8192^3 matmul ceiling float16 742.0 vs tf32 371.0 TFLOP/s" in fp16_tf32["reason"]
    assert f"on cuda, {H100}" in fp16_tf32["reason"], "the scale note names the GPU"
    tensor_cores = stage.evaluate(by_id["tensor-core-2-4x"], layout)
    fp16 = stage.evaluate(by_id["fp16-speedup-2-3x"], layout)
    for row, band in ((tensor_cores, "2–4 x"), (fp16, "2–3 x")):
        assert row["value"] == pytest.approx(989.4 / 66.9) and row["verdict"] == "inconclusive"
        assert f"(14.79 x, outside the tolerance band {band})" in row["reason"] and row["evidence"] == "measured"
        assert row["ci_low"] is None and row["reproduced"] == "14.79 x"
    assert "bfloat16 742.0 vs float32 50.2 TFLOP/s" in tensor_cores["reason"]


def test_a_cpu_base_model_leaves_the_gpu_claims_to_a_gpu(layout, by_id):
    _write(layout.metrics("base_model"), {"status": "ok", "dtype": "float32", "environment": {"device": "cpu"}})
    for claim in ("fp16-2x-tf32", "tensor-core-2-4x", "fp16-speedup-2-3x", "cuda-kernels-1gb"):
        assert stage.evaluate(by_id[claim], layout)["verdict"] == f"needs GPU: {by_id[claim]['gpu']}"
    with pytest.raises(NotHere, match="the results are from a CPU run"):
        readings.METRICS["matmul_ratio"](layout, by_id["tensor-core-2-4x"]["metric"])


def test_the_cuda_context_reads_nvmls_figure_less_torchs_reserve(layout, by_id, h100_rates):
    """600 MiB outside torch's allocator is 0.629 GB (the seed's GB are decimal), under its "max of 1GB", but read
    once: no interval. Where NVML cannot see the process (a container hiding PIDs), the claim needs a GPU run that
    can."""
    claim = by_id["cuda-kernels-1gb"]
    _h100_base_model(layout, h100_rates, {"mib": 600.0, "nvml_process_mib": 2_648.0, "torch_reserved_mib": 2_048.0})
    row = stage.evaluate(claim, layout)
    assert row["value"] == pytest.approx(600 * 2**20 / 1e9) and row["reproduced"] == "0.6291 GB"
    assert row["verdict"] == "inconclusive" and "inside the tolerance band ≤ 1 GB" in row["reason"]
    assert "NVML process 2648 MiB - torch reserved 2048 MiB = 600 MiB" in row["reason"]
    _h100_base_model(layout, h100_rates, {"mib": None, "unavailable": "NVML lists no memory for this process "
                                                                       "(containers often hide PIDs)"})
    assert stage.evaluate(claim, layout)["verdict"] == f"needs GPU: {claim['gpu']}"


def test_every_gpu_reading_claim_is_measured_on_a_planted_h100_run(layout, quiet_machine, by_id, h100_rates):
    """Every registered claim these readings serve, on an H100 run's records: each measured, none left needing a
    GPU."""
    _h100_base_model(layout, h100_rates)
    _attention(layout, "sdpa_flash", [_interleaved_row(quiet_machine, "sdpa_flash", 4096, 0.04, [2.5] * 6)])
    gpu = [i for i, c in by_id.items() if c.get("metric", {}).get("kind") in
           ("matmul_ratio", "attention_speedup", "cuda_context")]
    assert len(gpu) == 5
    df = stage.evaluate_all([by_id[i] for i in gpu], layout).set_index("id")
    assert not df.loc[gpu, "verdict"].str.startswith("needs GPU").any()
    assert (df.loc[gpu, "evidence"] == "measured").all()
    assert df.loc["flash-attention-2-4x", "verdict"] == "reproduced"
