"""efflab's local lm-eval tasks, written from the user's validation split: a folder lm_eval itself runs.

    efflab_validation_gen  generate an answer to each validation question; exact match and chrF against the
                           reference answer (lm-eval's exact_match and chrf metrics)
    efflab_validation_ll   the log-likelihood of the reference answer after the question, in bits per byte of the
                           answer, and whether greedy decoding reproduces it (acc)

The folder holds the two YAML files, utils.py (efflab.evaluation.task_utils) and validation.jsonl; nothing in it
names a path outside it, so it moves with the results. The number of documents and the generation length are not
in the YAML: the evaluate stage passes them as lm_eval's --limit and --gen_kwargs, and records the command line.
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
from pathlib import Path

GEN_TASK = "efflab_validation_gen"
LL_TASK = "efflab_validation_ll"
TASKS = (GEN_TASK, LL_TASK)
DOCS = "validation.jsonl"
DEFAULT_MAX_GEN_TOKS = 64  # the YAML's own length, for a rerun without --gen_kwargs

_COMMON = """# efflab's local lm-eval task on the user's validation split (written by efflab's prepare_data). Rerun:
#   lm_eval --model hf --model_args pretrained=<model folder> --include_path <this folder> --tasks {task} --limit N
task: {task}
custom_dataset: !function utils.load_docs
test_split: validation
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{answer}}}}"
target_delimiter: ""
"""
_GEN = """output_type: generate_until
generation_kwargs:
  max_gen_toks: {max_gen_toks}
  until: {until}
  do_sample: false
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
    ignore_case: true
    ignore_punctuation: true
  - metric: chrf
    aggregation: chrf
    higher_is_better: true
metadata:
  version: 1.0
"""
_LL = """output_type: loglikelihood
process_results: !function utils.answer_likelihood
metric_list:
  - metric: bits_per_byte
    aggregation: bits_per_byte
    higher_is_better: false
  - metric: acc
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""


def write_task(folder: Path, rows: list[dict], eos: str | None) -> None:
    """Write the task folder for validation rows holding "prompt" (the templated question), "question" and
    "answer" (the reference), in the split's order: lm_eval's --limit N takes the first N. An answer ends at the
    tokenizer's end of sequence `eos` (lm-eval's default would cut it at the first blank line)."""
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / DOCS, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps({"prompt": row["prompt"], "question": row["question"], "answer": row["answer"]},
                               ensure_ascii=False) + "\n")
    shutil.copyfile(Path(__file__).with_name("task_utils.py"), folder / "utils.py")
    (folder / f"{GEN_TASK}.yaml").write_text(_COMMON.format(task=GEN_TASK) +
                                             _GEN.format(max_gen_toks=DEFAULT_MAX_GEN_TOKS,
                                                                         until=json.dumps([eos] if eos else [])))
    (folder / f"{LL_TASK}.yaml").write_text(_COMMON.format(task=LL_TASK) + _LL)


_NAMED = re.compile(r"^\s*(?:task|group|tag)\s*:\s*['\"]?([\w.\-]+)", re.M)
_LISTED = re.compile(r"^\s*-\s*['\"]?([\w.\-]+)['\"]?\s*$", re.M)


def installed_task_names() -> set[str] | None:
    """The task, group and tag names in lm-eval's task YAML files, read as text (lm-eval's own TaskManager parses
    all ~14,000 of them: about 15 s, too slow for a dry run; this takes about 1 s); None without lm-eval. Lenient:
    any list item of a file that declares tags counts as a name, so a real task is never refused here."""
    spec = importlib.util.find_spec("lm_eval")
    if spec is None or spec.origin is None:
        return None
    return declared_names(Path(folder) / name for folder, _, files in os.walk(Path(spec.origin).parent / "tasks")
                          for name in files if name.endswith((".yaml", ".yml")))


def declared_names(files) -> set[str]:
    """The task, group and tag names task YAML files declare, read as text (and, leniently, every list item of a
    file that declares tags)."""
    names: set[str] = set()
    for file in files:
        text = Path(file).read_text(encoding="utf-8", errors="replace")
        names.update(_NAMED.findall(text))
        if "tag:" in text:
            names.update(_LISTED.findall(text))
    return names


def unknown_tasks(tasks: list[str]) -> list[str]:
    """The names in `tasks` that are neither efflab's tasks nor installed lm-eval tasks (all of them, other than
    efflab's, without lm-eval)."""
    others = [t for t in tasks if t not in TASKS]
    if not others:
        return []
    known = installed_task_names() or set()
    return [t for t in others if t not in known]
