"""efflab's CUDA branches, driven on a CPU by the fake device of tests/fake_cuda.py: every figure below is exact
arithmetic on what the fake's allocator, simulated clock and NVML were told, never a reading of this machine."""
from __future__ import annotations

import sys
import types

import pytest
import torch
import transformers  # imported before any fake device is installed (libraries inspect CUDA at import)

from efflab import config, training
from efflab.config import UserError
from efflab.experiment import FinetuneRun
from efflab.measure import device as measure_device
from efflab.measure import energy, flops, memory, phases, timing
from efflab.models import build as model_build
from efflab.stages import capacity
from efflab.stages.bench_inference import generation
from efflab.stages.finetune.callbacks import SequenceLengths, StepTimes
from tests.helpers import TEST_PARAMS, SimulatedClock

CUDA = torch.device("cuda")
MiB = memory.MiB
DEFAULTS = config.load(TEST_PARAMS)["finetune"]["defaults"]  # a run's keys, as the stages read them


def run_cfg(**overrides) -> FinetuneRun:
    return FinetuneRun.of(DEFAULTS | {"method": "lora"} | overrides)


# -- measure.memory --------------------------------------------------------------------------------------------


def test_track_memory_on_cuda_reads_the_allocator_s_peaks_and_nvml(fake_cuda):
    fake_cuda.allocate(1000)  # the model, allocated before the block
    fake_cuda.allocate(200)
    fake_cuda.free(200)  # an earlier peak: reset at entry, so not the block's
    fake_cuda.nvml_process_mib = 2500.0
    with memory.track_memory(CUDA) as mem:
        assert fake_cuda.peak_resets == 1
        fake_cuda.allocate(64)
        fake_cuda.allocate(300)  # transient: freed inside the block, still the peak
        fake_cuda.free(300)
    assert mem == {"kind": "cuda_max_allocated", "peak_mib": 1364.0, "delta_mib": 364.0,
                   "cuda_max_reserved_mib": 1364.0, "nvml_process_mib": 2500.0}
    assert fake_cuda.synchronize_calls == 2  # before the baseline and before the peaks are read

    fake_cuda.free(64)
    with memory.track_memory(CUDA) as mem:
        fake_cuda.allocate(64)
    assert mem["delta_mib"] == 64.0 and mem["peak_mib"] == 1064.0
    assert mem["cuda_max_reserved_mib"] == 1364.0  # the first block's reserve: the allocator keeps what it freed
    assert memory.allocated_delta(mem) == (64.0, "cuda_max_allocated")


