"""The one way a stage gets a model: `build(spec, ...)` of a fine-tuning run (experiment.FinetuneRun: the model it
trains) or of a model the pipeline made (experiment.ModelRef: a saved folder, or an adapter on its base); and the
numerics a run trains its model in (its weights' dtype, `trainable`, and its autocast, `mixed_precision`).

The model a run trains: full weights in fp32 (bf16 with bf16_weights), or the frozen base (4-bit for QLoRA) with a
LoRA adapter initialised as lora.init asks; Liger's kernels and activation checkpointing where the run asks.

transformers, peft and bitsandbytes take seconds to import: they are imported inside the functions that use them.
"""
from __future__ import annotations

import torch

from .. import lora
from ..config import UserError
from ..experiment import MODEL_KINDS, FinetuneRun, ModelRef
from .modeling import load_model, load_tokenizer, read_split


def build(spec: FinetuneRun | ModelRef, layout, dtype: str, device: torch.device):
    """The model `spec` names, on `device`: a run's model to train, in training mode; a made model, in eval mode."""
    if isinstance(spec, FinetuneRun):
        return trainable(spec, layout, dtype, device)
    return made(spec, layout, dtype, device)


def mixed_precision(run, dtype: str, device: torch.device) -> str:
    """The autocast a run (a FinetuneRun, or training.StepRun) trains its model in: 'bf16', 'fp16' or 'no'; 'auto'
    follows what the base_model stage measured to be fast, and is 'no' for bf16 weights (trainable's)."""
    want = run.mixed_precision
    if want == "auto" and run.bf16_weights:
        return "no"  # the weights are bf16 already: their matmuls run in bf16 without autocast
    if want == "auto":
        if device.type == "cuda":
            return "bf16" if torch.cuda.is_bf16_supported() else "fp16"
        return "bf16" if dtype == "bfloat16" else "no"
    return want


def made(ref: ModelRef, layout, dtype: str, device: torch.device):
    """A model another stage made: a saved folder, or a fine-tuning run's adapter on the base it trained on (loaded
    with the base's scheme, QLoRA's 4-bit)."""
    from peft import PeftModel

    folders = layout.variant_folders(ref)
    if not MODEL_KINDS[ref.kind].on_base:
        return load_model(folders[0], dtype, device)
    base = load_model(folders[0], dtype, device, quant=ref.quant)
    return PeftModel.from_pretrained(base, folders[-1]).eval()


def trainable(run: FinetuneRun, layout, dtype: str, device: torch.device):
    """The model `run` trains. With bf16_weights, full weights, or LoRA's base and adapters (QLoRA's adapters), in
    bf16."""
    folder = layout.base_model()
    calibration = _calibration_rows(run, layout) if run.lora_init in lora.DATA_DRIVEN else None
    quant = run.base_quant
    weights = "bfloat16" if run.bf16_weights and not quant else "float32" if run.method == "full" else dtype
    model = load_model(folder, weights, device, quant=quant, attn_implementation=run.attn_implementation)
    if run.liger_kernel:
        with_liger_kernels(model)
    if run.method == "full":
        if run.gradient_checkpointing:
            checkpointing_enable(model)
        return model
    model = _frozen_base(model, run, bool(quant))
    try:
        made_ = lora.adapt(model, run.lora, bool(quant), folder, calibration)
    except ValueError as err:
        raise UserError(f"finetune.lora.target_modules: {str(err).splitlines()[0]}") from None
    model = made_.model
    model.efflab_init = {"init": made_.init, "seconds": made_.seconds, "rows": made_.rows}
    if run.bf16_weights:  # peft keeps adapters in fp32 whatever the base's dtype
        for p in model.parameters():
            if p.requires_grad:
                p.data = p.data.to(torch.bfloat16)
    return model


def _frozen_base(model, run: FinetuneRun, quantized: bool):
    """The base an adapter trains on, ready for it: a 4-bit base through peft's prepare_model_for_kbit_training,
    with its layers kept differentiable; a full-precision one with checkpointing where the run asks."""
    from peft import prepare_model_for_kbit_training

    if quantized:
        keep_4bit_layers_differentiable(model)
        return prepare_model_for_kbit_training(model, use_gradient_checkpointing=run.gradient_checkpointing,
                                               gradient_checkpointing_kwargs={"use_reentrant": False})
    if run.gradient_checkpointing:
        checkpointing_enable(model)
        model.enable_input_require_grads()
    return model


def _calibration_rows(run: FinetuneRun, layout) -> lora.Calibration:
    """The training rows eva and corda read (the first batches of the train split), with their batch size and pad."""
    pad = load_tokenizer(layout.base_model()).pad_token_id or 0
    rows = read_split(layout.split("train"), lora.CALIBRATION_BATCHES * run.batch_size)
    return lora.Calibration(rows, run.batch_size, pad)


def checkpointing_enable(model) -> None:
    """Activation (gradient) checkpointing, non-reentrant: transformers >= 5.2x names it
    activation_checkpointing_enable and deprecates the old name; 5.17 (efflab's floor) has only the old one."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
def with_liger_kernels(model) -> None:
    """Liger's fused kernels patched into the model's own modules (what the HF Trainer's use_liger_kernel does), before
    peft wraps it, so the Trainer's loop and the written-out step (training_step) train the same patched model. A
    family Liger has no kernels for is a user-facing error naming it."""
    from liger_kernel.transformers import _apply_liger_kernel_to_instance
    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN

    if model.config.model_type not in MODEL_TYPE_TO_APPLY_LIGER_FN:
        raise UserError(f"finetune.liger_kernel: Liger has no kernels for model_type {model.config.model_type!r} "
                        f"(it has: {', '.join(sorted(MODEL_TYPE_TO_APPLY_LIGER_FN))})")
    _apply_liger_kernel_to_instance(model=model)


def keep_4bit_layers_differentiable(model) -> int:
    """Keep every bitsandbytes 4-bit layer of a model that will train on its differentiable path.

    bitsandbytes (0.50) repacks a Linear4bit weight for its AVX512-BF16 CPU inference kernel the first time
    the layer runs in eval mode without gradients (here: the validation loss before training) and from then
    on calls that kernel in training too. The kernel has no backward, so the gradient through every frozen
    4-bit layer would be silently dropped (torch only warns: "an autograd kernel was not registered") and
    QLoRA's adapters would train on wrong gradients. Returns the number of layers kept."""
    import bitsandbytes as bnb

    layers = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    for layer in layers:
        layer.support_avx512bf16_for_cpu = False
    return len(layers)

