"""Stage qat: quantization-aware training against post-training quantization at each bit width, and the
precision range test of the QAT notes (004): from the lowest width up, B_min is the first width whose
perplexity stays within the one perplexity tolerance (tolerance.perplexity_pct).

Every model here trains on the same batches, in the same order, with the same schedule:
- `full precision`: the base model fine-tuned `train.steps` steps. The tolerance is relative to it.
- PTQ at b bits: that fine-tuned model, its weights quantized after training.
- QAT at b bits: the base model fine-tuned with the same weights fake-quantized in every forward pass
  (quantized and dequantized, gradients passed straight through), then quantized.
So PTQ and QAT differ only in whether training saw the quantization. torchao does both the fake quantization
(QATConfig prepare/convert with IntxFakeQuantizeConfig) and the quantization itself (IntxWeightOnlyConfig:
symmetric, round to nearest, one scale per `group_size` weights). Quantized: every linear layer of the decoder
blocks; the embedding and the LM head (tied to it in SmolLM2) stay in full precision.

Each model is a cell (runtime.isolation), journalled as it ends. Per-row validation losses go to evals.csv and
per-step training losses to losses.csv: every perplexity and B_min in metrics.json is recomputed from them by
the tests. The fine-tuned full-precision model is kept (finetuned/, float32, loads in plain transformers), so
the PTQ figures can be recomputed from it.
"""
from __future__ import annotations

import csv
import logging
import math
import shutil
import tempfile
import time
from pathlib import Path

import torch

from .. import cli, quality, records
from ..architecture import linear_layers, matmul_shape, undivided_layer
from ..config import UserError, task_relative, task_tolerance
from ..evaluation import harness, scores, task
from ..layout import Job, Layout
from ..measure.env import environment
from ..measure.isolation import prestart, run_cell
from ..measure.stats import summarize
from ..models.modeling import forward_batches, load_model, load_tokenizer, read_split, row_nll, shape_only
from ..registry import LM_EVAL, QAT_MODEL
from ..training import StepRun, batches, training_step

# torchao, tqdm and transformers are imported inside the functions that use them: torchao's import is slow and noisy.

log = logging.getLogger("efflab")

FINETUNED = QAT_MODEL
EVALS_CSV, EVAL_COLUMNS = "evals.csv", ("variant", "method", "bits", "row", "tokens", "nll_sum")
LOSSES_CSV, LOSS_COLUMNS = "losses.csv", ("variant", "step", "loss")
QUANTIZED = "every linear layer of the decoder blocks; the embedding and the LM head stay in full precision"


def torchao():
    """torchao's quantization API (its import warnings are kept off the console: logs.QUIET_LIBRARIES)."""
    from torchao.quantization import IntxWeightOnlyConfig, PerGroup, quantize_
    from torchao.quantization.qat import IntxFakeQuantizeConfig, QATConfig

    return IntxWeightOnlyConfig, PerGroup, quantize_, IntxFakeQuantizeConfig, QATConfig


def int_dtype(bits: int) -> torch.dtype:
    return torch.int8 if bits == 8 else getattr(torch, f"int{bits}")


quantized_layers = linear_layers  # the layers quantized: every nn.Linear except the LM head


def check_group_size(model, group_size: int) -> None:
    undivided = undivided_layer(model, group_size)
    if undivided:
        raise UserError(f"qat.group_size: {group_size} does not divide the {undivided[1]} input features "
                        f"of {undivided[0]} (expected a divisor of every quantized layer's input size)")


def _only_quantized(model):
    layers = set(map(id, quantized_layers(model).values()))
    return lambda module, fqn: id(module) in layers


def quantize(model, bits: int, group_size: int) -> None:
    """Post-training quantization in place: the weights of the quantized layers become int`bits` codes and
    per-group scales."""
    weight_only, per_group, quantize_, _, _ = torchao()
    quantize_(model, weight_only(weight_dtype=int_dtype(bits), granularity=per_group(group_size)),
              filter_fn=_only_quantized(model))


def prepare_qat(model, bits: int, group_size: int) -> None:
    """Fake-quantize the weights of the quantized layers in every forward pass (quantization-aware training)."""
    _, _, quantize_, fake, qat_config = torchao()
    quantize_(model, qat_config(weight_config=fake(int_dtype(bits), group_size=group_size, is_symmetric=True),
                                step="prepare"), filter_fn=_only_quantized(model))


