"""efflab's local lm-eval tasks on the user's validation split: a folder lm_eval itself runs.

    efflab_validation_gen  generate an answer to each validation question; exact match and chrF against the
                           reference answer (lm-eval's exact_match and chrf metrics)
    efflab_validation_ll   the log-likelihood of the reference answer after the question, in bits per byte of the
                           answer, and whether greedy decoding reproduces it (acc)

One score, one recipe. prepare_data writes the documents (validation.jsonl: the rows no fine-tune trains on). The
job that scores a model writes the task folder it scores with (an evaluate job into its own folder, a qat cell into
a scratch one): the two YAML files, utils.py (efflab.evaluation.task_utils) and a copy of the documents. The
generation task's YAML carries every generation setting efflab generates with (evaluate.max_new_tokens, greedy,
up to the end of turn) and efflab passes lm-eval none of its own, so the YAML is what was scored: the rerun line in
its comment, the command the evaluate record holds, gives the same scores with no --gen_kwargs. Only the number of
documents is not in the YAML (lm-eval's task files have no place for it): it is that command's --limit. Apart from
that comment, nothing in the folder names a path outside it.
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

_COMMON = """# efflab's local lm-eval task on the user's validation split, written by the efflab job that scored with it;
# every setting of the scoring is in this file but the number of documents (the rerun line's --limit).
# {rerun_title}
#   {rerun}
task: {task}
custom_dataset: !function utils.load_docs
test_split: validation
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{answer}}}}"
target_delimiter: ""
"""
_RERUN_TITLE = "Rerun, from the folder efflab ran in (the command its evaluate record holds), for the same scores:"
_ANY_MODEL = ("Run on a model of your own:",
              "lm_eval --model hf --model_args pretrained=<model folder> --include_path <this folder> --tasks {task} "
              "--limit <documents>")
_GEN = """output_type: generate_until
generation_kwargs:
{generation_kwargs}
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


def write_docs(folder: Path, rows: list[dict]) -> None:
    """prepare_data's part: the validation rows holding "prompt" (the templated question), "question" and "answer"
    (the reference), in the split's order (lm_eval's --limit N takes the first N), as `folder`/validation.jsonl."""
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / DOCS, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps({"prompt": row["prompt"], "question": row["question"], "answer": row["answer"]},
                               ensure_ascii=False) + "\n")


def generation_kwargs(max_gen_toks: int, eos: str | None) -> dict:
    """Every setting efflab generates its answers with: greedy, up to `max_gen_toks` new tokens
    (evaluate.max_new_tokens) or the tokenizer's end of sequence `eos` (lm-eval's default would cut an answer at
    its first blank line)."""
    return {"max_gen_toks": max_gen_toks, "until": [eos] if eos else [], "do_sample": False}


def write_task(folder: Path, docs: Path, generation: dict, reruns: dict[str, str] | None = None) -> Path:
    """The task folder a job scores with, at `folder`: the documents of `docs` (prepare_data's folder), utils.py,
    and each task's YAML, the generation task's carrying `generation` (generation_kwargs) as its
    generation_kwargs. `reruns`: per task, the lm_eval command line that reruns what the job scored (its comment
    states it); a task without one states the command's general form."""
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(Path(docs) / DOCS, folder / DOCS)
    shutil.copyfile(Path(__file__).with_name("task_utils.py"), folder / "utils.py")
    gen = "\n".join(f"  {key}: {json.dumps(value, ensure_ascii=False)}" for key, value in generation.items())
    for task, body in ((GEN_TASK, _GEN.format(generation_kwargs=gen)), (LL_TASK, _LL)):
        title, rerun = ((_RERUN_TITLE, reruns[task]) if reruns and task in reruns
                        else (_ANY_MODEL[0], _ANY_MODEL[1].format(task=task)))
        (folder / f"{task}.yaml").write_text(_COMMON.format(task=task, rerun_title=title, rerun=rerun) + body,
                                             encoding="utf-8")
    return folder


def rerun_line(yaml_file: Path) -> str:
    """The lm_eval command line a task file's comment states (write_task's)."""
    lines = Path(yaml_file).read_text(encoding="utf-8").splitlines()
    return next(line.removeprefix("#").strip() for line in lines if line.startswith("#   lm_eval "))


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
