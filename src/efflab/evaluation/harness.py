"""lm-evaluation-harness run on a model efflab has already loaded (its HF model class wrapping that very object, so
a quantized model is evaluated as its quantized modules), one task at a time: a task that cannot run (its data
cannot be loaded offline, an unknown name) is a cell with its reason, and the other tasks go on.

lm_eval (and datasets under it) take seconds to import: they are imported inside `evaluate`.
"""
from __future__ import annotations

import contextlib
import io
import logging
import os
import sys
from pathlib import Path

import torch

from . import PRELOAD
from .task import GEN_TASK, TASKS, declared_names

__all__ = ["GEN_TASK", "PRELOAD", "TASKS", "cli_commands", "evaluate"]

log = logging.getLogger("efflab")


def cli_command(folders: list, dtype: str, device: str, task_dir: Path, task: str, docs: int | None,
                batch_size: int) -> str:
    """The lm_eval command line that reruns one cell by hand on the model's folders (a base and its adapter, or one
    folder; a quantized folder loads quantized from its own config), in the dtype and on the device efflab used. No
    --gen_kwargs: efflab's tasks generate as their task files say (task.write_task), as efflab scored them; other
    tasks keep their own settings, in efflab as in lm_eval."""
    model = f"pretrained={folders[0]}" + (f",peft={folders[1]}" if len(folders) > 1 else "") + f",dtype={dtype}"
    cmd = (f"lm_eval --model hf --model_args {model} --device {device} --include_path {task_dir} --tasks {task} "
           f"--batch_size {batch_size}")
    return cmd + (f" --limit {docs}" if docs else "")


def cli_commands(folders: list, dtype: str, device: str, task_dir: Path, tasks: list[str], docs: int | None,
                 batch_size: int) -> dict[str, str]:
    """The lm_eval command lines that rerun a model's cells by hand: efflab's tasks in one, each other task in its
    own, keyed by the comma-joined tasks each runs."""
    ours = [t for t in tasks if t in TASKS]
    out = {",".join(ours): cli_command(folders, dtype, device, task_dir, ",".join(ours), docs, batch_size)} \
        if ours else {}
    return out | {t: cli_command(folders, dtype, device, task_dir, t, docs, batch_size) for t in tasks if t not in TASKS}


def _metrics(results: dict) -> dict:
    """{metric: {"value", "stderr"}} from lm-eval's "metric,filter" keys (the first filter of each metric)."""
    out = {}
    for key, value in results.items():
        if "," not in key or key.split(",")[0].endswith("_stderr") or key == "alias":
            continue
        name = key.split(",")[0]
        stderr = results.get(key.replace(",", "_stderr,", 1))
        out.setdefault(name, {"value": value, "stderr": None if stderr in (None, "N/A") else stderr})
    return out


def _docs(samples: list[dict], metrics: list[str]) -> list[dict]:
    """Per document: its id, the model's response (generation tasks), the reference and each metric's item."""
    rows = []
    for s in sorted(samples, key=lambda s: s["doc_id"]):
        response = s["filtered_resps"][0] if s["filtered_resps"] else None
        rows.append({"doc_id": s["doc_id"], "target": str(s["target"]),
                     "response": response if isinstance(response, str) else None,
                     "scores": {m: s[m] for m in metrics if m in s}})
    return rows


def folder_tasks(task_dir: Path) -> set[str]:
    """The names the YAML files of a task folder declare (read as text, as lm-eval indexes them)."""
    return declared_names(Path(task_dir).glob("*.yaml"))


def run_task(lm, task_manager, task: str, docs: int | None, bootstrap_iters: int) -> dict:
    """lm-eval's simple_evaluate on one task, with no generation settings of efflab's: each task generates as its
    task file says (efflab's: task.write_task's), as lm_eval's own command line without --gen_kwargs does."""
    from lm_eval import simple_evaluate

    printed = io.StringIO()  # lm-eval prints "bootstrapping for stddev: <metric>": to the log, not the console
    with contextlib.redirect_stdout(printed):
        out = simple_evaluate(model=lm, tasks=[task], task_manager=task_manager, limit=docs, gen_kwargs=None,
                              bootstrap_iters=bootstrap_iters, log_samples=True)
    for line in printed.getvalue().splitlines():
        log.debug("lm-eval: %s", line)
    metrics = _metrics(out["results"][task])
    return {"status": "ok", "metrics": metrics, "higher_is_better": out["higher_is_better"].get(task, {}),
            "n_docs": len(out["samples"][task]), "docs": _docs(out["samples"][task], list(metrics))}


@contextlib.contextmanager
def no_bytecode():
    """lm-eval imports the task folder's utils.py, and the task folder is a job's output: no __pycache__ may appear
    in it, or its content changes after DVC recorded its hash."""
    before = sys.dont_write_bytecode
    sys.dont_write_bytecode = True
    try:
        yield
    finally:
        sys.dont_write_bytecode = before


def evaluate(model, tokenizer, task_dir: Path, tasks: list[str], docs: int | None, batch_size: int,
             bootstrap_iters: int) -> dict[str, dict]:
    """Each task's result on `model`: lm-eval's metrics with their standard errors and the per-document items, or
    {"status": "unavailable", "reason": ...}. `task_dir`: a task folder task.write_task wrote, whose YAML files say
    how efflab's tasks generate (evaluate.max_new_tokens among them); other tasks keep their own settings."""
    os.environ.setdefault("DISABLE_MULTIPROC", "1")  # lm-eval's bootstrap would start a process pool per metric
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    model.eval()  # inference: no dropout (a model fresh from training is in training mode)
    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size)
    if lm.model is not model:  # what is scored must be what efflab loaded (quantized, adapted), not a reload
        raise RuntimeError("lm-eval's HFLM did not keep the model it was given")
    # Indexing lm-eval's ~14,000 built-in task files takes about 15 s: only when a task is not in the task folder.
    with no_bytecode():
        manager = TaskManager(include_path=str(task_dir), include_defaults=not set(tasks) <= folder_tasks(task_dir))
        return {task: task_result(lm, manager, task, docs, bootstrap_iters) for task in tasks}


def task_result(lm, manager, task: str, docs: int | None, bootstrap_iters: int) -> dict:
    """One task's result, or {"status": "unavailable", "reason": ...} where lm-eval cannot run it."""
    try:
        return run_task(lm, manager, task, docs, bootstrap_iters)
    except (MemoryError, torch.OutOfMemoryError):
        raise  # the job's own status (oom), not one task's
    except Exception as err:  # noqa: BLE001 - lm-eval raises anything when a task's data cannot be loaded
        reason = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"[:300]
        log.warning("evaluate: task %s did not run: %s", task, reason)
        return {"status": "unavailable", "reason": reason}
