"""A base model source that cannot load, said in one line naming the key and the file instead of a traceback.

`check` reads a local folder the way transformers will, without loading it: config.json parses, the weights are
there in safetensors (efflab loads nothing else) and each file's header matches its size, the tokenizer's files
are there and its JSON parses. It reads no tensor data and imports nothing heavy, so the Snakemake dry run runs
it on every plan (model_check.check); base_model runs it again before it loads anything. What only loading can
tell (a model_type transformers does not know, a hub id that is gated or missing, weights of other shapes than the
config's) is turned into one line by `config_error`, `hub_error` and `load_error` where the load fails.
"""
from __future__ import annotations

import json
from importlib.metadata import version
from pathlib import Path

from ..config import UserError, local_source_files

KEY = "base_model.source"
# What transformers loads of a folder with use_safetensors=True (efflab passes no variant).
SAFETENSORS = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
OTHER_WEIGHTS = (".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf")
# A tokenizer's own files (tokenizer_config.json and special_tokens_map.json only describe one): a fast
# tokenizer's tokenizer.json, a sentencepiece model, a BPE vocabulary and merges, a WordPiece vocabulary, tiktoken.
TOKENIZER_NAMES = ("tokenizer.json", "tokenizer.model", "spiece.model", "sentencepiece.bpe.model", "vocab.json",
                   "vocab.txt", "merges.txt")
TOKENIZER_JSON = ("tokenizer.json", "tokenizer_config.json")
# safetensors refuses a header over 100 MB (a corrupt length reads as an absurd number)
MAX_HEADER = 100_000_000


def _json(path: Path, what: str = ""):
    """`path` parsed, or the one line that says it is not valid JSON."""
    try:
        return json.loads(path.read_bytes())
    except UnicodeDecodeError:
        raise UserError(f"{KEY}: {path} is not valid JSON (not UTF-8 text){what}") from None
    except json.JSONDecodeError as err:
        raise UserError(f"{KEY}: {path} is not valid JSON ({err.msg} at line {err.lineno} column {err.colno})"
                        f"{what}") from None


def safetensors_problem(path: Path) -> str | None:
    """What is wrong with a .safetensors file, read from its 8-byte header length and JSON header alone: the
    tensor data the header describes must fill the rest of the file exactly (what safetensors itself checks
    before it maps a tensor); None if nothing is."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return f"is truncated ({size} bytes: not even the 8-byte header length)"
        length = int.from_bytes(head, "little")
        if length > min(size - 8, MAX_HEADER):
            return (f"is truncated or corrupt: its header length reads {length:,} bytes, the file holds {size - 8:,} "
                    "after it")
        raw = f.read(length)
    try:
        header = json.loads(raw)
        ends = [entry["data_offsets"][1] for name, entry in header.items() if name != "__metadata__"]
        data_bytes = max(ends, default=0)
        if not isinstance(data_bytes, int):
            raise TypeError(data_bytes)
    except (ValueError, TypeError, KeyError, IndexError, AttributeError):  # JSONDecodeError is a ValueError
        return "is corrupt: its header is not a safetensors JSON header"
    held = size - 8 - length
    if data_bytes > held:
        return f"is truncated: its header describes {data_bytes:,} bytes of tensor data, the file holds {held:,}"
    if data_bytes < held:
        return f"is corrupt: its header describes {data_bytes:,} bytes of tensor data, the file holds {held:,}"
    return None


def _weights(folder: Path) -> None:
    """The safetensors files transformers will load are there and whole."""
    files = sorted(f.name for f in folder.iterdir() if f.is_file())
    index = folder / SAFETENSORS_INDEX
    if index.is_file():
        listed = _json(index)
        weight_map = listed.get("weight_map") if isinstance(listed, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise UserError(f"{KEY}: {index} has no weight_map (expected the shard of every tensor)")
        shards = sorted({str(shard) for shard in weight_map.values()})
        missing = [shard for shard in shards if not (folder / shard).is_file()]
        if missing:
            raise UserError(f"{KEY}: {index} names {folder / missing[0]}, which does not exist"
                            + (f" (and {len(missing) - 1} more shards)" if len(missing) > 1 else ""))
    elif (folder / SAFETENSORS).is_file():
        shards = [SAFETENSORS]
    else:
        other = [f for f in files if f.endswith(OTHER_WEIGHTS)]
        named = [f for f in files if f.endswith(".safetensors")]
        if other:
            raise UserError(f"{KEY}: {folder} holds {other[0]} but no {SAFETENSORS}: efflab loads safetensors only "
                            "(load the model in transformers and save_pretrained it, which writes safetensors)")
        if named:
            raise UserError(f"{KEY}: {folder} holds {named[0]} but neither {SAFETENSORS} nor {SAFETENSORS_INDEX}, "
                            "the weights transformers loads")
        raise UserError(f"{KEY}: {folder} has no weights (no {SAFETENSORS} beside its config.json; "
                        "base_model.random_init: true builds the model without them)")
    for shard in shards:
        problem = safetensors_problem(folder / shard)
        if problem:
            raise UserError(f"{KEY}: {folder / shard} {problem}")


def _tokenizer(folder: Path, trust_remote_code: bool) -> None:
    """The tokenizer's files are there, and those that are JSON parse."""
    names = [f.name for f in folder.iterdir() if f.is_file()]
    own = [n for n in names if n in TOKENIZER_NAMES or n.endswith(".tiktoken")
           or (trust_remote_code and n.startswith("tokenization_") and n.endswith(".py"))]
    if not own:
        raise UserError(f"{KEY}: {folder} has no tokenizer (expected tokenizer.json, or tokenizer.model, "
                        "vocab.json and merges.txt, ...: save the model's tokenizer there with save_pretrained)")
    for name in TOKENIZER_JSON:
        if name in names:
            _json(folder / name, ": the tokenizer cannot load")


