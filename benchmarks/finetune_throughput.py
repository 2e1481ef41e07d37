"""Benchmark: efflab's LoRA fine-tuning against the plain HF Trainer + peft script a user would write
(benchmarks/trainer_baseline.py), same model, rows, steps and hyperparameters, and where each loop's step time
goes, phase by phase.

Cells (each a fresh process, interleaved over the repeats so drift hits every cell alike; NAME@ROWS runs a cell at
ROWS rows a step, for a batch sweep):
  script          benchmarks/trainer_baseline.py: dynamic padding, the Trainer's defaults, the model in its saved
                  dtype (what efflab's base_model chose), no autocast
  script-fp32     the same script loading the model in float32 (transformers 4's default)
  efflab          `python -m efflab.stages.finetune` with the run's settings as shipped
  efflab-equal    efflab at the script's numerics: the saved dtype, no autocast (mixed_precision: "no")
  efflab-bare     efflab-equal without its instruments (instruments: false): what efflab's measurement costs
  efflab-loop     efflab-equal with torch's per-parameter AdamW loop (optimizer: adamw_torch) instead of the
                  fused kernel both loops use by default (the Trainer's default, efflab's)
  efflab-padded   efflab-equal with packing off (dynamic padding, as the script pads)
  efflab-compile  efflab-equal with torch.compile (its compile time is in the first steps, left out)
  efflab-liger    efflab-equal with Liger's fused kernels (CUDA and liger-kernel; unavailable elsewhere)
  efflab-fa2      efflab-equal with FlashAttention-2, over packed rows its variable-length kernel (CUDA, flash-attn)
  efflab-bf16     efflab with bf16 autocast forced on (the seeds' other speed-up; other numerics)
  script-bf16     the script loading the model in bfloat16 (peft keeps its adapters and their Adam moments fp32)
  efflab-bf16w    efflab with bf16_weights: base and adapters in bf16, Adam moments in fp32, updates rounded
                  stochastically (torchao's AdamW); against script-bf16 it differs in the adapters' dtype
A cell this machine cannot run (a knob the stage records unavailable) is listed with its reason and run no more.

Both loops carry one instrument, efflab.measure.phases.PhaseClock, which stamps every step's phases (data,
forward, backward, optimizer, step end, between steps, instrument, other): a cell's step time is its steady steps'
median (the first step left out), its speed against the script the script's median step over its own, repeat by
repeat (a 95% interval from 6 repeats; fewer give a range). efflab-equal's own phases (outside the matmuls) are held
to within 1 ms of the script's, repeat by repeat. Each setting the two loops compute differently is named with its
gain alone, where the pair of cells that differ in it alone ran (KNOBS). The loss of every step is compared with
the script's on the same batches, against the script's own run-to-run difference (its repeats, and one more run
with its random draws reseeded).

The machine is watched: a speed probe before every cell and after the last, and the share of the CPU other
processes took during each cell. A run whose speed changed (a probe beyond ±25% of the median) or that shared the
machine (others above 10% of its CPU) is refused with the reason, its samples kept in OUT.refused.json.

Needs the base model and the prepared data (`snakemake --cores all results/prepare_data/train.parquet
results/base_model/model`, or any earlier `make run`).

    python benchmarks/finetune_throughput.py --run lora-r8 --repeats 6
    python benchmarks/finetune_throughput.py --batch-size fill --cells script,efflab,efflab@8 --trace efflab  # GPU

Writes results/benchmarks/finetune_throughput.{json,md} (and with --trace .trace.json, .top_ops.csv).
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml
from transformers import AutoConfig

from efflab.config import load
from efflab.estimators.fill import fill
from efflab.experiment import FinetuneRun, finetune_run
from efflab.lora import lora_targets
from efflab.measure.device import thread_count
from efflab.measure.phases import PHASES, PHASES_ENV, summary
from efflab.measure.quiet import MAX_OTHERS_SHARE, OthersCpu
from efflab.measure.stats import (
    against_tolerance,
    median_ci_order,
    percentile,
    ratio_verdict,
    ratio_words,
    said_of_faster_side,
)
from efflab.measure.timing import SENTINEL_TOLERANCE, speed_probe
from efflab.registry import LOSS_CSV
from efflab.zygote import ENV as ZYGOTE_ENV

REPO = Path(__file__).resolve().parents[1]
EQUAL = {"mixed_precision": "no"}
CELLS = {  # name: (loop, its settings)
    "script": ("script", {"dtype": "auto"}),
    "script-fp32": ("script", {"dtype": "float32"}),
    "efflab": ("efflab", {}),
    "efflab-equal": ("efflab", EQUAL),
    "efflab-bare": ("efflab", EQUAL | {"instruments": False}),
    "efflab-loop": ("efflab", EQUAL | {"optimizer": "adamw_torch"}),
    "efflab-padded": ("efflab", EQUAL | {"packing": False}),
    "efflab-compile": ("efflab", EQUAL | {"torch_compile": True}),
    "efflab-liger": ("efflab", EQUAL | {"liger_kernel": True}),
    "efflab-fa2": ("efflab", EQUAL | {"attn_implementation": "flash_attention_2"}),
    "efflab-bf16": ("efflab", {"mixed_precision": "bf16"}),
    "script-bf16": ("script", {"dtype": "bfloat16"}),
    "efflab-bf16w": ("efflab", {"bf16_weights": True}),
}
DEFAULT_CELLS = "script,efflab,efflab-equal,efflab-bare,efflab-padded,efflab-loop"
# What the two loops may compute differently, each knob's pair of cells that differ in it alone (with, without):
# the knob's gain is the second's step over the first's, paired repeat by repeat
KNOBS = {
    "packing": ("efflab-equal", "efflab-padded"),
    "autocast": ("efflab", "efflab-equal"),
    "optimizer": ("efflab-equal", "efflab-loop"),
    "trainable dtype": ("efflab-bf16w", "efflab"),
    "attention": ("efflab-fa2", "efflab-equal"),
    "torch.compile": ("efflab-compile", "efflab-equal"),
    "liger kernels": ("efflab-liger", "efflab-equal"),
}
REPROBE_PAUSE_S = 2.0
UNWATCHED = "unwatched (--unwatched): nobody checked that the machine was quiet; not figures to compare"


def cell_spec(spec: str) -> tuple[str, int | None]:
    """`NAME` or `NAME@ROWS` (a batch of ROWS rows a step: a batch sweep) -> (name, rows or None)."""
    name, _, rows = spec.partition("@")
    return name, int(rows) if rows.isdigit() and int(rows) > 0 else (None if not rows else -1)


# The efflab cell's run is added beside the configured runs, so that every cross-check of the params
# (merge.runs, capacity.runs, ...) still holds: the stage reads the same file it would in the pipeline.
BENCH_RUN = "throughput-bench"


def efflab_cell(params: dict, run: str, overrides: dict, results: Path, work: Path, trace: dict | None = None) -> dict:
    """One efflab fine-tuning run through the stage's real CLI, in a scratch results folder that shares the
    pipeline's base model and data, its phases stamped; `trace`: efflab's profile section, to profile its steps
    instead (the trace's folder is then in `profile_folder`). A run the stage records unavailable (a knob this
    machine cannot do) is returned as {"unavailable": its reason}."""
    scratch = work / "results"
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir()
    for stage in ("base_model", "prepare_data"):
        (scratch / stage).symlink_to((results / stage).resolve())
    cfg = json.loads(json.dumps(params))
    cfg["finetune"]["runs"][BENCH_RUN] = {**cfg["finetune"]["runs"][run], **overrides}
    cfg["finetune"].pop("target", None)  # the plain script validates only at its ends: so does the compared run
    if trace:
        cfg["profile"] = trace
    path = work / "params.yaml"
    path.write_text(yaml.safe_dump(cfg))
    phases = _run([sys.executable, "-m", "efflab.stages.finetune", "--params", str(path), "--results", str(scratch),
                   "--name", BENCH_RUN], work)
    out = scratch / "finetune" / BENCH_RUN
    m = json.loads((out / "metrics.json").read_text())
    if m.get("status", "ok") != "ok":
        return {"unavailable": m.get("reason") or m["status"]}
    with open(out / LOSS_CSV) as f:
        losses = [float(row["loss"]) for row in csv.DictReader(f)]
    t = m["throughput"]
    return {"phases": phases, "tokens_seen": m["tokens_seen"], "steps": m["steps"], "train_s": m["train_s"],
            "losses": losses, "pad_fraction": m["pad_fraction"],
            "mixed_precision": f"{m['mixed_precision']}, trainable weights {m['trainable_dtype']}",
            "computes": {"packing": m["padding_free"], "autocast": m["mixed_precision"],
                         "optimizer": m["optimizer"], "trainable dtype": m["trainable_dtype"],
                         "attention": m.get("attn_implementation"), "torch.compile": m["settings"]["torch_compile"],
                         "liger kernels": m["settings"]["liger_kernel"], "threads": m["threads"]},
            "counted_steps": ((m["train_memory"].get("tensors") or {}).get("counted_steps") or []),
            "flops_per_token": t["flops"]["model_flops_per_token"], "ceiling_tflops": t["matmul_ceiling"]["tflops"],
            "ceiling_dtype": t["matmul_ceiling"]["dtype"]} | (
                {"profile_folder": str(out / "profile"), "top10": (m.get("profile") or {}).get("top10"),
                 "sorted_by": (m.get("profile") or {}).get("sorted_by")}
                if trace else {})


def script_cell(settings: dict, results: Path, work: Path, dtype: str, threads: int) -> dict:
    """The plain script at the run's settings (its seed among them), on efflab's CPU threads (runtime.threads)."""
    lora = settings["lora"]
    out = work / "script.json"
    phases = _run([sys.executable, str(REPO / "benchmarks" / "trainer_baseline.py"),
                   "--model", str(results / "base_model" / "model"),
                   "--train", str(results / "prepare_data" / "train.parquet"),
                   "--max-steps", str(settings["max_steps"]), "--batch-size", str(settings["batch_size"]),
                   "--learning-rate", str(settings["learning_rate"]), "--warmup-steps", str(settings["warmup_steps"]),
                   "--r", str(lora["r"]), "--alpha", str(lora["alpha"]), "--dropout", str(lora["dropout"]),
                   "--targets", _targets(results / "base_model" / "model", lora["target_modules"]),
                   "--seed", str(settings["seed"]), "--dtype", dtype, "--threads", str(threads),
                   "--json", str(out)], work)
    result = json.loads(out.read_text())
    return {"phases": phases, "tokens_seen": result["tokens_seen"], "steps": result["steps"],
            "train_s": result["train_s"], "losses": result["losses"], "pad_fraction": result["pad_fraction"],
            "mixed_precision": f"no autocast, weights {result['dtype'].replace('torch.', '')}",
            "computes": {"packing": False, "autocast": "no", "optimizer": result["optimizer"],
                         "trainable dtype": result["adapter_dtype"], "attention": result["attn_implementation"],
                         "torch.compile": False, "liger kernels": False, "threads": result["threads"]}}


def _targets(model: Path, modules: str | list[str] | None) -> str:
    """The LoRA targets efflab resolves for the model (null: peft's default for its family), as the baseline
    script's --targets: peft's own keyword all-linear, or comma-separated names."""
    targets = lora_targets(AutoConfig.from_pretrained(model), modules)
    return targets if isinstance(targets, str) else ",".join(targets)


def _run(argv: list[str], work: Path) -> dict:
    """A cell's command, its phases stamped into a file; a failed one ends the benchmark with the command's own
    last words, not a traceback. Returns the phase summary of its steady steps. The command runs in its own
    process, never handed to a pipeline's job server (EFFLAB_ZYGOTE): its CPU time is then this process's
    children's, which the quiet-machine watch subtracts."""
    stamps = work / "phases.json"
    stamps.unlink(missing_ok=True)
    env = {k: v for k, v in os.environ.items() if k != ZYGOTE_ENV} | {PHASES_ENV: str(stamps)}
    done = subprocess.run(argv, capture_output=True, text=True, env=env)
    if done.returncode:
        tail = (done.stderr or done.stdout).strip().splitlines()[-5:]
        sys.exit(f"finetune_throughput: error: {' '.join(argv[1:3])} exited {done.returncode}:\n" + "\n".join(tail))
    if not stamps.exists():  # a run recorded unavailable trains nothing
        return {"steps": 0}
    return summary(json.loads(stamps.read_text())["steps"])


def one_cell(args, params: dict, settings: dict, results: Path, work: Path, spec: str, trace=None) -> dict:
    name, rows = cell_spec(spec)
    loop, knobs = CELLS[name]
    batch = {"batch_size": rows} if rows else {}
    if loop == "script":
        return script_cell(settings | batch, results, work, knobs["dtype"], thread_count(params["runtime"]))
    return efflab_cell(params, args.run, {k: settings[k] for k in ("max_steps", "batch_size")} | batch | knobs,
                       results, work, trace)


def measure(args, params: dict, settings: dict, results: Path, cells: list[str], device: torch.device) -> dict:
    """Every cell `args.repeats` times, interleaved (A B C, then C B A), each in a fresh process, watched: a speed
    probe before each cell and after the last, and the share of the CPU other processes took during each. A run
    the watch finds disturbed ends here (refused), its samples kept beside the output for a look."""
    samples: dict[str, list[dict]] = {c: [] for c in cells}
    watch = {"probes_gflops": [], "others_share": [], "cells": [], "reprobed": [],
             "tolerance": SENTINEL_TOLERANCE, "max_others_share": MAX_OTHERS_SHARE}
    probe(watch, device, settle=3)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for repeat in range(args.repeats):
            # A B, then B A: drift hits both alike; a cell found unavailable is not run again
            running = [c for c in cells if not any("unavailable" in r for r in samples[c])]
            for cell in running if repeat % 2 == 0 else running[::-1]:
                t0, others = time.perf_counter(), OthersCpu().start()
                result = one_cell(args, params, settings, results, work, cell)
                watch["others_share"].append(others.stop())
                probe(watch, device)
                watch["cells"].append(f"{cell} (repeat {repeat + 1})")
                samples[cell].append(result)
                said = (f"unavailable: {result['unavailable']}" if "unavailable" in result else
                        f"median step {1000 * result['phases']['median_s']['total']:.0f} ms over "
                        f"{result['phases']['steps']} steady steps")
                print(f"[{repeat + 1}/{args.repeats}] {cell}: {said} (cell {time.perf_counter() - t0:.0f} s, "
                      f"others {_share(watch['others_share'][-1])} of the CPU)", flush=True)
                if (why := refusal(watch)) and not args.unwatched:
                    refuse(args, why, {"run": args.run, "settings": settings, "samples": samples, "watch": watch})
        # the script once more with its random draws changed: how far two equal trainings' losses lie apart
        reseeded = (script_cell(settings | {"seed": settings["seed"] + 1}, results, work, CELLS["script"][1]["dtype"],
                                thread_count(params["runtime"]))["losses"] if "script" in cells else None)
        trace = (one_cell(args, params, settings, results, work, args.trace, trace_settings(settings))
                 if args.trace else None)
        if trace and "unavailable" not in trace:
            trace["files"] = keep_trace(Path(trace.pop("profile_folder")), Path(args.out))
    return {"samples": samples, "reseeded_script_losses": reseeded,
            "watch": watch | ({"unwatched": UNWATCHED} if args.unwatched else {})} | (
        {"trace": trace} if trace else {})


def trace_settings(settings: dict) -> dict:
    """efflab's profile section for one steady step: after the warm-up steps and one steady step more (the
    profiler's own warm-up), CPU and, on a GPU, CUDA activities (efflab.profiling)."""
    return {"stages": ["finetune"], "skip_steps": settings["timing_warmup_steps"] + 1, "steps": 1,
            "record_shapes": False, "profile_memory": False, "with_stack": False}


def keep_trace(folder: Path, out: Path) -> dict:
    """The profiled step's trace (Chrome trace format: ui.perfetto.dev) and its operators by self time, beside
    the benchmark's output."""
    kept = {}
    for name, suffix in (("trace.json", ".trace.json"), ("top_ops.csv", ".top_ops.csv")):
        if (folder / name).exists():
            target = out.with_name(out.name + suffix)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(folder / name, target)
            kept[name] = str(target)
    return kept


def probe(watch: dict, device: torch.device, settle: int = 1) -> None:
    """The machine's speed now, into the watch: the best of `settle` probes (more before the first cell, to set the
    median). A probe off the median of those before it is taken once more after a pause, and the second reading
    kept (both recorded in `reprobed`): a moment's dip as a cell's process exits is not the machine's speed
    during the next cell; a real change reads the same twice."""
    if not watch["probes_gflops"]:  # the first: after a pause (a process that just exited, the data's load)
        time.sleep(REPROBE_PAUSE_S)
    reading = max(speed_probe(device) for _ in range(settle))
    before = watch["probes_gflops"]
    if before and abs(reading / statistics.median(before) - 1) > watch["tolerance"]:
        time.sleep(REPROBE_PAUSE_S)
        again = speed_probe(device)
        watch["reprobed"].append({"at": len(before), "first_gflops": reading, "again_gflops": again})
        reading = again
    before.append(reading)


def _share(share: float | None) -> str:
    return "?" if share is None else f"{share:.0%}"


def refusal(watch: dict) -> str | None:
    """Why a benchmark run cannot be read, or None: a speed probe off the probes' median by more than the tolerance
    (the machine changed speed between cells), or other processes taking more than their share of the CPU during a
    cell (a load beside the benchmark, which a probe taken under it would read as the machine's own speed)."""
    probes, tolerance = watch["probes_gflops"], watch["tolerance"]
    median = statistics.median(probes)
    for i, probe in enumerate(probes):
        if abs(probe / median - 1) > tolerance:
            when = f"after {watch['cells'][i - 1]}" if i else "before the first cell"
            return (f"the machine's speed changed: the speed probe {when} read {probe:.1f} GFLOP/s, {probe / median - 1:+.0%} "
                    f"from the probes' median {median:.1f} (tolerance ±{tolerance:.0%})")
    for cell, share in zip(watch["cells"], watch["others_share"]):
        if share is not None and share > watch["max_others_share"]:
            return (f"the machine was not ours: other processes took {share:.0%} of its CPU during {cell} "
                    f"(at most {watch['max_others_share']:.0%})")
    return None


def refuse(args, why: str, written: dict) -> None:
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    kept = out.with_name(out.name + ".refused.json")
    kept.write_text(json.dumps(written | {"refused": why}, indent=2))
    for stale in (out.with_suffix(".json"), out.with_suffix(".md")):
        stale.unlink(missing_ok=True)
    sys.exit(f"finetune_throughput: refused: {why}. Rerun on a machine nothing else uses (its samples: {kept})")


def summarise(samples: dict[str, list[dict]], reseeded: list[float] | None = None) -> dict:
    """Per cell: the median step and its spread over repeats, tokens/s, the speed against the script and against
    efflab-equal repeat by repeat (an interval from 6), each phase's median and its difference from the script's,
    the loss curve's largest difference from the script's on the same batches, and MFU where efflab measured the
    ceiling."""
    samples = available(samples)
    script, equal = samples.get("script"), samples.get("efflab-equal")
    # one matmul ceiling per dtype for every cell: the median of what each efflab process measured in that dtype
    # (one process's probe varies with the machine's moment: MFU would move with it)
    measured: dict[str, list[float]] = {}
    for r in (r for runs in samples.values() for r in runs if "ceiling_tflops" in r):
        measured.setdefault(r["ceiling_dtype"], []).append(r["ceiling_tflops"])
    ceilings = {dtype: statistics.median(values) for dtype, values in measured.items()}
    out = {}
    for cell, runs in samples.items():
        steps = [r["phases"]["median_s"]["total"] for r in runs]
        per_step_tokens = statistics.median(r["tokens_seen"] / r["steps"] for r in runs)
        step = statistics.median(steps)
        phases = {p: statistics.median(r["phases"]["median_s"].get(p, 0.0) for r in runs) for p in PHASES}
        entry = {"n": len(runs), "step_s_median": step, "step_s_min": min(steps), "step_s_max": max(steps),
                 "tokens_per_step": per_step_tokens, "tokens_per_s": per_step_tokens / step, "phases_s": phases,
                 "mixed_precision": runs[0]["mixed_precision"], "last_loss": [r["losses"][-1] for r in runs],
                 "pad_fraction": runs[0].get("pad_fraction")}
        same_work = "@" not in cell  # a batch sweep's cell trains other batches: its tokens/s and MFU alone
        if script and same_work:  # against the script's first repeat, step by step on the same batches
            entry["max_abs_loss_diff_vs_script"] = max(abs(a - b) for r in runs
                                                       for a, b in zip(r["losses"], script[0]["losses"]))
        if cell == "script" and reseeded:  # two equal trainings whose random draws differ: how far apart
            entry["reseeded_loss_diff"] = max(abs(a - b) for a, b in zip(reseeded, runs[0]["losses"]))
        if script and cell != "script" and same_work:
            base = statistics.median(s["phases"]["median_s"]["total"] for s in script)
            entry |= {"speedup_vs_script": _paired(script, runs),
                      "phase_delta_s": {p: phases[p] - statistics.median(s["phases"]["median_s"].get(p, 0.0)
                                                                         for s in script)
                                        for p in PHASES},
                      "step_delta_pct": 100 * (step - base) / base}
        if equal and cell.startswith("efflab-") and cell != "efflab-equal" and same_work:
            entry["speedup_vs_efflab_equal"] = _paired(equal, runs)
        ceiling = ceilings.get(runs[0].get("ceiling_dtype"))
        if "flops_per_token" in runs[0] and ceiling:
            entry |= {"mfu": entry["tokens_per_s"] * runs[0]["flops_per_token"] / (ceiling * 1e12),
                      "mfu_of": f"the {runs[0]['ceiling_dtype']} matmul ceiling"}
        out[cell] = entry
    return out


def available(samples: dict) -> dict:
    """The cells that ran (a cell's first repeat found unavailable is its only one)."""
    return {c: runs for c, runs in samples.items() if runs and not any("unavailable" in r for r in runs)}


def unavailable(samples: dict) -> dict[str, str]:
    return {c: next(r["unavailable"] for r in runs if "unavailable" in r) for c, runs in samples.items()
            if any("unavailable" in r for r in runs)}


def differences(samples: dict) -> list[dict]:
    """What efflab's loop (as shipped, and at the script's numerics) computes differently from the script: each
    setting whose value differs, with the gain of that knob alone where the pair of cells that differ in it alone
    ran (KNOBS: the cell without it over the cell with it, paired repeat by repeat)."""
    samples = available(samples)
    script = (samples.get("script") or [{}])[0].get("computes")
    out = []
    for cell in ("efflab", "efflab-equal"):
        mine = (samples.get(cell) or [{}])[0].get("computes")
        if not script or not mine:
            continue
        for knob, theirs in script.items():
            if mine.get(knob) == theirs:
                continue
            with_it, without = KNOBS.get(knob, (None, None))
            gain = (_paired(samples[without], samples[with_it])
                    if with_it in samples and without in samples and len(samples[with_it]) == len(samples[without])
                    else None)
            out.append({"cell": cell, "knob": knob, "efflab": mine.get(knob), "script": theirs,
                        "measured_by": f"{with_it} against {without}" if with_it else None, "gain": gain})
    return out


def instrument_cost(samples: dict) -> dict | None:
    """What the live-tensor count's own starts and stops cost, over the efflab-equal cell's steady steps: on how
    many of them it counted, and its median time on those (outside every other phase: measure.phases.watch)."""
    runs = available(samples).get("efflab-equal") or []
    steps = [s for r in runs for s in r["phases"].get("per_step", [])]
    counted = [s["instrument"] for s in steps if s.get("instrument")]
    if not steps:
        return None
    return {"steps": len(steps), "counted": len(counted),
            "median_s": statistics.median(counted) if counted else 0.0}


# efflab's own phases, outside the matmuls: each is held to within OVERHEAD_MS of the script's
OWN_PHASES = ("data", "optimizer", "step_end", "between", "other")
OVERHEAD_MS = 1.0


def phase_overhead(samples: dict, cell: str = "efflab-equal") -> dict | None:
    """Each of `cell`'s own phases (OWN_PHASES) less the script's, repeat by repeat (the two ran side by side in
    each), in ms: the median, its order-statistic interval (95% from 6 repeats) and the verdict against
    OVERHEAD_MS (within where the whole interval is at or below it)."""
    samples = available(samples)
    if cell not in samples or "script" not in samples:
        return None
    out = {}
    for phase in OWN_PHASES:
        deltas = sorted(1000 * (a["phases"]["median_s"].get(phase, 0.0) - b["phases"]["median_s"].get(phase, 0.0))
                        for a, b in zip(samples[cell], samples["script"]))
        ci = median_ci_order(deltas)
        lo, hi = ci[0] if ci else (None, None)
        out[phase] = {"median_ms": percentile(deltas, 0.5), "ci95_ms": [lo, hi] if ci else None,
                      "coverage": ci[1] if ci else None, "n": len(deltas),
                      "verdict": against_tolerance(percentile(deltas, 0.5), lo, hi, OVERHEAD_MS, " ms", len(deltas))}
    return out


def _paired(reference: list[dict], runs: list[dict]) -> dict:
    """The reference's median step over this cell's, repeat by repeat (the two ran side by side in each repeat):
    the median, its order-statistic interval (95% from 6 repeats), the range and the verdict said of this cell
    (faster / slower only where the interval excludes 1; efflab.measure.stats.ratio_verdict)."""
    ratios = [a["phases"]["median_s"]["total"] / b["phases"]["median_s"]["total"] for a, b in zip(reference, runs)]
    return said_of_faster_side(ratio_verdict(ratios)) | {"min": min(ratios), "max": max(ratios),
                                                          "repeats": len(ratios)}


def _speed(entry: dict, key: str = "speedup_vs_script") -> str:
    """The paired ratio (the reference's step over this cell's, repeat by repeat) with its interval and its verdict
    in the report's one vocabulary (faster / slower / same within ±10% / not decided at this size)."""
    s = entry.get(key)
    if not s:
        return "-"
    words = ratio_words(s | {"n": s["repeats"]})
    if s["ci95"]:
        return f"{s['median']:.2f} [{s['ci95'][0]:.2f}, {s['ci95'][1]:.2f}] ({s['coverage']:.1%} CI): {words}"
    return f"{s['median']:.2f} (range {s['min']:.2f}–{s['max']:.2f}, n={s['repeats']}): {words}"


def _pct(fraction: float | None) -> str:
    return "-" if fraction is None else f"{100 * fraction:.1f}"


def table(args, settings: dict, summ: dict) -> str:
    lines = [f"Fine-tuning step time, run `{args.run}` ({settings['max_steps']} steps of batch "
             f"{settings['batch_size']}, the first left out), {args.repeats} interleaved repeats of every cell. A "
             "cell's step and tokens/s are its own medians over the repeats; its comparison with the script is the "
             "× script column alone: the ratio paired repeat by repeat (the two ran side by side in each), whose "
             "verdict is the table's only one. Where it is not decided, the medians beside it may order either way.",
             "",
             "| cell | n | median step (ms) | min–max | tokens/s | × script (script's step / this cell's) | "
             "× efflab-equal | MFU (% of the ceiling in its matmul dtype) | max abs loss diff vs the script's "
             "first repeat | padding (% of positions) | precision |",
             "|---|--:|--:|---|--:|---|---|--:|--:|--:|---|"]
    for cell, e in summ.items():
        mfu = f"{100 * e['mfu']:.1f}" if e.get("mfu") else "-"
        loss = f"{e['max_abs_loss_diff_vs_script']:.3g}" if "max_abs_loss_diff_vs_script" in e else "-"
        lines.append(f"| {cell} | {e['n']} | {1000 * e['step_s_median']:.0f} | {1000 * e['step_s_min']:.0f}–"
                     f"{1000 * e['step_s_max']:.0f} | {e['tokens_per_s']:.1f} | {_speed(e)} | "
                     f"{_speed(e, 'speedup_vs_efflab_equal')} | {mfu} | {loss} | {_pct(e.get('pad_fraction'))} | "
                     f"{e['mixed_precision']} |")
    shown = [p for p in PHASES if any(e["phases_s"][p] for e in summ.values())]
    lines += ["", "Where the step time goes (median ms per step and phase; each step's phases add up to it exactly, "
                  "their medians' sum is beside the median step):", "",
              "| cell | " + " | ".join(shown) + " | sum of phases | median step |", "|---|" + "--:|" * (len(shown) + 2)]
    for cell, e in summ.items():
        lines.append(f"| {cell} | " + " | ".join(f"{1000 * e['phases_s'][p]:.1f}" for p in shown)
                     + f" | {1000 * sum(e['phases_s'].values()):.1f} | {1000 * e['step_s_median']:.1f} |")
    lines += [""] + [f"- {cell} against script: {e['step_delta_pct']:+.1f}% a step; " + ", ".join(
        f"{p} {1000 * d:+.1f} ms" for p, d in e["phase_delta_s"].items() if abs(d) >= 0.0005)
        for cell, e in summ.items() if cell != "script" and "phase_delta_s" in e]
    return "\n".join(lines)


def findings(summ: dict, samples: dict | None = None) -> str:
    """What the numbers say, each sentence computed from them: every cell against the script, efflab-equal's own
    phases against the script's, what each side computes differently and each difference's gain alone, what
    efflab's instruments cost, whether each loss curve stays within the script's own run-to-run difference, and
    the cells this machine could not run."""
    lines = ["What it says:", ""]
    lines += overhead_lines(phase_overhead(samples) if samples else None)
    lines += difference_lines(differences(samples) if samples else [])
    cost = instrument_cost(samples) if samples else None
    if cost and cost["counted"]:
        lines.append(f"- efflab-equal's live-tensor count started and stopped its recording on {cost['counted']} of "
                     f"its {cost['steps']} steady steps, {1000 * cost['median_s']:.1f} ms each (median; the "
                     f"`instrument` phase, outside data and between; its time is left out of efflab's train_s)")
    for cell, e in summ.items():
        if e.get("speedup_vs_script"):
            lines.append(f"- {cell} against the script: {_speed(e)}")
    for cell, e in summ.items():
        if e.get("speedup_vs_efflab_equal") and cell != "efflab-bare":
            lines.append(f"- {cell} against efflab-equal: {_speed(e, 'speedup_vs_efflab_equal')}")
    bare = summ.get("efflab-bare", {}).get("speedup_vs_efflab_equal")
    if bare:  # efflab-equal's step over efflab-bare's: what the instruments add to a step
        cost = [100 * (x - 1) for x in ([bare["median"]] + (bare["ci95"] or []))]
        interval = f" [{cost[1]:+.1f}%, {cost[2]:+.1f}%] ({bare['coverage']:.1%} CI)" if bare["ci95"] else " (no 95% CI)"
        words = ratio_words(bare | {"n": bare["repeats"]}, higher="slower with them", lower="faster with them")
        lines.append(f"- efflab's instruments (step timer, live-tensor count) add {cost[0]:+.1f}%{interval} to a step "
                     f"(efflab-equal against efflab-bare): {words}")
    lines += loss_lines(summ)
    swept = {c: e for c, e in summ.items() if "@" in c or c == "efflab"}
    if len(swept) > 1:  # other batches: the same work per token, not per step
        lines.append("- the batch sweep (tokens/s and MFU; a step of another batch is other work): " + "; ".join(
            f"{c}: {e['tokens_per_step']:.0f} tokens a step, {e['tokens_per_s']:.1f} tokens/s"
            + (f", MFU {100 * e['mfu']:.1f}%" if e.get("mfu") else "") for c, e in swept.items()))
    lines += [f"- {cell}: unavailable here: {why}" for cell, why in (unavailable(samples) if samples else {}).items()]
    return "\n".join(lines)


def loss_lines(summ: dict) -> list[str]:
    """Each cell's loss curve against the script's first repeat, step by step on the same batches, within two
    bands: the script's own repeats (the same seed: the run-to-run difference of one computation) and, wider, the
    script reseeded (its dropout masks and LoRA init drawn anew: how far two equal trainings lie apart)."""
    script = summ.get("script")
    if not script or "max_abs_loss_diff_vs_script" not in script:
        return []
    others = {c: e["max_abs_loss_diff_vs_script"] for c, e in summ.items()
              if c != "script" and "max_abs_loss_diff_vs_script" in e}
    lines = []
    for band, width in (("its repeats", script["max_abs_loss_diff_vs_script"]),
                        ("the script reseeded", script.get("reseeded_loss_diff"))):
        if width is None:
            continue
        within = [c for c, d in others.items() if d <= width]
        beyond = [f"{c} ({others[c]:.3g})" for c in others if c not in within]
        lines.append(f"- loss curves within the script's own run-to-run difference, {band} ({width:.3g}): "
                     f"{', '.join(within) or 'none'}" + (f"; beyond it: {', '.join(beyond)}" if beyond else ""))
    return lines


def overhead_lines(overhead: dict | None) -> list[str]:
    if not overhead:
        return []
    said = []
    for phase, d in overhead.items():
        interval = (f" [{d['ci95_ms'][0]:+.2f}, {d['ci95_ms'][1]:+.2f}] ({d['coverage']:.1%} CI)" if d["ci95_ms"]
                    else f" (n={d['n']}, no 95% interval)")
        said.append(f"{phase} {d['median_ms']:+.2f} ms{interval}: {d['verdict']}")
    held = all(d["verdict"].startswith("within") for d in overhead.values())
    return ["- efflab-equal's own phases (outside the matmuls) against the script's, repeat by repeat: "
            + "; ".join(said) + (f". Each within {OVERHEAD_MS:g} ms of the script's." if held else
                                 f". Not every one is shown within {OVERHEAD_MS:g} ms of the script's.")]


def difference_lines(found: list[dict]) -> list[str]:
    """One line a knob: which of efflab's cells compute it differently from the script, and its gain alone."""
    lines, knobs = [], {}
    for d in found:
        knobs.setdefault(d["knob"], []).append(d)
    for knob, ds in knobs.items():
        d, cells = ds[0], " and ".join(x["cell"] for x in ds)
        gain = d["gain"]
        measured = (f"alone, {d['measured_by']}: {_speed({'g': gain}, 'g')}" if gain else
                    f"not measured alone here (add the cells {d['measured_by'].replace(' against ', ' and ')})"
                    if d["measured_by"] else "no pair of cells measures it alone")
        values = "/".join(dict.fromkeys(_value(x["efflab"]) for x in ds))
        lines.append(f"- {cells} compute{'s' if len(ds) == 1 else ''} differently from the script: {knob} {values} "
                     f"where the script has {_value(d['script'])}; {measured}")
    return lines


def _value(v) -> str:
    return {True: "on", False: "off", None: "the library's default"}.get(v, str(v)) if not isinstance(v, str) else v


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--run", default="lora-r8", help="the finetune run whose settings both sides use")
    parser.add_argument("--results", default="results")
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--cells", default=DEFAULT_CELLS, help=f"comma-separated, of {', '.join(CELLS)}")
    parser.add_argument("--steps", type=int, help="optimizer steps of every cell (default: the run's max_steps; "
                                                   "more give steadier medians)")
    parser.add_argument("--batch-size", help="rows per step in every cell (default: the run's batch_size; larger "
                                              "batches have more padding for packing to remove); `fill`: the most "
                                              "the estimator fits in the device's memory")
    parser.add_argument("--unwatched", action="store_true", help="do not refuse a run on a busy or changing machine "
                                                                  "(smoke tests); its figures say so")
    parser.add_argument("--trace", metavar="CELL", help="after the repeats, one more run of CELL with one steady "
                                                         "step under torch.profiler: its trace beside the output")
    parser.add_argument("--out", default="results/benchmarks/finetune_throughput")
    parser.add_argument("--summarise", metavar="JSON", help="summarise an earlier run's written samples again (no "
                                                             "training); with its --run and --repeats")
    args = parser.parse_args()
    if args.summarise:
        written = json.loads(Path(args.summarise).read_text())
        summ = summarise(written["samples"], written.get("reseeded_script_losses"))
        print((watch_line(written["watch"]) + "\n\n" if "watch" in written else "") + table(args, written["settings"], summ)
              + "\n\n" + findings(summ, written["samples"]) + trace_lines(written.get("trace")))
        return
    params, results = load(args.params), Path(args.results)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    settings, filled = resolve(args, params, results, device)
    cells = args.cells.split(",")
    for cell in cells + ([args.trace] if args.trace else []):
        name, rows = cell_spec(cell)
        if name not in CELLS or rows == -1:
            sys.exit(f"finetune_throughput: error: --cells: {cell!r} is not a cell (expected one of "
                     f"{', '.join(CELLS)}, or one with @ROWS, e.g. efflab@16)")
    measured = measure(args, params, settings, results, cells, device)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    written = {"run": args.run, "settings": settings, "filled": filled} | measured
    out.with_suffix(".json").write_text(json.dumps(written, indent=2))  # first: a summary's bug loses no measurement
    summ = summarise(measured["samples"], measured["reseeded_script_losses"])
    text = watch_line(measured["watch"]) + "\n\n" + table(args, settings, summ) + (
        "\n\n" + findings(summ, measured["samples"]) + trace_lines(measured.get("trace")))
    print(text)
    out.with_suffix(".json").write_text(json.dumps(written | {"summary": summ}, indent=2))
    out.with_suffix(".md").write_text(text + "\n")


def resolve(args, params: dict, results: Path, device: torch.device) -> tuple[dict, dict | None]:
    """The run's settings with --steps and --batch-size; `fill` resolved by the estimator (and recorded)."""
    settings = finetune_run(params, args.run).settings | ({"max_steps": args.steps} if args.steps else {})
    if settings["method"] != "lora":
        sys.exit(f"finetune_throughput: error: --run {args.run!r} is a {settings['method']} run; the baseline "
                 "script is a LoRA script")
    for needed in (results / "base_model" / "model", results / "prepare_data" / "train.parquet"):
        if not needed.exists():
            sys.exit(f"finetune_throughput: error: {needed} does not exist (run the pipeline's base_model and "
                     "prepare_data first)")
    filled = None
    if args.batch_size == "fill":
        filled = fill(results, FinetuneRun.of(settings, args.run), device)
        if not filled["rows"]:
            why = filled.get("unavailable") or f"not even the run's own batch fits in {filled['budget_mib']:.0f} MiB"
            sys.exit(f"finetune_throughput: error: --batch-size fill: {why}")
        settings["batch_size"] = filled["rows"]
        print(f"--batch-size fill: {filled['rows']} rows a step (~{filled['tokens_per_step']:.0f} tokens), the "
              f"estimator's most within {filled['budget_mib']:.0f} MiB", flush=True)
    elif args.batch_size:
        if not args.batch_size.isdigit() or int(args.batch_size) < 1:
            sys.exit(f"finetune_throughput: error: --batch-size: {args.batch_size!r} is neither a number of rows "
                     "nor `fill`")
        settings["batch_size"] = int(args.batch_size)
    return settings, filled


def watch_line(watch: dict) -> str:
    """What the watch saw: the speed probes' spread and others' largest share of the CPU during a cell."""
    probes, shares = watch["probes_gflops"], [x for x in watch["others_share"] if x is not None]
    median = statistics.median(probes)
    said = (f"Watched: {len(probes)} speed probes (one before each cell, one after the last), "
            f"{min(probes):.1f}–{max(probes):.1f} GFLOP/s, within {max(abs(p / median - 1) for p in probes):.0%} of "
            f"their median {median:.1f} (refused beyond ±{watch['tolerance']:.0%}); other processes took at most "
            f"{max(shares, default=0):.0%} of the CPU during a cell (refused beyond {watch['max_others_share']:.0%}).")
    return f"{watch['unwatched']}. {said}" if watch.get("unwatched") else said


def trace_lines(trace: dict | None) -> str:
    if not trace:
        return ""
    if "unavailable" in trace:
        return f"\n\nThe profiled step: unavailable: {trace['unavailable']}"
    rows = trace.get("top10") or []
    lines = ["", "", f"One steady step under torch.profiler (files: {', '.join(trace.get('files', {}).values())}); "
             f"its operators by {trace.get('sorted_by') or 'self time'}, the top {len(rows)}:", ""]
    if rows:
        keys = list(rows[0])
        lines += ["| " + " | ".join(keys) + " |", "|---" * len(keys) + "|"]
        lines += ["| " + " | ".join(f"{r[k]:.2f}" if isinstance(r[k], float) else str(r[k]) for k in keys) + " |"
                  for r in rows]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