def test_track_memory_on_cuda_without_nvml_records_why(fake_cuda, monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml fails: not installed
    with memory.track_memory(CUDA) as mem:
        fake_cuda.allocate(64)
    assert mem["delta_mib"] == 64.0 and mem["nvml_process_mib"] is None
    assert mem["nvml_unavailable"] == "pynvml (nvidia-ml-py) is not installed"


def test_tensor_peak_on_cuda_keeps_the_reserved_peak_it_resets(fake_cuda):
    fake_cuda.allocate(1000)
    fake_cuda.allocate(3000)
    fake_cuda.free(3000)
    fake_cuda.empty_cache()  # reserved back to 1000 MiB; its peak since the last reset stays 4000
    with memory.tensor_peak(CUDA) as tensors:
        fake_cuda.allocate(512)
        fake_cuda.free(512)
        fake_cuda.allocate(128)
    assert tensors == {"reserved_before_mib": 4000.0, "kind": "cuda_max_allocated", "delta_mib": 512.0}
    assert fake_cuda.max_memory_reserved() == 1512 * MiB  # the peaks were reset at entry


def test_nvml_process_memory_is_this_process_s_entry(fake_cuda):
    fake_cuda.nvml_process_mib = 1536.0  # the fake also lists another process (7 MiB): not ours
    assert memory.nvml_process_mib(CUDA) == (1536.0, None)
    assert fake_cuda.nvml_handles == [("uuid", f"GPU-{fake_cuda.uuid}")]  # found by UUID, "GPU-" prefixed
    fake_cuda.nvml_process_mib = None
    assert memory.nvml_process_mib(CUDA) == (None, "NVML lists no memory for this process (containers often hide PIDs)")
    fake_cuda.nvml_error = "NVML_ERROR_UNINITIALIZED"
    assert memory.nvml_process_mib(CUDA) == (None, "NVML failed: NVML_ERROR_UNINITIALIZED")


def test_nvml_handle_by_uuid_or_by_index(fake_cuda):
    fake_cuda.uuid = f"GPU-{fake_cuda.uuid}"  # a UUID already prefixed is used as it is
    measure_device.nvml_handle(torch.device("cuda", 0))
    fake_cuda.uuid = ""  # no UUID from torch: NVML's index
    measure_device.nvml_handle(CUDA)
    assert fake_cuda.nvml_handles == [("uuid", fake_cuda.nvml_handles[0][1]), ("index", 0)]
    assert fake_cuda.nvml_handles[0][1].startswith("GPU-") and not fake_cuda.nvml_handles[0][1].startswith("GPU-GPU-")
    assert fake_cuda.nvml_inits == 2


def test_cuda_context_is_nvml_s_process_figure_less_torch_s_reserve(fake_cuda):
    fake_cuda.allocate(700)
    fake_cuda.free(200)  # reserved stays 700
    fake_cuda.nvml_process_mib = 1234.0
    assert memory.cuda_context_mib(CUDA) == {"mib": 534.0, "nvml_process_mib": 1234.0, "torch_reserved_mib": 700.0}
    fake_cuda.nvml_process_mib = None
    got = memory.cuda_context_mib(CUDA)
    assert got["mib"] is None and got["unavailable"].startswith("NVML lists no memory for this process")


# -- measure.energy ----------------------------------------------------------------------------------------------


def test_gpu_energy_is_the_board_counter_s_millijoules_in_joules(fake_cuda):
    meter = energy.EnergyMeter(CUDA).start()
    fake_cuda.spend(3.25)
    got = meter.stop()
    assert got["joules"] == 3.25 and got["source"] == "NVML total energy of the GPU board"
    assert energy.energy_per_token(got, 13)["joules_per_token"] == 0.25
    fake_cuda.nvml_error = "NVML_ERROR_NOT_SUPPORTED"
    assert energy.EnergyMeter(CUDA).start().stop() == {"unavailable": "FakeNVMLError: NVML_ERROR_NOT_SUPPORTED"}


# -- measure.timing, measure.phases, bench_inference.generation.TokenClock ----------------------------------------


def test_time_fn_on_cuda_times_with_events(fake_cuda):
    durations = iter([100.0, 100.0, 2.5, 4.0, 3.0])  # ms: two warm-up calls, then three timed ones

    def work():
        fake_cuda.advance(next(durations))
    got = timing.time_fn(work, CUDA, warmup=2, repeats=3)
    assert got["clock"] == "cuda_events" and got["warmup"] == 2
    assert got["samples"] == [0.0025, 0.004, 0.003] and got["median"] == 0.003 and got["n"] == 3
    assert fake_cuda.synchronize_calls == 1 + 3  # after the warm-up, then once per timed call


def test_event_stamps_are_read_after_one_synchronisation(fake_cuda):
    fake_cuda.advance(7.0)
    origin = timing.stamp(cuda=True)
    stamps = []
    for ms in (1.5, 0.25, 10.0):
        fake_cuda.advance(ms)
        stamps.append(timing.stamp(cuda=True))
    assert fake_cuda.synchronize_calls == 0  # stamping adds no synchronisation
    assert timing.seconds_since(origin, stamps, cuda=True) == pytest.approx([0.0015, 0.00175, 0.01175], abs=1e-15)
    assert fake_cuda.synchronize_calls == 1


def test_interleave_on_cuda_times_each_variant_with_events(fake_cuda, monkeypatch):
    """speed_probe would run a 4096² matmul on the device: replaced with a fixed probe that takes 5 ms of the
    host clock, which is the simulated one, so the sentinel's cost is exact too."""
    host = SimulatedClock()
    monkeypatch.setattr(timing, "clock", host)

    def probe(device):
        assert device.type == "cuda"
        host.advance(0.005)
        return 500.0
    monkeypatch.setattr(timing, "speed_probe", probe)
    calls = []

    def variant(name, ms):
        def run(r):
            calls.append((name, r))
            fake_cuda.advance(ms + r)  # round r takes r ms more
        return run
    got = timing.interleave({"a": variant("a", 2.0), "b": variant("b", 8.0)}, rounds=3, device=CUDA, warmup=1)
    assert got["clock"] == "cuda_events" and got["stable_rounds"] == 3 and got["set_aside"] == 0
    assert [r["order"] for r in got["rounds"]] == [["a", "b"], ["b", "a"], ["a", "b"]]
    assert calls[:2] == [("a", 0), ("b", 0)]  # the warm-up round
    assert got["variants"]["a"]["samples"] == pytest.approx([0.003, 0.004, 0.005], abs=1e-15)
    assert got["variants"]["b"]["samples"] == pytest.approx([0.009, 0.010, 0.011], abs=1e-15)
    assert got["sentinel_s"] == pytest.approx(4 * 0.005)  # one probe before the first round, one after each
    assert "unstable" not in got and got["probe"]["median"] == 500.0


def test_token_clock_on_cuda_times_each_token_from_events(fake_cuda):
    clock = generation.TokenClock(CUDA)
    for ms in (40.0, 5.0, 6.0, 5.0):  # the prompt (prefill), then three tokens
        fake_cuda.advance(ms)
        clock.put(None)
    clock.end()
    assert fake_cuda.synchronize_calls == 0
    assert clock.seconds() == pytest.approx([0.040, 0.045, 0.051, 0.056], abs=1e-15)


def test_generate_timed_on_cuda_gives_ttft_and_token_gaps_from_the_events(fake_cuda):
    """generate_timed reads the device from the prompt's input_ids: a stand-in that says cuda (and its shape)
    is passed, since the fake model never computes with it."""
    fake_cuda.advance(1.0)

    class Model:
        def generate(self, input_ids, attention_mask, max_new_tokens, streamer, **kwargs):
            assert max_new_tokens == 3 and kwargs["min_new_tokens"] == 3 and kwargs["use_cache"] is True
            fake_cuda.advance(2.0)  # between the clock's start and the prompt's put(): counted in ttft only
            streamer.put(None)  # the prompt
            for ms in (30.0, 4.0, 6.0):  # prefill to the first token, then two decode steps
                fake_cuda.advance(ms)
                streamer.put(None)
            streamer.end()
            return torch.zeros(2, 5 + 3, dtype=torch.long)
    tokenizer = types.SimpleNamespace(pad_token_id=0, batch_decode=lambda ids, skip_special_tokens: ["x", "y"])
    batch = {"input_ids": types.SimpleNamespace(device=CUDA, shape=(2, 5)),
             "attention_mask": torch.ones(2, 5, dtype=torch.long)}
    got = generation.generate_timed(Model(), tokenizer, batch, new_tokens=3)
    assert got["ttft_s"] == pytest.approx(0.032, abs=1e-15)  # from the clock's start, as the stage defines it
    assert got["token_gaps_s"] == pytest.approx([0.004, 0.006], abs=1e-15)
    assert got["decode_s"] == pytest.approx(0.010, abs=1e-15)
    assert (got["new_tokens"], got["batch_size"], got["prompt_tokens"]) == (3, 2, 10)


def test_phase_clock_on_cuda_cuts_a_trainer_step_at_its_event_stamps(fake_cuda, monkeypatch):
    """PhaseClock attached as the stage attaches it, to a stand-in Trainer (the real one takes seconds to import)
    whose step is played by hand: each phase takes a known number of simulated GPU milliseconds."""
    monkeypatch.setitem(vars(transformers), "TrainerCallback", object)

    class Forward(torch.nn.Module):
        def forward(self, x):
            fake_cuda.advance(10.0)
            return x

    class Between:  # a callback after the clock's own: logging, checkpoints
        def on_step_end(self, *args, **kwargs):
            fake_cuda.advance(5.0)

    def fetch(*args):
        fake_cuda.advance(3.0)
        return ["batch"]
    trainer = types.SimpleNamespace(callback_handler=types.SimpleNamespace(callbacks=[Between()]),
                                    get_batch_samples=fetch)
    model = Forward()
    clock = phases.PhaseClock(CUDA).attach(trainer, model)

    def event(name):
        for callback in trainer.callback_handler.callbacks:
            if hasattr(callback, name):
                getattr(callback, name)(None, None, None)

    for _ in range(2):
        trainer.get_batch_samples()
        event("on_step_begin")
        fake_cuda.advance(1.0)  # inputs to the device: `other`
        model(torch.zeros(1))
        fake_cuda.advance(20.0)  # backward
        event("on_pre_optimizer_step")
        fake_cuda.advance(4.0)
        event("on_optimizer_step")
        fake_cuda.advance(2.0)
        event("on_step_end")
    event("on_train_end")
    clock.detach()
    assert fake_cuda.synchronize_calls == 0  # none inside the loop
    steps = clock.steps()
    assert fake_cuda.synchronize_calls == 1
    expected = {"data": 0.003, "forward": 0.010, "backward": 0.020, "forward+backward": 0.0, "optimizer": 0.004,
                "step_end": 0.002, "between": 0.005, "instrument": 0.0, "other": 0.001, "total": 0.045}
    assert steps == [pytest.approx(expected, abs=1e-12)] * 2
    assert phases.summary(steps, skip=1)["median_s"]["total"] == pytest.approx(0.045, abs=1e-12)


# -- measure.flops -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name, dtype, tflops, gpu", [
    ("NVIDIA H100 80GB HBM3", "bfloat16", 989.4, "H100"),
    ("NVIDIA H100 80GB HBM3", "float32", 66.9, "H100"),
    ("NVIDIA H100 PCIe", "float16", 756.5, "H100 PCIe"),
    ("NVIDIA H200", "bfloat16", 989.4, "H200"),
    ("NVIDIA A100-SXM4-80GB", "bfloat16", 312.0, "A100"),
    ("NVIDIA A100 80GB PCIe", "float32", 19.5, "A100"),
    ("NVIDIA L40S", "float16", 362.1, "L40S"),
    ("NVIDIA L4", "bfloat16", 121.0, "L4"),
    ("Tesla T4", "float16", 65.0, "T4"),
])
def test_published_peaks_by_gpu_name_and_dtype(fake_cuda, name, dtype, tflops, gpu):
    fake_cuda.name = name
    assert flops.published_peak_tflops(CUDA, dtype) == {"tflops": tflops, "gpu": gpu,
                                                         "source": "NVIDIA datasheet, dense"}


