import copy

import pandas as pd
import pytest
import torch
import yaml

from efflab.config import UserError
from efflab.measure.memory import run_steps
from efflab.measure.stats import summarize
from efflab.stages import capacity
from efflab.stages.capacity import cells as capacity_cells
from efflab.stages.capacity import record
from efflab.stages.capacity.search import boundary_search, search
from efflab.stages.capacity.subjects import grid
from tests.helpers import run_stage


@pytest.mark.parametrize("boundary", [-1, 0, 3, 9, 19])
@pytest.mark.parametrize("guess", [0, 2, 9, 10, 19])
def test_the_search_finds_the_boundary_from_any_guess_asking_each_size_once(boundary, guess):
    asked = []

    def passes(i):
        asked.append(i)
        return i <= boundary
    found = search(20, passes, guess)
    assert found == boundary
    assert len(asked) == len(set(asked)), "no size is run twice"
    assert found + 1 in asked or found == 19, "the size above the maximum ran (and failed)"
    assert found in asked or found == -1
    assert len(asked) <= 2 + 2 * 5, "doubling steps and bisection, not a scan"


def test_a_close_prediction_is_confirmed_by_two_cells():
    asked = []
    assert search(64, lambda i: asked.append(i) or i <= 11, 11) == 11
    assert asked == [11, 12]


def injected(n: int, boundary: int, predicted_max: int, creeps_at: int | None = None):
    """A search's measure(i, role, timed) on injected results: sizes up to `boundary` pass; the estimator predicts
    `predicted_max` (the first cell's growth crosses a budget of 100 MiB above it); a size `creeps_at` passes
    without timed steps and fails with them (resident memory growing with each step). No cell runs."""
    asked = []

    def measure(i, role, timed):
        asked.append((i, role, timed))
        fits = i <= boundary and not (i == creeps_at and timed)
        result = {"status": "ok" if fits else "oom", "loaded_mib": 50.0, "tokens": 10,
                  "step_s": summarize([0.5] * timed) if timed and fits else None}
        if i == 0 and role == "search":
            result["predicted_growth_mib"] = [40.0 if j <= predicted_max else 60.0 for j in range(n)]
        return result
    return measure, asked


@pytest.mark.parametrize("boundary, predicted_max", [(5, 5), (5, 9), (5, 2), (19, 19), (0, 3)])
def test_only_a_cell_that_is_the_maximum_if_it_passes_runs_timed_steps(boundary, predicted_max):
    measure, asked = injected(20, boundary, predicted_max)
    found = boundary_search(20, measure, 100.0, timed=3)
    assert found["best"] == boundary and found["guess"] == predicted_max and found["failure"] is None
    ran = {(i, role): timed for i, role, timed in asked}
    held = found["timings"].get(boundary, found["seen"][boundary])
    assert held["step_s"]["n"] == 3, "the maximum's tokens/s has the timed repeats"
    for (i, role), timed in ran.items():
        if role == "search" and timed:
            assert i in (19, predicted_max) or found["seen"][i + 1]["status"] == "oom", "no timed step elsewhere"
    rerun = [i for (i, role) in ran if role == "timing"]
    assert rerun == ([] if ran[(boundary, "search")] else [boundary]), "a re-run only where the search gave none"


def test_a_maximum_whose_timed_steps_do_not_fit_is_not_the_maximum():
    measure, asked = injected(20, boundary=7, predicted_max=6, creeps_at=7)
    found = boundary_search(20, measure, 100.0, timed=2)
    assert found["seen"][7]["status"] == "ok" and found["timings"][7]["status"] == "oom"
    assert found["best"] == 6 and found["seen"][6]["step_s"]["n"] == 2
    assert record.speed(found["seen"][6])["tokens_per_s_at_max"]["median"] == pytest.approx(20.0)
    assert len(asked) == len(set(asked)), "no cell runs twice alike"


