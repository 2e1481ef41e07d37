"""The vLLM rows driven by a fake `vllm` package: bench_inference's engine cell and bench_serving's `vllm` method
run their real code (efflab.models.engines.Vllm, the interleaving, the figures) against a stand-in for the one thing this
machine lacks, vLLM itself, whose generations take known times on the simulated clock (measure.timing.clock).
Without vLLM, or off a CUDA GPU, the same rows are `unavailable` with the reason."""
from __future__ import annotations

import copy
import importlib.machinery
import sys
import types

import pytest
import torch

from efflab import experiment
from efflab.layout import Layout
from efflab.measure import timing
from efflab.measure.isolation import run_cell
from efflab.measure.stats import summarize
from efflab.models import engines
from efflab.models.modeling import load_model, load_tokenizer
from efflab.stages import bench_serving
from efflab.stages.bench_inference import cells, generation
from efflab.stages.bench_serving import rounds, servers
from tests.helpers import SimulatedClock, run_stage


def _token(prompt: list[int], k: int) -> int:
    """The fake's k-th generated token of a prompt: a function of the prompt, so answers tell prompts apart."""
    return (sum(prompt) + 7 * k) % 1000


def _output(request_id: str, prompt: list[int], tokens: list[int], finished: bool):
    """A vllm RequestOutput as efflab reads it: request_id, finished, outputs[0].token_ids and .text."""
    completion = types.SimpleNamespace(token_ids=list(tokens), text=" ".join(f"t{t}" for t in tokens))
    return types.SimpleNamespace(request_id=request_id, prompt_token_ids=list(prompt), outputs=[completion],
                                 finished=finished)


class FakeEngine:
    """vLLM's LLMEngine as Vllm.serve steps it: requests added by id, one token for every request in the engine per
    step (a prefill gives its first token in its own step, as vLLM's does), a step taking `step_s` on the
    simulated clock; the most requests it held at once is kept."""

    def __init__(self, clock: SimulatedClock, step_s: float):
        self.clock, self.step_s = clock, step_s
        self.running: dict[str, dict] = {}
        self.added: list[tuple[str, list[int], object]] = []
        self.most_at_once = 0

    def add_request(self, request_id, prompt, params):
        assert request_id not in self.running, "a request id is unique in the engine"
        self.added.append((request_id, prompt["prompt_token_ids"], params))
        self.running[request_id] = {"prompt": prompt["prompt_token_ids"], "params": params, "tokens": []}
        self.most_at_once = max(self.most_at_once, len(self.running))

    def has_unfinished_requests(self) -> bool:
        return bool(self.running)

    def step(self) -> list:
        self.clock.advance(self.step_s)
        outs = []
        for rid, r in list(self.running.items()):
            r["tokens"].append(_token(r["prompt"], len(r["tokens"])))
            done = len(r["tokens"]) == r["params"].max_tokens
            outs.append(_output(rid, r["prompt"], r["tokens"], done))
            if done:
                del self.running[rid]
        return outs


def fake_vllm(clock: SimulatedClock, generate_s: float = 0.25, step_s: float = 0.1) -> types.ModuleType:
    """A `vllm` module with what efflab.models.engines uses: __version__, SamplingParams and LLM (its generate(), and its
    llm_engine for serving). LLM.generate takes `generate_s` on the simulated clock per call and returns, per prompt,
    exactly max_tokens tokens; the calls are kept on the LLM for the test to read."""
    module = types.ModuleType("vllm")
    module.__spec__ = importlib.machinery.ModuleSpec("vllm", None)  # importlib.util.find_spec sees it installed
    module.__version__ = "0.0.0+fake"

    class SamplingParams:
        def __init__(self, temperature=1.0, max_tokens=16, min_tokens=0, ignore_eos=False):
            self.temperature, self.max_tokens, self.min_tokens, self.ignore_eos = (temperature, max_tokens,
                                                                                  min_tokens, ignore_eos)

    class LLM:
        instances: list = []

        def __init__(self, model, dtype="auto", seed=0, gpu_memory_utilization=0.9, trust_remote_code=False):
            self.kwargs = dict(model=model, dtype=dtype, seed=seed, gpu_memory_utilization=gpu_memory_utilization,
                               trust_remote_code=trust_remote_code)
            self.calls: list[dict] = []
            self.llm_engine = FakeEngine(clock, step_s)
            LLM.instances.append(self)

        def generate(self, prompts, sampling_params, use_tqdm=True):
            clock.advance(generate_s)
            outs = [_output(str(i), p["prompt_token_ids"],
                            [_token(p["prompt_token_ids"], k) for k in range(sampling_params.max_tokens)], True)
                    for i, p in enumerate(prompts)]
            self.calls.append({"prompts": [p["prompt_token_ids"] for p in prompts], "params": sampling_params,
                               "outputs": outs})
            return outs

    module.SamplingParams, module.LLM = SamplingParams, LLM
    return module


