"""What the chosen model can take, checked before anything runs: the params that depend on the model.

A LoRA target list, a pruning strategy, a quantization scheme or a QAT group size that the model cannot take
would otherwise fail minutes into a run. They are checked against the model's config and its module tree, built
on the meta device (no weights, no memory): at the dry run for a local folder, for the embedded model once its
metadata is cached and for a hub id once its config.json is in the local cache; and again by base_model, which
has the config in hand whatever the source. Each problem is one line naming the key, the model and what it
offers. An attention implementation the model's class does not support is a note, not an error: the default
list must work on any family, so its job records `unavailable` with what the family offers, said at the dry run.
Before any of it, a local folder that cannot load at all (a config.json that does not parse, no safetensors weights,
a truncated one, no tokenizer) is one line too (model_folder), and so is a config transformers cannot load.
"""
from __future__ import annotations

import hashlib
import json
import warnings
from importlib.metadata import version
from pathlib import Path

from ..config import UserError, classify_source
from ..experiment import ADAPTER_METHODS, finetune_run
from ..registry import not_asked
from . import model_folder

# Snakemake runs these checks while it plans the DAG: torch, transformers, peft and huggingface_hub (and the
# modules that import them: modeling, architecture) are imported inside the checks that need them.

ATTENTION_FLAGS = {"sdpa": "_supports_sdpa", "flash_attention_2": "_supports_flash_attn",
                   "flex_attention": "_supports_flex_attn"}


def config_file(cfg: dict) -> Path | None:
    """The base model's config.json where it is at hand without a download or a conversion, else None (the
    stage base_model checks the model then): the local folder's, the hub cache's, or the one efflab converted
    from the embedded GGUF on its first run."""
    bm = cfg["base_model"]
    try:
        kind = classify_source(bm["source"], "base_model.source")
    except UserError:  # a missing source: the dry run says so in its own line (common.smk, local_source)
        return None
    if kind == "local":
        return Path(bm["source"]).expanduser() / "config.json"
    if kind == "hub":
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(bm["source"], "config.json", revision=bm["revision"])
        return Path(found) if isinstance(found, str) else None
    from .modeling import EMBEDDED_MODELS, embedded_model, gguf_cache_entry

    if bm["source"] not in EMBEDDED_MODELS:
        return None  # base_model names the embedded models there are
    folder, gguf_file = embedded_model(bm["source"], bm["random_init"])
    if gguf_file is None:
        return folder / "config.json"  # the tokenizer-only export
    entry, _ = gguf_cache_entry(folder / gguf_file)
    return entry / "config.json" if (entry / "complete").is_file() else None


def load_config(cfg: dict, path: Path):
    """The model's config from `path`, with base_model.config_overrides applied."""
    from transformers import AutoConfig

    bm = cfg["base_model"]
    try:
        config = AutoConfig.from_pretrained(path.parent, trust_remote_code=bm["trust_remote_code"])
    except (OSError, ValueError, KeyError) as err:  # an unknown model_type is a ValueError, a bad file an OSError
        raise model_folder.config_error(bm, err, path) from None
    if hasattr(config, "quantization_config") and bm["source"].startswith("embedded:"):
        del config.quantization_config  # what GGUF loading adds; the saved folder has none
    for key, value in bm["config_overrides"].items():
        setattr(config, key, value)
    return config


