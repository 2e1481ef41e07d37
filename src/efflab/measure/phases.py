"""Where an HF Trainer's step time goes, phase by phase: the one instrument the fine-tuning benchmark puts on
efflab's loop and on the plain script's alike (benchmarks/finetune_throughput.py).

A step, as transformers' Trainer runs it: `data` (get_batch_samples: fetching and collating the step's
micro-batches), `forward` (the model's forward calls, summed over micro-batches), `backward` (from each forward's
end to the next forward or to the optimizer: the backward passes and gradient clipping), `optimizer`
(optimizer.step), `step_end` (scheduler step, zero_grad), then `between` steps (the callbacks' on_step_end,
logging, checkpoints, up to the next step's data). `instrument` is the time an instrument that must cost something
spends outside the work it measures, wherever it falls (efflab's live-tensor count starting and stopping its
recording on the steps it counts: `watch`), taken out of the phase it fell in. `other` is the rest of the step
(moving inputs to the device, the Trainer's bookkeeping). The phases add up to the step's whole time by
construction.

Stamps are time.perf_counter on a CPU; on a GPU, CUDA events recorded in the stream (read once, at the end: no
synchronisation inside the loop). A compiled model's forward is one graph: its forward and backward are then one
phase, `forward+backward`.
"""
from __future__ import annotations

import statistics

import torch

from .timing import seconds_since, stamp

# transformers' TrainerCallback is imported inside attach, which runs only in a process that trains: its module
# (transformers.trainer_callback) brings accelerate, peft and bitsandbytes, 5-10 s of imports on 2 cores, and
# bitsandbytes initialises CUDA at import. The finetune stage imports this module at its top, before cli.main has
# given the process its GPU, and the fine-tuning benchmark's driver (benchmarks/finetune_throughput.py) trains nothing.

# Where a process writes its steps' phases when the benchmark asks (the finetune stage, the plain script)
PHASES_ENV = "EFFLAB_PHASES"
PHASES = ("data", "forward", "backward", "forward+backward", "optimizer", "step_end", "between", "instrument",
          "other")


class PhaseClock:
    """Stamps the phase boundaries of a Trainer's steps (attach), then gives each step's phases in seconds."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: list[tuple[str, object]] = []
        self._hooks = []

    def mark(self, label: str) -> None:
        self.marks.append((label, stamp(self.cuda)))

    def attach(self, trainer, model) -> "PhaseClock":
        """Stamp `trainer`'s steps: its batch fetching, `model`'s forward calls, and the step's callbacks."""
        from transformers import TrainerCallback

        clock = self

        class Stamps(TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):
                clock.mark("step_begin")

            def on_pre_optimizer_step(self, args, state, control, **kwargs):
                clock.mark("optimizer_begin")

            def on_optimizer_step(self, args, state, control, **kwargs):
                clock.mark("optimizer_end")

            def on_step_end(self, args, state, control, **kwargs):
                clock.mark("step_end")

            def on_train_end(self, args, state, control, **kwargs):
                clock.mark("train_end")

        trainer.callback_handler.callbacks.insert(0, Stamps())  # first: the others' on_step_end is `between`
        fetch = trainer.get_batch_samples

        def timed_fetch(*args, **kwargs):
            self.mark("data_begin")
            out = fetch(*args, **kwargs)
            self.mark("data_end")
            return out
        trainer.get_batch_samples = timed_fetch
        self._hooks = [model.register_forward_pre_hook(lambda *a: self.mark("forward_begin")),
                       model.register_forward_hook(lambda *a: self.mark("forward_end"))]
        return self

    def watch(self, instrument, *methods: str) -> "PhaseClock":
        """Stamp each call of `instrument`'s `methods` as instrument time (e.g. CpuTensorPeak's pause and resume)."""
        for name in methods:
            method = getattr(instrument, name)

            def stamped(*args, _method=method, **kwargs):
                self.mark("instrument_begin")
                try:
                    return _method(*args, **kwargs)
                finally:
                    self.mark("instrument_end")
            setattr(instrument, name, stamped)
        return self

    def detach(self) -> None:
        for hook in self._hooks:
            hook.remove()

    def seconds(self) -> list[tuple[str, float]]:
        """Every mark with its time since the first, in seconds."""
        if not self.marks:
            return []
        labels, stamps = zip(*self.marks)
        return list(zip(labels, seconds_since(stamps[0], list(stamps), self.cuda)))

    def steps(self) -> list[dict]:
        return step_phases(self.seconds())


