"""The finetune stage's Trainer callbacks and training-step instruments.

A module of its own because importing transformers' trainer modules (trainer_callback here) pulls in accelerate,
peft and bitsandbytes, and bitsandbytes asks CUDA for the device capability at import: that initialises CUDA. The
finetune stage imports this module inside train(), after cli.main has given the process its GPU
(gpu_slots.assign), never at module top.
"""
from __future__ import annotations

import os
import signal
import time

import torch
from transformers import TrainerCallback
from transformers.trainer_callback import ProgressCallback

from ...measure.memory import CpuTensorPeak
from ...measure.timing import stamp

KILL_ENV = "EFFLAB_KILL_AFTER_CHECKPOINT"


class QuietProgress(ProgressCallback):
    """The Trainer's progress bar without its printout of every logged dict: efflab logs every step (loss.csv needs
    each step's loss), and the bar wrote each step's dict to the console (28 lines of a default run). The figures are
    in the job's records and its own log lines."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        return None


def quiet_progress(trainer) -> None:
    """Swap the Trainer's progress callback for QuietProgress (where it has one: disable_tqdm leaves none)."""
    if any(type(c) is ProgressCallback for c in trainer.callback_handler.callbacks):
        trainer.remove_callback(ProgressCallback)
        trainer.add_callback(QuietProgress)


class KillAfterCheckpoint(TrainerCallback):
    """Fault injection for the resume tests: SIGKILL this process right after the checkpoint of the step
    named in $EFFLAB_KILL_AFTER_CHECKPOINT is on disk (what a pre-empted cluster job looks like)."""

    def on_save(self, args, state, control, **kwargs):
        if state.global_step == int(os.environ[KILL_ENV]):
            os.kill(os.getpid(), signal.SIGKILL)


class CountLongestSteps(TrainerCallback):
    """The live-tensor count (measure.memory.CpuTensorPeak) on the steps that can hold the run's peak, not on every
    step: the first (counted from the start of training: the optimizer's state is allocated in it) and each later
    step whose longest micro-batch computes more token positions than any counted step's. A step's live tensors
    grow with its token positions, so its peak is on one of them; the other steps run without the profiler's
    per-allocation events (on a CPU they cost ~5% of a LoRA step's time). Where the run's longest micro-batch is
    known before training (`longest_expected`: the estimator draws the Trainer's batch order,
    estimators.training_memory.padded_batch_lengths), only a step that reaches it is counted after the first: at
    most two steps, where record after record would be counted otherwise (half the steps of a 7-step packed
    run). The count resumes once a step's micro-batches are fetched (before the step timer starts) and pauses
    after the step timer stops: its own start and stop are in no step's time. `steps` lists the counted steps,
    `record()` what it saw."""

    def __init__(self, tensors: CpuTensorPeak, trainer, longest_expected: int | None = None):
        self.tensors, self.steps, self.longest, self._positions = tensors, [], 0, 0
        self.expected, self.seen = longest_expected, 0
        fetch = trainer.get_batch_samples

        def fetched(*args, **kwargs):
            batches, items = fetch(*args, **kwargs)
            self._positions = max((b["input_ids"].numel() for b in batches if "input_ids" in b), default=0)
            self.seen = max(self.seen, self._positions)
            if self._positions > self.longest and self._positions >= (self.expected or 0):
                self.tensors.resume()
            return batches, items
        trainer.get_batch_samples = fetched

    def on_step_end(self, args, state, control, **kwargs):
        if self.tensors.counting:
            self.steps.append(state.global_step)
            self.longest = max(self.longest, self._positions)
            self.tensors.pause()

    def record(self) -> dict:
        """The counted steps, the longest micro-batch expected, seen and counted (token positions), and where the
        longest seen was not counted (the order differed from the one expected), that the peak may be short."""
        out = {"counted_steps": self.steps, "longest_expected": self.expected, "longest_seen": self.seen,
               "longest_counted": self.longest}
        if self.seen > self.longest:
            out["missed"] = (f"the longest micro-batch ({self.seen} token positions) was not counted (the longest "
                             f"counted: {self.longest}; expected {self.expected}): the peak may be short of it")
        return out