def lora_notes(cfg: dict, config, label: str) -> list[str]:
    """peft's own check of each LoRA setting, on the meta-device model: the target modules exist, and peft can
    wrap what they name (e.g. a mixture of experts' 3-D expert weights take no dropout). Not errors: a setting the
    family cannot take makes its runs unavailable, with peft's reason, and the rest of the DAG runs."""
    from peft import get_peft_model

    from ..architecture import skeleton
    from ..lora import lora_config, lora_refusal

    wanted = {}
    for run in cfg["finetune"]["runs"]:
        if finetune_run(cfg, run).method in ADAPTER_METHODS:
            own = set(cfg["finetune"]["runs"][run].get("lora") or {})
            key = f"finetune.runs.{run}.lora" if own else "finetune.defaults.lora"
            wanted.setdefault(json.dumps(finetune_run(cfg, run).lora, sort_keys=True), key)
    if not not_asked(cfg, "prune") and cfg["prune"]["heal"]["steps"]:
        wanted.setdefault(json.dumps(cfg["prune"]["heal"]["lora"], sort_keys=True), "prune.heal.lora")
    out = []
    for settings, key in wanted.items():
        model = skeleton(config, cfg["base_model"]["trust_remote_code"])
        try:
            with warnings.catch_warnings():  # peft's notes on what it adapts (GPT-2's Conv1D) are not the dry run's
                warnings.simplefilter("ignore")
                get_peft_model(model, lora_config(config, json.loads(settings), model))
        except ValueError as err:  # peft's errors, NoMatchingPeftModuleError among them
            out.append(f"{key}: {label}: {lora_refusal(model, err)} (target_modules null: peft's default for the "
                       "family, else those projections); what uses it is recorded unavailable")
    return out


def prune_problems(cfg: dict, config, label: str) -> list[str]:
    from ..architecture import shape

    s, out = shape(config), []
    for name, strategy in ({} if not_asked(cfg, "prune") else cfg["prune"]["strategies"]).items():
        key = f"prune.strategies.{name}"
        if "keep_heads" in strategy:
            target = strategy["keep_heads"]
        else:
            remove = strategy.get("remove_heads", 0)
            target = s["heads"] - (remove * s["heads"] if isinstance(remove, float) else remove)
        if not 1 <= target <= s["heads"]:
            out.append(f"{key}: keeps {target:g} of the {s['heads']} query heads of {label} (expected 1 to "
                       f"{s['heads']})")
        remove = strategy.get("remove_layers", 0)
        n = round(remove * s["layers"]) if isinstance(remove, float) else remove
        if not 0 <= n < s["layers"]:
            out.append(f"{key}: removes {n} of the {s['layers']} layers of {label} (expected 0 to {s['layers'] - 1})")
    return out


def attention_offers(model) -> list[str]:
    """The attention implementations the model's class declares it supports (eager always)."""
    return ["eager"] + [impl for impl, flag in ATTENTION_FLAGS.items() if getattr(type(model), flag, False)]


def attention_notes(cfg: dict, model, label: str) -> list[str]:
    """Implementations the model's class does not support. Not errors: the default list (eager, sdpa,
    flash_attention_2) must work on any family, so such a job records `unavailable` naming what the family
    offers, and the dry run says so first, in one line."""
    offers = attention_offers(model)
    lacking = [impl for impl in cfg["bench_attention"]["implementations"]
               if ("sdpa" if impl.startswith("sdpa") else impl) not in offers]
    return [f"bench_attention.implementations: {label} cannot take {', '.join(map(repr, lacking))} (it offers "
            f"{', '.join(offers)}): recorded as unavailable"] if lacking else []


def quantization_problems(cfg: dict, model, label: str) -> list[str]:
    """bitsandbytes quantizes nn.Linear and Conv1D layers; the LM head stays as it is."""
    from ..architecture import matmul_layers

    head = model.get_output_embeddings()
    layers = [n for n, m in model.named_modules() if n in matmul_layers(model) and m is not head]
    methods = {s["method"] for s in cfg["quantize"]["schemes"].values()} - {"none"}
    if methods and not layers:
        return [f"quantize.schemes: {label} has no nn.Linear or Conv1D layer for bitsandbytes to quantize"]
    return []


def qat_problems(cfg: dict, model, label: str) -> list[str]:
    from ..architecture import undivided_layer

    size = cfg["qat"]["group_size"]
    undivided = None if not_asked(cfg, "qat") else undivided_layer(model, size)
    return [f"qat.group_size: {size} does not divide the {undivided[1]} input features of {undivided[0]} in "
            f"{label} (expected a divisor of every nn.Linear layer's input size)"] if undivided else []


def _vocabulary(folder: Path) -> dict | None:
    tokens = folder / "tokenizer.json"
    if not tokens.is_file():
        return None
    return (json.loads(tokens.read_text()).get("model") or {}).get("vocab")


