"""Peak memory of a fine-tuning run, predicted before it starts (what a prediction is and how it is compared
with the measurement: estimators.memory).

Training: the peak is at the start of the backward pass of the longest padded batch, when every tensor the
forward saved for the backward is alive together with the three vocabulary-sized fp32 tensors of the loss,
or at the optimizer step (gradients + optimizer states), whichever is larger. The saved tensors are counted
per decoder layer from what each op of the transformers implementation saves (autograd saves an input only
when the other operand needs a gradient; autocast saves its low-precision copies), for the decoder family
efflab loads with SDPA attention (RMSNorm, rotary q/k, grouped-query SDPA with a padding mask, gated MLP):
llama, mistral, qwen2. Sizes are bytes; results are MiB.
"""
from __future__ import annotations

import math

import torch

from .. import architecture, lora
from ..experiment import FinetuneRun
from . import analytic
from .memory import ELEMENT_BYTES, MiB

DECODERS = ("llama", "mistral", "qwen2")
# cross-entropy's fp32 log-softmax output (saved), its gradient and the logits' gradient: live together when
# the backward pass starts (the logits themselves are freed once the Trainer drops the model outputs)
LOSS_VOCAB_TENSORS = 3
# bitsandbytes 8-bit optimizers keep 32-bit state for tensors under 4096 elements (min_8bit_size) and
# otherwise one byte per moment, one fp32 absmax per 256-element block per moment and a 256-entry fp32 qmap
BNB_MIN_8BIT_SIZE, BNB_STATE_BLOCK, BNB_QMAP = 4096, 256, 256
TRAINING_COMPARES_TO = "peak of live tensor bytes over those just before trainer.train()"


def padded_batch_lengths(lengths: list[int], batch_size: int, steps: int, accumulation: int, seed: int,
                         packing: bool = False) -> list[list[tuple[int, int]]]:
    """(rows, padded length) of every micro-batch of every optimizer step, in the order the Trainer draws
    them: accelerate's SeedableRandomSampler is a torch.randperm seeded with data_seed + epoch, batches are
    consecutive slices (the last one of an epoch short), each padded to its longest row; with packing (padding
    free) one row of all the batch's tokens, whose block-diagonal mask is (tokens x tokens)."""
    micro: list[tuple[int, int]] = []
    epoch = 0
    while len(micro) < steps * accumulation:
        generator = torch.Generator()
        generator.manual_seed(seed + epoch)
        order = torch.randperm(len(lengths), generator=generator).tolist()
        batches = [[lengths[j] for j in order[i:i + batch_size]] for i in range(0, len(order), batch_size)]
        micro += [(1, sum(b)) if packing else (len(b), max(b)) for b in batches]
        epoch += 1
    return [micro[k * accumulation:(k + 1) * accumulation] for k in range(steps)]


def longest_micro_batch(lengths: list[int], run: FinetuneRun) -> int:
    """The most token positions (rows x padded length; packed: the batch's tokens) of any micro-batch `run` will
    train on, in the Trainer's own order (padded_batch_lengths)."""
    steps = padded_batch_lengths(lengths, run.batch_size, run.max_steps, run.gradient_accumulation_steps,
                                 run.seed, run.packing)
    return max(rows * length for micro in steps for rows, length in micro)


def _arch(folder) -> dict:
    return architecture.shape(analytic.hf_config(str(folder)))


def _precisions(run: FinetuneRun, dtype: str, precision: str) -> dict:
    """Element sizes of the run as efflab's finetune builds it: full fine-tuning loads fp32 weights; LoRA keeps
    the base in the base dtype; QLoRA's prepare_model_for_kbit_training upcasts everything not 4-bit (norms,
    embeddings, head) to fp32. peft keeps adapters in fp32. Autocast (mixed precision) computes linears and
    SDPA in 16 bits."""
    method = run.method
    return {"autocast": {"bf16": 2, "fp16": 2}.get(precision), "base": 4 if method in ("full", "qlora") else
            ELEMENT_BYTES[dtype], "four_bit": method == "qlora", "trainable_base": method == "full"}


