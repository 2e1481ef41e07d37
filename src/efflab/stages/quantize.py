"""Stage quantize: post-training quantization of the base model with bitsandbytes, one job per scheme.

Each job loads the base folder with the scheme's BitsAndBytesConfig, saves the quantized folder,
reloads it and evaluates validation perplexity on the same rows as the baseline scheme (method none),
whose job every other scheme's job waits for, so the change is measured against it.
"""
from __future__ import annotations

import logging
import time

from .. import cli, quality, records
from ..layout import Job
from ..measure.device import pick_device, set_threads
from ..measure.env import environment
from ..measure.flops import count_parameters
from ..measure.memory import track_memory
from ..modeling import base_dtype, eval_loss, folder_bytes, load_model, load_tokenizer, read_split

log = logging.getLogger("efflab")


def run(cfg: dict, job: Job) -> dict:
    """Quantize the base model with one scheme and measure footprint, load time and perplexity."""
    q = cfg["quantize"]
    scheme = q["schemes"][job.name]
    layout = job.layout
    dtype = base_dtype(layout)
    set_threads(cfg["runtime"])
    device = pick_device(cfg["runtime"])
    tokenizer = load_tokenizer(layout.base_model())
    rows = read_split(layout.split("validation"), q["eval_rows"])

    baseline = cfg["report"]["baseline_scheme"]
    skipped = job.name != baseline and layout.skipped_because("quantize", baseline)
    if skipped:  # no reference to measure the change against
        layout.write_not_run("quantize", job.out, skipped["status"], skipped["reason"])
        return {**skipped, "scheme": job.name, "method": scheme["method"], "environment": environment(device, q)}
    reference = None if job.name == baseline else records.read(layout, "quantize", baseline)

    with track_memory(device) as load_mem:
        t0 = time.perf_counter()
        model = load_model(layout.base_model(), dtype, device, quant=scheme)
        quantize_s = time.perf_counter() - t0
    folder = job.out / "model"
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    del model

    t0 = time.perf_counter()
    model = load_model(folder, dtype, device)
    load_s = time.perf_counter() - t0
    quantized_modules = sorted({type(m).__name__ for m in model.modules() if "bitsandbytes" in type(m).__module__})
    with track_memory(device) as eval_mem:
        scheme_eval = eval_loss(model, rows, q["batch_size"], tokenizer)
    footprint = model.get_memory_footprint()
    base_eval = reference["validation"] if reference else scheme_eval
    base_footprint = reference["memory_footprint_bytes"] if reference else footprint
    log.info("%s: footprint %.1f MiB (%.2fx smaller), perplexity %.3f vs %.3f base",
             job.name, footprint / 2**20, base_footprint / footprint,
             scheme_eval["perplexity"], base_eval["perplexity"])
    return {
        "scheme": job.name, "method": scheme["method"], "double_quant": scheme.get("double_quant", False),
        "compute_dtype": dtype, "bnb_layer_types": quantized_modules,
        "parameters": count_parameters(model)["total"],
        "memory_footprint_bytes": footprint, "base_memory_footprint_bytes": base_footprint,
        "footprint_ratio_vs_base": base_footprint / footprint,
        "bytes_on_disk": folder_bytes(folder), "quantize_s": quantize_s, "load_s": load_s,
        "quantize_memory": load_mem, "eval_memory": eval_mem,
        "validation": scheme_eval, "base_validation": base_eval,
        "perplexity_change_pct": 100.0 * (scheme_eval["perplexity"] / base_eval["perplexity"] - 1.0),
        "perplexity_change": quality.paired_change(base_eval["per_row"], scheme_eval["per_row"]),
        "environment": environment(device, q),
    }


if __name__ == "__main__":
    cli.main("quantize", run)
