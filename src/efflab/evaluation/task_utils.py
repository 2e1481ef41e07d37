"""Helpers of efflab's local lm-eval tasks, copied beside them as utils.py by the efflab job that scores with them.

The tasks read validation.jsonl from this folder, wherever the folder is, so that it can be rerun by hand:

    lm_eval --model hf --model_args pretrained=<model folder> --include_path <this folder> \
            --tasks efflab_validation_gen,efflab_validation_ll --limit <docs>
"""
import json
from pathlib import Path

import datasets

HERE = Path(__file__).resolve().parent


def load_docs(**kwargs):
    """The user's validation rows (prompt: the templated question; answer: the reference answer)."""
    lines = (HERE / "validation.jsonl").read_text(encoding="utf-8").splitlines()
    return {"validation": datasets.Dataset.from_list([json.loads(line) for line in lines if line.strip()])}


def answer_likelihood(doc, results):
    """The log-likelihood of the reference answer after the prompt: per byte of the answer (lm-eval's bits_per_byte
    aggregation), and whether greedy decoding would reproduce it exactly (lm-eval's acc of a loglikelihood task)."""
    ((loglikelihood, is_greedy),) = results
    return {"bits_per_byte": (loglikelihood, len(doc["answer"].encode("utf-8"))), "acc": float(is_greedy)}
