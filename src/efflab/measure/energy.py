"""Energy: counters read before and after the measured work (RAPL on the CPU, NVML on the GPU)."""
from __future__ import annotations

import os
import re
import time
from pathlib import Path

import torch

from .device import nvml_handle, synchronize

# pynvml is optional (the gpu extra): it is imported where NVML is read.


POWERCAP_ENV = "EFFLAB_POWERCAP_ROOT"  # tests point it at a fake /sys/class/powercap tree


RAPL_PACKAGE = re.compile(r"^intel-rapl:\d+$")  # top-level zones: one per CPU package (AMD's too, same driver)


def _rapl_packages() -> tuple[list[Path], str | None]:
    root = Path(os.environ.get(POWERCAP_ENV) or "/sys/class/powercap")
    if not root.is_dir():
        return [], f"no {root} (the kernel exposes no RAPL powercap interface here)"
    zones = sorted(z for z in root.iterdir() if RAPL_PACKAGE.match(z.name) and (z / "energy_uj").exists())
    if not zones:
        return [], f"{root} has no intel-rapl package zone"
    return zones, None


def _read_uj(zone: Path) -> int:
    return int((zone / "energy_uj").read_text())


class EnergyMeter:
    """Joules used while a block runs, from hardware energy counters read at its start and end only (nothing
    runs in between): on a CUDA device NVML's total-energy counter of the GPU board (millijoules, Volta and
    newer); on CPU the RAPL package counters (microjoules, through powercap: the whole socket, every process on
    it, not this job alone); otherwise `unavailable` with the reason. `stop()` gives joules, seconds, mean watts
    and what was measured."""

    def __init__(self, device: torch.device):
        self.device, self.reason, self.start_counts = device, None, None

    def start(self) -> "EnergyMeter":
        self.t0 = time.perf_counter()
        try:
            self.start_counts = self._counts()
        except Exception as err:  # a counter that cannot be read is a recorded fact, not a crash
            self.reason = self.reason or f"{type(err).__name__}: {err}"
        return self

    def _counts(self) -> dict:
        if self.device.type == "cuda":
            try:
                import pynvml
            except ImportError:
                self.reason = "pynvml (nvidia-ml-py, the [gpu] extra) is not installed"
                raise
            synchronize(self.device)
            return {"gpu": pynvml.nvmlDeviceGetTotalEnergyConsumption(nvml_handle(self.device)) / 1e3}
        zones, reason = _rapl_packages()
        if reason:
            self.reason = reason
            raise FileNotFoundError(reason)
        self.zones = zones
        return {z.name: _read_uj(z) / 1e6 for z in zones}

    def stop(self) -> dict:
        seconds = time.perf_counter() - self.t0
        if self.start_counts is None:
            return {"unavailable": self.reason or "no energy counter"}
        try:
            end = self._counts()
        except Exception as err:
            return {"unavailable": self.reason or f"{type(err).__name__}: {err}"}
        joules = 0.0
        for key, before in self.start_counts.items():
            delta = end[key] - before
            if delta < 0 and self.device.type != "cuda":  # the counter wrapped (once) at max_energy_range_uj
                delta += int((self.zones[[z.name for z in self.zones].index(key)] / "max_energy_range_uj")
                             .read_text()) / 1e6
            joules += delta
        source = ("NVML total energy of the GPU board" if self.device.type == "cuda" else
                  f"RAPL package energy ({', '.join(self.start_counts)}): the whole CPU socket, all its processes")
        return {"joules": joules, "seconds": seconds, "watts": joules / seconds if seconds else None,
                "source": source}


def energy_of(work, device: torch.device, min_seconds: float = 2.0) -> tuple[dict, int]:
    """Energy of repeating `work() -> tokens` until `min_seconds` have passed (counters tick every few
    milliseconds; a longer window averages that out): the meter's result and the tokens made. Nothing runs
    when no counter can be read."""
    meter = EnergyMeter(device).start()
    if meter.start_counts is None:
        return {"unavailable": meter.reason}, 0
    tokens, t0 = 0, time.perf_counter()
    while not tokens or time.perf_counter() - t0 < min_seconds:
        tokens += work()
    return meter.stop(), tokens


def energy_per_token(energy: dict, tokens: float) -> dict:
    """Joules per token from an EnergyMeter result, or its unavailable reason."""
    if "joules" not in energy or not tokens:
        return {"unavailable": energy.get("unavailable", "no tokens")}
    return {"joules_per_token": energy["joules"] / tokens, "tokens": tokens} | energy
