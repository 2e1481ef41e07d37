"""What a finetune run writes besides its record: its step checkpoints (a killed run resumes from them), the initial
adapter state that an init which rewrites the base (PiSSA, OLoRA, CorDA) is converted against, the trained model and
its loss curve."""
from __future__ import annotations

import csv
import json
import logging
import shutil
from pathlib import Path

import torch

from ...experiment import FinetuneRun
from ...layout import LOSS_COLUMNS
from ...lora import rewrites_base, save_initial

log = logging.getLogger("efflab")


def checkpoints(layout, name: str, run_cfg: FinetuneRun, rank: int) -> tuple[Path, str | None]:
    """The run's step-checkpoint folder (a hidden sibling of its outputs, which Snakemake does not own and
    so does not delete when a killed job's outputs are cleaned up) and the checkpoint to resume from.
    Checkpoints written with different settings are discarded, never resumed."""
    from transformers.trainer_utils import get_last_checkpoint

    folder = layout.out("finetune").joinpath(f".{name}.checkpoints")
    stamp = folder / "settings.json"
    wanted = json.dumps({"settings": run_cfg.settings, "base": layout.metrics("base_model").read_text(),
                         "train": layout.split("train").stat().st_size}, sort_keys=True)
    if rank == 0:
        if folder.is_dir() and (not stamp.is_file() or stamp.read_text() != wanted):
            log.info("%s: discarding checkpoints written with other settings: %s", name, folder)
            shutil.rmtree(folder)
        folder.mkdir(parents=True, exist_ok=True)
        stamp.write_text(wanted)
    last = get_last_checkpoint(str(folder)) if folder.is_dir() and run_cfg.checkpoint_every else None
    return folder, last


def checkpoint_state(checkpoint: str | None) -> dict:
    """The step and real tokens seen of the checkpoint a run resumes from (none: from the start)."""
    if not checkpoint:
        return {"global_step": 0, "num_input_tokens_seen": 0}
    state = json.loads((Path(checkpoint) / "trainer_state.json").read_text())
    return {"global_step": state["global_step"], "num_input_tokens_seen": state.get("num_input_tokens_seen", 0)}


def initial_adapter(model, run_cfg: FinetuneRun, folder: Path) -> str | None:
    """The adapter as initialised, saved in `folder`, where its init leaves the base a residual (save_model converts
    the trained adapter against it); None for a full fine-tune and an init that keeps the base."""
    if run_cfg.method != "full" and rewrites_base(run_cfg.lora_init):
        return save_initial(model, folder)
    return None


def save_model(model, tokenizer, run_cfg: FinetuneRun, dtype: str, folder: Path, initial: str | None = None) -> None:
    """The full model in the base's dtype, or the peft adapter (its target modules sorted: a stable file); an
    adapter whose init left the base a residual (PiSSA, OLoRA, CorDA), converted against its `initial` state to one
    on the original base, which every later stage loads."""
    if run_cfg.method == "full":
        model.to(getattr(torch, dtype)).save_pretrained(folder, safe_serialization=True)
    else:
        model.save_pretrained(folder, safe_serialization=True,
                              **({"path_initial_model_for_weight_conversion": initial} if initial else {}))
        _sort_target_modules(folder / "adapter_config.json")
    tokenizer.save_pretrained(folder)


def _sort_target_modules(path: Path) -> None:
    """peft keeps target_modules as a set and writes it in the set's order, which changes with Python's hash
    seed: sorted, two identical runs write identical adapter folders (and their provenance hashes agree)."""
    config = json.loads(path.read_text())
    if isinstance(config.get("target_modules"), list):
        config["target_modules"] = sorted(config["target_modules"])
        path.write_text(json.dumps(config, indent=2, sort_keys=True))


def write_loss_curve(rows: list[dict], path) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=LOSS_COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
