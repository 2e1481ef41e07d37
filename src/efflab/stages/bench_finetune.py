"""Stage bench_finetune: what each fine-tuning knob costs in step time, measured so that the verdict holds.

The finetune stage trains each run in its own process, at its own time: a comparison of two runs' step
times also compares whatever else the machine was doing while each ran (another job took a core during
one of them, and checkpointing read 2x faster). Here, for every pair of configured runs that differ in
exactly one knob (records.knob_pairs), both runs' models, optimizers, precision and batches are built in
one process and their training steps (forward, backward, gradient clipping, optimizer step) are timed
interleaved, A B then B A, over the same batches, with a speed probe between rounds (measure.timing.interleave).
Each pair's verdict comes from the per-round ratios: median, its distribution-free 95% interval (order statistics), and `slower`,
`faster` or `same within ±10%` (else `not decided at this size`); rounds in which the machine's speed changed are set aside and
measured again, and a pair that never gets enough stable rounds says so instead of giving a verdict.
With bench_finetune.against_reference, every run is also timed against the reference (the first of finetune.runs),
the same way: the ratios the report ranks the runs by (records.step_ratio) are then interleaved ones too.
Every run of every pair is built once and all are timed in one cell (runtime.isolation), each round a step of each,
so a pair costs no more than its rounds; where they do not fit in one process together, each pair is a cell alone.

The step is training.training_step, written out rather than run by a Trainer (see training.py).
"""
from __future__ import annotations

import logging
from pathlib import Path

import torch

from .. import cli, records
from ..experiment import finetune_run
from ..layout import Job, Layout
from ..measure.device import synchronize
from ..measure.env import environment
from ..measure.isolation import prestart, run_cell
from ..measure.stats import format_ratio, paired_ratio
from ..measure.timing import interleave
from ..models.build import build
from ..models.modeling import load_tokenizer, read_split
from ..training import batches, real_tokens, training_step, unavailable_knobs

# transformers takes seconds to import: it is imported inside the function that uses it.

log = logging.getLogger("efflab")

# Knobs whose effect a pair of models in one process cannot show: they are process-wide (deterministic
# kernels), belong to the data loader this benchmark does not use (it feeds pre-built batches), or spread
# the step over processes.
NOT_INTERLEAVED = {
    "deterministic": "deterministic algorithms are a process-wide torch setting",
    "dataloader_num_workers": "a data-loader knob: this benchmark feeds pre-built batches",
    "pin_memory": "a data-loader knob: this benchmark feeds pre-built batches",
    "num_processes": "a multi-process (DDP) knob: one process cannot run both sides",
}


def _knob_reason(knob: str | None) -> str | None:
    """Why a knob's pair is not timed interleaved; None for one that is, and for a pair with the reference (no knob)."""
    return NOT_INTERLEAVED.get(knob.split(".")[0]) if knob else None


def group_cell(cfg: dict, results: str, runs: list[str], pairs: list[list[str]], dtype: str, device: str) -> dict:
    """Time the training steps of every run in `runs` interleaved in one process, each round a step of each: for
    each (a, b) of `pairs`, b's step time over a's within each stable round, with its interval and verdict. One
    model and one step of each run serve every pair it is in."""
    from transformers import set_seed

    bf, layout, device = cfg["bench_finetune"], Layout(Path(results)), torch.device(device)
    tokenizer = load_tokenizer(layout.base_model())
    rows = read_split(layout.split("train"))
    count = bf["warmup_rounds"] + 2 * bf["rounds"]  # enough batches for every round, set-aside ones included
    variants, tokens, precision = {}, {}, {}
    for name in runs:
        run_cfg = finetune_run(cfg, name)
        set_seed(run_cfg.seed)
        steps = batches(run_cfg, tokenizer, rows, count, device)
        model = build(run_cfg, layout, dtype, device)
        variants[name], precision[name] = training_step(run_cfg, model, dtype, device, steps,
                                                        str(layout.out("bench_finetune")))
        tokens[name] = [real_tokens(s) for s in steps]
    synchronize(device)
    timed = interleave(variants, bf["rounds"], device, warmup=bf["warmup_rounds"],
                       tolerance=bf["sentinel_tolerance"])
    per_run = {}
    for name in runs:
        kept = [(r["seconds"][name], tokens[name][i % count]) for i, r in enumerate(timed["rounds"], bf["warmup_rounds"])
                if r["stable"]]
        seconds = sum(s for s, _ in kept)
        per_run[name] = {"step_time": timed["variants"][name], "mixed_precision": precision[name],
                         "tokens_per_s": sum(t for _, t in kept) / seconds if seconds else None}
    out = {}
    for a, b in pairs:
        ratio = paired_ratio(timed, a, b)
        log.info("%s vs %s: step time ratio %s %s (%d stable rounds, %d set aside)", b, a, format_ratio(ratio, 3),
                 ratio["verdict"], timed["stable_rounds"], timed["set_aside"])
        out[f"{a} {b}"] = {"runs": {a: per_run[a], b: per_run[b]}, "step_time_ratio": ratio}
    return {"pairs": out, "interleaved": timed}