def test_an_unknown_gpu_or_dtype_has_no_published_peak_and_says_why(fake_cuda):
    fake_cuda.name = "NVIDIA GeForce RTX 4090"
    assert flops.published_peak_tflops(CUDA, "bfloat16") == {
        "tflops": None, "reason": "no published peak known for 'NVIDIA GeForce RTX 4090'"}
    fake_cuda.name = "NVIDIA L40"  # not in the table; its name contains "L4", a different card's peaks
    assert flops.published_peak_tflops(CUDA, "bfloat16")["tflops"] is None
    fake_cuda.name = "Tesla V100-SXM2-16GB"
    assert flops.published_peak_tflops(CUDA, "bfloat16") == {
        "tflops": None, "reason": "V100 has no published bfloat16 tensor peak"}


def test_auto_dtype_on_cuda_follows_bf16_support(fake_cuda):
    assert flops.resolve_dtype("auto", CUDA) == ("bfloat16", {"requested": "auto",
                                                              "reason": "CUDA device, bfloat16 supported"})
    fake_cuda.bf16 = False
    assert flops.resolve_dtype("auto", CUDA)[0] == "float16"
    assert measure_device.pick_device({"device": "auto"}) == CUDA


# -- training ------------------------------------------------------------------------------------------------------


def test_auto_mixed_precision_on_cuda_is_bf16_where_supported_else_fp16(fake_cuda):
    assert model_build.mixed_precision(run_cfg(), "float32", CUDA) == "bf16"
    fake_cuda.bf16 = False
    assert model_build.mixed_precision(run_cfg(), "bfloat16", CUDA) == "fp16"
    assert model_build.mixed_precision(run_cfg(bf16_weights=True), "float32", CUDA) == "no"  # bf16 already
    assert model_build.mixed_precision(run_cfg(mixed_precision="no"), "float32", CUDA) == "no"