def tokenizer_mismatch(base_folder: Path, draft_folder: Path) -> str | None:
    """Why a draft folder cannot draft for the base model (another tokenizer: its config's vocabulary size or its
    tokenizer.json's vocabulary differs), else None. A draft without those files is not refused here."""
    def size(folder):
        path = folder / "config.json"
        if not path.is_file():
            return None
        config = json.loads(path.read_text())
        return config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size")
    mine, theirs = size(base_folder), size(draft_folder)
    if mine and theirs and mine != theirs:
        return f"its vocabulary has {theirs} tokens, the base model's {mine}"
    a, b = _vocabulary(base_folder), _vocabulary(draft_folder)
    if a is not None and b is not None and a != b:
        return "its tokenizer.json vocabulary differs from the base model's (another tokenizer)"
    return None


def check_draft_sources(cfg: dict, base_folder: Path | None) -> None:
    """At the dry run: every `source` draft that is at hand (a local folder) has the base model's tokenizer; a
    missing path is refused by classify_source. One line naming the key."""
    for name, spec in ((cfg["bench_inference"].get("speculative") or {}).get("drafts") or {}).items():
        if "source" not in spec:
            continue
        key = f"bench_inference.speculative.drafts.{name}.source"
        if classify_source(spec["source"], key) != "local" or base_folder is None:
            continue
        why = tokenizer_mismatch(base_folder, Path(spec["source"]).expanduser())
        if why:
            raise UserError(f"{key}: {spec['source']!r} cannot draft for the base model: {why} (expected a draft "
                            "with the base model's tokenizer)")


def problems(cfg: dict, config) -> tuple[list[str], list[str]]:
    """Every param of `cfg` that the model of `config` cannot take, one line each; and notes, one line each,
    on what will be recorded unavailable instead."""
    from ..architecture import skeleton

    model = skeleton(config, cfg["base_model"]["trust_remote_code"])
    label = f"{type(model).__name__} ({config.model_type})"
    return ([*prune_problems(cfg, config, label), *quantization_problems(cfg, model, label),
             *qat_problems(cfg, model, label)],
            [*lora_notes(cfg, config, label), *attention_notes(cfg, model, label)])


# The params sections the checks read: a verdict is reused until one of them, the model's config or this code changes.
CHECKED = ("base_model", "quantize", "prune", "qat", "finetune", "bench_attention")


def _verdict_marker(cfg: dict, path: Path) -> Path:
    from .modeling import cache_root

    key = hashlib.sha256(json.dumps({k: cfg[k] for k in CHECKED}, sort_keys=True, default=str).encode()
                         + path.read_bytes() + Path(__file__).read_bytes()
                         + version("transformers").encode() + version("peft").encode()).hexdigest()
    return cache_root() / "model-check" / key[:32]


def check(cfg: dict, source: str | Path = "params", config=None) -> list[str]:
    """Raise UserError naming the first param the model cannot take; else return the notes to show. `config`:
    the model's config in hand (base_model); else the config file at hand, if any, with a verdict already
    reached for the same params, config and code reused (a Snakemake dry run stays fast); nothing to check when
    no config is at hand. A local folder that cannot load is refused first, whatever verdict was reached."""
    if config is not None:
        found, notes = problems(cfg, config)
    else:
        try:
            model_folder.check(cfg["base_model"])  # a local folder that cannot load: one line, on every plan
            path = config_file(cfg)
            if path is None or not path.is_file():
                return []
            check_draft_sources(cfg, path.parent)
            marker = _verdict_marker(cfg, path)
            if marker.is_file():
                return json.loads(marker.read_text())
            config = load_config(cfg, path)
        except UserError as err:
            raise UserError(f"{source}: {err}") from None
        found, notes = problems(cfg, config)
        if not found:
            try:
                marker.parent.mkdir(parents=True, exist_ok=True)
                marker.write_text(json.dumps(notes))
            except OSError:
                pass  # an unwritable cache costs the next dry run the check again
    if found:
        raise UserError(f"{source}: {found[0]}" + (f" (and {len(found) - 1} more)" if len(found) > 1 else ""))
    return notes
