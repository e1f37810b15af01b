"""How many threads a CPU engine's torch ops use: as many as this process may run on (its CPU affinity, its
cgroup's CPU quota), and one while the machine is oversubscribed.

torch's OpenMP regions end in a barrier that every thread of the region must reach. When other processes keep
the cores busy, a descheduled thread holds the barrier up for a scheduler slice: with two busy neighbours on a
2-core box a SmolLM2 decode step went from 38 ms to 157-764 ms with two threads, and took 110 ms with one (a fair
share of 2/3 of a core gives ~107). So while other work is waiting for the CPUs, the engine steps with one
thread, and with all of them again once the machine is quiet. Tokens and log-probs do not change: the CPU
products are the same bits at any thread count (tests/test_cpu_threads.py checks it).

A local engine steps in its caller's thread: the count is set for each step and the caller's put back after
it (a learner in the same process keeps its own), and the caller's count is the most the engine uses.

Contention is read from Linux's CPU pressure (/proc/pressure/cpu: the share of time some task waited for a CPU
over the last sampling interval) and, to go back to all threads, from the runnable tasks of /proc/loadavg beyond
our own threads (none may be left, or our threads would make them wait again).
"""
from __future__ import annotations

import math
import os
import time
from collections import deque
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch

BUSY = 0.3               # share of time some task waited for a CPU above which the machine is contended
SAMPLES = 3              # consecutive samples that must agree before the thread count changes
INTERVAL_S = 0.25


def usable_cpus() -> int:
    """CPUs this process may run on: its affinity mask, capped by a cgroup CPU quota (v2 or v1)."""
    n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    quota = _cgroup_quota(Path("/sys/fs/cgroup"))
    return max(1, min(n, math.ceil(quota)) if quota else n)


def _cgroup_quota(root: Path) -> float | None:
    """CPUs the cgroup's quota allows (cpu.max for v2, cpu.cfs_quota_us / cpu.cfs_period_us for v1), None if
    unlimited or unknown."""
    try:
        text = (root / "cpu.max").read_text().split()
        if text and text[0] != "max":
            return int(text[0]) / int(text[1])
        return None
    except (OSError, ValueError, IndexError):
        pass
    try:
        quota = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period = int((root / "cpu" / "cpu.cfs_period_us").read_text())
        return quota / period if quota > 0 and period > 0 else None
    except (OSError, ValueError):
        return None


class Pressure:
    """Two readings of the machine: the share of the time since the last read that some task waited for a CPU
    (Linux PSI; None without it), and how many tasks besides our own threads are runnable now (/proc/loadavg)."""

    def __init__(self, psi: Path = Path("/proc/pressure/cpu"), loadavg: Path = Path("/proc/loadavg")):
        self.psi, self.loadavg = psi, loadavg
        self._last: tuple[float, float] | None = None

    def read(self, own_threads: int) -> tuple[float | None, int]:
        return self._waiting_share(), self._others(own_threads)

    def _waiting_share(self) -> float | None:
        try:
            total = float(self.psi.read_text().splitlines()[0].rsplit("total=", 1)[1])
        except (OSError, ValueError, IndexError):
            return None
        now = time.monotonic()
        last, self._last = self._last, (now, total)
        if last is None or now <= last[0]:
            return 0.0
        return (total - last[1]) / 1e6 / (now - last[0])

    def _others(self, own_threads: int) -> int:
        try:
            running = int(self.loadavg.read_text().split()[3].split("/")[0])
        except (OSError, ValueError, IndexError):
            return 0
        return max(0, running - own_threads)


class CpuThreads:
    """Run each engine step inside step(); call tick() before each forward (cheap: it samples at most every
    INTERVAL_S)."""

    def __init__(self, pressure: Pressure | None = None, interval_s: float = INTERVAL_S):
        self.usable = usable_cpus()
        self.full = max(1, min(torch.get_num_threads(), self.usable))
        self.contended = False
        self.pressure = pressure or Pressure()
        self.interval_s = interval_s
        self.samples: deque[tuple[float | None, int]] = deque(maxlen=SAMPLES)
        self.switches = 0
        self._next = 0.0
        self._stepping = False

    @property
    def current(self) -> int:
        return 1 if self.contended else self.full

    @contextmanager
    def step(self) -> Iterator[None]:
        """The engine's count for the block, the caller's again after it."""
        caller = torch.get_num_threads()
        self.full = max(1, min(caller, self.usable))
        if self.current != caller:
            torch.set_num_threads(self.current)
        self._stepping = True
        try:
            yield
        finally:
            self._stepping = False
            if torch.get_num_threads() != caller:
                torch.set_num_threads(caller)

    def tick(self) -> None:
        if self.full == 1:
            return
        now = time.monotonic()
        if now < self._next:
            return
        self._next = now + self.interval_s
        self.samples.append(self.pressure.read(self.current))
        want = decide(self.current, self.full, list(self.samples))
        if want != self.current:
            self.contended = want < self.full
            self.switches += 1
            self.samples.clear()  # the next decision reads the machine as it is with the new count
            if self._stepping:
                torch.set_num_threads(want)


def decide(current: int, full: int, samples: list[tuple[float | None, int]]) -> int:
    """The thread count for the next steps, from SAMPLES consecutive (waiting share, other runnable tasks)
    readings (fewer: unchanged, so one noisy reading never flips it). With all threads: one once tasks kept
    waiting for a CPU (PSI >= BUSY; without PSI, another task runnable in every reading). With one: all again
    once no other task was runnable in any reading, so that our threads would not make anyone wait (PSI cannot
    tell: with one thread nobody waits even while a neighbour holds a core)."""
    if len(samples) < SAMPLES:
        return current
    recent = samples[-SAMPLES:]
    if current == full:
        contended = all((share >= BUSY) if share is not None else others >= 1 for share, others in recent)
        return 1 if contended else current
    return full if all(others == 0 for _, others in recent) else current
