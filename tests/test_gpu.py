"""The device smoke suite: real CUDA behaviour through efflab's own code, each test under a minute on an H100.

Run on a GPU node with `pytest -m gpu -n 0 tests/test_gpu.py` (one process: the tests share the card). Every test is
marked `gpu` and skipped, with the reason, where torch sees no CUDA GPU, so the suite collects and skips cleanly on
the CPU machines that run `make test`. A test that needs an optional package (bitsandbytes, torchao, pynvml) skips
with the reason where it is missing.
"""
from __future__ import annotations

import importlib.util
from dataclasses import replace

import pytest
import torch

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA GPU (torch.cuda.is_available() is False here)")
pytestmark = [pytest.mark.gpu, needs_cuda]

CUDA = torch.device("cuda")
MiB = 2**20


def _needs(package: str) -> None:
    if importlib.util.find_spec(package) is None:
        pytest.skip(f"{package} is not installed")


def _tiny_llama_config():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    """A random-init Llama of 2 layers, hidden 256, saved as a local safetensors folder (what efflab loads)."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("tiny-llama")
    LlamaForCausalLM(_tiny_llama_config()).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def token_ids() -> torch.Tensor:
    return torch.randint(0, 1024, (2, 64), generator=torch.Generator().manual_seed(1)).to(CUDA)


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


def _closeness(quantized: torch.Tensor, reference: torch.Tensor) -> tuple[float, float]:
    """(relative error ||q - r|| / ||r||, cosine similarity) of two logit tensors."""
    rel = ((quantized - reference).norm() / reference.norm()).item()
    cos = torch.nn.functional.cosine_similarity(quantized.flatten(), reference.flatten(), dim=0).item()
    return rel, cos


# (scheme, library, the quantized layer class efflab.models.quantization.quantized_kind names, the largest relative error
# of the logits against bf16). Measured on the tiny model on a CPU: int8 0.021, nf4 0.19, torchao-int8 0.017.
SCHEMES = [({"method": "int8"}, "bitsandbytes", "Linear8bitLt", 0.08),
           ({"method": "nf4", "double_quant": True}, "bitsandbytes", "Linear4bit", 0.35),
           ({"method": "torchao-int8"}, "torchao", None, 0.08),
           ({"method": "torchao-int4", "group_size": 64}, "torchao", None, 0.35)]


@pytest.mark.parametrize("quant, library, layer, tolerance", SCHEMES, ids=[s[0]["method"] for s in SCHEMES])
def test_quantized_models_stay_close_to_bf16_and_take_less_memory(tiny_llama, token_ids, quant, library, layer,
                                                                  tolerance):
    """bitsandbytes int8 / nf4 and torchao int8 / int4 weight-only, loaded on CUDA by efflab (modeling.load_model
    with the scheme, quantization.config): quantized layers, a smaller footprint, logits close to the bf16 model's."""
    _needs(library)
    from efflab.models import quantization
    from efflab.models.modeling import load_model

    reference = load_model(tiny_llama, "bfloat16", CUDA)
    model = load_model(tiny_llama, "bfloat16", CUDA, quant=quant)
    parts = quantization.quantized_parts(model)
    assert sum(parts.values()) == 14, f"every Linear of the 2 layers (7 each) is quantized: {parts}"
    if layer:
        assert set(parts) == {layer}
    # An H200 run (torch 2.11, torchao 0.18, transformers 5.17) found torchao-int4's footprint equal to bf16's;
    # the message carries what the next run needs to say why: a quantized weight's class and inner tensors.
    weight = next(m.weight for m in model.modules() if quantization.quantized_kind(m))
    inner = {n: (tuple(getattr(weight, n).shape), str(getattr(weight, n).dtype))
             for n in (weight.__tensor_flatten__()[0] if hasattr(weight, "__tensor_flatten__") else [])}
    assert quantization.footprint_bytes(model) < 0.8 * quantization.footprint_bytes(reference), (
        type(weight).__name__, tuple(weight.shape), weight.dtype, inner, quantization.tensor_bytes(weight))
    rel, cos = _closeness(_logits(model, token_ids), _logits(reference, token_ids))
    assert rel < tolerance and cos > 0.95, (quant, rel, cos)


