"""Whether a job fits the device's memory, said before it starts: at the dry run (common.smk, through `plan`) for every
fine-tuning run, inference variant and capacity subject, and again by each fine-tuning job and inference cell before
it loads its model, from the same functions, on the job's own rows and prompts.

A prediction is the loaded weights (counted from the architecture: parameter bytes, or the quantized footprint) plus
what the memory estimator predicts the job adds over them (training_memory, generation_memory): live tensor bytes,
the kind torch.cuda.max_memory_allocated reports on a GPU (the CUDA context and the allocator's cache come on top)
and the live tensors on a CPU (whose resident set also holds the libraries and what malloc keeps). The budget is
runtime.memory_budget (GiB), else the GPU's memory, else the memory this machine has available now. The verdict:
- will not fit: the prediction is over the budget; the job (or cell) is recorded `unavailable: predicted X GiB > Y GiB`
  without loading its model, unless runtime.try_anyway (a capacity search's cells run under its own budget instead);
- tight: it fits, but not by the estimator's error: the largest |measured / predicted - 1| among the predictions this
  run's records compare (results/ at hand), of the same kind (training or generation), applied to the predicted
  growth over the weights;
- fits.
Where no record compares a prediction yet, the error is not known and nothing is called tight. A family the
estimator does not model has a floor only (weights, gradients and optimizer states): it can be refused, never
called fitting.

torch and transformers take seconds to import, and `plan` runs while Snakemake plans: they are imported inside the
functions that use them.
"""
from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

MiB = 2**20
FITS, TIGHT, WILL_NOT_FIT = "fits", "tight", "will not fit"
KINDS = {"finetune": "training", "bench_inference": "generation"}


def available_host_mib() -> float:
    """The memory this machine has available now (MemAvailable)."""
    meminfo = Path("/proc/meminfo").read_text().splitlines()
    return next(int(line.split()[1]) for line in meminfo if line.startswith("MemAvailable:")) / 1024


def gpu_memory_mib() -> float | None:
    """The smallest visible GPU's memory, from nvidia-smi (no CUDA initialised in this process); None without one."""
    if not shutil.which("nvidia-smi"):
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    sizes = [float(line) for line in out.split() if line.strip().replace(".", "", 1).isdigit()]
    return min(sizes) if sizes else None


def budget(runtime: dict, device_type: str) -> dict:
    """The memory a job may hold, in MiB, and where that figure comes from."""
    if runtime.get("memory_budget") is not None:
        return {"mib": runtime["memory_budget"] * 1024, "source": "runtime.memory_budget"}
    if device_type == "cuda":
        card = gpu_memory_mib()
        if card is not None:
            return {"mib": card, "source": "the GPU's memory"}
    return {"mib": available_host_mib(), "source": "this machine's available memory"}


def measured_error(results: Path) -> dict:
    """Per kind (training, generation): the largest |measured / predicted - 1| among the memory predictions the
    records under `results` compare, and how many; a kind with none is absent."""
    ratios: dict[str, list[float]] = {}
    for stage, kind in KINDS.items():
        for path in sorted((Path(results) / stage).glob("*/metrics.json")):
            try:
                record = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            found = [record.get("memory_prediction")] + [c.get("memory_prediction") for c in record.get("cells") or []
                                                         if isinstance(c, dict)]
            ratios.setdefault(kind, []).extend(p["ratio"] for p in found if p and p.get("ratio"))
    return {kind: {"error": max(abs(r - 1) for r in rs), "n": len(rs)} for kind, rs in ratios.items() if rs}


def assess(prediction: dict, room: dict, errors: dict) -> dict:
    """The verdict of a prediction (finetune_prediction, generation_prediction: the loaded weights and the predicted
    growth over them, or a floor where the family is not modelled) against `room` (budget)."""
    error, weights = errors.get(prediction["kind"]), prediction["weights_mib"]
    out = prediction | {"budget_mib": room["mib"], "budget_source": room["source"],
                        "error": error and error["error"], "error_n": error and error["n"]}
    if prediction.get("growth_mib") is None:
        return out | {"predicted_mib": None, "verdict": WILL_NOT_FIT if prediction["floor_mib"] > room["mib"] else None}
    predicted = weights + prediction["growth_mib"]
    verdict = WILL_NOT_FIT if predicted > room["mib"] else \
        TIGHT if error and weights + prediction["growth_mib"] * (1 + error["error"]) > room["mib"] else FITS
    return out | {"predicted_mib": predicted, "verdict": verdict}


def refusal(fit: dict) -> str | None:
    """Why a job is not started (`unavailable: ...`), where its prediction (or its floor) is over the budget."""
    if fit.get("verdict") != WILL_NOT_FIT:
        return None
    said = (f"predicted {fit['predicted_mib'] / 1024:.2f} GiB" if fit.get("predicted_mib") is not None
            else f"predicted at least {fit['floor_mib'] / 1024:.2f} GiB")
    return f"{said} > {fit['budget_mib'] / 1024:.2f} GiB ({fit['budget_source']})"


def finetune_prediction(folder, run, dtype: str, precision: str, lengths: list[int], device_type: str) -> dict:
    """What the fine-tuning run `run` (a resolved FinetuneRun) on rows of `lengths` tokens is predicted to hold."""
    from ..config import UserError
    from .training_memory import loaded_weights_bytes, optimizer_step_bytes, training_peak

    try:
        weights = loaded_weights_bytes(folder, run, dtype) / MiB
    except UserError as err:  # LoRA targets the family lacks: the run is recorded unavailable for that, with peft's words
        return {"kind": "training", "weights_mib": None, "floor_mib": 0.0, "unavailable": f"not predicted: {err}"}
    growth = training_peak(folder, run, dtype, precision, lengths, device_type)
    out = {"kind": "training", "weights_mib": weights, "floor_mib": weights + optimizer_step_bytes(folder, run) / MiB}
    if growth["total_mib"] is None:
        return out | {"unavailable": growth["unavailable"]}
    return out | {"growth_mib": growth["total_mib"]}


def generation_prediction(folder, dtype: str, quant: dict | None, shape, device_type: str) -> dict:
    """What a greedy generation of `shape` (generation_memory.Generation) with the weights `quant` loads is predicted
    to hold."""
    from .generation_memory import generation_peak

    growth = generation_peak(folder, dtype, quant, shape, device=device_type)
    if growth["weights_mib"] is None:  # a scheme without a footprint model (torchao int4)
        return {"kind": "generation", "weights_mib": None, "floor_mib": growth["total_mib"],
                "unavailable": f"no footprint model of {quant['method']}"}
    return {"kind": "generation", "weights_mib": growth["weights_mib"], "floor_mib": growth["weights_mib"],
            "growth_mib": growth["total_mib"]}


def try_anyway(cfg: dict) -> bool:
    return bool(cfg["runtime"].get("try_anyway"))