def not_causal(declared: dict) -> str | None:
    """Why a config is not a causal language model's, or None: the `architectures` it was saved from name no class of
    transformers' causal LM mapping (a masked-LM or classification head), or its model_type has none. A model of its
    own code counts as causal where its auto_map maps AutoModelForCausalLM."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as CAUSAL

    if (declared.get("auto_map") or {}).get("AutoModelForCausalLM"):
        return None
    names, model_type = declared.get("architectures") or [], declared.get("model_type")
    own = CAUSAL.get(model_type)
    if names and not set(names) & set(CAUSAL.values()):
        return (f"names {', '.join(names)}, not a causal language model: "
                + (f"efflab needs {own}, the causal LM class of {model_type}" if own else
                   f"transformers has no causal LM class for {model_type!r}"))
    if not names and model_type and own is None:
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING

        if model_type in CONFIG_MAPPING:  # one it does not know is config_error's line
            return f"has model_type {model_type!r}, for which transformers has no causal LM class"
    return None


def weights_problem(info: dict, where: str) -> str | None:
    """What from_pretrained's loading info (output_loading_info) says does not fit: parameters of the model that
    no weight of the folder filled (left at their random init) and weights of the folder the model has no place
    for, the first of each named; None where every weight went to its parameter."""
    missing, unexpected = sorted(info.get("missing_keys") or ()), sorted(info.get("unexpected_keys") or ())
    if not missing and not unexpected:
        return None
    said = [f"{len(missing):,} parameters of the model are not in them (first: {missing[0]})" if missing else "",
            f"{len(unexpected):,} of their tensors have no place in the model (first: {unexpected[0]})"
            if unexpected else ""]
    return (f"{KEY}: the weights of {where} do not fit its config: " + "; ".join(filter(None, said))
            + " (a config.json of another model beside these weights?)")


def check(bm: dict) -> None:
    """Raise UserError, one line naming the key and the file, for a local base_model.source folder that cannot
    load; nothing for embedded and hub sources. A missing source or a folder without config.json is
    config.local_source_files' line."""
    if not local_source_files("base_model", bm["source"]):
        return
    folder = Path(bm["source"]).expanduser()
    declared = _json(folder / "config.json")
    if not isinstance(declared, dict):
        raise UserError(f"{KEY}: {folder / 'config.json'} is not a JSON object (expected a model config)")
    if why := not_causal(declared):
        raise UserError(f"{KEY}: {folder / 'config.json'} {why}")
    if not bm["random_init"]:
        _weights(folder)
    _tokenizer(folder, bm["trust_remote_code"])