@pytest.mark.parametrize("impl", ["sdpa_flash", "sdpa_efficient", "sdpa_cudnn", "sdpa_math"])
def test_every_sdpa_backend_agrees_with_the_math_backend(impl):
    """Each SDPA backend forced as bench_attention forces it (attention_backend), bf16 causal attention of shape
    (1, 8, 512, 64), within bf16's tolerance of the math backend in fp32. Flash, memory-efficient and math run on
    every Ampere-or-newer GPU; cuDNN's depends on the cuDNN torch was built with, and where it has no kernel for
    these inputs the test says so (bench_attention records that cell `unavailable` with the same words)."""
    from efflab.stages.bench_attention import attention_backend, unavailable_reason

    assert unavailable_reason(impl, CUDA) is None
    gen = torch.Generator(device=CUDA).manual_seed(0)
    q, k, v = (torch.randn(1, 8, 512, 64, device=CUDA, dtype=torch.bfloat16, generator=gen) for _ in range(3))
    with attention_backend("sdpa_math"):
        reference = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
    try:
        with attention_backend(impl):
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    except NotImplementedError as err:
        if impl != "sdpa_cudnn":
            raise
        pytest.skip(str(err))
    assert out.dtype == torch.bfloat16 and out.shape == (1, 8, 512, 64)
    torch.testing.assert_close(out.float(), reference, atol=2e-2, rtol=2e-2)


def test_static_cache_and_cuda_graph_generation_give_dynamic_generations_greedy_tokens(tiny_llama, token_ids):
    """bench_inference's generation modes (mode_kwargs) on CUDA: a static cache, and the static cache with the
    forward compiled by torch.compile in transformers' CUDA default (reduce-overhead: CUDA graphs), decode the same
    greedy tokens as generate()'s dynamic cache. fp32, so no near-tie of bf16 logits can flip a token."""
    from efflab.models.modeling import load_model
    from efflab.stages.bench_inference.generation import mode_kwargs

    config = mode_kwargs("compiled", CUDA)["compile_config"]
    assert config.mode == "reduce-overhead" and not config._compile_all_devices, "transformers' CUDA default"
    model = load_model(tiny_llama, "float32", CUDA)
    ids = token_ids[:, :16]
    mask = torch.ones_like(ids)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    tokens = {}
    for mode in ("dynamic", "static", "compiled", "compiled"):  # compiled twice: the second replays the graphs
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, min_new_tokens=8,
                                 do_sample=False, num_beams=1, pad_token_id=0, **mode_kwargs(mode, CUDA))
        assert out.shape == (2, 16 + 8)
        tokens.setdefault(mode, []).append(out[:, 16:].tolist())
    assert tokens["static"][0] == tokens["dynamic"][0] == tokens["compiled"][0] == tokens["compiled"][1]
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1, "compiled generation compiled something"


def test_track_memory_sees_a_known_cuda_allocation_and_nvml_sees_the_process():
    """measure.memory.track_memory on CUDA: a 256 MiB tensor allocated inside the block is its delta (within
    1 MiB), of kind cuda_max_allocated; NVML, where pynvml is installed and can see this process, gives the
    process's memory and the CUDA context outside torch's allocator, both positive."""
    from efflab.measure.memory import cuda_context_mib, nvml_process_mib, track_memory

    torch.cuda.init()
    with track_memory(CUDA) as mem:
        block = torch.empty(256 * MiB, dtype=torch.uint8, device=CUDA)
    assert mem["kind"] == "cuda_max_allocated"
    assert abs(mem["delta_mib"] - 256) <= 1 and mem["peak_mib"] >= 256
    assert mem["cuda_max_reserved_mib"] >= mem["peak_mib"]
    del block
    if importlib.util.find_spec("pynvml") is None:
        pytest.skip("pynvml (nvidia-ml-py, the gpu extra) is not installed: the NVML figures are not checked")
    process, reason = nvml_process_mib(CUDA)
    if process is None:
        pytest.skip(f"NVML cannot attribute memory to this process here: {reason}")
    context = cuda_context_mib(CUDA)
    assert process > 0 and context["mib"] > 0 and context["nvml_process_mib"] > 0, context
    assert mem.get("nvml_process_mib") is None or mem["nvml_process_mib"] > 0


