"""The LoRA adapter of any family: the modules it adapts (lora_targets), its peft config (lora_config) and the adapter
put on a model the way `lora.init` asks (adapt: peft's init_lora_weights), with what it cost.

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

from .architecture import own_projections, skeleton, text_config
from .experiment import adapter_init

DATA_DRIVEN = ("eva", "corda")  # modes that read the layers' inputs on training rows
# modes that move the weights' principal part into the adapter and leave the base the residual: their trained adapter
# is saved converted to one on the original base (peft's path_initial_model_for_weight_conversion)
RESIDUAL = ("pissa", "olora", "corda")
CALIBRATION_BATCHES = 4  # batches of training rows the data-driven modes read


class Refused(Exception):
    """peft cannot initialise this adapter this way on this model: the reason is peft's."""


@dataclass(frozen=True)
class Calibration:
    """The training rows eva and corda read, the batch size they are read in and the pad id that fills a batch."""
    rows: list[dict]
    batch_size: int
    pad_id: int


@dataclass
class Initialised:
    model: object  # the peft model
    init: str  # lora.init as asked
    seconds: float  # making the adapter and initialising it (the data-driven modes' forward passes included)
    rows: int  # training rows a data-driven mode read (0 for the others)


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


def adapt(model, lora: dict, quantized: bool, base_folder, calibration: Calibration | None = None) -> Initialised:
    """`model` with a LoRA adapter of the settings `lora`, initialised as lora.init asks. `quantized`: the base is
    4-bit (QLoRA); `calibration`: the training rows eva and corda read (padded into batches on the model's device)."""
    init = adapter_init(lora)
    t0 = time.perf_counter()
    calibration = calibration_batches(calibration, model.device) if init in DATA_DRIVEN else []
    try:
        made = _adapt(model, lora, init, quantized, str(base_folder), calibration)
    except (ValueError, TypeError, NotImplementedError, RuntimeError, AttributeError, AssertionError) as err:
        if init == "default" and isinstance(err, ValueError):  # the targets, or what they name (fused experts
            raise Refused(lora_refusal(model, err)) from None  # take no dropout)
        raise Refused(f"lora.init {init}: peft refused it for this model: {str(err).splitlines()[0]}") from None
    rows = sum(len(b["input_ids"]) for b in calibration) if init in DATA_DRIVEN else 0
    return Initialised(made, init, time.perf_counter() - t0, rows)


def _adapt(model, lora: dict, init: str, quantized: bool, base_folder: str, calibration: list[dict]):
    from peft import get_peft_model

    if init == "loftq" and quantized:
        from peft import replace_lora_weights_loftq

        made = get_peft_model(model, lora_config(model.config, lora, model, init_lora_weights=True))
        replace_lora_weights_loftq(made, model_path=base_folder)
        return made
    extra = _extra_config(init)
    config = lora_config(model.config, lora, model, init_lora_weights=peft_value(init), **extra)
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


def calibration_batches(calibration: Calibration, device) -> list[dict]:
    """The first CALIBRATION_BATCHES right-padded batches of training rows, as eva and corda read them: input ids,
    attention mask and labels (eva leaves out the label mask's -100 positions)."""
    rows, batch_size, pad_id = calibration.rows, calibration.batch_size, calibration.pad_id
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


def lora_targets(config, targets: str | list[str] | None, model=None, dropout: float = 0.0) -> str | list[str]:
    """The modules LoRA adapts: the user's names or peft's all-linear as given; for null, what peft itself
    chooses for the family (its per-architecture default, e.g. q_proj and v_proj for Llama, query_key_value
    for GPT-NeoX, c_attn for GPT-2), and for a family peft has no default for, the model's own projections
    (own_projections of `model`, else of the config's skeleton). A mixture of experts' routed experts are among
    them only without dropout: peft maps their names onto the fused 3-D expert weights (expert_targets), which it
    wraps as parameters, and those take no dropout. Not all-linear there: it would take them whatever the dropout."""
    if targets is not None:
        return targets
    from peft.utils import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as PEFT_DEFAULTS

    default = PEFT_DEFAULTS.get(text_config(config).model_type)
    if default:
        return sorted(default)
    model = model if model is not None else skeleton(config)
    names = own_projections(model)
    if dropout:
        names = [n for n in names if n not in expert_targets(model, names)]
    return names or "all-linear"


def expert_targets(model, names: list[str]) -> set[str]:
    """Of the target names `names`, those peft's own conversion for transformers 5 maps onto a mixture of experts'
    fused expert weights (Qwen3-MoE's and DeepSeek-V3's gate_proj, up_proj and down_proj name their shared or dense
    MLP's layers and the routed experts' gate_up_proj and down_proj at once); none for any other model."""
    from peft import LoraConfig
    from peft.utils.transformers_weight_conversion import convert_peft_config_for_transformers

    probe = LoraConfig(task_type="CAUSAL_LM", target_modules=list(names))
    convert_peft_config_for_transformers(probe, model, None)
    return set(names) - set(probe.target_modules)


def lora_refusal(model, err: Exception) -> str:
    """peft's reason for refusing a LoRA setting on `model`, with the projections a target_modules list can name."""
    return (f"peft cannot adapt {type(model).__name__} so: {str(err).splitlines()[0].rstrip('.')}; its own "
            f"projections are {', '.join(own_projections(model))}")


def lora_config(config, lora: dict, model=None, **init):
    """peft's LoraConfig for the settings `lora` (r, alpha, dropout, target_modules, use_dora, use_rslora) on a
    model of `config` (`model`, where the caller has it: lora_targets reads its modules): one construction for
    fine-tuning, healing and the dry-run check. `init`: the initialisation's keys (init_lora_weights and its
    method's config: adapt)."""
    from peft import LoraConfig

    return LoraConfig(task_type="CAUSAL_LM", r=lora["r"], lora_alpha=lora["alpha"], lora_dropout=lora["dropout"],
                      bias="none", target_modules=lora_targets(config, lora["target_modules"], model, lora["dropout"]),
                      use_dora=lora.get("use_dora", False), use_rslora=lora.get("use_rslora", False), **init)