class _Saved:
    """Bytes per token saved for the backward pass; a tensor saved by several ops counts once (by name)."""

    def __init__(self):
        self.names: set[str] = set()
        self.per_token = 0.0

    def keep(self, name: str, nbytes: float) -> None:
        if name not in self.names:
            self.names.add(name)
            self.per_token += nbytes


def _linear_input(saved: _Saved, p: dict, lora: dict | None, module: str, source: str, width: int,
                  source_bytes: int, grad_in: bool) -> None:
    """What a linear layer keeps of its input (`source`, `width` features of `source_bytes` each)."""
    c = p["autocast"]
    if p["trainable_base"]:  # the weight's gradient needs the input: a 16-bit copy per layer under autocast
        saved.keep(f"{source}@{module}" if c and c != source_bytes else source, (c or source_bytes) * width)
    if lora and module in lora["modules"]:
        dropout = lora["dropout"] > 0
        if dropout and grad_in:  # CPU/CUDA dropout keeps its fp32 scaled mask for the input's gradient
            saved.keep(f"{source}:mask@{module}", 4 * width)
        if c:  # lora_A's weight gradient needs its input, cast to 16 bits by autocast
            saved.keep(f"{source}:lora@{module}", c * width)
        elif dropout or source_bytes != 4:  # the dropped (or fp32-cast) input, a new fp32 tensor per adapter
            saved.keep(f"{source}:lora@{module}", 4 * width)
        else:  # no dropout, fp32 input: lora_A keeps the input itself, shared by the adapters that read it
            saved.keep(source, 4 * width)


def _decoder_layer(a: dict, p: dict, lora: dict | None, grad_in: bool) -> tuple[float, float, bool]:
    """(bytes per token, bytes per (row x length^2), output requires grad) saved by one decoder layer."""
    h, i, attn = a["hidden"], a["intermediate"], a["heads"] * a["head_dim"]
    c, base = p["autocast"], p["base"]
    saved = _Saved()
    norm = 4 + (4 if p["trainable_base"] else 0)  # RMSNorm keeps its fp32 input, and x/rms when its weight trains
    if grad_in:
        saved.keep("x", norm * h)
    for module in ("q_proj", "k_proj", "v_proj"):
        _linear_input(saved, p, lora, module, "y1", h, base, grad_in)
    grad_attn = grad_in or p["trainable_base"] or bool(lora and {"q_proj", "k_proj", "v_proj"} & lora["modules"])
    out_bytes = c or base  # linear outputs: 16-bit under autocast; a 4-bit layer returns its input's dtype
    per_square = 0.0
    if grad_attn:
        # SDPA (flash on CPU, also with a mask) keeps q, the repeated k and v, and its output at the heads'
        # width, the fp32 log-sum-exp per head, and the boolean padding mask converted to the query dtype
        sdpa = c or max(out_bytes, base)
        saved.per_token += 4 * sdpa * attn + 4 * a["heads"]
        saved.names.add("attn")  # the output, o_proj's input
        per_square = sdpa
    _linear_input(saved, p, lora, "o_proj", "attn", attn, c or max(out_bytes, base), grad_attn)
    grad_mlp = grad_attn or bool(lora and "o_proj" in lora["modules"])
    if grad_mlp:
        saved.keep("r1", norm * h)
    for module in ("gate_proj", "up_proj"):
        _linear_input(saved, p, lora, module, "y2", h, base, grad_mlp)
    mlp = base if p["four_bit"] else (c or base)
    if grad_mlp:  # SiLU keeps the gate, the product keeps SiLU(gate) and up
        saved.per_token += 3 * mlp * i
    _linear_input(saved, p, lora, "down_proj", "gated", i, mlp, grad_mlp)
    return saved.per_token, per_square, grad_mlp


