"""What an experiment's params make: the kinds of model its stages write (one table), the fine-tuning runs with their
full settings, the runs merge merges and the models evaluate scores.

A leaf: no torch and no other efflab module, so that config validates against it and the stage registry's grids
and reads (which Snakemake evaluates while it plans the DAG) derive from it.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, fields, replace

# The folders a stage's job writes its model to (layout says where the job's folder is).
MODEL = "model"
HEALED = "healed"  # prune's LoRA-healed model
ADAPTER_METHODS = ("lora", "qlora")


@dataclass(frozen=True)
class ModelKind:
    """A kind of model the pipeline makes: which stage's job makes it (the job named by its `of`, or the stage's
    single job), the folder of that job it lives in, and how it is loaded."""
    stage: str
    folder: str = MODEL
    # Loaded as an adapter on the base model its fine-tuning run trained on (QLoRA's on its 4-bit base): the base's
    # folder is read first. Otherwise the folder holds a whole model that loads on its own.
    on_base: bool = False
    # The params names its `of` is one of (None: it takes no `of`).
    of_names: str | None = None


# Every kind of model, in the order evaluate lists them; variant_folders, provenance, the rules' inputs, the jobs'
# skipped checks and evaluate's jobs all read it.
MODEL_KINDS = {
    "base": ModelKind("base_model"),
    "quantized": ModelKind("quantize", of_names="quantize.schemes"),
    "pruned": ModelKind("prune", of_names="prune.strategies"),
    "healed": ModelKind("prune", HEALED, of_names="prune.strategies"),
    "adapter": ModelKind("finetune", on_base=True, of_names="finetune.runs"),
    "finetuned": ModelKind("finetune", of_names="finetune.runs"),
    "merged": ModelKind("merge", of_names="merge.runs"),
}


def made_by(kind: str, of: str | None) -> str:
    """The job that makes a model of `kind` (`stage/of`, or the stage for the base model)."""
    stage = MODEL_KINDS[kind].stage
    return f"{stage}/{of}" if MODEL_KINDS[kind].of_names else stage


def model_paths(kind: str, of: str | None) -> list[str]:
    """The folders, relative to the results folder, that loading a model of `kind` reads: an adapter's base, then
    its own folder."""
    own = f"{made_by(kind, of)}/{MODEL_KINDS[kind].folder}"
    return [model_paths("base", None)[0], own] if MODEL_KINDS[kind].on_base else [own]


def deep_merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in over.items():
        out[key] = deep_merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


@dataclass(frozen=True)
class FinetuneRun:
    """A fine-tuning run's full settings (finetune.defaults overridden by finetune.runs.<name>, every key of the
    schema's finetune_settings), resolved once (finetune_run) and handed whole to the stages that train, the model
    builder and the estimators. `settings` is the dict its records keep."""
    name: str
    max_steps: int
    batch_size: int
    gradient_accumulation_steps: int
    learning_rate: float
    lr_scheduler: str
    warmup_steps: int
    weight_decay: float
    max_grad_norm: float
    optimizer: str
    mixed_precision: str
    gradient_checkpointing: bool
    packing: bool
    tf32: bool
    torch_compile: bool
    bf16_weights: bool
    liger_kernel: bool
    attn_implementation: str | None
    dataloader_num_workers: int
    pin_memory: str | bool
    deterministic: bool
    eval_rows: int | None
    seed: int
    checkpoint_every: int
    timing_warmup_steps: int
    instruments: bool
    num_processes: int
    num_machines: int
    accelerate_config: str | None
    lora: dict
    quant: dict
    method: str

    @classmethod
    def of(cls, settings: dict, name: str = "") -> FinetuneRun:
        return cls(name=name, **copy.deepcopy(settings))

    @property
    def settings(self) -> dict:
        """The run's settings as params name them (its records' `settings`)."""
        return {f.name: copy.deepcopy(getattr(self, f.name)) for f in fields(self) if f.name != "name"}

    @property
    def base_quant(self) -> dict | None:
        """The bitsandbytes scheme the run's frozen base is loaded with: QLoRA's 4-bit scheme, else None (full
        precision). Training, merging, inference and the memory estimates all load that same base."""
        return self.quant if self.method == "qlora" else None

    @property
    def lora_init(self) -> str:
        """How its adapter is initialised (lora.init; peft's default where unset)."""
        return adapter_init(self.lora)

    def but(self, **changes) -> FinetuneRun:
        """The run with `changes` to its settings."""
        return replace(self, **changes)


def adapter_init(lora: dict) -> str:
    """How an adapter of the settings `lora` is initialised: lora.init, peft's default where unset."""
    return lora.get("init") or "default"


def finetune_run(cfg: dict, name: str) -> FinetuneRun:
    """A finetune run's full settings: finetune.defaults overridden by finetune.runs.<name>."""
    return FinetuneRun.of(deep_merge(cfg["finetune"]["defaults"], cfg["finetune"]["runs"][name]), name)


@dataclass(frozen=True)
class ModelRef:
    """A model a stage loads, as the params name it (a bench_inference variant, an evaluated model, a draft, a
    capacity subject), resolved once (model_ref): its kind, the grid entry it is `of`, and the quantization scheme
    its weights are loaded with (a quantized model's scheme; an adapter's base's, QLoRA's 4-bit; None: full
    precision)."""
    kind: str
    of: str | None = None
    quant: dict | None = None


@dataclass(frozen=True)
class Variant:
    """A bench_inference variant, built once and handed whole to each of its cells: its name, the model it loads and
    its own params entry (kv_cache, batch_sizes, generation, ...)."""
    name: str
    model: ModelRef
    settings: dict


def model_ref(cfg: dict, entry: dict) -> ModelRef:
    """The model a params entry ({kind, of}) names, with the scheme its weights load with."""
    kind, of = entry["kind"], entry.get("of")
    quant = (cfg["quantize"]["schemes"][of] if kind == "quantized"
             else finetune_run(cfg, of).base_quant if MODEL_KINDS[kind].on_base else None)
    return ModelRef(kind, of, quant)


def variant(cfg: dict, name: str) -> Variant:
    """The bench_inference variant `name`."""
    entry = cfg["bench_inference"]["variants"][name]
    return Variant(name, model_ref(cfg, entry), entry)


def adapter_runs(cfg: dict) -> list[str]:
    """Finetune runs that produce an adapter, so that merge has work to do."""
    return [n for n, r in cfg["finetune"]["runs"].items() if r["method"] in ADAPTER_METHODS]


def merge_runs(cfg: dict) -> list[str]:
    """The adapter runs the merge stage merges: merge.runs, or every adapter run when it is null."""
    chosen = cfg["merge"]["runs"]
    return adapter_runs(cfg) if chosen is None else list(chosen)


def evaluated_name(kind: str, of: str | None) -> str:
    """The evaluate job of a model: "base", or "<kind>-<of>" (quantized-int8, adapter-lora-r8, healed-heads-half)."""
    return "base" if kind == "base" else f"{kind}-{of}"


def _made(cfg: dict) -> list[tuple[str, str | None]]:
    """(kind, of) of every model the experiment makes: the base; the quantize schemes that change the model (method
    none is the base); each pruned strategy, then its healed model where prune heals; each fine-tune, an adapter or
    a full model by its method; each merged adapter."""
    made = [("base", None)] + [("quantized", n) for n, s in cfg["quantize"]["schemes"].items() if s["method"] != "none"]
    for name in cfg["prune"]["strategies"]:
        made += [("pruned", name)] + ([("healed", name)] if cfg["prune"]["heal"]["steps"] > 0 else [])
    made += [("adapter" if run["method"] in ADAPTER_METHODS else "finetuned", name)
             for name, run in cfg["finetune"]["runs"].items()]
    return made + [("merged", name) for name in merge_runs(cfg)]


def evaluated_models(cfg: dict) -> dict[str, dict]:
    """The models the evaluate stage scores, by job name: every model the experiment makes (`_made`), or those
    evaluate.models chooses and what they are paired with. Each is {"kind", "of", "reference"}: the job it is
    paired with (the base, or for a merged model the adapter it came from)."""
    models = {evaluated_name(kind, of): {"kind": kind, "of": of, "reference": None if kind == "base" else
                                         evaluated_name("adapter", of) if kind == "merged" else "base"}
              for kind, of in _made(cfg)}
    chosen = cfg["evaluate"]["models"]
    if chosen is None:
        return models
    kept = set(chosen) | {models[n]["reference"] for n in chosen if n in models and models[n]["reference"]}
    return {n: m for n, m in models.items() if n in kept}  # what a chosen model is paired with is evaluated too


def drafts_of(b: dict, variant: dict) -> list[str]:
    """The draft names a bench_inference variant's assisted cells take (`b`: the bench_inference section): its own
    `drafts`, else every one of speculative.drafts; [] where it generates no assisted cell."""
    if "assisted" not in variant.get("generation", b["generation"]):
        return []
    return variant.get("drafts", list((b.get("speculative") or {}).get("drafts") or {}))
