"""A LoRA adapter put on a model the way `lora.init` asks (peft's init_lora_weights), with what it cost.

peft initialises an adapter in one of three ways: from the weights alone (default, gaussian, pissa, pissa_niter_N,
olora, orthogonal, and loftq on a full-precision base), from the layers' inputs on training rows (eva: the SVD of
each layer's inputs, after the adapter is made; corda: their covariance, before it is made), or, on a 4-bit base,
by fitting the adapter to the NF4 base's error against the original weights (loftq for QLoRA: peft's
replace_lora_weights_loftq reads the original weights from the base model's safetensors). The seconds this takes
are the init's cost, recorded beside the run's training time. A mode peft refuses for a model (a layer type it
cannot decompose, a 4-bit base PiSSA cannot rewrite, LoftQ's quantizer on a machine without CUDA) raises Refused
with peft's own words, which the finetune stage records as `unavailable`.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from . import architecture

DATA_DRIVEN = ("eva", "corda")  # modes that read the layers' inputs on training rows
# modes that move the weights' principal part into the adapter and leave the base the residual: their trained adapter
# is saved converted to one on the original base (peft's path_initial_model_for_weight_conversion)
RESIDUAL = ("pissa", "olora", "corda")
CALIBRATION_BATCHES = 4  # batches of training rows the data-driven modes read


class Refused(Exception):
    """peft cannot initialise this adapter this way on this model: the reason is peft's."""


@dataclass
class Initialised:
    model: object  # the peft model
    init: str  # lora.init as asked
    seconds: float  # making the adapter and initialising it (the data-driven modes' forward passes included)
    rows: int  # training rows a data-driven mode read (0 for the others)


def lora_init(lora: dict) -> str:
    return lora.get("init") or "default"


def rewrites_base(init: str) -> bool:
    return init.startswith(RESIDUAL)


def save_initial(model, folder) -> str:
    """The adapter as initialised, saved where the trained one's conversion reads it (init_lora_weights True in its
    config, as peft asks, so that reading it does not decompose the residual base again)."""
    config = model.peft_config["default"]
    asked, config.init_lora_weights = config.init_lora_weights, True
    model.save_pretrained(str(folder), safe_serialization=True)
    config.init_lora_weights = asked
    return str(folder)


def peft_value(init: str):
    """LoraConfig's init_lora_weights for a lora.init value (QLoRA's loftq is applied after, from the default)."""
    return True if init == "default" else init


def adapt(model, lora: dict, quantized: bool, base_folder, calibration: list[dict]) -> Initialised:
    """`model` with a LoRA adapter of the settings `lora`, initialised as lora.init asks. `quantized`: the base is
    4-bit (QLoRA); `calibration`: padded batches of training rows for eva and corda."""
    init = lora_init(lora)
    t0 = time.perf_counter()
    try:
        made = _adapt(model, lora, init, quantized, str(base_folder), calibration)
    except (ValueError, TypeError, NotImplementedError, RuntimeError, AttributeError, AssertionError) as err:
        if init == "default" and isinstance(err, ValueError):  # the targets, or what they name (fused experts
            raise Refused(architecture.lora_refusal(model, err)) from None  # take no dropout)
        raise Refused(f"lora.init {init}: peft refused it for this model: {str(err).splitlines()[0]}") from None
    rows = sum(len(b["input_ids"]) for b in calibration) if init in DATA_DRIVEN else 0
    return Initialised(made, init, time.perf_counter() - t0, rows)


def _adapt(model, lora: dict, init: str, quantized: bool, base_folder: str, calibration: list[dict]):
    from peft import get_peft_model

    if init == "loftq" and quantized:
        from peft import replace_lora_weights_loftq

        made = get_peft_model(model, architecture.lora_config(model.config, lora, model, init_lora_weights=True))
        replace_lora_weights_loftq(made, model_path=base_folder)
        return made
    extra = _extra_config(init)
    config = architecture.lora_config(model.config, lora, model, init_lora_weights=peft_value(init), **extra)
    if init == "corda":
        from peft.tuners.lora.corda import preprocess_corda

        preprocess_corda(model, config, run_model=lambda: _forward(model, calibration))
    made = get_peft_model(model, config)
    if init == "eva":
        from peft import initialize_lora_eva_weights

        initialize_lora_eva_weights(made, dataloader=calibration, show_progress_bar=False)
    return made


def _extra_config(init: str) -> dict:
    if init == "eva":
        from peft import EvaConfig
        return {"eva_config": EvaConfig()}
    if init == "corda":
        from peft.tuners.lora.config import CordaConfig
        return {"corda_config": CordaConfig()}
    if init == "loftq":
        from peft import LoftQConfig
        return {"loftq_config": LoftQConfig(loftq_bits=4, loftq_iter=1)}
    return {}


@torch.no_grad()
def _forward(model, batches: list[dict]) -> None:
    """Each calibration row through the model alone, without its padding (CorDA's hooks take one row at a time)."""
    for batch in batches:
        for ids, mask in zip(batch["input_ids"], batch["attention_mask"]):
            model(input_ids=ids[mask.bool()].unsqueeze(0))


def calibration_batches(rows: list[dict], batch_size: int, pad_id: int, device) -> list[dict]:
    """The first CALIBRATION_BATCHES right-padded batches of training rows, as eva and corda read them: input ids,
    attention mask and labels (eva leaves out the label mask's -100 positions)."""
    out = []
    for start in range(0, min(len(rows), CALIBRATION_BATCHES * batch_size), batch_size):
        chunk = rows[start:start + batch_size]
        width = max(len(r["input_ids"]) for r in chunk)
        ids = torch.full((len(chunk), width), pad_id, dtype=torch.long)
        labels = torch.full((len(chunk), width), -100, dtype=torch.long)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for i, r in enumerate(chunk):
            n = len(r["input_ids"])
            ids[i, :n], labels[i, :n], mask[i, :n] = torch.tensor(r["input_ids"]), torch.tensor(r["labels"]), 1
        out.append({"input_ids": ids.to(device), "attention_mask": mask.to(device), "labels": labels.to(device)})
    return out