def activation_rates(folder, run: FinetuneRun, dtype: str, precision: str) -> dict:
    """Bytes the forward pass leaves saved for the backward, per token and per (row x length^2), by part:
    a batch's shape only scales them (see `activation_terms`)."""
    a, p = _arch(folder), _precisions(run, dtype, precision)
    lora = None
    if run.method != "full":
        names = {lay["name"].rsplit(".", 1)[-1] for lay in _targeted_layers(folder, run)}
        lora = {"modules": names, "dropout": run.lora["dropout"]}
    checkpointing = run.gradient_checkpointing
    # the embedding output needs a gradient when the embedding trains, or when checkpointing (efflab then makes
    # the inputs require grad, as peft's prepare_model_for_kbit_training does, so the recomputed layers have one)
    grad = p["trainable_base"] or checkpointing
    per_token = per_square = 0.0
    for _ in range(a["layers"]):
        layer_token, layer_square, grad = _decoder_layer(a, p, lora, grad)
        per_token, per_square = per_token + layer_token, per_square + layer_square
    head = (4 + (4 if p["trainable_base"] else 0)) * a["hidden"]  # final RMSNorm
    if p["trainable_base"]:  # the head's weight gradient needs its input
        head += (p["autocast"] or p["base"]) * a["hidden"]
    rates = {"layers_per_token": per_token, "layers_per_square": per_square, "head_per_token": head,
             "loss_per_token": LOSS_VOCAB_TENSORS * 4 * a["vocab"]}
    if checkpointing:
        # Non-reentrant checkpointing of each decoder layer keeps only the layer's input (the residual stream,
        # in the dtype of the embeddings: fp32 for full and QLoRA, the base dtype for LoRA); the backward
        # recomputes one layer at a time, whose saved tensors then live beside the residual stream's gradient
        # (incoming, and the one being built) once the head and loss tensors are freed.
        rates |= {"layers_per_token": a["layers"] * a["hidden"] * p["base"], "layers_per_square": 0.0,
                  "recompute_per_token": layer_token + 2 * a["hidden"] * p["base"],
                  "recompute_per_square": layer_square}
    return rates


def activation_terms(folder, run: FinetuneRun, dtype: str, precision: str, rows: int, length: int,
                     rates: dict | None = None) -> dict:
    """Bytes the forward pass of one (rows x length) batch leaves saved for the backward, by part; with
    gradient checkpointing also `recompute`: what recomputing one layer in the backward adds."""
    r = rates or activation_rates(folder, run, dtype, precision)
    tokens = rows * length
    terms = {"layers": r["layers_per_token"] * tokens + r["layers_per_square"] * rows * length**2,
             "head": r["head_per_token"] * tokens, "loss": r["loss_per_token"] * tokens}
    if "recompute_per_token" in r:
        terms["recompute"] = r["recompute_per_token"] * tokens + r["recompute_per_square"] * rows * length**2
    return terms


def _trainable_tensors(folder, run: FinetuneRun) -> list[int]:
    """Element counts of the trainable tensors (tied weights once)."""
    if run.method == "full":
        return [t.numel() for t in analytic.meta_model(str(folder)).parameters()]
    r = run.lora["r"]
    return [n for lay in _targeted_layers(folder, run) for n in (r * lay["in"], r * lay["out"])]


def _targeted_layers(folder, run: FinetuneRun) -> list[dict]:
    """The layers a LoRA run adapts (lora.lora_targets, read from the cached meta-device model)."""
    targets = lora.lora_targets(analytic.hf_config(str(folder)), run.lora["target_modules"],
                                        analytic.meta_model(str(folder)), run.lora["dropout"])
    return analytic.targeted_layers(str(folder), targets)


def _gradients_before_the_last_layer(folder, run: FinetuneRun, layers: int, gradients: int) -> int:
    """fp32 gradient bytes that exist when the backward reaches the last decoder layer's recompute: those of
    the parameters outside the decoder layers (head, tied embedding, final norm) and of the last layer; with
    LoRA, the last layer's adapters' (one layer's share of all the trainable `gradients`)."""
    if run.method != "full":
        return gradients // layers
    last = f".layers.{layers - 1}."
    return 4 * sum(p.numel() for name, p in analytic.meta_model(str(folder)).named_parameters()
                   if ".layers." not in name or last in name)


