"""Stage prepare_data: instruction rows -> templated, tokenized, prompt-masked train/validation splits.

Sources: the embedded Swedish Construction FAQ (Zaragoza AB, CC BY 4.0) from the
zaragoza-construction-faq wheel, local .jsonl/.json/.csv/.parquet files, or a hub dataset id.
"""
from __future__ import annotations

import logging
import random
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from .. import cli
from ..config import UserError, classify_source, local_source_files
from ..evaluation.task import write_docs
from ..layout import Job
from ..measure.env import environment
from ..models.modeling import EMBEDDED_DATA, package_folder

# datasets takes seconds to import: it is imported only to read a hub dataset.

log = logging.getLogger("efflab")

READERS = {".jsonl": lambda p: pd.read_json(p, lines=True), ".json": pd.read_json,
           ".csv": pd.read_csv, ".parquet": pd.read_parquet}
ALPACA_PROMPT = ("Below is an instruction that describes a task{with_input}. Write a response that "
                 "appropriately completes the request.\n\n### Instruction:\n{instruction}\n\n"
                 "{input_block}### Response:\n")


def read_rows(pd_cfg: dict) -> tuple[pd.DataFrame, str | None]:
    """The raw instruction rows as a DataFrame, and the attribution the source asks for."""
    source = pd_cfg["source"]
    kind = classify_source(source, "prepare_data.source")
    if kind == "embedded":
        if source not in EMBEDDED_DATA:
            raise UserError(f"prepare_data.source: unknown embedded dataset {source!r} "
                            f"(expected one of {', '.join(EMBEDDED_DATA)})")
        package, relpath, pip_name, attribution = EMBEDDED_DATA[source]
        return pd.read_json(package_folder(package, pip_name) / relpath, lines=True), attribution
    if kind == "hub":
        import datasets

        return datasets.load_dataset(source, split=pd_cfg["split"]).to_pandas(), None
    (path,) = local_source_files("prepare_data", source)  # an existing file with a suffix READERS reads
    try:
        return READERS[Path(path).suffix](path), None
    except ValueError as err:
        raise UserError(f"prepare_data.source: cannot read {source!r}: {str(err).splitlines()[0]}") from None


def _text(row, column: str | None) -> str:
    if column is None:
        return ""
    value = row.get(column)
    return "" if value is None or (isinstance(value, float) and np.isnan(value)) else str(value).strip()


def prompt_and_full(row, pd_cfg: dict, tokenizer) -> tuple[str, str]:
    """The prompt text and the prompt+response text of one row, in the configured template."""
    cols = pd_cfg["columns"]
    instruction, extra, answer = _text(row, cols["instruction"]), _text(row, cols["input"]), _text(row, cols["output"])
    if pd_cfg["template"] == "alpaca":
        prompt = ALPACA_PROMPT.format(with_input=", paired with an input" if extra else "",
                                      instruction=instruction,
                                      input_block=f"### Input:\n{extra}\n\n" if extra else "")
        return prompt, prompt + answer + tokenizer.eos_token
    if not tokenizer.chat_template:
        raise UserError("prepare_data.template: the tokenizer has no chat template; use 'alpaca'")
    user = f"{instruction}\n\n{extra}" if extra else instruction
    messages = [{"role": "user", "content": user}]
    if pd_cfg["system_prompt"] is not None:
        messages.insert(0, {"role": "system", "content": pd_cfg["system_prompt"]})
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    full = tokenizer.apply_chat_template(messages + [{"role": "assistant", "content": answer}], tokenize=False)
    return prompt, full


def tokenize_row(prompt: str, full: str, tokenizer, max_length: int, mask_prompt: bool) -> dict:
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    full_ids = tokenizer(full, add_special_tokens=False)["input_ids"]
    n_prompt = _common_prefix(full_ids, prompt_ids)
    ids = full_ids[:max_length]
    labels = [-100] * min(n_prompt, len(ids)) + ids[n_prompt:] if mask_prompt else list(ids)
    return {"input_ids": ids, "labels": labels[:len(ids)], "prompt_tokens": n_prompt,
            "truncated": len(full_ids) > max_length}


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def split_rows(n: int, fraction: float, seed: int) -> tuple[list[int], list[int]]:
    order = list(range(n))
    random.Random(seed).shuffle(order)
    n_val = max(1, round(n * fraction))
    return sorted(order[n_val:]), sorted(order[:n_val])


