"""Timing: one timed function, and interleaved comparisons with a speed sentinel."""
from __future__ import annotations

import statistics
import time

import torch

from .device import synchronize
from .stats import summarize

# The host clock of CPU timings (time_fn, interleave). Tests replace it with a simulated clock that the timed
# work advances by known amounts, so that no test of a verdict or a threshold races the real machine.
clock = time.perf_counter


def stamp(cuda: bool):
    """A point in time for a clock that reads it later: a CUDA event recorded in the stream (it times the kernels,
    not their asynchronous launch, and adds no synchronisation), else perf_counter."""
    if cuda:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event
    return time.perf_counter()


def seconds_since(origin, stamps: list, cuda: bool) -> list[float]:
    """Each stamp's time since `origin`, in seconds (stamp(); one synchronisation on a GPU, here)."""
    if cuda:
        torch.cuda.synchronize()
        return [origin.elapsed_time(s) / 1000 for s in stamps]
    return [s - origin for s in stamps]


def time_fn(fn, device: torch.device, warmup: int, repeats: int) -> dict:
    """Run fn `warmup` times untimed, then `repeats` timed times; CUDA events on GPU."""
    for _ in range(warmup):
        fn()
    synchronize(device)
    samples = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize(device)
            samples.append(start.elapsed_time(end) / 1000.0)
        else:
            t0 = clock()
            fn()
            samples.append(clock() - t0)
    return summarize(samples) | {"warmup": warmup, "clock": "cuda_events" if device.type == "cuda" else "perf_counter"}


# How far a speed probe may stray from the median probe before its round is set aside. Probes on a quiet
# shared 2-core VM spread about ±15%; a core taken by another process halves them.
SENTINEL_TOLERANCE = 0.25


def speed_probe(device: torch.device) -> float:
    """The machine's speed right now: the best of three short fixed fp32 matmuls, in GFLOP/s (about 30 ms on
    two CPU cores). Another process taking a core, a clock change or thermal throttling shows as a drop.
    Sized so that on a quiet 2-core machine 30 probes in a row stay within ±10% of their median (384 or
    512 were too short for that: 72-153 GFLOP/s around 125)."""
    size = 4096 if device.type == "cuda" else 768
    a = torch.randn(size, size, device=device)
    best = min(time_fn(lambda: torch.mm(a, a), device, warmup=1, repeats=3)["samples"])
    return 2 * size**3 / best / 1e9


def alternating(names: list, index: int) -> list:
    """Round `index`'s order in interleave(): A B, then B A, and so on."""
    return names if index % 2 == 0 else names[::-1]