def convert_qat(model, bits: int, group_size: int) -> None:
    """Replace the fake-quantized layers by really quantized ones, with the same quantizer as `quantize`."""
    weight_only, per_group, quantize_, _, qat_config = torchao()
    layers = {id(m) for n, m in model.named_modules() if type(m).__name__ == "FakeQuantizedLinear"}
    quantize_(model, qat_config(weight_only(weight_dtype=int_dtype(bits), granularity=per_group(group_size)),
                                step="convert"), filter_fn=lambda module, fqn: id(module) in layers)


def weight_bytes(model, bits: int | None, group_size: int) -> dict:
    """The quantized layers' weights: in full precision (fp32), as held (torchao keeps each code in an int8),
    and packed `bits` per weight with a bf16 scale per group, as a packed kernel would store them."""
    numel = sum(m.weight.numel() for m in quantized_layers(model).values())
    held = 0
    for layer in quantized_layers(model).values():
        w = layer.weight
        held += sum(getattr(w, a).numel() * getattr(w, a).element_size()
                    for a in ("qdata", "scale", "zero_point") if hasattr(w, a)) or w.numel() * w.element_size()
    return {"weights": numel, "fp32_bytes": 4 * numel, "held_bytes": held,
            "packed_bytes": None if bits is None else numel * bits / 8 + 2 * numel / group_size}


def per_row_nll(model, rows: list[dict], tokenizer, batch_size: int = 4) -> list[dict]:
    """Summed next-token loss and label-token count of each validation row (right-padded batches: a row's
    real tokens never see the padding after them)."""
    per_row = [r for batch, logits in forward_batches(model, rows, batch_size, tokenizer)
               for r in row_nll(logits, batch["labels"])]
    return [{"row": i, "tokens": n, "nll_sum": nll} for i, (n, nll) in enumerate(per_row)]


def perplexity(rows: list[dict]) -> float:
    return math.exp(sum(r["nll_sum"] for r in rows) / sum(r["tokens"] for r in rows))


def _train(model, q: dict, tokenizer, train_rows: list[dict], dtype: str, device: torch.device, tag: str,
           scratch: str) -> dict:
    from tqdm.auto import tqdm

    run = StepRun.of(q["train"])
    steps = batches(run, tokenizer, train_rows, run.steps, device)
    step, precision = training_step(run, model, dtype, device, steps, scratch)
    losses, times = [], []
    for i in (bar := tqdm(range(run.steps), desc=f"qat {tag}", unit="step", leave=False)):
        t0 = time.perf_counter()
        losses.append(step(i).item())
        times.append(time.perf_counter() - t0)
        bar.set_postfix(loss=f"{losses[-1]:.3f}")
    model.eval()
    return {"losses": losses, "train_s": sum(times), "mixed_precision": precision,
            "step_time": summarize(times[1:] or times)}


def cell(cfg: dict, results: str, method: str, bits: int | None, dtype: str, device: str) -> dict:
    """One model of the grid: `full precision` (trains, keeps the fine-tuned model), `ptq` or `qat` at `bits`."""
    from transformers import set_seed

    q, layout, device = cfg["qat"], Layout(Path(results)), torch.device(device)
    set_seed(q["train"]["seed"])
    tokenizer = load_tokenizer(layout.base_model())
    val_rows = read_split(layout.split("validation"), q["eval_rows"])
    scratch = layout.out("qat") / f".{FINETUNED}"
    result = {}
    if method == "ptq":
        model = load_model(scratch, "float32", device)
        quantize(model, bits, q["group_size"])
    else:
        model = load_model(layout.base_model(), "float32", device)  # trained in fp32, as finetune's full runs
        if method == "full precision":
            result["base_rows"] = per_row_nll(model, val_rows, tokenizer)
        else:
            prepare_qat(model, bits, q["group_size"])
        train_rows = read_split(layout.split("train"))
        result |= _train(model, q, tokenizer, train_rows, dtype, device, method if bits is None else f"int{bits}",
                         str(layout.out("qat") / ".trainer"))
        if method == "full precision":
            model.save_pretrained(scratch, safe_serialization=True)
            tokenizer.save_pretrained(scratch)
        else:
            # the fake-quantized model computes what the converted one does: record that it did
            result["fake_quantized_rows"] = per_row_nll(model, val_rows, tokenizer)
            convert_qat(model, bits, q["group_size"])
    result["rows"] = per_row_nll(model, val_rows, tokenizer)
    result["weight_bytes"] = weight_bytes(model, bits, q["group_size"])
    result["tasks"] = score_tasks(cfg, layout, model, tokenizer) if q["eval_tasks"] else {}
    return result


