"""A batch that fills the device: the most rows a fine-tuning step can take within a share of the device's memory,
by the memory estimator (estimators.training_memory.largest_batch), for throughput measurements (the GPU lane's
MFU and the fine-tuning benchmark's `--batch-size fill`). A few thousand tokens a step leave a large GPU waiting on
its kernel launches: an MFU read at such a batch says more about the launch overhead than about the training.

    python -m efflab.estimators.fill [--most N] PARAMS RESULTS RUN [RUN ...]   # a params overlay of each run's batch
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
import yaml

from .fit import available_host_mib
from .memory import MiB
from .training_memory import largest_batch

# The share of the device's memory a filled batch may take (the rest: the allocator's fragmentation, the CUDA
# context, the estimator's error)
FILL_SHARE = 0.8


def device_memory_mib(device: torch.device) -> float:
    """A GPU's whole card, or the memory a CPU has available now."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory / MiB
    return available_host_mib()


def fill(results: Path, run: dict, device: torch.device, share: float = FILL_SHARE, most: int = 4096) -> dict:
    """The rows a step of `run` (a resolved finetune run) that fill `share` of the device's memory less the loaded
    model's weights, with the estimator's predictions on the way (largest_batch)."""
    import pandas as pd

    from ..layout import Layout
    from ..models.build import mixed_precision
    from ..models.modeling import base_dtype

    layout = Layout(Path(results))
    folder, dtype = layout.base_model(), base_dtype(layout)  # the dtype the finetune stage trains in
    memory_mib = device_memory_mib(device)
    weights_mib = sum(f.stat().st_size for f in Path(folder).glob("*.safetensors")) / MiB
    lengths = [len(ids) for ids in pd.read_parquet(layout.split("train")).input_ids]
    return largest_batch(folder, run, dtype, mixed_precision(run, dtype, device), lengths, device.type,
                         share * memory_mib - weights_mib, most) | {
        "device_memory_mib": memory_mib, "weights_mib": weights_mib, "share": share}


def main(argv: list[str]) -> None:
    import argparse

    from ..config import load
    from ..experiment import finetune_run

    parser = argparse.ArgumentParser(prog="python -m efflab.estimators.fill", description=__doc__.splitlines()[0])
    parser.add_argument("--most", type=int, default=4096, help="rows a step at most")
    parser.add_argument("params")
    parser.add_argument("results")
    parser.add_argument("runs", nargs="+")
    args = parser.parse_args(argv)
    params, runs, results = load(args.params), args.runs, args.results
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    overlay, said = {}, []
    for name in runs:
        filled = fill(Path(results), finetune_run(params, name), device, most=args.most)
        if filled["rows"]:
            overlay[name] = {"batch_size": filled["rows"]}
        said.append(f"{name}: {filled['rows']} rows a step (~{filled.get('tokens_per_step') or 0:.0f} tokens) within "
                    f"{filled['budget_mib']:.0f} MiB" + (f" ({filled['unavailable']})" if filled.get("unavailable")
                                                         else ""))
    print(yaml.safe_dump({"finetune": {"runs": overlay}}, sort_keys=False), end="")
    print("# " + "; ".join(said), file=sys.stderr)


if __name__ == "__main__":
    main(sys.argv[1:])
