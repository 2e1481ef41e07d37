"""The GPU lane's params files (benchmarks/gpu_lane.sh): one whole experiment from a base params file and overlays
laid over it in order, each the way a params overlay is (efflab.config.overlay: settings merge key by key, grids of
named entries are replaced whole, so an overlay cuts a grid to the cells it names).

    python benchmarks/lane_params.py OUT.yaml BASE.yaml OVERLAY.yaml [OVERLAY.yaml ...]
"""
from __future__ import annotations

import sys
from pathlib import Path

import yaml

from efflab import config


def main(argv: list[str]) -> None:
    out, base, *overlays = argv
    params = config.load(base)  # with the overlays it extends
    for overlay in overlays:
        params = config.overlay(params, yaml.safe_load(Path(overlay).read_text()))
    config.validate(params, out)
    Path(out).write_text(yaml.safe_dump(params, sort_keys=False))


if __name__ == "__main__":
    main(sys.argv[1:])
