"""Stage evaluate: lm-evaluation-harness on one model the experiment makes or uses, one job per model.

The model is loaded as its stage left it (a quantized folder as its quantized modules, an adapter on the base it
trained on) and lm-eval's HF model class wraps that very object. The tasks are efflab's own on the user's
validation split and any installed lm-eval task named in evaluate.tasks. From prepare_data's documents the job
writes the task folder it scores with into its own folder (lm_eval/): the generation task's file carries every
generation setting (evaluate.max_new_tokens among them), and its comment, like the record's `commands`, the lm_eval
command line that reruns this model's scores. Each model is paired, document by document, with its reference (the
base; for a merged model, the adapter it came from), whose job it waits for: the change of every metric with its
95% interval, and the quality gate (the `tolerance` section: one per metric) decided by that interval.
"""
from __future__ import annotations

import importlib.util
import logging
import time

from .. import cli, records
from ..config import task_relative, task_tolerance
from ..evaluation import harness, scores, task
from ..experiment import evaluated_models, model_ref
from ..layout import Job
from ..measure.env import environment
from ..models import quantization
from ..models.build import build
from ..registry import LM_EVAL, built_on

log = logging.getLogger("efflab")

def run(cfg: dict, job: Job) -> dict:
    """Evaluate one model on evaluate.tasks and pair it with its reference."""
    e, layout = cfg["evaluate"], job.layout
    model_cfg = evaluated_models(cfg)[job.name]
    kind, of, reference = model_cfg["kind"], model_cfg["of"], model_cfg["reference"]
    device = job.device
    about = {"model": job.name, "kind": kind, "of": of, "reference": reference}
    skipped = layout.skipped_because(built_on(cfg, "evaluate", job.name))
    if not skipped and importlib.util.find_spec("lm_eval") is None:  # an offline node's bundle can leave it out
        skipped = {"status": "unavailable", "reason": "lm-eval is not installed (pip install 'lm-eval>=0.4.13')"}
    if skipped:
        layout.write_not_run("evaluate", job.out, skipped["status"], skipped["reason"])
        return {**skipped, **about, "environment": environment(device, e)}

    tokenizer, dtype = job.tokenizer, job.dtype
    # The task folder it scores with, written where the job's outputs go (named by where they end up): its
    # generation task's file carries every generation setting, and its comment the command that reruns this model.
    ref = model_ref(cfg, model_cfg)
    folders = [str(f) for f in layout.variant_folders(ref)]
    commands = harness.cli_commands(folders, dtype, device.type, job.final / LM_EVAL, e["tasks"], e["docs"],
                                    e["batch_size"])
    task_dir = task.write_task(job.out / LM_EVAL, layout.lm_eval_docs(),
                               task.generation_kwargs(e["max_new_tokens"], tokenizer.eos_token),
                               {t: cmd for tasks, cmd in commands.items() for t in tasks.split(",") if t in task.TASKS})
    t0 = time.perf_counter()
    model = build(ref, layout, dtype, device)
    load_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    results = harness.evaluate(model, tokenizer, task_dir, e["tasks"], e["docs"], e["batch_size"],
                               e["bootstrap_iters"])
    eval_s = time.perf_counter() - t0
    ref_record = records.read(layout, "evaluate", reference) if reference else None
    changes = scores.paired_changes(results, ref_record if ref_record and records.is_ok(ref_record) else None,
                                     task_tolerance(cfg), task_relative(cfg))
    gate = scores.gate_verdict(changes) if reference else {"verdict": "reference", "failed": []}
    for name, result in results.items():
        shown = ", ".join(f"{m} {v['value']:.4g}" for m, v in result.get("metrics", {}).items())
        log.info("%s: %s: %s", job.name, name, shown or result.get("reason"))
    log.info("%s: gate %s (against %s)%s", job.name, gate["verdict"], reference or "itself",
             f": fails on {', '.join(gate['failed'])}" if gate["failed"] else "")
    return {**about, "tasks": results, "changes": changes, "gate": gate,
            "quantized_modules": quantization.quantized_parts(model),
            "samples": scores.samples(results, e["samples"], harness.GEN_TASK),
            "load_s": load_s, "eval_s": eval_s, "commands": commands,
            "environment": environment(device, e)}


if __name__ == "__main__":
    cli.main("evaluate", run)