def balanced_order(names: list, index: int) -> list:
    """Round `index`'s order for more than two: the names rotated by one every two rounds, every odd round the
    reverse of the round before (A B C, C B A, B C A, A C B, C A B, B A C). Every two rounds each name's mean
    position is the middle, so a drift of the machine's speed linear over those two rounds shifts every name's mean
    time by the same amount (a median's, not exactly);
    each pair of names runs in either order equally often; over 2n rounds of n names each name takes every
    position twice."""
    k = (index // 2) % len(names) if names else 0
    rotated = names[k:] + names[:k]
    return rotated if index % 2 == 0 else rotated[::-1]


def sentinel_rounds(run_round, rounds: int, device: torch.device, tolerance: float = SENTINEL_TOLERANCE,
                    extra_rounds: int | None = None) -> dict:
    """Rounds of work watched by the speed sentinel: a speed probe before the first round and after each (the probe
    after one round is the probe before the next), outside the work. `run_round(index)` does round `index`'s work
    (its order of the variants or cells is the caller's: alternating, balanced_order) and returns the round's entry
    of the record, to which its probes (`probe_gflops`) and `stable` are added.

    A round whose probes fall outside ±tolerance of the median probe is set aside, and another round is run in its
    place (at most `extra_rounds` more, default `rounds`); if fewer than `rounds` stable rounds are left, the result
    is `unstable`, with the probes that say so, and must not be read as a verdict (figure_rounds then gives every
    round). `sentinel_s` is what the probes cost. Returns the rounds, how many are stable and set aside, the probes'
    summary with the tolerance, and `unstable` where the machine was."""
    extra = rounds if extra_rounds is None else extra_rounds
    log, sentinel_s, probe_before = [], 0.0, None
    while True:
        t0 = clock()
        probe_before = probe_before or speed_probe(device)
        sentinel_s += clock() - t0
        entry = run_round(len(log))
        t0 = clock()
        probe_after = speed_probe(device)
        sentinel_s += clock() - t0
        log.append(entry | {"probe_gflops": [probe_before, probe_after]})
        probe_before = probe_after  # the probe after one round is the probe before the next
        stable = _mark_stable(log, tolerance)
        if stable >= rounds or len(log) >= rounds + extra:
            break
    kept = [r for r in log if r["stable"]]
    probes = [p for r in log for p in r["probe_gflops"]]
    out = {"rounds": log, "stable_rounds": len(kept), "set_aside": len(log) - len(kept),
           "probe": summarize(probes, unit="GFLOP/s", keep_samples=False) | {"tolerance": tolerance},
           "sentinel_s": sentinel_s}
    if len(kept) < rounds:
        out["unstable"] = (f"the machine's speed changed: {len(log) - len(kept)} of {len(log)} rounds had a speed "
                           f"probe outside ±{tolerance:.0%} of the median {out['probe']['median']:.1f} GFLOP/s "
                           f"(range {out['probe']['min']:.1f}–{out['probe']['max']:.1f})")
    return out


def interleave(variants: dict, rounds: int, device: torch.device, warmup: int = 1,
               tolerance: float = SENTINEL_TOLERANCE, extra_rounds: int | None = None) -> dict:
    """Time each variant's `fn(round)` once per round, the variants interleaved (A B, then B A, ...) so that a
    drift of the machine's speed falls on each variant equally often first and second, the rounds watched by the speed sentinel
    (sentinel_rounds: a probe before and after each round, a round whose probes strayed beyond ±tolerance of the
    median set aside and run again, at most `extra_rounds` more; `unstable` where too few stable rounds are left,
    its figures then of every round, not to be read as a verdict). Returns the per-round record and, per variant,
    the summary of its stable rounds."""
    names = list(variants)
    for r in range(warmup):
        for name in names:
            variants[name](r)
    synchronize(device)

    def one_round(index: int) -> dict:
        order = alternating(names, index)
        return {"order": order, "seconds": {name: time_fn(lambda: variants[name](warmup + index), device, 0, 1)
                                            ["samples"][0] for name in order}}

    watched = sentinel_rounds(one_round, rounds, device, tolerance, extra_rounds)
    figures = [watched["rounds"][i] for i in figure_rounds(watched["rounds"], rounds)]
    out = {k: watched[k] for k in ("rounds", "stable_rounds", "set_aside")} | {"warmup_rounds": warmup} | {
        k: watched[k] for k in ("probe", "sentinel_s")} | {
        "clock": "cuda_events" if device.type == "cuda" else "perf_counter",
        "variants": {n: summarize([r["seconds"][n] for r in figures]) for n in names}}
    return out | ({"unstable": watched["unstable"]} if "unstable" in watched else {})


def figure_rounds(log: list[dict], rounds: int) -> list[int]:
    """The rounds an interleave() result's figures are of, by index: the stable ones, or every one where fewer than
    `rounds` are stable (the result is then `unstable`, flagged as such)."""
    stable = [i for i, r in enumerate(log) if r["stable"]]
    return stable if len(stable) >= rounds else list(range(len(log)))


def _mark_stable(log: list[dict], tolerance: float) -> int:
    median = statistics.median(p for r in log for p in r["probe_gflops"])
    for r in log:
        r["stable"] = all(abs(p / median - 1) <= tolerance for p in r["probe_gflops"])
    return sum(r["stable"] for r in log)


def set_aside_why(log: list[dict], tolerance: float) -> dict[int, str]:
    """Why each set-aside round of a sentinel_rounds() record was set aside, by index: its probes that strayed
    from the median probe, and by how much."""
    median = statistics.median(p for r in log for p in r["probe_gflops"])
    return {i: "speed probe " + ", ".join(f"{p:.1f} GFLOP/s ({p / median - 1:+.0%})" for p in r["probe_gflops"]
                                          if abs(p / median - 1) > tolerance)
               + f" outside ±{tolerance:.0%} of the median probe {median:.1f} GFLOP/s"
            for i, r in enumerate(log) if not r["stable"]}


# What an interleave() result keeps beside its figures: the rounds, the sentinel's probes and cost.
INTERLEAVE_RECORD = ("rounds", "stable_rounds", "set_aside", "probe", "sentinel_s")