def optimizer_state_bytes(numels: list[int], optimizer: str, param_bytes: int = 4) -> int:
    """AdamW's two moments per trainable parameter in the parameter's dtype and an fp32 step count per tensor
    (torch), or 8-bit blockwise (bitsandbytes adamw_bnb_8bit / paged_adamw_8bit) for tensors of at least 4096
    elements."""
    if optimizer in ("adamw_bnb_8bit", "paged_adamw_8bit"):
        return sum(2 * 4 * n if n < BNB_MIN_8BIT_SIZE else
                   2 * (n + 4 * math.ceil(n / BNB_STATE_BLOCK) + 4 * BNB_QMAP) for n in numels)
    return sum(2 * param_bytes * n + 4 for n in numels)


def _autocast_weight_copies(folder, run: FinetuneRun, p: dict) -> int:
    """Under autocast every fp32 nn.Linear weight is cast to 16 bits for its matmul, and the copy stays saved
    for the backward (the weight's own gradient or the input's). 4-bit layers dequantize transiently."""
    c = p["autocast"]
    if not c:
        return 0
    copies = 0
    for lay in analytic.linear_layers(str(folder)):
        kept = lay["head"] or not p["four_bit"]
        if kept and p["base"] != c:
            copies += c * lay["in"] * lay["out"]
    if run.method != "full":
        copies += c * sum(_trainable_tensors(folder, run))  # the fp32 adapters
    return copies


def training_peak(folder, run: FinetuneRun, dtype: str, precision: str, lengths: list[int], device: str = "cpu") -> dict:
    """Predicted peak of the memory a fine-tuning run adds over its start (see the module docstring).

    `run` is a resolved finetune run (finetune_run), `dtype` the base model's dtype, `precision` the mixed
    precision the run resolved ('bf16', 'fp16', 'no'), `lengths` the token count of every training row."""
    a = _arch(folder)
    unmodelled = (f"model type {a['model_type']!r} (modelled: {', '.join(DECODERS)})"
                  if a["model_type"] not in DECODERS else
                  "several processes (each rank draws its own shard of the batches)"
                  if run.num_processes * run.num_machines > 1 or run.accelerate_config else
                  "bf16_weights (the model assumes fp32 trainable weights and gradients)"
                  if run.bf16_weights else None)
    if unmodelled:
        return {"total_mib": None, "unavailable": f"not modelled: {unmodelled}", "compares_to": TRAINING_COMPARES_TO}
    p = _precisions(run, dtype, precision)
    numels = _trainable_tensors(folder, run)
    states = optimizer_state_bytes(numels, run.optimizer)
    gradients = 4 * sum(numels)  # trainable parameters are fp32 in every method efflab runs
    copies = _autocast_weight_copies(folder, run, p)
    # torch's AdamW on CPU runs per tensor (no foreach kernels): sqrt(v) and its bias correction are two
    # temporaries of the largest tensor; on CUDA the foreach path builds sqrt(v) for all tensors at once
    step_temporaries = 2 * 4 * max(numels) if device == "cpu" else 4 * sum(numels)
    if run.optimizer != "adamw_torch":
        step_temporaries = 0
    steps = padded_batch_lengths(lengths, run.batch_size, run.max_steps, run.gradient_accumulation_steps,
                                 run.seed, run.packing)
    rates = activation_rates(folder, run, dtype, precision)
    last_gradients = (_gradients_before_the_last_layer(folder, run, a["layers"], gradients)
                      if run.gradient_checkpointing else 0)
    best = {"total": 0.0}
    for k, micro in enumerate(steps):
        for m, (rows, length) in enumerate(micro):
            act = activation_terms(folder, run, dtype, precision, rows, length, rates)
            held = {"optimizer_states": states if k else 0, "gradients": gradients if m else 0,
                    "autocast_weight_copies": copies}
            phases = [("backward start", held | {"activations": act["layers"] + act["head"],
                                                 "loss_logits": act["loss"]})]
            if "recompute" in act:  # checkpointing: the last layer recomputed, head and loss tensors freed
                phases.append(("recompute of the last layer", held | {
                    "activations": act["layers"], "recomputed_layer": act["recompute"],
                    "gradients": gradients if m else last_gradients}))
            for phase, terms in phases:
                total = sum(terms.values())
                if total > best["total"]:
                    best = {"total": total, "terms": terms, "phase": f"{phase}, step {k + 1}",
                            "batch": {"rows": rows, "padded_length": length}}
    step = {"optimizer_states": states, "gradients": gradients, "optimizer_step_temporaries": step_temporaries}
    if sum(step.values()) > best["total"]:
        best = {"total": sum(step.values()), "terms": step, "phase": "optimizer step", "batch": None}
    longest = max(length for micro in steps for _, length in micro)
    return {
        "total_mib": best["total"] / MiB, "compares_to": TRAINING_COMPARES_TO, "phase": best["phase"],
        "batch": best["batch"], "terms_mib": {k: v / MiB for k, v in best["terms"].items()},
        "padded_lengths": {"longest": longest, "max_length_of_data": max(lengths)},
        "optimizer_state_mib": states / MiB,
    }


