"""Benchmark: efflab's LoRA fine-tuning against the plain HF Trainer + peft script a user would write
(benchmarks/trainer_baseline.py), same model, rows, steps and hyperparameters, and where each loop's step time
goes, phase by phase.

Cells (each a fresh process, interleaved over the repeats so drift hits every cell alike):
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
  efflab-bf16     efflab with bf16 autocast forced on (the seeds' other speed-up; other numerics)
  script-bf16     the script loading the model in bfloat16 (peft keeps its adapters and their Adam moments fp32)
  efflab-bf16w    efflab with bf16_weights: base and adapters in bf16, Adam moments in fp32, updates rounded
                  stochastically (torchao's AdamW); against script-bf16 it differs in the adapters' dtype

Both loops carry one instrument, efflab.measure.phases.PhaseClock, which stamps every step's phases (data,
forward, backward, optimizer, step end, between steps, other): a cell's step time is its steady steps' median (the
first step left out), its speed against the script the script's median step over its own, repeat by repeat (a
95% interval from 6 repeats; fewer give a range). Every phase's difference from the script is named. The loss of
every step is compared with the script's on the same batches.

Needs the base model and the prepared data (`snakemake --cores all results/prepare_data/train.parquet
results/base_model/model`, or any earlier `make run`).

    python benchmarks/finetune_throughput.py --run lora-r8 --repeats 6

Writes results/benchmarks/finetune_throughput.{json,md}.
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

import yaml
from transformers import AutoConfig

from efflab.architecture import lora_targets
from efflab.config import load
from efflab.experiment import finetune_run
from efflab.measure.phases import PHASES, PHASES_ENV, summary
from efflab.measure.stats import ratio_verdict, ratio_words, said_of_faster_side
from efflab.registry import LOSS_CSV

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
    "efflab-bf16": ("efflab", {"mixed_precision": "bf16"}),
    "script-bf16": ("script", {"dtype": "bfloat16"}),
    "efflab-bf16w": ("efflab", {"bf16_weights": True}),
}
DEFAULT_CELLS = "script,efflab,efflab-equal,efflab-bare,efflab-loop"

# The efflab cell's run is added beside the configured runs, so that every cross-check of the params
# (merge.runs, capacity.runs, ...) still holds: the stage reads the same file it would in the pipeline.
BENCH_RUN = "throughput-bench"


def efflab_cell(params: dict, run: str, overrides: dict, results: Path, work: Path) -> dict:
    """One efflab fine-tuning run through the stage's real CLI, in a scratch results folder that shares the
    pipeline's base model and data, its phases stamped."""
    scratch = work / "results"
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir()
    for stage in ("base_model", "prepare_data"):
        (scratch / stage).symlink_to((results / stage).resolve())
    cfg = json.loads(json.dumps(params))
    cfg["finetune"]["runs"][BENCH_RUN] = {**cfg["finetune"]["runs"][run], **overrides}
    cfg["finetune"].pop("target", None)  # the plain script validates only at its ends: so does the compared run
    path = work / "params.yaml"
    path.write_text(yaml.safe_dump(cfg))
    phases = _run([sys.executable, "-m", "efflab.stages.finetune", "--params", str(path), "--results", str(scratch),
                   "--name", BENCH_RUN], work)
    out = scratch / "finetune" / BENCH_RUN
    m = json.loads((out / "metrics.json").read_text())
    with open(out / LOSS_CSV) as f:
        losses = [float(row["loss"]) for row in csv.DictReader(f)]
    t = m["throughput"]
    return {"phases": phases, "tokens_seen": m["tokens_seen"], "steps": m["steps"], "train_s": m["train_s"],
            "losses": losses, "pad_fraction": m["pad_fraction"],
            "mixed_precision": f"{m['mixed_precision']}, trainable weights {m['trainable_dtype']}",
            "flops_per_token": t["flops"]["model_flops_per_token"], "ceiling_tflops": t["matmul_ceiling"]["tflops"],
            "ceiling_dtype": t["matmul_ceiling"]["dtype"]}