class StepTimes(TrainerCallback):
    """Wall time and real (non-padding) input tokens of every optimizer step (forward, backward, optimizer), so
    that a run's step time has a spread, two runs' step times can be told apart from noise, and throughput can be
    taken over the steady steps alone. On a GPU each step's ends are CUDA events recorded in the stream, read when
    `durations` is first asked for after a step (one synchronisation then, none inside the loop): the timer adds no
    synchronisation to a step. First in the callback list, so the tensor count's pause and checkpoint saving (after
    on_step_end) stay outside the interval."""

    def __init__(self, device: torch.device):
        self.cuda, self.tokens = device.type == "cuda", []
        self._stamps: list[tuple] = []  # (start, end) of each step, stamps of measure.timing.stamp
        self._read: list[float] = []  # the durations of the first len(_read) steps, read already
        self._t0, self._seen = None, 0

    def on_step_begin(self, args, state, control, **kwargs):
        self._seen = state.num_input_tokens_seen
        self._t0 = stamp(self.cuda)

    def on_step_end(self, args, state, control, **kwargs):
        self._stamps.append((self._t0, stamp(self.cuda)))
        self.tokens.append(state.num_input_tokens_seen - self._seen)

    @property
    def durations(self) -> list[float]:
        """Each timed step's seconds (on a GPU, reading the steps' events not read before waits for them)."""
        unread = self._stamps[len(self._read):]
        if unread:
            if self.cuda:
                torch.cuda.synchronize()
            self._read += [start.elapsed_time(end) / 1000 if self.cuda else end - start for start, end in unread]
        return list(self._read)


class ValidationEvery(TrainerCallback):
    """The validation loss every `every` optimizer steps (time to quality, finetune.target), taken after the step's
    timer and tensor count stop (it is added to the Trainer after them): its time is in no step's time. Each point
    is (step, loss, training seconds so far: the sum of the timed steps). The last step's loss is the run's
    validation loss after training, taken once, by the stage."""

    def __init__(self, every: int, evaluate, step_times: StepTimes | None, processed: "SequenceLengths",
                 tensors: CpuTensorPeak):
        self.every, self.evaluate, self.step_times, self.curve = every, evaluate, step_times, []
        self.processed, self.tensors, self.seconds = processed, tensors, 0.0  # seconds: the validations' own

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step % self.every or state.global_step >= state.max_steps:
            return
        counting = self.tensors.counting
        if counting:  # neither the training's token count nor its live tensors see the validation
            self.tensors.pause()
        self.processed.paused = True
        t0, was_training = time.perf_counter(), model.training
        model.eval()
        self.curve.append({"step": state.global_step, "loss": self.evaluate(model)["loss"],
                           "train_s": sum(self.step_times.durations) if self.step_times else None})
        model.train(was_training)
        self.seconds += time.perf_counter() - t0
        self.processed.paused = False
        if counting:
            self.tensors.resume()


class SequenceLengths:
    """What the model computes in training, seen at its forward: every token position (pad tokens included,
    so the report can say how much of the compute went to padding) and each sequence's real length, from
    the position ids of a packed row (a new sequence starts at position 0) or the attention mask of a padded
    batch. Attention FLOPs grow with each sequence's own length, so they are counted per token over
    sum(len^2) / sum(len), the token-weighted mean length, not over the mean length.

    Nothing is read back to the host inside the loop (a GPU would wait for the step's queued kernels): the sums
    are kept as tensors on the inputs' device and read once, after training. A packed row's sum(len^2) is the sum
    over its tokens of 2 * position + 1 (the odd numbers up to 2L - 1 add up to L^2)."""

    def __init__(self, model):
        self.positions, self.paused = 0, False
        self._tokens = self._squares = 0  # ints, or tensors on the inputs' device until read
        self._hook = model.register_forward_pre_hook(self._seen, with_kwargs=True)

    def _seen(self, module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None or self.paused:
            return
        self.positions += ids.numel()  # from the shape: no read of the device
        tokens, squares = self.sums(ids, kwargs.get("attention_mask"), kwargs.get("position_ids"))
        self._tokens, self._squares = self._tokens + tokens, self._squares + squares

    @staticmethod
    def sums(ids: torch.Tensor, attention_mask, position_ids) -> tuple:
        """(sum of the sequences' lengths, sum of their squares) of one forward's inputs, as tensors on their
        device (ints where the shape alone says)."""
        if position_ids is not None and attention_mask is None:
            return position_ids.numel(), (2 * position_ids.long() + 1).sum()
        if attention_mask is not None:
            lengths = attention_mask.long().sum(dim=1)
            return lengths.sum(), (lengths * lengths).sum()
        return ids.numel(), ids.shape[0] * ids.shape[1] ** 2

    @property
    def tokens(self) -> int:
        return int(self._tokens)

    @property
    def squares(self) -> int:
        return int(self._squares)

    def attention_length(self) -> float | None:
        return self.squares / self.tokens if self.tokens else None

    def remove(self) -> None:
        self._hook.remove()