def _stats(frame: pd.DataFrame) -> dict:
    lengths = frame["input_ids"].map(len)
    targets = frame["labels"].map(lambda labels: sum(1 for t in labels if t != -100))
    return {"rows": len(frame), "tokens": int(lengths.sum()), "label_tokens": int(targets.sum()),
            "truncated_rows": int(frame["truncated"].sum()),
            "length_percentiles": {f"p{q}": float(np.percentile(lengths, q)) for q in (5, 25, 50, 75, 95, 100)}}


def run(cfg: dict, job: Job) -> dict:
    """Template, tokenize, mask and split the instruction rows."""
    pd_cfg = cfg["prepare_data"]
    raw, attribution = read_rows(pd_cfg)
    for role, column in pd_cfg["columns"].items():
        if column is not None and column not in raw.columns:
            raise UserError(f"prepare_data.columns.{role}: column {column!r} not in the data "
                            f"(columns: {', '.join(map(str, raw.columns))})")
    if pd_cfg["max_rows"] is not None:
        raw = raw.sample(frac=1.0, random_state=pd_cfg["seed"]).head(pd_cfg["max_rows"]).sort_index()
    answers = raw[pd_cfg["columns"]["output"]].map(lambda v: _text({"v": v}, "v"))
    empty = int((answers == "").sum())  # nothing to learn from: the loss would be on the end-of-turn tokens alone
    if empty:
        log.warning("prepare_data: %d of %d rows have an empty, null or blank %r: dropped", empty, len(raw),
                    pd_cfg["columns"]["output"])
    read, raw = len(raw), raw[answers != ""]
    if len(raw) < 4:
        raise UserError(f"prepare_data.source: {pd_cfg['source']}: {len(raw)} rows with a non-empty "
                        f"{pd_cfg['columns']['output']!r} column (prepare_data.columns.output); at least 4 are "
                        f"needed for a train/validation split")
    tokenizer = job.tokenizer
    records = []
    cols = pd_cfg["columns"]
    for _, row in raw.iterrows():
        prompt, full = prompt_and_full(row, pd_cfg, tokenizer)
        # The row's question, reference answer and templated prompt travel with it: bench_inference asks the
        # models the user's own validation questions and the report shows the reference beside their answers.
        question = "\n\n".join(t for t in (_text(row, cols["instruction"]), _text(row, cols["input"])) if t)
        records.append(tokenize_row(prompt, full, tokenizer, pd_cfg["max_length"], pd_cfg["mask_prompt"])
                       | {"question": question, "answer": _text(row, cols["output"]), "prompt": prompt})
    frame = pd.DataFrame.from_records(records)
    frame = frame[frame["labels"].map(lambda labels: any(t != -100 for t in labels))].reset_index(drop=True)
    train_idx, val_idx = split_rows(len(frame), pd_cfg["validation_fraction"], pd_cfg["seed"])
    splits = {"train": frame.iloc[train_idx], "validation": frame.iloc[val_idx]}
    for split, part in splits.items():
        part.to_parquet(job.out / f"{split}.parquet", index=False)
    # The documents of efflab's lm-eval tasks: the validation questions, which no fine-tune trains on (each job
    # that scores a model writes the task folder it scores with from them, its generation settings in it).
    write_docs(job.out / job.layout.lm_eval_docs().name, splits["validation"].to_dict("records"))
    stats = {split: _stats(part) for split, part in splits.items()}
    log.info("prepare_data: %d train / %d validation rows, median %d tokens",
             stats["train"]["rows"], stats["validation"]["rows"],
             stats["train"]["length_percentiles"]["p50"])
    return {"source": pd_cfg["source"], "attribution": attribution, "template": pd_cfg["template"],
            "mask_prompt": pd_cfg["mask_prompt"], "raw_rows": read,
            "dropped_empty_responses": empty, "dropped_rows_without_labels": len(raw) - len(frame),
            **stats,
            "example": tokenizer.decode(splits["train"].iloc[0]["input_ids"]),
            "environment": environment(torch.device("cpu"), pd_cfg)}


if __name__ == "__main__":
    cli.main("prepare_data", run)
