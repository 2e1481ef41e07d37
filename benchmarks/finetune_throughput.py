"""Benchmark: efflab's LoRA fine-tuning throughput vs the plain HF Trainer + peft script a user would write
(benchmarks/trainer_baseline.py), same model, data, steps and hyperparameters, in one run on one machine.

Cells (each a fresh process, interleaved over the repeats so drift hits every cell alike):
  baseline       benchmarks/trainer_baseline.py: dynamic padding, the Trainer's defaults, the model in the
                 dtype transformers 5 loads by default (the saved one: what efflab's base_model chose)
  baseline-fp32  the same script loading the model in float32 (transformers 4's default)
  efflab         `python -m efflab.stages.finetune` with the run's settings as shipped (padding-free packing,
                 the precision the base_model probe found fastest here, step checkpoints on)
  efflab-padded  the same with packing off: what packing alone buys, and efflab's overhead otherwise
  efflab-bf16    the same with bf16 mixed precision forced on (the seeds' other speed-up)

Needs the base model and the prepared data (`snakemake --cores all results/prepare_data/train.parquet
results/base_model/model`, or any earlier `make run`).

    python benchmarks/finetune_throughput.py --run lora-r8 --repeats 3

Reports per cell the median and range of real-token throughput, the ratio of medians vs the baseline and MFU
(model FLOPs per token × tokens/s over the matmul ceiling efflab measured on this machine in the training
dtype), and writes them to results/benchmarks/finetune_throughput.{json,md}.
"""
from __future__ import annotations

import argparse
import json
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
from efflab.config import finetune_run, load

REPO = Path(__file__).resolve().parents[1]
CELLS = ("baseline", "baseline-fp32", "efflab", "efflab-padded", "efflab-bf16")


# The efflab cell's run is added beside the configured runs, so that every cross-check of the params
# (merge.runs, capacity.runs, ...) still holds: the stage reads the same file it would in the pipeline.
BENCH_RUN = "throughput-bench"


def efflab_cell(params: dict, run: str, overrides: dict, results: Path, work: Path) -> dict:
    """One efflab fine-tuning run through the stage's real CLI, in a scratch results folder that shares the
    pipeline's base model and data."""
    scratch = work / "results"
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir()
    for stage in ("base_model", "prepare_data"):
        (scratch / stage).symlink_to((results / stage).resolve())
    cfg = json.loads(json.dumps(params))
    cfg["finetune"]["runs"][BENCH_RUN] = {**cfg["finetune"]["runs"][run], **overrides}
    path = work / "params.yaml"
    path.write_text(yaml.safe_dump(cfg))
    _run([sys.executable, "-m", "efflab.stages.finetune", "--params", str(path), "--results", str(scratch),
          "--name", BENCH_RUN])
    m = json.loads((scratch / "finetune" / BENCH_RUN / "metrics.json").read_text())
    t = m["throughput"]
    return {"tokens_per_s": m["tokens_per_s"], "train_s": m["train_s"], "tokens_seen": m["tokens_seen"],
            "last_loss": m["last_loss"], "mfu": t["mfu_vs_measured_ceiling"], "mixed_precision": m["mixed_precision"],
            "flops_per_token": t["flops"]["model_flops_per_token"], "ceiling_tflops": t["matmul_ceiling"]["tflops"],
            "pad_fraction": m["pad_fraction"]}


def baseline_cell(settings: dict, results: Path, work: Path, dtype: str = "auto") -> dict:
    lora = settings["lora"]
    out = work / "baseline.json"
    _run([sys.executable, str(REPO / "benchmarks" / "trainer_baseline.py"),
                    "--model", str(results / "base_model" / "model"),
                    "--train", str(results / "prepare_data" / "train.parquet"),
                    "--max-steps", str(settings["max_steps"]), "--batch-size", str(settings["batch_size"]),
                    "--learning-rate", str(settings["learning_rate"]), "--warmup-steps", str(settings["warmup_steps"]),
                    "--r", str(lora["r"]), "--alpha", str(lora["alpha"]), "--dropout", str(lora["dropout"]),
                    "--targets", _targets(results / "base_model" / "model", lora["target_modules"]),
                    "--seed", str(settings["seed"]),
                    "--dtype", dtype, "--json", str(out)])
    return json.loads(out.read_text())


def _targets(model: Path, modules: str | list[str] | None) -> str:
    """The LoRA targets efflab resolves for the model (null: peft's default for its family), as the baseline
    script's --targets: peft's own keyword all-linear, or comma-separated names."""
    targets = lora_targets(AutoConfig.from_pretrained(model), modules)
    return targets if isinstance(targets, str) else ",".join(targets)


