"""Profiling on demand: where the time of a stage's steps goes (params `profile`).

Off by default, and then nothing is started or labelled: the stage runs as it does without this module. On for
a stage (profile.stages), its steps after `profile.skip_steps` run under torch.profiler for `profile.steps`
steps (CPU activities, and CUDA kernels on a GPU), each phase labelled with record_function: data, forward,
backward and optimizer step for training (finetune), generate for generation (bench_inference). It writes,
into the job's folder, profile/trace.json (Chrome trace event format: open it in Perfetto, ui.perfetto.dev, or
chrome://tracing) and profile/top_ops.csv (every operator by self time), and returns the top 10 for
metrics.json and the report.

A profiled run is a different measurement: the profiler's own cost is in its step times and memory. On CPU
it also takes the place of the tensor-peak counter (CpuTensorPeak, itself a torch.profiler): its figure is
recorded as unavailable for a profiled run. bench_inference profiles a generation pass of its own, after the
timed ones, so its figures are not disturbed.
"""
from __future__ import annotations

import csv
from pathlib import Path

import torch

from .registry import STAGES

# torch.profiler and transformers are slow to import: they are imported only when a job is profiled.

FOLDER, TRACE, TOP_OPS = "profile", "trace.json", "top_ops.csv"
TOP_COLUMNS = ("operator", "calls", "self_cpu_ms", "cpu_total_ms", "self_device_ms", "device_total_ms")
REPLACES_TENSOR_PEAK = "unavailable: this run was profiled (profile.stages): torch.profiler recorded its trace"


def wanted(cfg: dict, stage: str) -> bool:
    return STAGES[stage].profiled and stage in cfg["profile"]["stages"]


class Profiler:
    """torch.profiler over `steps` steps after `skip_steps` steps; `step()` after each step, `phase(name)` around
    each phase. Writes the trace and the operator table when its steps are done (or at `close()`)."""

    def __init__(self, settings: dict, folder: Path, device: torch.device, relative: str = FOLDER):
        """`folder`: where the files go; `relative`: that folder as metrics.json names it (from the job's folder)."""
        from torch.profiler import ProfilerActivity, profile, schedule

        self.folder, self.device, self.relative, self.written = Path(folder), device, relative, None
        self.steps, self.skip, self.stepped = settings["steps"], settings["skip_steps"], 0
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        warmup = 1 if self.skip else 0  # the profiler's own warm-up is the last skipped step
        self._prof = profile(activities=activities, record_shapes=settings["record_shapes"],
                             profile_memory=settings["profile_memory"], with_stack=settings["with_stack"],
                             schedule=schedule(wait=self.skip - warmup, warmup=warmup, active=self.steps, repeat=1),
                             on_trace_ready=self._write)
        self._prof.start()

    @staticmethod
    def phase(name: str):
        return torch.profiler.record_function(name)

    def step(self) -> None:
        self.stepped += 1
        self._prof.step()

    def close(self) -> dict:
        self._prof.stop()
        return self.summary()

    def _write(self, prof) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(self.folder / TRACE))
        rows = [{"operator": e.key, "calls": e.count, "self_cpu_ms": e.self_cpu_time_total / 1e3,
                 "cpu_total_ms": e.cpu_time_total / 1e3,
                 "self_device_ms": (getattr(e, "self_device_time_total", 0) or 0) / 1e3,
                 "device_total_ms": (getattr(e, "device_time_total", 0) or 0) / 1e3} for e in prof.key_averages()]
        by = "self_device_ms" if self.device.type == "cuda" else "self_cpu_ms"
        rows.sort(key=lambda r: r[by], reverse=True)
        with open(self.folder / TOP_OPS, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=TOP_COLUMNS)
            writer.writeheader()
            writer.writerows(rows)
        self.written = {"rows": rows, "sorted_by": by}

    def summary(self) -> dict:
        done = min(max(self.stepped - self.skip, 0), self.steps)
        if self.written is None or done == 0:
            return {"unavailable": f"no step ran after the {self.skip} skipped one(s)"}
        out = {"trace": f"{self.relative}/{TRACE}", "top_ops": f"{self.relative}/{TOP_OPS}", "steps": done,
               "sorted_by": self.written["sorted_by"], "top10": self.written["rows"][:10],
               "format": "Chrome trace event JSON (Perfetto, chrome://tracing)",
               "note": "a profiled run: its step times and memory include the profiler's own cost"}
        if done < self.steps:
            out["short"] = f"only {done} of the {self.steps} steps asked for ran after the skipped ones"
        return out


def profile_generation(settings: dict, folder: Path, relative: str, device: torch.device, generate) -> dict:
    """A pass of its own after the timed ones (so they are not disturbed): skip_steps untimed generations, then
    `steps` profiled ones, each labelled generate."""
    profiler = Profiler(settings, folder, device, relative)
    for _ in range(settings["skip_steps"] + settings["steps"]):
        with profiler.phase("generate"):
            generate()
        profiler.step()
    return profiler.close()


def trainer_hooks(trainer, profiler: Profiler) -> None:
    """Label the Trainer's phases for the profile: data (fetching the step's batches), forward (compute_loss),
    backward (accelerator.backward) and optimizer step; the profiler steps at each step's end."""
    from transformers import TrainerCallback

    def wrap(owner, name: str, label: str) -> None:
        inner = getattr(owner, name)

        def labelled(*args, **kwargs):
            with profiler.phase(label):
                return inner(*args, **kwargs)
        setattr(owner, name, labelled)

    wrap(trainer, "get_batch_samples", "data")
    wrap(trainer, "compute_loss", "forward")
    wrap(trainer.accelerator, "backward", "backward")

    class Steps(TrainerCallback):
        span = None

        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            self.span = profiler.phase("optimizer step")
            self.span.__enter__()

        def on_optimizer_step(self, args, state, control, **kwargs):
            if self.span is not None:
                self.span.__exit__(None, None, None)
                self.span = None

        def on_step_end(self, args, state, control, **kwargs):
            profiler.step()
    trainer.add_callback(Steps())