def score_tasks(cfg: dict, layout: Layout, model, tokenizer) -> dict:
    """Task quality, through the evaluate stage's code (QAT models live only in this cell): a scratch task folder
    with evaluate's generation settings, as an evaluate job writes its own."""
    e = cfg["evaluate"]
    with tempfile.TemporaryDirectory(prefix="efflab-qat-tasks-") as scratch:
        folder = task.write_task(Path(scratch) / LM_EVAL, layout.lm_eval_docs(),
                                 task.generation_kwargs(e["max_new_tokens"], tokenizer.eos_token))
        return harness.evaluate(model, tokenizer, folder, cfg["qat"]["eval_tasks"], e["docs"], e["batch_size"],
                                e["bootstrap_iters"])


def _rows(variant: str, method: str, bits, rows: list[dict]) -> list[dict]:
    return [{"variant": variant, "method": method, "bits": "" if bits is None else bits} | r for r in rows]


def _write_csv(path: Path, columns, rows: list[dict]) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)


def check_family(skeleton, group_size: int) -> None:
    """The model has linear layers to fake-quantize (else unavailable, naming its projections), and the group
    size divides their input sizes."""
    if not quantized_layers(skeleton):  # recorded as unavailable (cli.not_run), naming what the family lacks
        head = skeleton.get_output_embeddings()
        kinds = sorted({type(m).__name__ for m in skeleton.modules() if matmul_shape(m) and m is not head})
        raise NotImplementedError(f"qat fake-quantizes nn.Linear layers (torchao) and {type(skeleton).__name__} "
                                  f"has none besides its LM head: its projections are {', '.join(kinds)}")
    check_group_size(skeleton, group_size)


def run_cells(cfg: dict, layout, journal, bits: list[int], dtype: str, device) -> dict:
    """The full-precision fine-tune, then PTQ and QAT at every width, each a cell: name -> result."""
    rt, cells = cfg["runtime"], {}
    for method, b in [("full precision", None)] + [(m, b) for b in bits for m in ("ptq", "qat")]:
        name = method if b is None else f"{method}-int{b}"
        if method == "ptq" and not records.is_ok(cells["full precision"]):
            cells[name] = {"status": "skipped", "reason": "the full-precision fine-tune did not run"}
            continue
        cells[name] = journal.result({"method": method, "bits": b}, lambda: run_cell(
            cell, dict(cfg=cfg, results=str(layout.root), method=method, bits=b, dtype=dtype, device=str(device)),
            isolation=rt["isolation"], timeout_s=rt["cell_timeout_s"], memory_cap_mib=rt["cell_memory_cap_mib"]))
        result = cells[name]
        if records.is_ok(result):
            log.info("qat %s: validation perplexity %.2f", name, perplexity(result["rows"]))
        else:
            log.warning("qat %s: %s: %s", name, result["status"], result.get("reason"))
    return cells


def tables(cells: dict, tolerance: dict, relative: float | None = None) -> tuple[list, list, list]:
    """(evals rows, loss rows, one entry per model) from the cells' results; each PTQ and QAT model's task scores
    paired with the full-precision fine-tune's, gated by `tolerance` (config.task_tolerance) and `relative` of the
    full-precision fine-tune's score (config.task_relative)."""
    evals, losses, variants = [], [], []
    fp = cells["full precision"]
    if records.is_ok(fp):
        evals += _rows("base", "base", None, fp["base_rows"])
    for name, result in cells.items():
        method, b = (name, None) if name == "full precision" else (name.split("-")[0], int(name.rsplit("int", 1)[1]))
        entry = {"variant": name, "method": method, "bits": b, "status": result["status"]}
        if not records.is_ok(result):
            variants.append(entry | {"reason": result.get("reason")})
            continue
        evals += _rows(name, method, b, result["rows"])
        losses += [{"variant": name, "step": i + 1, "loss": v} for i, v in enumerate(result.get("losses", []))]
        entry |= {"perplexity": perplexity(result["rows"]), "weight_bytes": result["weight_bytes"],
                  "cell_wall_s": result.get("cell_wall_s")}
        if "losses" in result:
            entry |= {"first_loss": result["losses"][0], "last_loss": result["losses"][-1],
                      "train_s": result["train_s"], "step_time": result["step_time"],
                      "mixed_precision": result["mixed_precision"]}
        if "fake_quantized_rows" in result:
            entry["fake_quantized_perplexity"] = perplexity(result["fake_quantized_rows"])
        entry["tasks"] = {t: {k: v for k, v in r.items() if k != "docs"} for t, r in result["tasks"].items()}
        if method in ("ptq", "qat") and records.is_ok(fp):
            entry["perplexity_change"] = quality.paired_change(fp["rows"], result["rows"])
            entry["task_changes"] = scores.paired_changes(result["tasks"], fp, tolerance, relative)
            entry["task_gate"] = scores.gate_verdict(entry["task_changes"])
        if method == "qat" and records.is_ok(fp):
            entry |= against_ptq(fp, cells.get(f"ptq-int{b}") or {}, result)
        variants.append(entry)
    return evals, losses, variants