@pytest.fixture
def clock(monkeypatch) -> SimulatedClock:
    """The host clock of the timers (measure.timing.clock), simulated: each reading 1 ms after the last, plus what
    the fake engine's work advances it by. The speed probe's matmuls then read the same every time (1 ms), so no
    round is set aside, and a round's time is exactly its engine work plus the 1 ms of its own reading."""
    sim = SimulatedClock()
    monkeypatch.setattr(timing, "clock", lambda: (sim.advance(0.001), sim())[1])
    return sim


@pytest.fixture
def vllm(monkeypatch, clock) -> types.ModuleType:
    module = fake_vllm(clock)
    monkeypatch.setitem(sys.modules, "vllm", module)
    return module


def test_the_engine_cell_times_the_fakes_generations_interleaved_with_dynamic_generate(results, test_cfg, vllm):
    cfg = copy.deepcopy(test_cfg)
    b = cfg["bench_inference"]
    n, batch_size = b["max_new_tokens"], 1
    assert engines.unavailable("vllm", torch.device("cuda"), "base") is None, "installed: a GPU run would time it"
    cell = run_cell(cells.engine_cell, dict(
        cfg=cfg, results=str(results), variant=experiment.variant(cfg, "baseline"), dtype="float32", device="cpu",
        cell={"kv_cache": True, "batch_size": batch_size, "generation": "vllm"}, limits={}), isolation="inprocess")
    assert cell["status"] == "ok", cell.get("reason")
    (llm,) = vllm.LLM.instances
    assert llm.kwargs == {"model": str(Layout(results).base_model()), "dtype": "float32",
                          "seed": cfg["base_model"]["seed"], "gpu_memory_utilization": 0.3, "trust_remote_code": False}
    assert cell["engine"] == {"name": "vllm", "version": "0.0.0+fake"}
    # the very prompt tokens generate() reads, unpadded, one batch of `batch_size` per engine call
    tokenizer = load_tokenizer(Layout(results).base_model())
    asked = generation.prompts(b, Layout(results), tokenizer)
    expected = [tokenizer(a["text"], add_special_tokens=False)["input_ids"] for a in asked]
    batches = len(expected) // batch_size
    rounds = b["warmup"] + b["repeats"]  # no round set aside: the simulated probes never move
    assert len(llm.calls) == rounds * batches
    assert [p for call in llm.calls[:batches] for p in call["prompts"]] == expected
    for call in llm.calls:
        params = call["params"]
        assert (params.temperature, params.max_tokens, params.min_tokens, params.ignore_eos) == (0.0, n, n, True)
        assert len(call["prompts"]) == batch_size
        assert sum(len(o.outputs[0].token_ids) for o in call["outputs"]) == batch_size * n
    # every engine round: its `batches` calls of 0.25 s, plus the 1 ms of the timer's own reading; dynamic
    # generate() advances the simulated clock by nothing, so its rounds read 1 ms
    engine_round = batches * 0.25 + 0.001
    rate = cell["generation_tokens_per_s"]
    assert rate["unit"] == "tokens/s" and rate["n"] == b["repeats"]
    assert rate["samples"] == pytest.approx([len(expected) * n / engine_round] * b["repeats"])
    versus = cell["vs_dynamic"]
    assert versus["against"] == "dynamic" and versus["stable_rounds"] == b["repeats"] and versus["set_aside"] == 0
    assert all(r["seconds"]["vllm"] == pytest.approx(engine_round) for r in versus["rounds"])
    assert versus["dynamic_generation_s"]["median"] == pytest.approx(0.001)
    speedup = versus["generation_speedup"]
    assert speedup["median"] == pytest.approx(0.001 / engine_round) and speedup["rounds"] == b["repeats"]
    assert speedup["ci95"] is None and speedup["verdict"].startswith(f"not decided at this size: {b['repeats']} rounds")
    assert cell["generations"] == b["repeats"] * batches and cell["memory_footprint_bytes"] > 0
    last = llm.calls[-batches:]  # the samples are the last round's answers, the fake's texts
    assert [s["answer"] for s in cell["samples"]] == [o.outputs[0].text for call in last for o in call["outputs"]]
    assert [s["prompt"] for s in cell["samples"]] == [a["question"] for a in asked]


