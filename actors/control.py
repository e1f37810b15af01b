"""The router's control of every worker at once: pause and resume, sleep and wake-up for a colocated learner,
and the sleep's lease (a sleep lasts only while the client that asked for it lives).

Sleep, wake-up and weight refreshes hold one lock (`lock`): interleaved at the workers, two clients' sleep and
wake-up could leave the workers asleep while the router thinks them awake. The service's sleep level is the
deepest one a worker reports after each change, so the router's view is the workers'.
"""
from __future__ import annotations

import asyncio
import time
from typing import Callable

from rollout_service.connections.remote_errors import ACTOR_DOWN, error_text, is_down
from actors.workers import WorkerTable


class Control:
    def __init__(self, workers: WorkerTable, lease_s: float, counters: dict, log: Callable[[str], None]):
        self.workers, self.lease_s, self.counters, self._log = workers, lease_s, counters, log
        self.lock = asyncio.Lock()
        self.paused = False
        self.asleep = 0                      # the deepest sleep level a worker reports
        self.fail_if_asleep = False
        self._holder: str | None = None      # the client whose live process keeps the service asleep
        self._renewed = 0.0
        self._wake_after_refresh = False     # its holder is gone and sleep(2) dropped the weights: wake with them

    # -- pause ------------------------------------------------------------------------------------
    async def pause(self) -> None:
        self.paused = True
        await self._each("pause")

    async def resume(self) -> None:
        self.paused = False
        await self._each("resume")

    async def _each(self, method: str) -> None:
        for i in self.workers.targets():
            try:
                await getattr(self.workers.handles[i], method).remote()
            except ACTOR_DOWN:
                pass

    async def join(self, i: int) -> None:
        """A restarted worker i, before it serves: paused and asleep as the others are. Hold `lock`."""
        if self.paused:
            await self.workers.handles[i].pause.remote()
        if self.asleep:
            await self.workers.handles[i].sleep.remote(self.asleep)

    # -- sleep ------------------------------------------------------------------------------------
    async def sleep(self, level: int, fail_if_asleep: bool, holder: str | None) -> str | None:
        """Put every worker to sleep. `holder`: the client whose process keeps renewing this sleep (renew);
        None: asleep until wake_up, whoever lives. A later sleep replaces the holder. An error message or None."""
        if level not in (1, 2):
            return f"sleep: level={level!r} must be 1 (weights kept in host memory) or 2 (dropped)"
        async with self.lock:
            self.asleep, self.fail_if_asleep = max(self.asleep, level), bool(fail_if_asleep)
            self._holder, self._renewed = holder, time.monotonic()
            self._wake_after_refresh = False
            return await self._sleep_or_wake("sleep", level)

    async def wake_up(self) -> str | None:
        async with self.lock:
            return await self._wake_up()

    async def _wake_up(self) -> str | None:
        err = await self._sleep_or_wake("wake_up")
        if err is None:
            self.fail_if_asleep = False
            self._holder, self._wake_after_refresh = None, False
        return err

    async def _sleep_or_wake(self, method: str, *args: int) -> str | None:
        targets = self.workers.targets()
        outcomes = [o for _, o in await self.workers.each(targets, method, *args)]
        failed = [(i, o) for i, o in zip(targets, outcomes) if isinstance(o, BaseException) and not is_down(o)]
        stats = [o for o in outcomes if isinstance(o, dict)]  # sleep and wake_up answer with the worker's stats
        stats += [s for _, s in await self.workers.each([i for i, _ in failed], "stats")]
        levels = [s["sleep_level"] for s in stats if isinstance(s, dict)]
        if levels:
            self.asleep = max(levels)  # (one that failed to wake still sleeps)
        return f"{method} failed on " + "; ".join(f"worker {i}: {error_text(o)}" for i, o in failed) if failed else None

    # -- the sleep's lease ------------------------------------------------------------------------
    def renew(self, holder: str) -> None:
        """The client process that put the service to sleep still lives (anyone else's renewal is ignored: a
        renewal may also overtake the sleep call it belongs to)."""
        if holder == self._holder:
            self._renewed = time.monotonic()

    @property
    def orphaned(self) -> bool:
        """The sleep's holder has stopped renewing it."""
        return self._holder is not None and time.monotonic() - self._renewed > self.lease_s

    async def end_orphaned_sleep(self) -> None:
        """Wake the workers, which serve the last weights. Nothing here may end the lease loop."""
        self._holder = None
        self.counters["sleep_expired"] += 1
        self._log(f"the client that put the service to sleep is gone (no renewal for {self.lease_s:g} s); "
                  "waking the workers")
        try:
            err = await self.wake_up()
        except Exception as e:
            err = error_text(e)
        if err is not None:  # sleep(2) dropped the weights: a full refresh must bring them first
            self._wake_after_refresh = True
            self._log(f"the workers stay asleep ({err}); they wake after the next full refresh")

    async def after_refresh(self) -> None:
        """A refresh landed (the caller holds `lock`): an orphaned level-2 sleep wakes with its weights."""
        if not self._wake_after_refresh:
            return
        err = await self._wake_up()
        self._log("the refresh brought the weights back: the workers are awake" if err is None else
                  f"the workers stay asleep after the refresh ({err}); they wake after the next full refresh")