def test_time_fn_times_with_cuda_events_and_four_times_the_flops_take_longer():
    """measure.timing.time_fn on CUDA records CUDA events; a bf16 matmul of 4x the FLOPs (4096 x 4096 by 4096 x
    16384 against 4096 x 4096 by 4096 x 4096: both compute-bound on an H100) takes at least twice as long."""
    from efflab.measure.timing import time_fn

    a = torch.randn(4096, 4096, device=CUDA, dtype=torch.bfloat16)
    small_b = torch.randn(4096, 4096, device=CUDA, dtype=torch.bfloat16)
    big_b = torch.randn(4096, 16384, device=CUDA, dtype=torch.bfloat16)
    small = time_fn(lambda: a @ small_b, CUDA, warmup=3, repeats=10)
    big = time_fn(lambda: a @ big_b, CUDA, warmup=3, repeats=10)
    assert small["clock"] == big["clock"] == "cuda_events" and small["n"] == 10
    assert small["median"] > 0 and big["median"] > 2 * small["median"], (small["median"], big["median"])


def test_the_measured_bf16_matmul_ceiling_is_a_plausible_share_of_the_published_peak():
    """measure.flops: NVIDIA's published dense bf16 peak is known for this GPU (H100, H200 and the others in the
    table), and the measured bf16 matmul ceiling, the MFU denominator, lies between 10% and 110% of it."""
    from efflab.measure.flops import PUBLISHED_PEAK_TFLOPS, matmul_ceiling, published_peak_tflops

    name = torch.cuda.get_device_name(CUDA)
    peak = published_peak_tflops(CUDA, "bfloat16")
    if any(gpu in name for gpu in ("H100", "H200")):
        assert peak["tflops"] in (PUBLISHED_PEAK_TFLOPS["H100"]["bfloat16"], PUBLISHED_PEAK_TFLOPS["H100 PCIe"]["bfloat16"],
                                  PUBLISHED_PEAK_TFLOPS["H200"]["bfloat16"]), peak
    if peak["tflops"] is None:
        pytest.skip(f"no published bf16 peak for {name}: {peak['reason']}")
    ceiling = matmul_ceiling("bfloat16", CUDA)
    assert ceiling["size"] == 8192 and ceiling["dtype"] == "bfloat16"
    share = ceiling["tflops"] / peak["tflops"]
    assert 0.10 <= share <= 1.10, f"{name}: {ceiling['tflops']:.1f} of a published {peak['tflops']} TFLOP/s"