def test_an_engine_that_stops_short_of_the_forced_length_fails_the_cell(results, test_cfg, vllm, monkeypatch):
    short = vllm.LLM.generate

    def one_token_short(self, prompts, params, use_tqdm=True):
        outs = short(self, prompts, params, use_tqdm)
        for o in outs:
            o.outputs[0].token_ids = o.outputs[0].token_ids[:-1]
        return outs
    monkeypatch.setattr(vllm.LLM, "generate", one_token_short)
    cell = run_cell(cells.engine_cell, dict(
        cfg=copy.deepcopy(test_cfg), results=str(results), variant=experiment.variant(test_cfg, "baseline"),
        dtype="float32", device="cpu",
        cell={"kv_cache": True, "batch_size": 2, "generation": "vllm"}, limits={}), isolation="inprocess")
    assert cell["status"] == "failed" and "generation length differs from max_new_tokens" in cell["reason"]


def test_without_vllm_or_off_a_gpu_the_engine_row_is_unavailable_with_the_reason(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # what find_spec reads as not installed, wherever vLLM is
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert engines.unavailable("vllm", cuda, "base").startswith("vllm is not installed (pip install vllm")
    monkeypatch.setitem(sys.modules, "vllm", fake_vllm(SimulatedClock()))
    assert engines.unavailable("vllm", cpu, "base") == "vllm is run here on a CUDA GPU only (this job's device is cpu)"
    assert "a adapter variant is not passed to vllm" in engines.unavailable("vllm", cuda, "adapter")
    assert engines.unavailable("vllm", cuda, "merged") is None and engines.unavailable("dynamic", cpu, "base") is None


@pytest.mark.parametrize("installed", [False, True])
def test_the_stages_record_the_vllm_rows_unavailable_without_vllm_or_a_gpu(results, write_params, monkeypatch,
                                                                             installed):
    """The stages' own runs on this CPU: without vLLM its rows say it is not installed; with it (the fake), that it
    runs on a CUDA GPU only. Nothing of the fake is called either way. (The real clock: the stages measure the
    machine's matmul ceiling, which a process keeps once measured.)"""
    module = fake_vllm(SimulatedClock()) if installed else None
    monkeypatch.setitem(sys.modules, "vllm", module)

    def edit(cfg):
        cfg["bench_inference"]["variants"]["baseline"] |= {"kv_cache": [True], "batch_sizes": [1],
                                                           "generation": ["dynamic", "vllm"]}
        cfg["bench_serving"] |= {"methods": ["naive", "vllm"], "concurrency": [3], "bursts": 2}
    params = write_params(edit)
    inference = run_stage("bench_inference", params, results, "baseline")
    serving = run_stage("bench_serving", params, results)
    why = "CUDA GPU only (this job's device is cpu)" if installed else "vllm is not installed"
    (row,) = [c for c in inference["cells"] if c["generation"] == "vllm"]
    assert row["status"] == "unavailable" and why in row["reason"]
    (cell,) = [c for c in serving["cells"] if c["method"] == "vllm"]
    assert cell == {"method": "vllm", "concurrency": 3, "status": "unavailable", "reason": row["reason"]}
    assert not installed or module.LLM.instances == []


# Four requests of 2, 3, 1 and 2 new tokens, a step of 0.1 s: when each one's first token and end come, worked out
# by hand from the slots (a finished request's slot goes to the next waiting one before the next step).
NEW_TOKENS = [2, 3, 1, 2]
BY_HAND = {  # concurrency: [(first token, finished)] per request, seconds since the burst arrived
    1: [(0.1, 0.2), (0.3, 0.5), (0.6, 0.6), (0.7, 0.8)],  # one after the other
    2: [(0.1, 0.2), (0.1, 0.3), (0.3, 0.3), (0.4, 0.5)],  # r2 takes r0's slot at 0.2, r3 r1's and r2's at 0.3
    4: [(0.1, 0.2), (0.1, 0.3), (0.1, 0.1), (0.1, 0.2)],  # all at once
}


def _times(rows: list[dict]) -> list[float]:
    return [t for r in rows for t in (r["first_token_s"], r["finished_s"])]


@pytest.mark.parametrize("concurrency", sorted(BY_HAND))
def test_vllm_serving_admits_at_most_concurrency_requests_and_stamps_each_step(monkeypatch, concurrency):
    sim = SimulatedClock()
    monkeypatch.setattr(timing, "clock", sim)
    monkeypatch.setitem(sys.modules, "vllm", fake_vllm(sim, step_s=0.1))
    engine = engines.load("vllm", "/models/base", "bfloat16", 0)
    reqs = [{"request": i, "prompt": [10 + i, 20, 30][: 1 + i % 3], "new_tokens": k} for i, k in enumerate(NEW_TOKENS)]
    rows = servers.SERVERS["vllm"](engine, None, reqs, concurrency, torch.device("cuda"))
    assert _times(rows) == pytest.approx([t for pair in BY_HAND[concurrency] for t in pair])
    assert [r["output_tokens"] for r in rows] == NEW_TOKENS and [r["request"] for r in rows] == [0, 1, 2, 3]
    assert all(r["submitted_s"] == 0.0 for r in rows) and [r["prompt_tokens"] for r in rows] == [1, 2, 3, 1]
    fake = engine.llm.llm_engine
    assert fake.most_at_once == concurrency and not fake.running
    assert [(p, params.max_tokens, params.min_tokens, params.ignore_eos, params.temperature)
            for _, p, params in fake.added] == [(r["prompt"], r["new_tokens"], r["new_tokens"], True, 0.0) for r in reqs]
    burst = rounds.figures(rows)
    makespan = max(f for _, f in BY_HAND[concurrency])
    assert burst["makespan_s"] == pytest.approx(makespan) and burst["output_tokens"] == sum(NEW_TOKENS)
    assert burst["output_tokens_per_s"] == pytest.approx(sum(NEW_TOKENS) / makespan)
    again = servers.SERVERS["vllm"](engine, None, reqs, concurrency, torch.device("cuda"))
    assert _times(again) == pytest.approx([t for pair in BY_HAND[concurrency] for t in pair]), \
        "a second burst on the same engine: new request ids, times from its own start"


def test_an_engine_that_drops_requests_fails_instead_of_waiting_forever(monkeypatch):
    sim = SimulatedClock()
    monkeypatch.setattr(timing, "clock", sim)
    monkeypatch.setitem(sys.modules, "vllm", fake_vllm(sim))
    engine = engines.load("vllm", "/models/base", "bfloat16", 0)
    monkeypatch.setattr(engine.llm.llm_engine, "step", lambda: engine.llm.llm_engine.running.clear() or [])
    with pytest.raises(RuntimeError, match="vLLM holds no request but 2 never finished"):
        engine.serve([[1], [2]], [3, 3], 2)


def test_the_vllm_method_is_served_in_the_interleaved_bursts_beside_naive(results, test_cfg, monkeypatch):
    """bench_serving's rounds with the vllm method wired in as the stage wires it (server, measure): the engine
    loaded once, at its first cell's warm-up, each burst's per-request rows from its steps (0.1 s each on the
    simulated clock), the figures recomputed from them, and the paired ratio over naive in the same rounds."""
    sim = SimulatedClock()
    monkeypatch.setattr(timing, "clock", sim)
    monkeypatch.setattr(timing, "speed_probe", lambda device: 100.0)  # a quiet machine: no burst is set aside
    vllm = fake_vllm(sim, step_s=0.1)
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    cfg = copy.deepcopy(test_cfg)
    s = cfg["bench_serving"] | {"bursts": 6}
    layout = Layout(results)
    reqs = bench_serving.requests(cfg, layout)
    model = load_model(layout.base_model(), "float32", torch.device("cpu"))
    tokenizer = load_tokenizer(layout.base_model())
    loads = []

    def load_engine(method):
        loads.append(method)
        return engines.load(method, layout.base_model(), "float32", s["seed"])
    cells = [{"method": "naive", "concurrency": 1}] + [{"method": "vllm", "concurrency": c} for c in (2, len(reqs))]
    serve = servers.server(model, tokenizer, reqs, torch.device("cpu"), load_engine)
    rows, sentinel = rounds.measure(cells, serve, s["bursts"])
    assert loads == ["vllm"] and len(vllm.LLM.instances) == 1
    names = ["naive@1", "vllm@2", f"vllm@{len(reqs)}"]
    assert [r["order"] for r in sentinel["rounds"]] == [timing.balanced_order(names, b) for b in range(s["bursts"])]
    assert sentinel["set_aside"] == 0 and sentinel["figures_of_bursts"] == list(range(s["bursts"]))
    fake = vllm.LLM.instances[0].llm_engine
    assert len(fake.added) == 2 * 2 + 2 * s["bursts"] * len(reqs), "the warm-up's two requests per cell, then bursts"
    new_tokens = [r["new_tokens"] for r in reqs]
    for c in cells[1:]:
        assert c["status"] == "ok" and c["bursts"] == s["bursts"] and c["requests"] == len(reqs)
        mine = [r for r in rows if r["method"] == "vllm" and r["concurrency"] == c["concurrency"]]
        for burst in range(s["bursts"]):
            served = sorted((r for r in mine if r["burst"] == burst), key=lambda r: r["request"])
            assert [r["output_tokens"] for r in served] == new_tokens
            assert all(0 < r["first_token_s"] <= r["finished_s"] for r in served)
            assert min(r["first_token_s"] for r in served) == pytest.approx(0.1), "the first step's tokens"
        if c["concurrency"] == len(reqs):  # every request in the engine from the start: one step per token
            assert [r["finished_s"] for r in mine if r["burst"] == 0] == pytest.approx([0.1 * k for k in new_tokens])
            assert c["makespan_s"]["median"] == pytest.approx(0.1 * max(new_tokens))
        again = [rounds.figures([r for r in mine if r["burst"] == b]) for b in range(s["bursts"])]
        stats = summarize([f["output_tokens_per_s"] for f in again])
        assert c["output_tokens_per_s"]["median"] == pytest.approx(stats["median"])
        assert c["output_tokens_per_s"]["ci95_median"] == pytest.approx(stats["ci95_median"])
        assert c["latency_s"] == pytest.approx(rounds.percentiles(mine)["latency_s"])
        assert c["ttft_s"] == pytest.approx(rounds.percentiles(mine)["ttft_s"])
        ratio = c["throughput_vs_naive"]
        naive = cells[0]["by_burst"]
        assert ratio["ratios"] == pytest.approx([a["output_tokens_per_s"] / b["output_tokens_per_s"]
                                                 for a, b in zip(c["by_burst"], naive)])
        assert ratio["rounds"] == s["bursts"] and ratio["ci95"] is not None
    wider = cells[2]["output_tokens_per_s"]["median"] / cells[1]["output_tokens_per_s"]["median"]
    assert wider > 1, "more requests in the engine at once: fewer steps for the same tokens"
    assert "continuous_vs_static" not in cells[1] and "throughput_vs_naive" not in cells[0]