def timed_pairs(cfg: dict, configured: list[dict]) -> list[tuple[str | None, object, object, dict, dict]]:
    """The pairs to time: every knob pair of finetune.runs (records.knob_pairs), and with
    bench_finetune.against_reference the reference run (the first) with each other run it is not a knob pair with,
    knob None: the step ratios the report ranks runs by, over the reference."""
    pairs = records.knob_pairs(configured)
    if not cfg["bench_finetune"]["against_reference"] or len(configured) < 2:
        return pairs
    reference, seen = configured[0], {(a["run"], b["run"]) for *_, a, b in pairs}
    return pairs + [(None, "-", "-", reference, other) for other in configured[1:]
                    if (reference["run"], other["run"]) not in seen]


def run(cfg: dict, job: Job) -> dict:
    """Every knob pair of finetune.runs, and each run against the reference, timed interleaved."""
    bf, rt, layout = cfg["bench_finetune"], cfg["runtime"], job.layout
    prestart(rt["isolation"])  # the cells' forkserver imports beside this job
    device, dtype = job.device, job.dtype
    configured = [{"run": name, "settings": finetune_run(cfg, name).settings} for name in cfg["finetune"]["runs"]]
    journal = job.journal({"bench_finetune": bf, "finetune": cfg["finetune"], "runtime": rt,
                           "base": layout.metrics("base_model").read_text()})
    pairs, cells = [], []
    for knob, value_a, value_b, a, b in timed_pairs(cfg, configured):
        cell = {"knob": knob, "from": value_a, "to": value_b, "a": a["run"], "b": b["run"]}
        reason = _knob_reason(knob) or "; ".join(unavailable_knobs(finetune_run(cfg, a["run"]), device)
                                                 + unavailable_knobs(finetune_run(cfg, b["run"]), device)) or None
        pairs.append(cell)  # in timed_pairs' order; a pair that runs is filled in below, where it was timed
        if reason:
            cell.update(status="unavailable", reason=reason)
        else:
            cells.append(cell)
    runs = list(dict.fromkeys(r for c in cells for r in (c["a"], c["b"])))

    def timed(group: list[str], wanted: list[list[str]]) -> dict:
        return journal.result({"runs": group, "pairs": wanted}, lambda: run_cell(
            group_cell, dict(cfg=cfg, results=str(layout.root), runs=group, pairs=wanted, dtype=dtype,
                             device=str(device)),
            isolation=rt["isolation"], timeout_s=rt["cell_timeout_s"], memory_cap_mib=rt["cell_memory_cap_mib"]))

    together = timed(runs, [[c["a"], c["b"]] for c in cells]) if cells else None
    for c in cells:
        # every run in one process, one model each; where they do not fit together, the pair alone
        result = together if together and records.is_ok(together) else timed([c["a"], c["b"]], [[c["a"], c["b"]]])
        if not records.is_ok(result):
            log.warning("%s vs %s: %s: %s", c["b"], c["a"], result["status"], result.get("reason"))
            c.update(result)
            continue
        c.update({k: v for k, v in result.items() if k != "pairs"}, together=result is together and len(runs) > 2,
                 **result["pairs"][f"{c['a']} {c['b']}"])
    journal.remove()
    return {"status": "ok", "dtype": dtype, "rounds": bf["rounds"], "warmup_rounds": bf["warmup_rounds"],
            "sentinel_tolerance": bf["sentinel_tolerance"],
            "measured": "training steps (forward, backward, clipping, optimizer step) of every paired run in one "
                        "process, interleaved over the same batches (a pair alone where they do not fit together)",
            "pairs": pairs, "environment": environment(device, bf)}


if __name__ == "__main__":
    cli.main("bench_finetune", run)