def test_a_lora_step_in_bf16_lowers_the_loss_over_ten_steps(tmp_path):
    """efflab.training.training_step (the step bench_finetune, capacity and qat run) on a peft LoRA of a tiny random
    Llama on CUDA, mixed precision auto (bf16 autocast on a GPU that has it): ten steps on one batch lower the loss,
    the adapters train and the base weights stay frozen."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    from efflab import training

    torch.manual_seed(0)
    model = get_peft_model(LlamaForCausalLM(_tiny_llama_config()).to(CUDA),
                           LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules="all-linear",
                                      task_type="CAUSAL_LM"))
    ids = torch.randint(0, 1024, (4, 64), generator=torch.Generator().manual_seed(2)).to(CUDA)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
    run = training.StepRun(steps=10, batch_size=4, learning_rate=1e-2, lr_scheduler="constant")
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad and "layers.0" in n}
    step, precision = training.training_step(run, model, "float32", CUDA, [[batch]], str(tmp_path))
    assert precision == ("bf16" if torch.cuda.is_bf16_supported() else "fp16")
    losses = [step(i).item() for i in range(10)]
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < 0.9 * losses[0], losses
    assert all(torch.equal(p, dict(model.named_parameters())[n]) for n, p in frozen.items())


def test_auto_picks_bf16_on_a_gpu_that_has_it():
    """'auto' on CUDA: the base model's dtype (measure.flops.resolve_dtype) and the training's mixed precision
    (models.build.mixed_precision) are bf16 where the GPU supports it (compute capability 8.0 on: A100, H100, H200)."""
    from efflab import training
    from efflab.measure.flops import resolve_dtype
    from efflab.models.build import mixed_precision

    supported = torch.cuda.is_bf16_supported()
    if torch.cuda.get_device_capability(CUDA)[0] >= 8:
        assert supported, "an Ampere-or-newer GPU has bf16"
    dtype, evidence = resolve_dtype("auto", CUDA)
    assert dtype == ("bfloat16" if supported else "float16") and evidence["requested"] == "auto"
    run = training.StepRun(steps=1, batch_size=1, learning_rate=1e-3)
    assert mixed_precision(run, "float32", CUDA) == ("bf16" if supported else "fp16")
    assert mixed_precision(replace(run, bf16_weights=True), "bfloat16", CUDA) == "no"
    assert mixed_precision(replace(run, mixed_precision="fp16"), "float32", CUDA) == "fp16", "an explicit choice stands"


def test_efflab_s_step_instruments_add_no_synchronisation_to_a_training_step(tiny_llama, tmp_path):
    """The HF Trainer on a LoRA of a tiny Llama over packed rows, six steps, as efflab runs it (its step timer and its
    sequence-length count on) and bare: under torch.cuda.set_sync_debug_mode("warn") (every op that makes the host
    wait for the GPU warns) and with torch.cuda.synchronize counted, efflab's run synchronises exactly as often as the
    bare Trainer's (its own per-step loss and token-count reads). The timer's events are read after training, once."""
    import warnings

    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, DataCollatorWithFlattening, Trainer, TrainingArguments

    from efflab.stages.finetune.callbacks import SequenceLengths, StepTimes

    lengths = torch.randint(20, 120, (48,), generator=torch.Generator().manual_seed(3)).tolist()
    rows = [{"input_ids": list(range(1, n + 1)), "labels": list(range(1, n + 1))} for n in lengths]

    def synchronisations(instrumented: bool, folder) -> tuple[int, StepTimes | None, SequenceLengths | None]:
        torch.manual_seed(0)
        model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.bfloat16).to(CUDA),
                               LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM"))
        timer = StepTimes(CUDA) if instrumented else None
        args = TrainingArguments(output_dir=str(folder), max_steps=6, per_device_train_batch_size=4,
                                 logging_steps=1, save_strategy="no", report_to=[], disable_tqdm=True,
                                 include_num_input_tokens_seen="non_padding")
        trainer = Trainer(model=model, args=args, train_dataset=rows, callbacks=[timer] if timer else [],
                          data_collator=DataCollatorWithFlattening(return_position_ids=True, separator_id=-100))
        seen = SequenceLengths(model) if instrumented else None
        calls, synchronize = [0], torch.cuda.synchronize

        def counted(*a, **kw):
            calls[0] += 1
            return synchronize(*a, **kw)
        torch.cuda.synchronize = counted
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                trainer.train()
        finally:
            torch.cuda.set_sync_debug_mode(0)
            torch.cuda.synchronize = synchronize
        return calls[0] + sum("synchroniz" in str(w.message) for w in caught), timer, seen

    bare, _, _ = synchronisations(False, tmp_path / "bare")
    mine, timer, seen = synchronisations(True, tmp_path / "efflab")
    assert mine == bare, f"efflab's instruments add {mine - bare} synchronisations to 6 steps ({bare} without them)"
    assert len(timer.durations) == 6 and all(d > 0 for d in timer.durations)
    assert seen.tokens > 0 and seen.squares >= seen.tokens