def test_tf32_needs_compute_capability_8_and_the_cuda_only_knobs_are_honoured(fake_cuda):
    gpu_knobs = run_cfg(tf32=True, mixed_precision="fp16", pin_memory=True)
    assert training.unavailable_knobs(gpu_knobs, CUDA) == []  # an H100: 9.0
    fake_cuda.capability = (8, 0)
    assert training.unavailable_knobs(gpu_knobs, CUDA) == []
    fake_cuda.name, fake_cuda.capability = "Tesla T4", (7, 5)
    assert training.unavailable_knobs(gpu_knobs, CUDA) == ["tf32 needs compute capability 8.0 or newer; Tesla T4 has 7.5"]
    assert training.unavailable_knobs(run_cfg(), CUDA) == []


class _Optimizer:
    """Plain SGD: torch.optim's first use imports torch._dynamo (~8 s); GradScaler needs only param_groups and step."""

    def __init__(self, params, lr):
        self.param_groups = [{"params": list(params), "lr": lr}]

    def step(self):
        with torch.no_grad():
            for p in self.param_groups[0]["params"]:
                p -= self.param_groups[0]["lr"] * p.grad

    def zero_grad(self, set_to_none=True):
        for p in self.param_groups[0]["params"]:
            p.grad = None


class _Trainer:
    """The HF Trainer as training_step uses it (its optimizer and scheduler): the real one would move the model to
    the fake device and takes seconds to import."""
    made: list = []

    def __init__(self, model, args, optimizer_cls_and_kwargs=None):
        self.model, self.args = model, args
        _Trainer.made.append(self)

    def create_optimizer(self):
        return _Optimizer(self.model.parameters(), self.args.learning_rate)

    def create_scheduler(self, steps, optimizer):
        return types.SimpleNamespace(step=lambda: None)


