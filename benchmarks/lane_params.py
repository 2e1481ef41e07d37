"""The GPU lane's params files (benchmarks/gpu_lane.sh): one whole experiment from a base params file and overlays
merged over it in order, each by efflab.config's merge (the one finetune runs use over their defaults); an overlay's
`replace` list names dotted sections it replaces whole rather than merges into (a grid cut to fewer cells).

    python benchmarks/lane_params.py OUT.yaml BASE.yaml OVERLAY.yaml [OVERLAY.yaml ...]
"""
from __future__ import annotations

import sys
from pathlib import Path

import yaml

from efflab.experiment import deep_merge


def compose(base: dict, *overlays: dict) -> dict:
    out = base
    for overlay in overlays:
        overlay = dict(overlay)
        replaced = overlay.pop("replace", [])
        out = deep_merge(out, overlay)
        for dotted in replaced:
            *parents, leaf = dotted.split(".")
            source, target = overlay, out
            for key in parents:
                source, target = source[key], target[key]
            target[leaf] = source[leaf]
    return out


def main(argv: list[str]) -> None:
    out, base, *overlays = argv
    params = compose(*(yaml.safe_load(Path(f).read_text()) for f in (base, *overlays)))
    Path(out).write_text(yaml.safe_dump(params, sort_keys=False))


if __name__ == "__main__":
    main(sys.argv[1:])
