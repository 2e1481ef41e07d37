"""What measures a finetune run as it trains: rank 0's readings before training (the validation loss, the matmul
ceiling), the instruments on its Trainer (step timer, live-tensor count, phase clock, sequence lengths, validations
between steps), the memory the estimator predicts, and the training loop run under them (fit), with what it did."""
from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ... import profiling
from ...estimators.training_memory import longest_micro_batch, training_peak
from ...layout import Job
from ...measure.energy import EnergyMeter
from ...measure.flops import matmul_ceiling
from ...measure.memory import CpuTensorPeak, track_memory
from ...measure.phases import PHASES_ENV, PhaseClock
from .outputs import checkpoint_state
from .prepared import PreparedRun

log = logging.getLogger("efflab")

COUNTED_STEPS = ("the first step, from the start of training, and each later step with more token positions in a "
                 "micro-batch than any counted step's and at least the run's longest micro-batch as its batch order "
                 "foretold (where the peak can be); the others were not counted")


@dataclass
class Trained:
    """What the training loop did in this process (fit): its Trainer and train result, the seconds it trained (the
    validations between steps left out), its memory, energy and profile, and the checkpoint it resumed from."""
    trainer: object
    result: object
    train_s: float
    memory: dict
    energy: dict
    profile: dict | None
    resumed: dict

    @property
    def steps(self) -> int:
        """What this process trained (and timed): the steps after the one it resumed from."""
        return self.result.global_step - self.resumed["global_step"]

    @property
    def tokens(self) -> int:
        """The real (non-padding) input tokens of those steps."""
        return self.trainer.state.num_input_tokens_seen - self.resumed["num_input_tokens_seen"]

    @property
    def loss_curve(self) -> list[dict]:
        """Each logged step's loss, learning rate and gradient norm (the rows of loss.csv)."""
        return [{"step": h["step"], "loss": h["loss"], "learning_rate": h.get("learning_rate"),
                 "grad_norm": h.get("grad_norm")} for h in self.trainer.state.log_history if "loss" in h]

    @property
    def optimizer_state_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for state in self.trainer.optimizer.state.values()
                   for t in state.values() if torch.is_tensor(t))


class Instruments:
    """The instruments of one run in this process. Made before its Trainer, whose first callbacks they give
    (callbacks); attached to it once it is made (attach); read as it trains (fit)."""

    def __init__(self, cfg: dict, job: Job, run: PreparedRun):
        from .callbacks import StepTimes

        self.job, self.run, self.profile_cfg = job, run, cfg["profile"]
        self.before = self.ceiling = None
        if run.processes.main:  # only rank 0 reports: the other ranks need neither the start loss nor the ceiling
            self.before = run.validation_loss(run.model)
            self.ceiling = matmul_ceiling(run.matmul_dtype, run.device)
            log.info("%s: matmul ceiling %.3f TFLOP/s (%s, measured in this process)", job.name,
                     self.ceiling["tflops"], run.matmul_dtype)
        on = run.run_cfg.instruments
        self.profiled = run.processes.main and profiling.wanted(cfg, "finetune")
        self.tensors = CpuTensorPeak(unavailable=profiling.REPLACES_TENSOR_PEAK if self.profiled else
                                     None if on else "instruments: false (no live-tensor count)")
        self.step_times = StepTimes(run.device) if on else None
        self.target = cfg["finetune"].get("target")
        self.counted = self.phases = self.processed = self.evals = self.prediction = None

    def callbacks(self) -> list:
        """The Trainer's own callbacks: the step timer first, and the fault injection of the resume tests."""
        from .callbacks import KILL_ENV, KillAfterCheckpoint

        return ([self.step_times] if self.step_times is not None else []) + \
            ([KillAfterCheckpoint()] if os.environ.get(KILL_ENV) else [])

    def attach(self, trainer) -> None:
        """The instruments added to the made Trainer, and the memory the estimator predicts for its run."""
        from .callbacks import CountLongestSteps, SequenceLengths, ValidationEvery

        run = self.run
        lengths = run.train_lengths
        if run.run_cfg.instruments:
            self.counted = CountLongestSteps(self.tensors, trainer, None if run.processes.world > 1 else
                                             longest_micro_batch(lengths, run.run_cfg))
            trainer.add_callback(self.counted)  # after StepTimes: it pauses once the step is timed
        if os.environ.get(PHASES_ENV) and run.processes.main:
            self.phases = PhaseClock(run.device).attach(trainer, run.model)
            if self.counted:  # the count's own starts and stops are its phase, not the loop's data or between
                self.phases.watch(self.tensors, "pause", "resume")
        self.processed = SequenceLengths(run.model)
        if self.target and run.processes.main:
            self.evals = ValidationEvery(self.target["every"], run.validation_loss, self.step_times, self.processed,
                                         self.tensors)
            trainer.add_callback(self.evals)  # after the step timer and the count: the validation is in neither
        self.prediction = training_peak(self.job.layout.base_model(), run.run_cfg, run.dtype,  # from config
                                        run.precision, lengths, run.device.type)  # and data only

    def fit(self, trainer, resume: str | None) -> Trained:
        """trainer.train() (from the checkpoint `resume` where there is one) with its memory tracked and its energy
        counted at the ends (and profiled where asked); then the instruments come off the model."""
        resumed = checkpoint_state(resume)
        if resume:
            log.info("%s: resuming from %s (step %d)", self.job.name, resume, resumed["global_step"])
        device = self.run.device
        with track_memory(device, self.tensors) as memory:
            profiler = None
            if self.profiled:
                profiler = profiling.Profiler(self.profile_cfg, self.job.out / profiling.FOLDER, device)
                profiling.trainer_hooks(trainer, profiler)
            meter = EnergyMeter(device).start()  # two counter reads, at the ends: nothing in between
            t0 = time.perf_counter()
            result = trainer.train(resume_from_checkpoint=resume)
            # the tensor count's pauses and the validations between steps are not training
            seconds = time.perf_counter() - t0 - self.tensors.overhead_s - (self.evals.seconds if self.evals else 0.0)
            energy = meter.stop()
            profile = profiler.close() if profiler else None
        if self.counted and self.counted.steps:  # none where the count did not run (a GPU, a profiled run)
            memory["tensors"] |= self.counted.record() | {"counted": COUNTED_STEPS}
        self.processed.remove()
        if self.phases:  # the benchmark's phase clock (benchmarks/finetune_throughput.py)
            Path(os.environ[PHASES_ENV]).write_text(json.dumps({"steps": self.phases.steps()}))
        return Trained(trainer, result, seconds, memory, energy, profile, resumed)