def _first_line(err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    return lines[0].strip() if lines else type(err).__name__


def config_error(bm: dict, err: Exception, path: Path | None) -> UserError:
    """One line for a config transformers cannot load from base_model.source; `path`: its config.json where it
    is at hand (a local folder's, the hub cache's). A model_type transformers does not know is said as what
    would fix it: base_model.trust_remote_code where config.json maps the model's own code (auto_map), else
    that this transformers does not know it."""
    hub = hub_error(bm, err)
    if hub is not None:
        return hub
    declared = {}
    if path is not None and path.is_file():
        try:
            declared = json.loads(path.read_bytes())
        except ValueError:
            return UserError(f"{KEY}: {path} is not valid JSON")
    model_type = declared.get("model_type") if isinstance(declared, dict) else None
    where = path or repr(bm["source"])
    if isinstance(model_type, str):
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING

        if model_type not in CONFIG_MAPPING:
            known = f"model_type {model_type!r}, which transformers {version('transformers')} does not know"
            if declared.get("auto_map") and not bm["trust_remote_code"]:
                return UserError(f"base_model.trust_remote_code: {where} declares {known}, with auto_map (the "
                                 "model's own code): base_model.trust_remote_code: true would run that code")
            if declared.get("auto_map"):
                return UserError(f"{KEY}: {where} declares {known}, and its own code (auto_map) does not load: "
                                 f"{_first_line(err)}")
            return UserError(f"{KEY}: {where} declares {known}, and no auto_map (its own code), so "
                             "base_model.trust_remote_code: true would not help: a newer transformers may know it")
    elif isinstance(declared, dict) and declared:
        return UserError(f"{KEY}: {where} has no model_type (transformers picks the model class by it)")
    return UserError(f"{KEY}: cannot load {bm['source']!r}: {_first_line(err)}")  # offline: transformers' line


def hub_error(bm: dict, err: BaseException) -> UserError | None:
    """One line for a hub id that is gated, not there, or at a revision it does not have, from huggingface_hub's
    error (transformers raises an OSError from it); None for other errors. An unreachable hub with the files not
    in the cache (LocalEntryNotFoundError) is transformers' own line, said by the caller."""
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

    source, seen = bm["source"], set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, GatedRepoError):
            return UserError(f"{KEY}: {source!r} is a gated model: accept its terms at https://huggingface.co/{source} "
                             "and set HF_TOKEN to a token of that account (or run `hf auth login`)")
        if isinstance(err, RepositoryNotFoundError):
            return UserError(f"{KEY}: {source!r} is not a model on the Hugging Face hub (a private one needs "
                             "HF_TOKEN set to a token with access)")
        if isinstance(err, RevisionNotFoundError):
            return UserError(f"base_model.revision: {bm['revision']!r} is not a branch, tag or commit of {source!r}")
        err = err.__cause__ or err.__context__
    return None


def _local_file(bm: dict, names: tuple[str, ...]) -> Path | None:
    """The first of `names` in a local base_model.source folder, else None (a hub source, none there)."""
    folder = Path(bm["source"]).expanduser()
    return next((folder / n for n in names if (folder / n).is_file()), None) if folder.is_dir() else None


def load_error(bm: dict, err: Exception, what: str) -> UserError:
    """One line for `what` ("the tokenizer", "the weights") of base_model.source that does not load, naming the
    file where the source is a local folder."""
    hub = hub_error(bm, err)
    if hub is not None:
        return hub
    line = _first_line(err)
    if isinstance(err, KeyError) or len(line) < 20:  # a bare key or word says nothing without its type
        line = f"{type(err).__name__}: {line}"
    if what == "the tokenizer":
        file = _local_file(bm, TOKENIZER_NAMES)
        return UserError(f"{KEY}: cannot load the tokenizer of {bm['source']!r}"
                         f"{f' from {file}' if file else ''}: {line}")
    weights = _local_file(bm, (SAFETENSORS_INDEX, SAFETENSORS))
    if "mismatch" in line.lower():
        overrides = " after base_model.config_overrides" if bm["config_overrides"] else ""
        return UserError(f"{KEY}: the weights in {weights or repr(bm['source'])} do not fit its config.json{overrides} "
                         "(transformers' report above lists the tensors of other shapes)")
    if "safetensors" in line:
        line = f"{line.rstrip('.')} (efflab loads safetensors only)"
    return UserError(f"{KEY}: cannot load the weights of {bm['source']!r}{f' from {weights}' if weights else ''}: "
                     f"{line}")
