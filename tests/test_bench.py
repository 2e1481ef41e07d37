import json
import os
import re
import subprocess
import sys

import pandas as pd
import pytest

from efflab import config, experiment
from efflab.measure.memory import allocated_delta
from efflab.stages.report.options import attention_memory_error
from tests.helpers import TEST_PARAMS, run_stage


def test_attention_cells_run_isolated_agree_with_eager_and_flash_is_unavailable_on_cpu(results, write_params):
    def edit(cfg):
        cfg["runtime"]["isolation"] = "subprocess"
        cfg["bench_attention"] |= {"implementations": ["sdpa", "flash_attention_2"], "seq_lens": [32, 128],
                                   "batch_sizes": [1]}
    params = write_params(edit)
    cfg = config.load(params)
    sdpa = run_stage("bench_attention", params, results, "sdpa")
    flash = run_stage("bench_attention", params, results, "flash_attention_2")
    b = cfg["bench_attention"]
    assert [(r["mode"], r["seq_len"]) for r in sdpa["rows"]] == [(m, s) for m in b["modes"] for s in b["seq_lens"]]
    for row in sdpa["rows"]:
        assert row["status"] == "ok" and row["isolation"] == "subprocess"
        assert row["max_abs_diff_vs_eager"] < 1e-4
        assert row["latency"]["n"] >= b["repeats"], "rounds the speed probe set aside are measured again"
        speedup = row["vs_eager"]["speedup"]
        assert speedup["verdict"].startswith(("faster", "slower", "same within", "not a verdict", "not decided"))
        assert row["vs_eager"]["eager_latency"]["median"] > 0 and row["vs_eager"]["probe"]["median"] > 0
        assert row["latency"]["p99"] >= row["latency"]["p90"] >= row["latency"]["median"] > 0
        assert row["memory"]["kind"] == "cpu_peak_rss" and allocated_delta(row["memory"])[0] > 0
    fwd = {r["seq_len"]: r for r in sdpa["rows"] if r["mode"] == "forward"}
    bwd = {r["seq_len"]: r for r in sdpa["rows"] if r["mode"] == "forward_backward"}
    assert allocated_delta(bwd[128]["memory"])[0] > allocated_delta(fwd[128]["memory"])[0], "training keeps activations"
    assert bwd[128]["compared"] == "gradient of the input embeddings"
    assert {(f["mode"], f["batch_size"]) for f in sdpa["memory_exponents"]} == {(m, 1) for m in b["modes"]}
    assert all(f["exponent"] is not None and f["exponent"] > 0 and f["memory_kind"] == "cpu_tensor_peak"
               for f in sdpa["memory_exponents"]), "fitted on the live tensors, which RSS's reuse cannot hide"
    assert flash["status"] == "unavailable" and "CUDA" in flash["reason"]
    assert all(r["status"] == "unavailable" and "CUDA" in r["reason"] for r in flash["rows"])
    error = attention_memory_error([sdpa])  # each cell's step read twice: the error a peak of it carries
    assert error["kind"] == "cpu_tensor_peak" and error["pairs"] == len(sdpa["rows"])
    assert error["pct"] < 5, "the same step's live tensors, counted twice, are nearly the same bytes"


def test_eager_attention_memory_grows_faster_than_linear_in_sequence_length(results, write_params):
    def edit(cfg):
        cfg["runtime"]["isolation"] = "subprocess"
        cfg["bench_attention"] |= {"seq_lens": [256, 1024], "batch_sizes": [1], "modes": ["forward"]}
    params = write_params(edit)
    eager = run_stage("bench_attention", params, results, "eager")
    (fit,) = eager["memory_exponents"]
    assert fit["memory_kind"] == "cpu_tensor_peak"
    assert fit["exponent"] > 1.5, "eager materialises the seq x seq attention matrix"


