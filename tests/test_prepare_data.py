import json

import pandas as pd
import pytest

from efflab.layout import Layout
from efflab.models.modeling import load_tokenizer
from efflab.stages.prepare_data import split_rows
from tests.helpers import run_stage


def test_splits_are_disjoint_masked_and_complete(prepared, test_cfg):
    layout = Layout(prepared)
    train, val = pd.read_parquet(layout.split("train")), pd.read_parquet(layout.split("validation"))
    stats = json.loads(layout.metrics("prepare_data").read_text())
    assert len(train) + len(val) == test_cfg["prepare_data"]["max_rows"]
    assert stats["train"]["rows"] == len(train) and stats["validation"]["rows"] == len(val)
    assert not set(map(tuple, train.input_ids)) & set(map(tuple, val.input_ids))
    tok = load_tokenizer(layout.base_model())
    row = train.iloc[0]
    n = row.prompt_tokens
    assert list(row.labels[:n]) == [-100] * n, "prompt tokens are masked out of the loss"
    assert list(row.labels[n:]) == list(row.input_ids[n:])
    response = tok.decode(row.input_ids[n:])
    assert response.endswith("<|im_end|>\n") and "<|im_start|>assistant" in tok.decode(row.input_ids[:n])
    assert max(map(len, train.input_ids)) <= test_cfg["prepare_data"]["max_length"]


def test_split_is_deterministic_by_seed():
    assert split_rows(100, 0.2, 7) == split_rows(100, 0.2, 7)
    assert split_rows(100, 0.2, 7) != split_rows(100, 0.2, 8)
    train, val = split_rows(100, 0.2, 7)
    assert len(val) == 20 and sorted(train + val) == list(range(100))


def test_local_jsonl_with_other_columns_and_alpaca_template(prepared, tmp_path, write_params):
    rows = [{"q": f"Question number {i}?", "a": f"Answer {i}."} for i in range(12)]
    data = tmp_path / "rows.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows))

    def edit(cfg):
        cfg["prepare_data"] |= {"source": str(data), "template": "alpaca", "max_rows": None, "mask_prompt": False,
                                "columns": {"instruction": "q", "input": None, "output": "a"}}
    results = tmp_path / "results"
    (results / "base_model").mkdir(parents=True)
    (results / "base_model" / "model").symlink_to(prepared / "base_model" / "model")
    metrics = run_stage("prepare_data", write_params(edit), results)
    assert metrics["raw_rows"] == 12 and metrics["template"] == "alpaca"
    train = pd.read_parquet(results / "prepare_data" / "train.parquet")
    assert list(train.iloc[0].labels) == list(train.iloc[0].input_ids), "mask_prompt: false trains on every token"
    assert "### Response:" in metrics["example"]


def test_a_missing_column_is_a_user_error(prepared, tmp_path, write_params):
    def edit(cfg):
        cfg["prepare_data"]["columns"]["output"] = "answer"
    with pytest.raises(SystemExit) as exit_:
        run_stage("prepare_data", write_params(edit), tmp_path / "results")
    assert exit_.value.code == 2
    assert not (tmp_path / "results" / "prepare_data").exists()


def _rows_file(tmp_path, answers):
    data = tmp_path / "rows.jsonl"
    data.write_text("\n".join(json.dumps({"q": f"Question number {i}?", "a": a}) for i, a in enumerate(answers)))
    return data


def _local(cfg, data):
    cfg["prepare_data"] |= {"source": str(data), "max_rows": None,
                            "columns": {"instruction": "q", "input": None, "output": "a"}}


def test_rows_with_an_empty_null_or_blank_answer_are_dropped_and_counted(prepared, tmp_path, write_params):
    data = _rows_file(tmp_path, [f"Answer {i}." for i in range(8)] + ["", None, "   \n"])
    results = tmp_path / "results"
    (results / "base_model").mkdir(parents=True)
    (results / "base_model" / "model").symlink_to(prepared / "base_model" / "model")
    metrics = run_stage("prepare_data", write_params(lambda cfg: _local(cfg, data)), results)
    assert metrics["raw_rows"] == 11 and metrics["dropped_empty_responses"] == 3
    assert metrics["train"]["rows"] + metrics["validation"]["rows"] == 8


def test_a_file_without_usable_answers_is_refused_naming_the_file_and_column(prepared, tmp_path, write_params,
                                                                            capsys):
    data = _rows_file(tmp_path, [None] * 10)
    results = tmp_path / "results"
    (results / "base_model").mkdir(parents=True)
    (results / "base_model" / "model").symlink_to(prepared / "base_model" / "model")
    with pytest.raises(SystemExit) as exit_:
        run_stage("prepare_data", write_params(lambda cfg: _local(cfg, data)), results)
    assert exit_.value.code == 2 and not (results / "prepare_data").exists()
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert str(data) in err and "'a' column (prepare_data.columns.output)" in err and "0 rows" in err