class _Regression(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(2, 1)
        with torch.no_grad():
            self.linear.weight.copy_(torch.tensor([[0.5, -1.0]]))
            self.linear.bias.fill_(0.25)
        self.config = types.SimpleNamespace(use_cache=True)
        self.autocast: list = []

    def forward(self, x, y):
        self.autocast.append((torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")))
        return types.SimpleNamespace(loss=((self.linear(x) - y) ** 2).mean())


def test_training_step_on_cuda_autocasts_and_scales_fp16_gradients(fake_cuda, monkeypatch, request):
    """training_step's own loop on the fake device: bf16 autocast without a scaler, fp16 autocast with a GradScaler
    whose scaled gradients are unscaled before clipping (so the update equals the unscaled one), and TF32 set as
    the run asks. Its loss accumulator is made on the device (torch.zeros(device=...)): keep_tensors_on_cpu makes
    it on the CPU; the model and batch are CPU tensors, which CUDA autocast leaves in fp32."""
    # the transformers module training_step will import from now (an earlier test in the worker may have put a
    # fresh one in sys.modules), not the one this file imported at collection
    current = sys.modules["transformers"]
    monkeypatch.setitem(vars(current), "Trainer", _Trainer)
    monkeypatch.setitem(vars(current), "TrainingArguments", types.SimpleNamespace)
    scalers = []

    class GradScaler(torch.amp.GradScaler):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            scalers.append(self)
    monkeypatch.setattr(torch.amp, "GradScaler", GradScaler)
    matmul = torch.backends.cuda.matmul  # allow_tf32 is a property of torch's flags: saved and put back by hand
    request.addfinalizer(lambda tf32=matmul.allow_tf32: setattr(matmul, "allow_tf32", tf32))
    matmul.allow_tf32 = False
    fake_cuda.keep_tensors_on_cpu(training)
    batch = {"x": torch.tensor([[1.0, 2.0], [3.0, -1.0]]), "y": torch.tensor([[4.0], [-2.0]])}
    cfg = run_cfg(max_grad_norm=0.01, learning_rate=0.5, tf32=True)  # the gradient's norm is far above 0.01

    def one_step():
        model = _Regression()
        step, precision = training.training_step(cfg, model, "float32", CUDA, [[batch]], "unused")
        loss = step(0)
        return model, precision, loss

    bf16_model, precision, bf16_loss = one_step()
    assert precision == "bf16" and scalers == [] and bf16_model.autocast == [(True, torch.bfloat16)]
    assert _Trainer.made[-1].args.use_cpu is False
    assert torch.backends.cuda.matmul.allow_tf32 is True

    fake_cuda.bf16 = False
    fp16_model, precision, fp16_loss = one_step()
    assert precision == "fp16" and fp16_model.autocast == [(True, torch.float16)]
    assert len(scalers) == 1 and scalers[0]._device == "cuda" and scalers[0].is_enabled()
    assert scalers[0].get_scale() == 65536.0 and scalers[0]._get_growth_tracker() == 1  # a finite step, updated
    assert fp16_loss.item() == bf16_loss.item()
    for fp16_p, bf16_p in zip(fp16_model.parameters(), bf16_model.parameters()):  # (torch.testing imports ~4 s)
        assert torch.equal(fp16_p, bf16_p)  # the scale is a power of two: unscaled exactly
    moved = torch.cat([(p - q).flatten() for p, q in zip(fp16_model.parameters(), _Regression().parameters())])
    assert moved.norm().item() == pytest.approx(0.5 * 0.01, rel=1e-5)  # lr x the clipped gradient's norm


def test_liger_kernels_without_the_package_are_an_unavailable_knob_and_never_skipped(fake_cuda, monkeypatch):
    monkeypatch.setitem(sys.modules, "liger_kernel", None)  # not installed, whatever this machine has
    assert training.unavailable_knobs(run_cfg(liger_kernel=True), CUDA) == [
        "liger_kernel needs the liger-kernel package, which is not installed (pip install liger-kernel)"]
    model = types.SimpleNamespace(config=types.SimpleNamespace(model_type="llama"))
    with pytest.raises(ImportError, match="liger_kernel"):  # never a run labelled liger trained without it
        model_build.with_liger_kernels(model)


def test_liger_kernels_patch_a_known_family_and_name_an_unknown_one(fake_cuda, monkeypatch):
    applied = []
    package = types.ModuleType("liger_kernel")
    transformers_ = types.ModuleType("liger_kernel.transformers")
    transformers_._apply_liger_kernel_to_instance = lambda model: applied.append(model)
    monkey_patch = types.ModuleType("liger_kernel.transformers.monkey_patch")
    monkey_patch.MODEL_TYPE_TO_APPLY_LIGER_FN = {"llama": None, "qwen2": None}
    for module in (package, transformers_, monkey_patch):
        monkeypatch.setitem(sys.modules, module.__name__, module)
    llama = types.SimpleNamespace(config=types.SimpleNamespace(model_type="llama"))
    model_build.with_liger_kernels(llama)
    assert applied == [llama]
    with pytest.raises(UserError, match=r"no kernels for model_type 'gpt_neox' \(it has: llama, qwen2\)"):
        model_build.with_liger_kernels(types.SimpleNamespace(config=types.SimpleNamespace(model_type="gpt_neox")))
    assert applied == [llama]


# -- stages.capacity ---------------------------------------------------------------------------------------------


def test_capacity_budget_on_cuda_is_the_card_or_the_configured_mib(fake_cuda):
    runtime = {"cell_memory_cap_mib": None}
    whole = capacity.budget({"budget_mib": {"cuda": None, "cpu": 2048}}, runtime, CUDA)
    assert whole == {"mib": 81559.0, "source": "the whole card (81559 MiB)", "memory": capacity.MEMORY["cuda"]}
    assert whole["memory"].startswith("cuda_peak_reserved_plus_context:")
    assert capacity.budget({"budget_mib": {"cuda": 40000, "cpu": None}}, runtime, CUDA) == {
        "mib": 40000, "source": "capacity.budget_mib.cuda", "memory": capacity.MEMORY["cuda"]}
    assert capacity.budget({"budget_mib": {"cuda": 10**6, "cpu": None}}, runtime, CUDA)["mib"] == 81559.0  # the card


def test_capacity_cell_on_cuda_holds_the_reserved_peak_and_context_against_the_budget(fake_cuda):
    fake_cuda.allocate(1000)  # the loaded model
    fake_cuda.allocate(3000)
    fake_cuda.free(3000)
    fake_cuda.empty_cache()  # reserved 1000 MiB now, but 4000 at its peak: the cell's peak, kept across the reset
    context = 300.0
    assert memory.held_mib(CUDA, context) == 1300.0

    def work():
        fake_cuda.allocate(512)
        fake_cuda.advance(8.0)
        fake_cuda.free(512)
    budgets = []

    def fits(tensors):
        peak = memory.held_peak_mib(CUDA, context, tensors)
        budgets.append(peak)
        return peak <= 4300.0
    ran = memory.run_steps(work, CUDA, warmup=2, timed=3, fits=fits)
    assert ran["tensors"] == {"reserved_before_mib": 4000.0, "kind": "cuda_max_allocated", "delta_mib": 512.0}
    assert budgets == [4300.0] and ran["step_s"]["samples"] == [0.008] * 3
    assert memory.run_steps(work, CUDA, warmup=1, timed=3, fits=lambda tensors: False)["step_s"] is None


def test_the_step_timer_and_the_sequence_count_add_no_synchronisation_to_a_gpu_step(fake_cuda):
    """On a GPU the step timer records events and the sequence count keeps its sums on the device: a training loop
    of three steps makes no synchronisation; reading the step times afterwards makes one, and they are the simulated
    clock's. The sums (sum of lengths, of their squares) are those of the packed rows' and the padded batch's real
    lengths."""
    class Model(torch.nn.Module):
        def forward(self, input_ids, **kwargs):
            return input_ids
    timer, model = StepTimes(CUDA), Model()
    seen = SequenceLengths(model)
    state = types.SimpleNamespace(num_input_tokens_seen=0)
    packed = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]])  # rows of 3, 2 and 4 tokens laid end to end
    padded = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    for ms, kwargs in ((30.0, {"position_ids": packed}), (20.0, {"attention_mask": padded}), (25.0, {})):
        timer.on_step_begin(None, state, None)
        model(input_ids=torch.zeros(2, 4, dtype=torch.long), **kwargs)
        fake_cuda.advance(ms)
        state.num_input_tokens_seen += 5
        timer.on_step_end(None, state, None)
    assert fake_cuda.synchronize_calls == 0
    assert timer.durations == pytest.approx([0.030, 0.020, 0.025], abs=1e-12) and timer.tokens == [5, 5, 5]
    assert fake_cuda.synchronize_calls == 1
    assert timer.durations == pytest.approx([0.030, 0.020, 0.025]) and fake_cuda.synchronize_calls == 1
    assert seen.tokens == 9 + 5 + 8 and seen.squares == (9 + 4 + 16) + (9 + 4) + 2 * 16
    assert seen.positions == 3 * 8