def test_inference_separates_prefill_from_decode_per_kv_cache_batch_and_generation_cell(results, write_params):
    def with_static(cfg):
        cfg["bench_inference"]["variants"]["baseline"]["generation"] = ["dynamic", "static", "vllm"]
    params = write_params(with_static)
    b = config.load(params)["bench_inference"]
    m = run_stage("bench_inference", params, results, "baseline")
    variant = b["variants"]["baseline"]
    assert [(c["kv_cache"], c["batch_size"], c["generation"]) for c in m["cells"]] == [
        (kv, bs, mode) for kv in variant["kv_cache"] for bs in variant["batch_sizes"]
        for mode in variant["generation"] if kv or mode == "dynamic"], "static cache and engines: KV cache on only"
    n = b["max_new_tokens"]
    engine = [c for c in m["cells"] if c["generation"] == "vllm"]
    assert engine and all(c["status"] == "unavailable" and "vllm is not installed" in c["reason"] for c in engine)
    for c in m["cells"]:
        if c["generation"] == "vllm":
            continue
        assert c["status"] == "ok"
        versus = c.get("vs_dynamic")  # an interleaved cell's figures are of its stable rounds (all, if unstable)
        rounds = b["repeats"] if not versus else (
            len(versus["rounds"]) if "unstable" in versus else versus["stable_rounds"])
        generations = rounds * -(-m["prompts"] // c["batch_size"])
        assert c["generations"] == c["ttft"]["n"] == c["decode_tokens_per_s"]["n"] == generations
        assert c["per_token_latency"]["n"] == generations * (n - 1)
        assert c["ttft"]["median"] > 0 and c["decode_tokens_per_s"]["median"] > 0
        assert c["memory"]["kind"] == "cpu_peak_rss"
        assert c["energy"].get("joules_per_token", 0) > 0 or c["energy"]["unavailable"], "measured, or why not"
        roof = c["roofline"]  # every weight read once a step for the whole batch, plus the KV cache with one
        # (the tiny model's head is its input embedding: read whole every step, so the whole footprint is read)
        assert roof["weights_bytes"] == c["memory_footprint_bytes"] and roof["mean_context"] > 0
        assert roof["bytes_per_token"] == roof["weights_bytes"] / c["batch_size"] + roof["kv_cache_bytes_per_token"]
        assert (roof["kv_cache_bytes_per_token"] > 0) == c["kv_cache"]
        assert roof["bandwidth_fraction"] == pytest.approx(
            c["decode_tokens_per_s"]["median"] * roof["bytes_per_token"] / (m["limits"]["bandwidth"]["gb_per_s"] * 1e9))
        assert roof["bound"] in ("framework-bound", "memory-bound", "compute-bound")
    cell = {(c["kv_cache"], c["batch_size"]): c for c in m["cells"] if c["generation"] == "dynamic"}
    assert cell[(True, 1)]["samples"][0]["answer"] == cell[(False, 1)]["samples"][0]["answer"], \
        "greedy decoding gives the same tokens with and without the KV cache"
    for static in (c for c in m["cells"] if c["generation"] == "static"):  # interleaved with the dynamic cache
        dynamic = cell[(True, static["batch_size"])]
        assert static["samples"] == dynamic["samples"] and static["vs_base"] is None
        versus = static["vs_dynamic"]
        assert versus["against"] == "dynamic" and len(versus["rounds"]) >= b["repeats"]
        assert all(set(r["seconds"]) == {"baseline", "dynamic"} for r in versus["rounds"])
        assert versus["generation_speedup"]["rounds"] == versus["stable_rounds"]
    # by default the models are asked the user's own validation questions, the reference answer kept beside
    validation = pd.read_parquet(results / "prepare_data" / "validation.parquet")
    assert m["prompts_from"] == "validation rows" and m["prompts"] == b["prompts"]["validation_rows"]
    for sample in cell[(True, 1)]["samples"]:
        row = validation[validation.question == sample["prompt"]]
        assert len(row) == 1 and row.answer.iloc[0] == sample["reference"] != ""


@pytest.mark.integration  # torch.compile's first call: ~20 s of a 2-core CI machine (make test-integration)
def test_static_and_compiled_generation_give_dynamic_generations_greedy_tokens(results):
    """The three transformers modes decode the same greedy tokens (left-padded batch of two prompts of unequal
    length); compiled is torch.compile'd for real (its first call traces and generates code: ~20 s here). Static
    against dynamic on the CI pipeline's prompts is in make test too (the inference cells' test above)."""
    import torch

    from efflab.models.modeling import load_model, load_tokenizer
    from efflab.stages.bench_inference.generation import generate_timed, mode_kwargs, prompt_batches

    tokenizer = load_tokenizer(results / "base_model" / "model")
    model = load_model(results / "base_model" / "model", "float32", torch.device("cpu"))
    (batch,) = prompt_batches(tokenizer, ["Is a permit needed for a fence?", "What is a building permit?"], 2,
                              torch.device("cpu"))
    assert batch["attention_mask"][1].sum() < batch["attention_mask"][0].sum(), "one prompt is padded"
    texts = {mode: generate_timed(model, tokenizer, batch, 6, True, mode)["texts"]
             for mode in ("dynamic", "static", "compiled")}
    assert texts["static"] == texts["dynamic"] == texts["compiled"]
    assert mode_kwargs("compiled", torch.device("cpu"))["compile_config"]._compile_all_devices, \
        "transformers compiles off CUDA only when told to: without it, 'compiled' would silently run eagerly"


def test_a_mode_a_quantizer_cannot_compile_is_unavailable_and_an_engine_without_its_package_too():
    import types

    import torch

    from efflab.models import engines
    from efflab.stages.bench_inference.generation import mode_unavailable

    bnb = types.SimpleNamespace(hf_quantizer=type("Bnb8BitHfQuantizer", (), {"is_compileable": False})())
    assert "Bnb8BitHfQuantizer" in mode_unavailable("compiled", bnb) and mode_unavailable("static", bnb) is None
    assert mode_unavailable("compiled", types.SimpleNamespace()) is None
    assert engines.unavailable("dynamic", torch.device("cpu"), "base") is None
    reason = engines.unavailable("vllm", torch.device("cpu"), "base")
    assert reason.startswith("vllm is not installed") or "CUDA GPU only" in reason


def test_explicit_prompts_are_chat_templated_and_the_default_draw_is_seeded(results, test_cfg):
    from efflab.layout import Layout
    from efflab.models.modeling import load_tokenizer
    from efflab.stages.bench_inference.generation import prompts

    tokenizer = load_tokenizer(results / "base_model" / "model")
    (asked,) = prompts({"prompts": ["Is a permit needed for a fence?"]}, None, tokenizer)
    assert asked["reference"] is None and asked["text"].index("Is a permit needed for a fence?") > 0
    b = test_cfg["bench_inference"]
    drawn = [p["question"] for p in prompts(b, Layout(results), tokenizer)]
    assert drawn == [p["question"] for p in prompts(b, Layout(results), tokenizer)]
    assert len(drawn) == b["prompts"]["validation_rows"]


def test_flex_attention_runs_forward_and_says_why_not_backward_on_cpu(results, write_params):
    def edit(cfg):
        cfg["bench_attention"] |= {"implementations": ["eager", "flex_attention"], "seq_lens": [32],
                                   "batch_sizes": [1], "warmup": 1, "repeats": 1}
    params = write_params(edit)
    flex = run_stage("bench_attention", params, results, "flex_attention")
    rows = {r["mode"]: r for r in flex["rows"]}
    assert rows["forward"]["status"] == "ok" and rows["forward"]["max_abs_diff_vs_eager"] < 1e-4
    assert rows["forward_backward"]["status"] == "unavailable"
    assert "backward on CPU" in rows["forward_backward"]["reason"]


@pytest.mark.integration  # make test's 10 minutes on a 2-core AVX2 CPU: run by make test-integration
def test_int8_cells_show_each_warning_at_most_once_and_no_profiler_lines(results, write_params, capfd):
    """bitsandbytes logs 'MatMul8bitLt: inputs will be cast ...' on every INT8 matmul and Kineto a 'USDT: ...
    profiler_start/stop' line at every start and stop of the memory profiler: neither may flood the console, in
    the stage's own process (quantize) nor in a cell forked from the forkserver (bench_inference, subprocess
    isolation: the stage's logging and warnings setup does not reach it), which the stage's CLI shows here."""
    params = write_params(lambda cfg: cfg["runtime"].update(isolation="subprocess"))
    run_stage("quantize", params, results, "baseline")
    run_stage("quantize", params, results, "int8")
    in_stage = capfd.readouterr().err
    env = {k: v for k, v in os.environ.items() if k != "KINETO_LOG_LEVEL"}  # efflab's default, not the caller's
    proc = subprocess.run([sys.executable, "-m", "efflab.stages.bench_inference", "--params", str(params), "--results",
                           str(results), "--name", "int8"], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (cell,) = json.loads((results / "bench_inference" / "int8" / "metrics.json").read_text())["cells"]
    assert cell["status"] == "ok" and cell["isolation"] == "subprocess" and cell["memory"]["tensors"]["delta_mib"] > 0
    vs_base = cell["vs_base"]  # timed interleaved with the base model on the same prompts
    speedup = vs_base["generation_speedup"]
    assert vs_base["base_generation_s"]["median"] > 0 and vs_base["probe"]["n"] >= 2
    if speedup.get("ci95"):
        assert speedup["ci95"][0] <= speedup["median"] <= speedup["ci95"][1]
    # the rounds are the stable ones the speed sentinel kept: on a busy machine too few, and then no verdict, saying why
    assert speedup["rounds"] == vs_base["stable_rounds"]
    if "unstable" in vs_base:
        assert speedup["verdict"].startswith("not a verdict: ") and speedup["median"] is None
    else:
        assert speedup["rounds"] >= 2 and (speedup["verdict"].startswith(("faster", "slower", "same within")) or
                                           re.match(rf"not decided at this size: {speedup['rounds']} rounds cannot give",
                                                    speedup["verdict"]))
    for err in (in_stage, proc.stderr):
        assert "USDT" not in err and "profiler_start" not in err
        assert err.count("MatMul8bitLt") <= 1
        warned = [re.sub(r"^[\d-]+ [\d:,]+ ", "", line) for line in err.splitlines()
                  if re.search(r"\bWARNING\b|\w+Warning: ", line)]  # logged, and Python's warnings
        assert len(warned) == len(set(warned)), f"a warning shown more than once:\n{err[-3000:]}"


def test_a_stage_killed_mid_grid_keeps_its_finished_cells_and_its_rerun_measures_only_the_rest(
        results, monkeypatch):
    """Each cell's result is journalled as it ends: a job killed in its third cell (a cluster's time limit)
    leaves no outputs but two journalled cells, and its rerun measures the other cells only."""
    import pytest

    from efflab.stages import bench_attention

    measured = []
    real_cell = bench_attention.attention_cell

    def cell(**kwargs):
        measured.append((kwargs["cell"]["mode"], kwargs["cell"]["seq_len"]))
        if kill_at and len(measured) == kill_at:
            raise KeyboardInterrupt("killed")
        return real_cell(**kwargs)
    monkeypatch.setattr(bench_attention, "attention_cell", cell)
    kill_at = 3
    with pytest.raises(KeyboardInterrupt):
        run_stage("bench_attention", TEST_PARAMS, results, "eager")
    assert not (results / "bench_attention" / "eager").exists(), "no partial outputs"
    journal = results / "bench_attention" / ".eager.cells.jsonl"
    assert len(journal.read_text().splitlines()) == 1 + 2, "the settings line and the two finished cells"
    first = measured[:2]
    measured.clear()
    kill_at = None
    m = run_stage("bench_attention", TEST_PARAMS, results, "eager")
    grid = [(r["mode"], r["seq_len"]) for r in m["rows"]]
    assert measured == [g for g in grid if g not in first] and len(grid) == 4
    assert all(r["status"] == "ok" for r in m["rows"]) and not journal.exists()


def test_a_per_token_tail_above_one_and_a_half_medians_is_named():
    from efflab.stages.bench_inference.cells import explain_tail

    steady = [{"token_gaps_s": [0.010, 0.011, 0.010, 0.010]} for _ in range(5)]
    assert explain_tail(steady, kv_cache=True) is None
    first_slow = [{"token_gaps_s": [0.040, 0.010, 0.011, 0.010]} for _ in range(5)]
    assert explain_tail(first_slow, kv_cache=True).startswith("the first decode step")
    growing = [{"token_gaps_s": [0.010, 0.015, 0.020, 0.030]} for _ in range(5)]
    assert explain_tail(growing, kv_cache=False).startswith("no KV cache")
    stray = [{"token_gaps_s": [0.010, 0.010, 0.050 if i == 2 else 0.010, 0.010]} for i in range(5)]
    assert explain_tail(stray, kv_cache=True).startswith("isolated slow tokens (1 of 20")


def test_a_forced_sdpa_backend_is_measured_beside_the_others_or_says_torch_has_no_kernel(results, write_params):
    """sdpa_<backend> forces one PyTorch SDPA kernel (its FlashAttention-2 where the flash-attn package
    cannot be installed). Which kernels exist depends on the device and the torch build: a missing one is
    `unavailable` with torch's reason, never a failure."""
    def edit(cfg):
        cfg["bench_attention"] |= {"implementations": ["sdpa_math", "sdpa_efficient"], "modes": ["forward"],
                                   "seq_lens": [32]}
    params = write_params(edit)
    math_ = run_stage("bench_attention", params, results, "sdpa_math")
    assert math_["status"] == "ok" and math_["rows"][0]["max_abs_diff_vs_eager"] < 1e-5
    efficient = run_stage("bench_attention", params, results, "sdpa_efficient")
    for row in efficient["rows"]:
        assert row["status"] == "ok" or (row["status"] == "unavailable" and "EFFICIENT_ATTENTION" in row["reason"])
        assert row["status"] == "ok" or "CPU SDPA has the flash and math kernels only" in row["reason"]


def test_a_missing_sdpa_kernel_s_reason_is_torch_s_own_words_once_without_their_source_lines():
    """On an H200 (torch 2.11) a grouped-query model's forced memory-efficient kernel failed with these warnings
    (the GPU lane's log): the record says why in torch's words, not 'see the log'."""
    import warnings

    import torch

    from efflab.stages.bench_attention import kernel_reasons

    seen = ["Memory efficient kernel not used because: (Triggered internally at /pytorch/aten/src/ATen/native/"
            "transformers/cuda/sdp_utils.cpp:986.)",
            "For dense input, both fused kernels require query, key and value to have the same num_heads. "
            "Query.sizes(): [1, 32, 512, 64], Key sizes(): [1, 8, 512, 64], Value sizes(): [1, 8, 512, 64] "
            "instead. To broadcast dense inputs, try using unsqueeze and expand_to before passing them into the kernel",
            "cuDNN attention has been runtime disabled. (Triggered internally at /pytorch/aten/src/ATen/native/"
            "transformers/cuda/sdp_utils.cpp:706.)"]
    caught = [warnings.WarningMessage(UserWarning(text), UserWarning, "sdpa_attention.py", 158) for text in seen * 2]
    reason = kernel_reasons(caught, torch.device("cuda"))
    assert reason.startswith("For dense input, both fused kernels require query, key and value to have the same "
                             "num_heads. Query.sizes(): [1, 32, 512, 64]")
    assert reason.count("same num_heads") == 1 and "Triggered internally" not in reason
    assert "not used because" not in reason and "To broadcast" not in reason
    assert kernel_reasons([], torch.device("cuda")) == "torch gave no reason"


def test_a_generation_mode_the_model_cannot_run_is_unavailable_with_the_reason(results, test_cfg, monkeypatch):
    """A family whose cache or forward a mode cannot take (here: generate() refusing a static cache, as transformers
    does for models without StaticCache support) is an unavailable cell naming the error, not a failed one."""
    from efflab.stages.bench_inference import cells

    real = cells.generate_timed

    def refusing(model, tokenizer, batch, n, kv_cache=True, mode="dynamic", extra=None):
        if mode == "static":
            raise ValueError("This model does not support `cache_implementation='static'`")
        return real(model, tokenizer, batch, n, kv_cache, mode, extra)
    monkeypatch.setattr(cells, "generate_timed", refusing)
    cell = cells.inference_cell(test_cfg, str(results), experiment.variant(test_cfg, "baseline"), "float32", "cpu", {
        "kv_cache": True, "batch_size": 1, "generation": "static"}, {"bandwidth": {}, "matmul": {}})
    assert cell["status"] == "unavailable" and "static generation is not supported" in cell["reason"]
    assert "does not support `cache_implementation='static'`" in cell["reason"]