def script_cell(settings: dict, results: Path, work: Path, dtype: str) -> dict:
    lora = settings["lora"]
    out = work / "script.json"
    phases = _run([sys.executable, str(REPO / "benchmarks" / "trainer_baseline.py"),
                   "--model", str(results / "base_model" / "model"),
                   "--train", str(results / "prepare_data" / "train.parquet"),
                   "--max-steps", str(settings["max_steps"]), "--batch-size", str(settings["batch_size"]),
                   "--learning-rate", str(settings["learning_rate"]), "--warmup-steps", str(settings["warmup_steps"]),
                   "--r", str(lora["r"]), "--alpha", str(lora["alpha"]), "--dropout", str(lora["dropout"]),
                   "--targets", _targets(results / "base_model" / "model", lora["target_modules"]),
                   "--seed", str(settings["seed"]), "--dtype", dtype, "--json", str(out)], work)
    result = json.loads(out.read_text())
    return {"phases": phases, "tokens_seen": result["tokens_seen"], "steps": result["steps"],
            "train_s": result["train_s"], "losses": result["losses"], "pad_fraction": result["pad_fraction"],
            "mixed_precision": f"no autocast, weights {result['dtype'].replace('torch.', '')}"}


def _targets(model: Path, modules: str | list[str] | None) -> str:
    """The LoRA targets efflab resolves for the model (null: peft's default for its family), as the baseline
    script's --targets: peft's own keyword all-linear, or comma-separated names."""
    targets = lora_targets(AutoConfig.from_pretrained(model), modules)
    return targets if isinstance(targets, str) else ",".join(targets)


def _run(argv: list[str], work: Path) -> dict:
    """A cell's command, its phases stamped into a file; a failed one ends the benchmark with the command's own
    last words, not a traceback. Returns the phase summary of its steady steps."""
    stamps = work / "phases.json"
    stamps.unlink(missing_ok=True)
    done = subprocess.run(argv, capture_output=True, text=True, env=os.environ | {PHASES_ENV: str(stamps)})
    if done.returncode:
        tail = (done.stderr or done.stdout).strip().splitlines()[-5:]
        sys.exit(f"finetune_throughput: error: {' '.join(argv[1:3])} exited {done.returncode}:\n" + "\n".join(tail))
    return summary(json.loads(stamps.read_text())["steps"])


def measure(args, params: dict, settings: dict, results: Path, cells: list[str]) -> dict[str, list[dict]]:
    samples: dict[str, list[dict]] = {c: [] for c in cells}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for repeat in range(args.repeats):
            for cell in cells if repeat % 2 == 0 else cells[::-1]:  # A B, then B A: drift hits both alike
                loop, knobs = CELLS[cell]
                t0 = time.perf_counter()
                result = (script_cell(settings, results, work, knobs["dtype"]) if loop == "script"
                          else efflab_cell(params, args.run, {k: settings[k] for k in ("max_steps", "batch_size")}
                                           | knobs, results, work))
                samples[cell].append(result)
                step = result["phases"]["median_s"]["total"]
                print(f"[{repeat + 1}/{args.repeats}] {cell}: median step {1000 * step:.0f} ms over "
                      f"{result['phases']['steps']} steady steps (cell {time.perf_counter() - t0:.0f} s)", flush=True)
    return samples
def summarise(samples: dict[str, list[dict]]) -> dict:
    """Per cell: the median step and its spread over repeats, tokens/s, the speed against the script and against
    efflab-equal repeat by repeat (an interval from 6), each phase's median and its difference from the script's,
    the loss curve's largest difference from the script's on the same batches, and MFU where efflab measured the
    ceiling."""
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
        phases = {p: statistics.median(r["phases"]["median_s"][p] for r in runs) for p in PHASES}
        entry = {"n": len(runs), "step_s_median": step, "step_s_min": min(steps), "step_s_max": max(steps),
                 "tokens_per_step": per_step_tokens, "tokens_per_s": per_step_tokens / step, "phases_s": phases,
                 "mixed_precision": runs[0]["mixed_precision"], "last_loss": [r["losses"][-1] for r in runs],
                 "pad_fraction": runs[0].get("pad_fraction")}
        if script:  # the script's own repeats against its first: the loss curve's noise
            entry["max_abs_loss_diff_vs_script"] = max(abs(a - b) for r in runs
                                                       for a, b in zip(r["losses"], script[0]["losses"]))
        if script and cell != "script":
            base = statistics.median(s["phases"]["median_s"]["total"] for s in script)
            entry |= {"speedup_vs_script": _paired(script, runs),
                      "phase_delta_s": {p: phases[p] - statistics.median(s["phases"]["median_s"][p] for s in script)
                                        for p in PHASES},
                      "step_delta_pct": 100 * (step - base) / base}
        if equal and cell.startswith("efflab-") and cell != "efflab-equal":
            entry["speedup_vs_efflab_equal"] = _paired(equal, runs)
        ceiling = ceilings.get(runs[0].get("ceiling_dtype"))
        if "flops_per_token" in runs[0] and ceiling:
            entry |= {"mfu": entry["tokens_per_s"] * runs[0]["flops_per_token"] / (ceiling * 1e12),
                      "mfu_of": f"the {runs[0]['ceiling_dtype']} matmul ceiling"}
        out[cell] = entry
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