def test_the_tensor_peak_sees_the_warm_up_and_not_the_timed_steps():
    """A work function allocating a known tensor: the tracked warm-up sees it (on top of a tensor kept from the
    first call, as the optimizer states are); the timed calls, untracked, allocate more and are not counted."""
    kept, calls = [], []
    mib = 2**20

    def work():
        calls.append(1)
        if not kept:
            kept.append(torch.ones(mib // 4))  # 1 MiB kept, like the optimizer states from step 1
        size = 8 if len(calls) <= 2 else 32
        return torch.ones(size * mib // 4).sum()  # 8 MiB live in the warm-up, 32 MiB in a timed step
    ran = run_steps(work, torch.device("cpu"), warmup=2, timed=3)
    assert ran["tensors"]["kind"] == "cpu_tensor_peak"
    assert ran["tensors"]["delta_mib"] == pytest.approx(9.0, abs=0.01)
    assert ran["step_s"]["n"] == 3 and len(calls) == 5
    assert run_steps(work, torch.device("cpu"), warmup=1, timed=0)["step_s"] is None
    over = run_steps(work, torch.device("cpu"), warmup=1, timed=3, fits=lambda tensors: False)
    assert over["step_s"] is None and len(calls) == 7, "a warm-up past the budget is not timed"


def test_the_budget_comes_from_the_params_then_the_cell_memory_cap_and_is_never_guessed(test_cfg):
    cpu = torch.device("cpu")
    c, rt = copy.deepcopy(test_cfg["capacity"]), dict(test_cfg["runtime"])
    c["budget_mib"]["cpu"] = 1234
    assert capacity.budget(c, rt | {"cell_memory_cap_mib": 999}, cpu)["mib"] == 1234
    c["budget_mib"]["cpu"] = None
    chosen = capacity.budget(c, rt | {"cell_memory_cap_mib": 999}, cpu)
    assert chosen["mib"] == 999 and chosen["source"] == "runtime.cell_memory_cap_mib"
    assert "VmHWM" in chosen["memory"]
    with pytest.raises(UserError, match="capacity.budget_mib.cpu"):
        capacity.budget(c, rt | {"cell_memory_cap_mib": None}, cpu)


def test_grids_stay_within_the_model_s_context(test_cfg):
    c = test_cfg["capacity"]
    seq = grid(c, "generate", "seq_len", 100)
    assert seq == [(1, n) for n in range(c["seq_len_step"], 100 - c["generate"]["new_tokens"] + 1, c["seq_len_step"])]
    batch = grid(c, "train", "batch_size", 4096)
    assert batch[0] == (1, c["train_seq_len"]) and batch[-1] == (c["max_batch_size"], c["train_seq_len"])


@pytest.mark.integration  # make test's 10 minutes on a 2-core AVX2 CPU: run by make test-integration
def test_each_maximum_passes_within_the_budget_and_the_next_size_runs_out_of_memory(results, write_params):
    """The stage on the tiny model, every cell a real subprocess: each maximum in metrics.json, and the memory at it
    (predicted and measured tensor growth, growth of the memory the budget holds, their gap), is recomputed from
    cells.csv, where the maximum passed under the budget and the next size was out of memory."""
    metrics = run_stage("capacity", write_params(lambda cfg: cfg["capacity"].update(variants=["baseline"])), results)
    cells = pd.read_csv(results / "capacity" / record.CELLS_CSV)
    budget, timed = metrics["budget"]["mib"], metrics["steps"]["timed"]
    searches = metrics["searches"]
    assert {(s["kind"], s["subject"], s["dimension"]) for s in searches} == {
        ("train", "lora-r8", "batch_size"), ("train", "lora-r8", "seq_len"),
        ("generate", "baseline", "batch_size"), ("generate", "baseline", "seq_len")}
    assert metrics["tensors"]["kind"] == "cpu_tensor_peak"
    bounded = 0
    for s in searches:
        assert s["status"] == "ok", s
        mine = cells[(cells.subject == s["subject"]) & (cells.dimension == s["dimension"])]
        mine = mine.assign(size=mine.batch_size if s["dimension"] == "batch_size" else mine.seq_len)
        search = mine[mine.role == "search"]
        assert len(search) == s["cells"] and search["size"].is_unique
        assert (mine[mine.role == "timing"]["size"] == s["measured_max"]).all(), "only the maximum is re-run"
        passed = mine[mine.status == "ok"]
        assert (passed.peak_mib <= budget).all() and (passed.tensor_growth_mib > 0).all()
        assert set(mine.status) <= {"ok", "oom"}
        fits = mine.groupby("size").status.agg(lambda st: (st == "ok").all())  # every run of a size passed
        assert s["measured_max"] == fits[fits].index.max()
        first = search[search["size"] == search["size"].min()].iloc[0]
        predicted_fit = mine.drop_duplicates("size").sort_values("size")
        predicted_fit = predicted_fit[predicted_fit.predicted_peak_mib <= budget]
        assert s["predicted_max"] == predicted_fit["size"].max() and first.predicted_peak_mib == pytest.approx(
            first.loaded_mib + first.predicted_growth_mib)
        at = mine[mine["size"] == s["measured_max"]].sort_values("role").iloc[-1]  # its timing re-run, if any
        m = s["at_max"]
        assert at.timed_steps == timed and s["tokens_per_s_at_max"]["n"] == timed
        assert s["tokens_per_s_at_max"]["median"] == pytest.approx(at.tokens_per_s)
        timed_elsewhere = passed[(passed.timed_steps > 0) & (passed["size"] != s["measured_max"])]
        assert set(timed_elsewhere["size"]) <= {s["predicted_max"]}, "timed steps only where a cell may be the maximum"
        assert (m["peak_mib"], m["loaded_mib"], m["tensor_growth_mib"], m["predicted_growth_mib"]) == pytest.approx(
            (at.peak_mib, at.loaded_mib, at.tensor_growth_mib, at.predicted_growth_mib))
        assert m["held_growth_mib"] == pytest.approx(at.peak_mib - at.loaded_mib)
        assert m["loaded_shift_mib"] == pytest.approx(at.loaded_mib - first.loaded_mib)
        assert m["gap_mib"] == pytest.approx(at.peak_mib - at.loaded_mib - at.tensor_growth_mib)
        assert m["ratio"] == pytest.approx(at.tensor_growth_mib / at.predicted_growth_mib)
        if not s["whole_range_fits"]:
            bounded += 1
            failing = mine[mine["size"] == s["first_failing"]]
            assert "oom" in set(failing.status), "the next size ran and did not fit"
            assert (mine["size"][mine.status == "oom"] > s["measured_max"]).all()
        assert s["predicted_max"] is not None and s["predicted_peak_mib"]
    assert bounded >= 2, "the tiny budget bounds the training searches"
    # Training's two searches both start at batch 1 x capacity.train_seq_len (= seq_len_step here): one cell,
    # run once; generation's start at different sizes (prompt_len is not a multiple of seq_len_step)
    shared = {(s["kind"], s["dimension"]): s["cells_shared"] for s in searches}
    assert shared == {("train", "batch_size"): 0, ("train", "seq_len"): 1,
                      ("generate", "batch_size"): 0, ("generate", "seq_len"): 0}
    train = cells[(cells.kind == "train") & (cells.batch_size == 1) & (cells.seq_len == 64)]
    assert set(train.dimension) == {"batch_size", "seq_len"} and train.cell_wall_s.nunique() == 1


def test_a_budget_below_the_loaded_model_says_nothing_fits(results, write_params):
    metrics = run_stage("capacity", write_params(lambda cfg: cfg["capacity"].update(
        budget_mib={"cpu": 50, "cuda": 50}, variants=[])), results)
    for s in metrics["searches"]:
        assert s["status"] == "ok" and s["measured_max"] is None and s["cells"] == 1


def test_capacity_names_an_unknown_run_or_variant(write_params, tmp_path):
    from efflab import config

    for key, value in (("runs", ["nope"]), ("variants", ["nope"])):
        path = write_params(lambda cfg: cfg["capacity"].update({key: value}))
        with pytest.raises(UserError, match=f"capacity.{key}: 'nope'"):
            config.load(path)
    assert yaml.safe_load(path.read_text())["capacity"]


# -- the longest context with a quantized KV cache (capacity.kv_quant) ------------------------------------------------


@pytest.mark.integration  # real quanto-4 generation: quanto compiles its CPU kernels on a fresh install's first use
def test_a_quantized_cache_search_passes_its_cache_to_generate(results, test_cfg, monkeypatch):
    """A cell of `<subject>+kv-quanto-4` generates with transformers' QuantizedCache (kv_cache.generate_kwargs, with
    bench_inference.kv_quant_options); the full-precision one with generate()'s own cache. Real generations of the
    tiny model, in-process, generate() spied on."""
    from efflab.layout import Layout
    from efflab.models import kv_cache

    calls, load = [], capacity_cells.build

    def spied(*args, **kwargs):
        model = load(*args, **kwargs)
        generate = model.generate
        model.generate = lambda **kw: calls.append(kw) or generate(**kw)
        return model
    monkeypatch.setattr(capacity_cells, "build", spied)
    cfg = copy.deepcopy(test_cfg)
    options = {"residual_length": 16, "group_size": 32, "eval_rows": 2, "chunk": 16, "context_lengths": [64]}
    cfg["bench_inference"]["kv_quant_options"] = options
    for kv in ("quanto-4", kv_cache.NONE):
        work, tokens, _ = capacity_cells._generate_work(cfg, {"kind": "base"}, Layout(results), "float32",
                                                  torch.device("cpu"), 1, 64, kv=kv)
        work()  # raises unless exactly new_tokens tokens came out
    quantized, plain = calls
    assert quantized["cache_implementation"] == "quantized"
    assert quantized["cache_config"] == {"backend": "quanto", "nbits": 4, "q_group_size": 32, "residual_length": 16}
    assert "cache_implementation" not in plain and "cache_config" not in plain


@pytest.mark.integration  # real quanto-4 generation: quanto compiles its CPU kernels on a fresh install's first use
def test_each_quantized_cache_searches_the_base_model_s_longest_context_and_an_unavailable_one_is_said(
        results, write_params, monkeypatch):
    """capacity.kv_quant with no variant of kind base searched (int8's quantize job did not run here: its searches
    are skipped): the base model generates, its sequence search once with the full-precision cache and once per
    quantized cache, each a subject of its own; a cache whose backend is missing is `unavailable`, the rest runs."""
    import json

    from efflab.models import kv_cache

    real = kv_cache.unavailable
    monkeypatch.setattr(kv_cache, "unavailable", lambda spec, config=None:
                        "quanto-2 is not installed here (planted)" if spec == "quanto-2" else real(spec, config))
    (results / "quantize" / "int8").mkdir(parents=True)
    (results / "quantize" / "int8" / "metrics.json").write_text(json.dumps({"status": "skipped", "reason": "planted"}))
    metrics = run_stage("capacity", write_params(lambda cfg: cfg["capacity"].update(
        runs=[], variants=["int8"], kv_quant=["quanto-4", "quanto-2"])), results)
    searches = {(s["subject"], s["dimension"]): s for s in metrics["searches"]}
    assert set(searches) == {("int8", "batch_size"), ("int8", "seq_len"), ("int8+kv-quanto-4", "seq_len"),
                             ("int8+kv-quanto-2", "seq_len"), ("base", "seq_len"), ("base+kv-quanto-4", "seq_len"),
                             ("base+kv-quanto-2", "seq_len")}
    assert all(s["status"] == "skipped" for (subject, _), s in searches.items() if subject.startswith("int8"))
    plain, quantized, missing = (searches[(name, "seq_len")] for name in ("base", "base+kv-quanto-4",
                                                                           "base+kv-quanto-2"))
    assert plain["status"] == quantized["status"] == "ok" and "kv_quant" not in plain
    assert (quantized["kv_quant"], quantized["paired_with"], quantized["predicted_max"]) == ("quanto-4", "base", None)
    assert "does not model a quantized KV cache" in quantized["prediction"]
    assert quantized["measured_max"] is not None and quantized["at_max"]["ratio"] is None
    assert (missing["status"], missing["reason"]) == ("unavailable", "quanto-2 is not installed here (planted)")
    assert missing["context_gain"] is None and "did not run (unavailable)" in missing["context_gain_why"]
    if plain["whole_range_fits"] or quantized["whole_range_fits"]:  # the tiny model fits 900 MiB: decides nothing
        assert quantized["context_gain"] is None and "whole range" in quantized["context_gain_why"]
    else:
        assert quantized["context_gain"] == pytest.approx(quantized["measured_max"] / plain["measured_max"])
    cells = pd.read_csv(results / "capacity" / record.CELLS_CSV)
    assert set(cells.subject) == {"base", "base+kv-quanto-4"} and set(cells.dimension) == {"seq_len"}
    mine = cells[cells.subject == "base+kv-quanto-4"]
    assert len(mine[mine.role == "search"]) == quantized["cells"] and mine.predicted_peak_mib.isna().all()
    assert metrics["kv_quant"]["caches"] == ["quanto-4", "quanto-2"]


def _seq(subject, measured, whole=False, kv=None, status="ok"):
    s = {"subject": subject, "kind": "generate", "dimension": "seq_len", "status": status, "predicted_max": None,
         "measured_max": measured, "whole_range_fits": whole, "first_failing": None if whole else (measured or 0) + 128}
    return s | ({"kv_quant": kv, "paired_with": subject.split("+")[0]} if kv else {})


def test_the_context_gain_is_a_ratio_only_where_both_searches_decided_their_maximum():
    gains = record.context_gain([_seq("base", 384), _seq("base+kv-quanto-4", 1024, kv="quanto-4"),
                                   _seq("base+kv-quanto-2", 1536, whole=True, kv="quanto-2"),
                                   _seq("nf4", 512, whole=True), _seq("nf4+kv-quanto-4", 512, whole=True, kv="quanto-4"),
                                   _seq("int8", None), _seq("int8+kv-quanto-4", 256, kv="quanto-4")])
    said = {s["subject"]: (s.get("context_gain"), s.get("context_gain_why")) for s in gains}
    assert said["base"] == (None, None), "a full-precision search has no gain"
    assert said["base+kv-quanto-4"] == (pytest.approx(1024 / 384), None)
    assert said["base+kv-quanto-2"][0] is None and "at least 1536 against 384" in said["base+kv-quanto-2"][1]
    assert said["nf4+kv-quanto-4"][0] is None and "nothing decided" in said["nf4+kv-quanto-4"][1]
    assert said["int8+kv-quanto-4"][0] is None and "found nothing that fits" in said["int8+kv-quanto-4"][1]


def test_the_decision_and_the_glance_say_the_longest_context_with_and_without_the_quantized_cache():
    """A planted record: lora-r8's training batch, and the base model's longest context at batch 1, 384 tokens with
    the full-precision cache, 1,024 with quanto-4 (2.67×), hqq-2 unavailable. The decision carries the pairs once;
    the glance says them from it, the quantized searches in no other clause; the table has a row for each."""
    from efflab.measure.env import environment
    from efflab.stages.report import decisions, glance
    from efflab.stages.report.tables import capacity as tables

    missing = _seq("base+kv-hqq-2", None, kv="hqq-2", status="unavailable") | {"reason": "hqq is not installed"}
    batch = {"subject": "lora-r8", "kind": "train", "dimension": "batch_size", "status": "ok", "predicted_max": 5,
             "measured_max": 4, "whole_range_fits": False, "first_failing": 5}
    job = {"status": "ok", "budget": {"mib": 2048, "source": "capacity.budget_mib.cpu", "memory": "cpu_peak_rss: x"},
           "fixed": {"train_seq_len": 128, "prompt_len": 64, "new_tokens": 8},
           "searches": record.context_gain([batch, _seq("base", 384), _seq("base+kv-quanto-4", 1024, kv="quanto-4"),
                                              missing]), "environment": environment(torch.device("cpu"))}
    d = decisions._capacity(job)
    assert d["answer"]["base+kv-quanto-4 generate seq_len"] == 1024
    [pair] = d["context"]
    assert (pair["subject"], pair["measured_max"], pair["whole_range_fits"]) == ("base", 384, False)
    quanto, hqq = pair["quantized"]
    assert (quanto["kv_quant"], quanto["measured_max"], quanto["context_gain"]) == ("quanto-4", 1024,
                                                                                    pytest.approx(1024 / 384))
    assert (hqq["kv_quant"], hqq["status"], hqq["context_gain"]) == ("hqq-2", "unavailable", None)
    line = glance.capacity(d)
    assert ("lora-r8: batch 4; generating with base, the longest context at batch 1: 384 tokens with the "
            "full-precision KV cache, 1,024 tokens with quanto-4 (2.67×), hqq-2 unavailable.") in line
    assert "+kv-" not in line
    rows = tables.capacity_table([job]).set_index("subject")
    assert rows.loc["base+kv-quanto-4", "largest"] == "generation sequence (batch 1, quanto-4 KV cache)"
    assert rows.loc["base+kv-quanto-4", "measured max"] == "1024 (1152 fails); 2.67× base's"
    assert rows.loc["base+kv-hqq-2", "status"] == "unavailable: hqq is not installed"