def largest_batch(folder, run: FinetuneRun, dtype: str, precision: str, lengths: list[int], device: str,
                  budget_mib: float, most: int = 4096) -> dict:
    """The most rows a step of `run` can take within `budget_mib` of memory over the loaded model, by this
    estimator: the run's batch_size doubled while the predicted training peak (training_peak) stays within the
    budget, up to `most` rows. A batch that fills a GPU for a throughput measurement (a few thousand tokens leave an
    H100 waiting on its kernel launches). `rows` is None where even the run's own batch does not fit, or where the
    run is not modelled (`unavailable`)."""
    rows, tried, fits = run.batch_size, [], None
    while rows <= most:
        predicted = training_peak(folder, run.but(batch_size=rows), dtype, precision, lengths, device)
        if predicted["total_mib"] is None:
            return {"rows": None, "unavailable": predicted["unavailable"], "budget_mib": budget_mib}
        tried.append({"rows": rows, "predicted_mib": predicted["total_mib"]})
        if predicted["total_mib"] > budget_mib:
            break
        fits, rows = rows, 2 * rows
    per_row = sum(lengths) / len(lengths)
    return {"rows": fits, "tokens_per_step": fits * per_row if fits else None, "budget_mib": budget_mib,
            "tried": tried, "by": f"efflab's memory estimator ({TRAINING_COMPARES_TO}), batch_size doubled"}


def loaded_weights_bytes(folder, run: FinetuneRun, dtype: str) -> int:
    """What the model a run trains weighs once loaded, before training adds anything (_precisions: fp32 weights for
    full fine-tuning, bf16 ones with bf16_weights; the base in its dtype for LoRA, QLoRA's 4-bit base with the rest in
    fp32), its fp32 adapters included. Counted from the architecture, not estimated: any family."""
    if run.method == "full":
        return (2 if run.bf16_weights else 4) * analytic.parameter_count(str(folder))
    adapters = 4 * sum(_trainable_tensors(folder, run))
    if run.base_quant:
        return round(analytic.quant_footprint(str(folder), run.base_quant, "float32")["total"]) + adapters
    return ELEMENT_BYTES[dtype] * analytic.parameter_count(str(folder)) + adapters


def optimizer_step_bytes(folder, run: FinetuneRun) -> int:
    """The gradients and optimizer states (fp32, bf16_weights' too) alive together at every optimizer step: a floor
    under any run's training peak, for any family (the activations on top are what training_peak models, for its
    decoders)."""
    numels = _trainable_tensors(folder, run)
    return optimizer_state_bytes(numels, run.optimizer) + (2 if run.bf16_weights else 4) * sum(numels)