def findings(summ: dict) -> str:
    """What the numbers say, each sentence computed from them: every cell against the script, what efflab's
    instruments cost, whether each loss curve stays within the script's own run-to-run difference."""
    lines = ["What it says:", ""]
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
    noise = summ.get("script", {}).get("max_abs_loss_diff_vs_script")
    if noise is not None:
        within = [c for c, e in summ.items() if c != "script" and e.get("max_abs_loss_diff_vs_script", 1e9) <= noise]
        beyond = [c for c, e in summ.items() if c != "script" and c not in within]
        lines.append(f"- loss curves within the script's own run-to-run difference ({noise:.3g}): "
                     f"{', '.join(within) or 'none'}" + (f"; beyond it: {', '.join(beyond)}" if beyond else ""))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--run", default="lora-r8", help="the finetune run whose settings both sides use")
    parser.add_argument("--results", default="results")
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--cells", default=DEFAULT_CELLS, help=f"comma-separated, of {', '.join(CELLS)}")
    parser.add_argument("--steps", type=int, help="optimizer steps of every cell (default: the run's max_steps; "
                                                   "more give steadier medians)")
    parser.add_argument("--batch-size", type=int, help="rows per step in every cell (default: the run's batch_size; "
                                                        "larger batches have more padding for packing to remove)")
    parser.add_argument("--out", default="results/benchmarks/finetune_throughput")
    parser.add_argument("--summarise", metavar="JSON", help="summarise an earlier run's written samples again (no "
                                                             "training); with its --run and --repeats")
    args = parser.parse_args()
    if args.summarise:
        written = json.loads(Path(args.summarise).read_text())
        summ = summarise(written["samples"])
        print(table(args, written["settings"], summ) + "\n\n" + findings(summ))
        return
    params, results = load(args.params), Path(args.results)
    settings = (finetune_run(params, args.run) | ({"max_steps": args.steps} if args.steps else {})
                | ({"batch_size": args.batch_size} if args.batch_size else {}))
    if settings["method"] != "lora":
        sys.exit(f"finetune_throughput: error: --run {args.run!r} is a {settings['method']} run; the baseline "
                 "script is a LoRA script")
    cells = args.cells.split(",")
    if unknown := [c for c in cells if c not in CELLS]:
        sys.exit(f"finetune_throughput: error: --cells: {unknown[0]!r} is not a cell (expected {', '.join(CELLS)})")
    for needed in (results / "base_model" / "model", results / "prepare_data" / "train.parquet"):
        if not needed.exists():
            sys.exit(f"finetune_throughput: error: {needed} does not exist (run the pipeline's base_model and "
                     "prepare_data first)")
    samples = measure(args, params, settings, results, cells)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    written = {"run": args.run, "settings": settings, "samples": samples}
    out.with_suffix(".json").write_text(json.dumps(written, indent=2))  # first: a summary's bug loses no measurement
    summ = summarise(samples)
    text = table(args, settings, summ) + "\n\n" + findings(summ)
    print(text)
    out.with_suffix(".json").write_text(json.dumps(written | {"summary": summ}, indent=2))
    out.with_suffix(".md").write_text(text + "\n")


if __name__ == "__main__":
    main()