def against_ptq(fp: dict, ptq: dict, qat: dict) -> dict:
    """A QAT model as torchao reports it: the share of the same width's PTQ perplexity gap it recovers, paired over
    the validation rows. (What its step costs against the full-precision fine-tune's is said by the report, from the
    step times: decisions' qat_step_cost fact.)"""
    return {"recovered_share": quality.recovered_share(fp["rows"], ptq["rows"], qat["rows"])} if records.is_ok(ptq) \
        else {}


def precision_tests(variants: list[dict], tolerance_pct: float, reference: float | None, bits: list[int]) -> dict:
    """The precision range test of PTQ and of QAT: the lowest width whose perplexity change passes."""
    tests = {}
    for method in ("ptq", "qat"):
        changes = {v["bits"]: v.get("perplexity_change") for v in variants if v["method"] == method}
        tests[method] = quality.range_test(changes, tolerance_pct) if reference else None
        if reference:
            t = tests[method]
            log.info("precision range test, %s: B_min %s (the whole 95%% interval of the perplexity change "
                     "within +%g%% of %.2f)", method, f"{t['b_min']} bits" if t["b_min"] else
                     f"undecided at {t['undecided_at']} bits" if t["undecided_at"] else f"none of {bits}",
                     tolerance_pct, reference)
    return tests


def run(cfg: dict, job: Job) -> dict:
    """Fine-tune in full precision, then PTQ and QAT at every bit width; the precision range test for each."""
    q, rt, layout = cfg["qat"], cfg["runtime"], job.layout
    # the cells' forkserver imports beside this job (lm-eval only where the cells evaluate)
    prestart(rt["isolation"], extra=harness.PRELOAD if q["eval_tasks"] else [])
    device, dtype = job.device, job.dtype
    check_family(shape_only(layout.base_model()), q["group_size"])
    bits = sorted(q["bits"])
    journal = job.journal({"qat": q, "runtime": rt, "base": layout.metrics("base_model").read_text()})
    cells = run_cells(cfg, layout, journal, bits, dtype, device)
    evals, losses, variants = tables(cells, task_tolerance(cfg), task_relative(cfg))
    fp = cells["full precision"]
    reference = perplexity(fp["rows"]) if records.is_ok(fp) else None
    tests = precision_tests(variants, cfg["tolerance"]["perplexity_pct"], reference, bits)
    out = job.out
    _write_csv(out / EVALS_CSV, EVAL_COLUMNS, evals)
    _write_csv(out / LOSSES_CSV, LOSS_COLUMNS, losses)
    scratch = layout.out("qat") / f".{FINETUNED}"
    if scratch.is_dir():
        shutil.move(str(scratch), str(out / FINETUNED))
    else:
        (out / FINETUNED).mkdir()
    journal.remove()
    shutil.rmtree(layout.out("qat") / ".trainer", ignore_errors=True)
    return {
        "status": "ok" if records.is_ok(fp) else "failed", "dtype": dtype, "bits": bits,
        "group_size": q["group_size"], "tolerance_pct": cfg["tolerance"]["perplexity_pct"], "quantized": QUANTIZED,
        "quantizer": "torchao IntxWeightOnlyConfig (symmetric, per group, round to nearest); QAT: QATConfig "
                     "with IntxFakeQuantizeConfig, converted with the same quantizer",
        "base_perplexity": perplexity(fp["base_rows"]) if records.is_ok(fp) else None,
        "reference_perplexity": reference, "precision_range_test": tests, "variants": variants,
        "eval_rows": q["eval_rows"], "environment": environment(device, q),
    }


if __name__ == "__main__":
    cli.main("qat", run)