def _run(argv: list[str]) -> None:
    """A cell's command; a failed one ends the benchmark with the command's own last words, not a traceback."""
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode:
        tail = (done.stderr or done.stdout).strip().splitlines()[-5:]
        sys.exit(f"finetune_throughput: error: {' '.join(argv[1:3])} exited {done.returncode}:\n" + "\n".join(tail))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--run", default="lora-r8", help="the finetune run whose settings both sides use")
    parser.add_argument("--results", default="results")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cells", default="baseline,baseline-fp32,efflab,efflab-padded",
                        help=f"comma-separated, of {', '.join(CELLS)} (efflab-bf16 differs from efflab only where "
                             "the base_model probe chose fp32)")
    parser.add_argument("--out", default="results/benchmarks/finetune_throughput")
    args = parser.parse_args()
    params, results = load(args.params), Path(args.results)
    settings = finetune_run(params, args.run)
    if settings["method"] != "lora":
        sys.exit(f"finetune_throughput: error: --run {args.run!r} is a {settings['method']} run; the baseline "
                 "script is a LoRA script")
    for needed in (results / "base_model" / "model", results / "prepare_data" / "train.parquet"):
        if not needed.exists():
            sys.exit(f"finetune_throughput: error: {needed} does not exist (run the pipeline's base_model and "
                     "prepare_data first)")
    cells = args.cells.split(",")
    overrides = {"efflab": {}, "efflab-padded": {"packing": False}, "efflab-bf16": {"mixed_precision": "bf16"}}
    samples: dict[str, list[dict]] = {c: [] for c in cells}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for repeat in range(args.repeats):
            for cell in cells:
                t0 = time.perf_counter()
                if cell.startswith("baseline"):
                    result = baseline_cell(settings, results, work, "float32" if cell == "baseline-fp32" else "auto")
                else:
                    result = efflab_cell(params, args.run, overrides[cell], results, work)
                samples[cell].append(result)
                print(f"[{repeat + 1}/{args.repeats}] {cell}: {result['tokens_per_s']:.1f} tokens/s "
                      f"({result['tokens_seen']} tokens in {result['train_s']:.1f} s; cell {time.perf_counter() - t0:.0f} s)",
                      flush=True)

    efflab = next((s for c, s in samples.items() if not c.startswith("baseline") and s), [])
    flops = statistics.median(s["flops_per_token"] for s in efflab) if efflab else None
    ceiling = statistics.median(s["ceiling_tflops"] for s in efflab) if efflab else None
    base = statistics.median(s["tokens_per_s"] for s in samples["baseline"]) if samples.get("baseline") else None
    base32 = statistics.median(s["tokens_per_s"] for s in samples["baseline-fp32"]) \
        if samples.get("baseline-fp32") else None
    summary = {}
    for cell, runs in samples.items():
        tps = [s["tokens_per_s"] for s in runs]
        median = statistics.median(tps)
        summary[cell] = {
            "n": len(tps), "tokens_per_s_median": median, "tokens_per_s_min": min(tps), "tokens_per_s_max": max(tps),
            "ratio_vs_baseline": median / base if base else None,
            "ratio_vs_baseline_fp32": median / base32 if base32 else None,
            "mfu": median * flops / (ceiling * 1e12) if flops and ceiling else None,
            "last_loss": [s["last_loss"] for s in runs], "pad_fraction": runs[0].get("pad_fraction"),
            "mixed_precision": runs[0].get("mixed_precision") or f"no autocast, weights {runs[0]['dtype']}",
        }
    lines = [f"Fine-tuning throughput, run `{args.run}` ({settings['max_steps']} steps, batch {settings['batch_size']}), "
             f"{args.repeats} interleaved repeats; MFU over the measured {ceiling:.3f} TFLOP/s matmul ceiling" if ceiling
             else "", "",
             "| cell | n | tokens/s median | min–max | × baseline | × baseline-fp32 | MFU (%) | precision |",
             "|---|---|---|---|---|---|---|---|"]
    for cell, s in summary.items():
        ratio = f"{s['ratio_vs_baseline']:.2f}" if s["ratio_vs_baseline"] else "-"
        ratio32 = f"{s['ratio_vs_baseline_fp32']:.2f}" if s["ratio_vs_baseline_fp32"] else "-"
        mfu = f"{100 * s['mfu']:.1f}" if s["mfu"] else "-"
        lines.append(f"| {cell} | {s['n']} | {s['tokens_per_s_median']:.1f} | {s['tokens_per_s_min']:.1f}–"
                     f"{s['tokens_per_s_max']:.1f} | {ratio} | {ratio32} | {mfu} | {s['mixed_precision']} |")
    table = "\n".join(lines)
    print(table)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"run": args.run, "settings": settings, "summary": summary,
                                                    "samples": samples}, indent=2))
    out.with_suffix(".md").write_text(table + "\n")


if __name__ == "__main__":
    main()
