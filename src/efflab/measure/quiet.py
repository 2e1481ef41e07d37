"""Whether the machine was ours while we measured: the share of its CPU time that other processes (and, on a VM, the
hypervisor's steal) took, from the kernel's counters (/proc/stat) less what this process and its finished children
used (getrusage). A speed probe catches a change of speed between two moments; this catches a load that stayed the
same all through a measurement (another training job beside a benchmark), which a probe taken under it sees as the
machine's own speed.

    watch = OthersCpu().start()
    ...   # the measured work, in this process or in child processes that have exited
    share = watch.stop()   # 0.0 on a quiet machine; 0.5: others took half of every core
"""
from __future__ import annotations

import os
import resource
import time
from pathlib import Path

STAT = Path("/proc/stat")
# The share of the machine's CPU time others may take while a benchmark measures: a quiet 2-core VM's own daemons
# take about 1%; another training job beside it takes a whole core, 50%.
MAX_OTHERS_SHARE = 0.10


def busy_seconds(stat_text: str, ticks_per_s: float) -> float:
    """The CPU seconds all cores spent busy (neither idle nor waiting for I/O; steal included: time the VM's cores
    were given to someone else), from /proc/stat's first line."""
    fields = stat_text.splitlines()[0].split()
    if fields[0] != "cpu":
        raise ValueError(f"{STAT}: its first line is not the machine's `cpu` line: {stat_text.splitlines()[0]!r}")
    user, nice, system, idle, iowait, irq, softirq, steal = (int(x) for x in fields[1:9])
    return (user + nice + system + irq + softirq + steal) / ticks_per_s


def own_seconds() -> float:
    """CPU seconds of this process and of its children that have exited and been waited for."""
    return sum(u.ru_utime + u.ru_stime for u in (resource.getrusage(resource.RUSAGE_SELF),
                                                  resource.getrusage(resource.RUSAGE_CHILDREN)))


def others_share(busy_s: float, own_s: float, wall_s: float, cores: int) -> float:
    """The share of the machine's CPU time (wall × cores) that was busy with work not ours, at least 0."""
    if wall_s <= 0 or cores <= 0:
        return 0.0
    return max(0.0, (busy_s - own_s) / (wall_s * cores))


class OthersCpu:
    """Others' share of the CPU between start() and stop(); None where /proc/stat cannot be read."""

    def __init__(self):
        self.ticks = os.sysconf("SC_CLK_TCK")
        self.cores = os.cpu_count() or 1
        self._at = None

    def _read(self):
        try:
            busy = busy_seconds(STAT.read_text(), self.ticks)
        except (OSError, ValueError, IndexError):
            return None
        return busy, own_seconds(), time.monotonic()

    def start(self) -> "OthersCpu":
        self._at = self._read()
        return self

    def stop(self) -> float | None:
        now = self._read()
        if self._at is None or now is None:
            return None
        (busy0, own0, t0), (busy1, own1, t1) = self._at, now
        return others_share(busy1 - busy0, own1 - own0, t1 - t0, self.cores)
