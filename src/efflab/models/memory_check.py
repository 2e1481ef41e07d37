"""What will not fit, said at the dry run: every fine-tuning run's, inference variant's and capacity subject's
predicted peak against the device's memory (estimators.fit), from the model's config where it is at hand
(model_check.config_file) with base_model.config_overrides applied, one line each. The rows are the prepared split's
where it is at hand, else rows of prepare_data.max_length (an upper bound, said so); the dtype is the one base_model
chose where its record is at hand, else the one it will choose on this kind of machine.

torch and transformers take seconds to import, and this runs while Snakemake plans: they are imported inside.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from ..estimators import fit
from ..layout import Layout
from ..registry import not_asked
from . import model_check


def _folder(cfg: dict, path: Path) -> Path:
    """A folder holding the model's config.json with the overrides applied (what the estimators read), written once
    per config and overrides."""
    from .modeling import cache_root

    bm = cfg["base_model"]
    key = path.read_bytes() + json.dumps([bm["config_overrides"], bm["source"]], sort_keys=True).encode()
    folder = cache_root() / "memory-check" / hashlib.sha256(key).hexdigest()[:32]
    if not (folder / "config.json").is_file():
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "config.json").write_text(model_check.load_config(cfg, path).to_json_string())
    return folder


def _dtype(cfg: dict, layout: Layout, device_type: str) -> str:
    from ..measure.env import FAST_BF16_ISA, cpu_isa

    record = layout.metrics("base_model")
    if record.is_file():
        return json.loads(record.read_text())["dtype"]
    if cfg["base_model"]["dtype"] != "auto":
        return cfg["base_model"]["dtype"]
    return "bfloat16" if device_type == "cuda" or FAST_BF16_ISA & set(cpu_isa()) else "float32"


def _lengths(cfg: dict, layout: Layout, rows: int) -> tuple[list[int], dict]:
    """The training rows' token counts, and how they were taken (`bounded`: at max_length, the data not prepared)."""
    split = layout.split("train")
    if split.is_file():
        import pandas as pd

        return ([len(ids) for ids in pd.read_parquet(split, columns=["input_ids"]).input_ids],
                {"rows": "the prepared rows", "bounded": False})
    n = cfg["prepare_data"]["max_length"]
    return [n] * rows, {"rows": f"rows of prepare_data.max_length {n} (at most; the data is not prepared yet)",
                        "bounded": True}


def _line(p: dict, f: dict) -> str:
    room = f"{f['budget_mib'] / 1024:.2f} GiB ({f['budget_source']})"
    if f.get("predicted_mib") is None:
        said = (f"predicted at least {f['floor_mib'] / 1024:.2f} GiB ({f['unavailable']})" if f["floor_mib"] else
                f["unavailable"])
    else:
        said = (f"predicted {f['predicted_mib'] / 1024:.2f} GiB (weights {f['weights_mib'] / 1024:.2f} + peak "
                f"{f['growth_mib'] / 1024:.2f}{', ' + p['rows'] if p.get('rows') else ''})")
    error = "" if f["error"] is None else f"; estimator error ±{100 * f['error']:.1f}% over {f['error_n']} jobs"
    verdict = f["verdict"] or "not decided"
    if p.get("bounded") and verdict == fit.WILL_NOT_FIT and f["floor_mib"] <= f["budget_mib"]:
        verdict = "may not fit (its job decides on the prepared rows)"
    line = f"memory: {p['job']}: {verdict}: {said}; budget {room}{error}"
    if verdict == fit.WILL_NOT_FIT:
        line += (f"; recorded unavailable unless runtime.try_anyway: true (change {p['key']}, or "
                 "runtime.memory_budget)")
    return line


def _precision(run, dtype: str, device_type: str) -> str:
    import torch

    from .build import mixed_precision

    if device_type == "cpu":
        return mixed_precision(run, dtype, torch.device("cpu"))
    return "bf16" if run.mixed_precision == "auto" and not run.bf16_weights else run.mixed_precision