def step_phases(marks: list[tuple[str, float]]) -> list[dict]:
    """Each step's phases in seconds from the marks (label, time) in order: a step runs from one `data_begin` to
    the next (or to `train_end`); its phases add up to its `total`."""
    starts = [i for i, (label, _) in enumerate(marks) if label == "data_begin"]
    ends = starts[1:] + [next((i for i, (label, _) in enumerate(marks) if label == "train_end"), None)]
    out = []
    for a, b in zip(starts, ends):
        if b is None:
            break
        out.append(_one_step(marks[a:b + 1]))
    return out


def _one_step(marks: list[tuple[str, float]]) -> dict:
    instruments = _instrument_intervals(marks)
    marks = [(label, t) for label, t in marks if not label.startswith("instrument_")]
    at = {}
    for label, t in marks[:-1]:
        at.setdefault(label, []).append(t)
    begin, end = marks[0][1], marks[-1][1]
    phases = dict.fromkeys(PHASES, 0.0)
    if not {"data_end", "step_begin", "optimizer_begin", "optimizer_end", "step_end"} <= set(at):
        return {"total": end - begin, "incomplete": True}
    phases["data"] = at["data_end"][0] - begin
    phases["optimizer"] = at["optimizer_end"][0] - at["optimizer_begin"][0]
    phases["step_end"] = at["step_end"][0] - at["optimizer_end"][0]
    phases["between"] = end - at["step_end"][0]
    fwd_begin, fwd_end = at.get("forward_begin", []), at.get("forward_end", [])
    if fwd_begin and len(fwd_begin) == len(fwd_end):
        phases["forward"] = sum(e - s for s, e in zip(fwd_begin, fwd_end))
        after = fwd_begin[1:] + [at["optimizer_begin"][0]]  # each forward's backward runs until the next forward
        phases["backward"] = sum(n - e for e, n in zip(fwd_end, after))
    else:  # a compiled model: no forward boundary to see inside the step
        phases["forward+backward"] = at["optimizer_begin"][0] - at["step_begin"][0]
    for start, stop in instruments:  # out of the phase it fell in, into its own
        phases[_phase_at(start, at)] -= stop - start
        phases["instrument"] += stop - start
    phases["other"] = (end - begin) - sum(phases.values())
    return phases | {"total": end - begin}


def _instrument_intervals(marks: list[tuple[str, float]]) -> list[tuple[float, float]]:
    begins = [t for label, t in marks if label == "instrument_begin"]
    ends = [t for label, t in marks if label == "instrument_end"]
    return list(zip(begins, ends, strict=True))


def _phase_at(t: float, at: dict) -> str:
    """The phase a moment outside the forward calls falls in, by the step's marks (`at`: label -> times)."""
    if t < at["data_end"][0]:
        return "data"
    if t >= at["step_end"][0]:
        return "between"
    if t >= at["optimizer_end"][0]:
        return "step_end"
    if t >= at["optimizer_begin"][0]:
        return "optimizer"
    return "other"


def summary(steps: list[dict], skip: int = 1) -> dict:
    """Median seconds per phase over the steps after the first `skip` (warm-up), the median step, and the sum of
    the phases' medians (each step's phases add up to it exactly; their medians need not add up to its median)."""
    kept = [s for s in steps[skip:] if not s.get("incomplete")] or [s for s in steps if not s.get("incomplete")]
    if not kept:
        return {"steps": 0}
    median = {p: statistics.median(s[p] for s in kept) for p in PHASES + ("total",)}
    return {"steps": len(kept), "median_s": median, "sum_of_phase_medians_s": sum(median[p] for p in PHASES),
            "per_step": kept}
