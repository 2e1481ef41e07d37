import copy

import pandas as pd
import pytest
import torch
import yaml

from tests.helpers import run_stage
from efflab import capacity
from efflab.config import UserError


@pytest.mark.parametrize("boundary", [-1, 0, 3, 9, 19])
@pytest.mark.parametrize("guess", [0, 2, 9, 10, 19])
def test_the_search_finds_the_boundary_from_any_guess_asking_each_size_once(boundary, guess):
    asked = []

    def passes(i):
        asked.append(i)
        return i <= boundary
    found = capacity.search(20, passes, guess)
    assert found == boundary
    assert len(asked) == len(set(asked)), "no size is run twice"
    assert found + 1 in asked or found == 19, "the size above the maximum ran (and failed)"
    assert found in asked or found == -1
    assert len(asked) <= 2 + 2 * 5, "doubling steps and bisection, not a scan"


def test_a_close_prediction_is_confirmed_by_two_cells():
    asked = []
    assert capacity.search(64, lambda i: asked.append(i) or i <= 11, 11) == 11
    assert asked == [11, 12]


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
    seq = capacity.grid(c, "generate", "seq_len", 100)
    assert seq == [(1, n) for n in range(c["seq_len_step"], 100 - c["generate"]["new_tokens"] + 1, c["seq_len_step"])]
    batch = capacity.grid(c, "train", "batch_size", 4096)
    assert batch[0] == (1, c["train_seq_len"]) and batch[-1] == (c["max_batch_size"], c["train_seq_len"])


def test_each_maximum_passes_within_the_budget_and_the_next_size_runs_out_of_memory(results, write_params):
    """The stage on the tiny model, every cell a real subprocess: each maximum in metrics.json is recomputed from
    cells.csv, where the cell at the maximum passed under the budget and the next size was out of memory."""
    metrics = run_stage("capacity", write_params(), results)
    cells = pd.read_csv(results / "capacity" / capacity.CELLS_CSV)
    budget = metrics["budget"]["mib"]
    searches = metrics["searches"]
    assert {(s["kind"], s["subject"], s["dimension"]) for s in searches} == {
        ("train", "lora-r8", "batch_size"), ("train", "lora-r8", "seq_len"),
        ("generate", "baseline", "batch_size"), ("generate", "baseline", "seq_len")}
    bounded = 0
    for s in searches:
        assert s["status"] == "ok", s
        mine = cells[(cells.subject == s["subject"]) & (cells.dimension == s["dimension"])]
        size = mine.batch_size if s["dimension"] == "batch_size" else mine.seq_len
        assert len(mine) == s["cells"] and size.is_unique
        passed = mine[mine.status == "ok"]
        assert (passed.peak_mib <= budget).all() and (passed.peak_mib > passed.loaded_mib).all()
        assert set(mine.status) <= {"ok", "oom"}
        assert s["measured_max"] == size[mine.status == "ok"].max()
        at_max = mine[size == s["measured_max"]].iloc[0]
        assert at_max.tokens_per_s == pytest.approx(s["tokens_per_s_at_max"])
        if not s["whole_range_fits"]:
            bounded += 1
            failing = mine[size == s["first_failing"]]
            assert list(failing.status) == ["oom"], "the next size ran and did not fit"
            assert (size[mine.status == "oom"] > s["measured_max"]).all()
        assert s["predicted_max"] is not None and s["predicted_peak_mib"]
    assert bounded >= 2, "the tiny budget bounds the training searches"


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