def _training(cfg: dict, folder: Path, dtype: str, device_type: str, layout: Layout) -> list[dict]:
    from ..experiment import finetune_run

    out, c = [], cfg["capacity"]
    for name in cfg["finetune"]["runs"]:
        run = finetune_run(cfg, name)
        lengths, taken = _lengths(cfg, layout, run.batch_size * run.gradient_accumulation_steps)
        predicted = fit.finetune_prediction(folder, run, dtype, _precision(run, dtype, device_type), lengths,
                                            device_type)
        out.append({"job": f"finetune {name}", "key": f"finetune.runs.{name} (method, batch_size, optimizer)"}
                   | taken | predicted)
    for name in c["runs"] if not not_asked(cfg, "capacity") else []:
        run = finetune_run(cfg, name).but(batch_size=1, max_steps=2, gradient_accumulation_steps=1, packing=False)
        out.append({"job": f"capacity {name} (its first cell)", "key": "capacity.runs"} | fit.finetune_prediction(
            folder, run, dtype, _precision(run, dtype, device_type), [c["train_seq_len"]], device_type))
    return out


def _generation(cfg: dict, folder: Path, dtype: str, device_type: str) -> list[dict]:
    from ..estimators.generation_memory import Generation
    from ..experiment import model_ref, variant

    b, c, out = cfg["bench_inference"], cfg["capacity"], []
    prompt = cfg["prepare_data"]["max_length"]
    for name, entry in b["variants"].items() if not not_asked(cfg, "bench_inference") else []:
        batch = max(entry.get("batch_sizes", b["batch_sizes"]))
        shape = Generation(batch, prompt, b["max_new_tokens"], any(entry.get("kv_cache", b["kv_cache"])))
        out.append({"job": f"bench_inference {name}", "key": f"bench_inference.variants.{name}",
                    "rows": f"batch {batch}, prompts of at most {prompt} tokens", "bounded": True}
                   | fit.generation_prediction(folder, dtype, variant(cfg, name).model.quant, shape, device_type))
    for name in c["variants"] if not not_asked(cfg, "capacity") else []:
        shape = Generation(1, c["generate"]["prompt_len"], c["generate"]["new_tokens"])
        out.append({"job": f"capacity {name} (its first cell)", "key": "capacity.variants"}
                   | fit.generation_prediction(folder, dtype, model_ref(cfg, b["variants"][name]).quant, shape,
                                               device_type))
    return out


PREDICTED = ("base_model", "prepare_data", "quantize", "finetune", "bench_inference", "capacity")
CODE = [Path(__file__), Path(fit.__file__).with_name("training_memory.py"),
        Path(fit.__file__).with_name("generation_memory.py"), Path(fit.__file__).with_name("analytic.py")]


def _predictions(cfg: dict, folder: Path, dtype: str, device_type: str, layout: Layout) -> list[dict]:
    """Every job's prediction, reused until the params it reads, the model's config, the prepared split, the dtype or
    this code changes (a Snakemake dry run stays fast; the verdicts are taken anew each time)."""
    from importlib.metadata import version

    from .modeling import cache_root

    split = layout.split("train")
    key = json.dumps([{k: cfg[k] for k in PREDICTED}, (folder / "config.json").read_text(), dtype, device_type,
                      [split.stat().st_size, split.stat().st_mtime_ns] if split.is_file() else None,
                      [p.read_text() for p in CODE], version("transformers")], sort_keys=True, default=str)
    marker = cache_root() / "memory-check" / f"{hashlib.sha256(key.encode()).hexdigest()[:32]}.json"
    if marker.is_file():
        return json.loads(marker.read_text())
    found = [] if not_asked(cfg, "finetune") else _training(cfg, folder, dtype, device_type, layout)
    found += _generation(cfg, folder, dtype, device_type)
    try:
        marker.write_text(json.dumps(found))
    except OSError:
        pass  # an unwritable cache costs the next dry run the predictions again
    return found


def plan(cfg: dict, device_type: str, results: Path = Path("results")) -> list[str]:
    """The dry run's memory lines (none where the model's config is not at hand yet: base_model's job checks then)."""
    path = model_check.config_file(cfg)
    if path is None or not path.is_file():
        return []
    folder, layout = _folder(cfg, path), Layout(results)
    try:
        found = _predictions(cfg, folder, _dtype(cfg, layout, device_type), device_type, layout)
    except (KeyError, ValueError, TypeError, AttributeError, NotImplementedError) as err:  # a family's config the
        return [f"memory: not predicted ({type(err).__name__}: {err}); the jobs run without a verdict"]  # estimators miss
    room, errors = fit.budget(cfg["runtime"], device_type), fit.measured_error(results)
    return [_line(p, fit.assess(p, room, errors)) for p in found]
