"""Elastic workers: the first ones at start-up, and `scale(n)` at runtime (RolloutClient.scale, `rollout-service
scale`), one scale at a time.

- Adding: bundles come from those the service holds free first, then from one new placement group
  (actors/slots.py). Every new worker must answer health() with its engine built within placement.timeout_s;
  otherwise every worker this call started is ended, the new group removed, and the call fails, leaving the
  service as it was. Then each one catches up as a restarted worker does (actors/recovery.py: the replay log,
  or it waits for the learner's next full refresh), is paused or put to sleep as the others are, and serves.
- Replacing: workers given up (gone: no restarts left, their node died) among the first n get new ones, added
  the same way at the same index.
- Removing, the last ones first: a removed worker drains. No new request goes to it, and those it holds may
  finish for `drain_s` seconds; then it hands the rest back (results it finished meanwhile are kept, the others
  are aborted there and resubmitted to the other workers, as after a death). Only then is it ended and its
  bundle released: nothing is lost, and the ledger delivers each sample once.
"""
from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any, Callable

import ray

from rollout_service.connections.capacity import check_resources
from actors.control import Control
from actors.dispatch import Dispatcher
from rollout_service.connections.capacity import worker_bundle
from actors.placement import start_worker
from actors.quarantine import Quarantine
from actors.recovery import Recovery
from rollout_service.connections.remote_errors import error_text
from actors.slots import Slots
from actors.workers import WorkerTable
from rollout_service.config import ServiceConfig
from rollout_service.api.values import is_int, is_number


class Scaler:
    def __init__(self, config: ServiceConfig, workers: WorkerTable, slots: Slots, recovery: Recovery,
                 dispatcher: Dispatcher, control: Control, quarantine: Quarantine,
                 watch: Callable[[int, int], None], counters: dict, log: Callable[[str], None],
                 engine_factory: Callable[[dict], Any] | None = None):
        """`watch(i, generation)`: start collecting worker i's results (its poll loop)."""
        self.config, self.workers, self.slots, self.recovery = config, workers, slots, recovery
        self.dispatcher, self.control, self.quarantine = dispatcher, control, quarantine
        self._watch, self.counters, self._log, self.engine_factory = watch, counters, log, engine_factory
        self.reward_actors: list = []
        self.lock = asyncio.Lock()

    async def start(self, n: int) -> str | None:
        """The service's first n workers; an error message or None."""
        async with self.lock:
            return await self._add(list(range(n)), self.config.placement.timeout_s)

    async def scale(self, n: Any, drain_s: Any = 60.0, timeout_s: Any = None) -> str | None:
        """n workers from now on (gone ones among them replaced); an error message (the service unchanged)
        or None."""
        if not is_int(n) or n < 1:
            return f"scale: num_workers={n!r} must be an int >= 1"
        for name, v in (("drain_s", drain_s), ("timeout_s", timeout_s)):
            if v is not None and (not is_number(v) or not 0 <= v < 1e9):
                return f"scale: {name}={v!r} must be a number of seconds >= 0"
        if n > len(self.workers):
            try:  # a size the cluster can never hold is refused now, not after placement.timeout_s
                check_resources(dataclasses.replace(self.config, num_workers=n))
            except ValueError as e:
                return f"scale: {e}; the service keeps its {len(self.workers)} worker(s)"
        async with self.lock:
            current = len(self.workers)
            new = [i for i in range(min(n, current)) if self.workers.gone[i]] + list(range(current, n))
            if new:
                err = await self._add(new, self.config.placement.timeout_s if timeout_s is None else timeout_s)
                if err:
                    return f"{err}; the service keeps its {current} worker(s)"
            if n < current:
                await self._remove(list(range(n, current)), float(drain_s))
            self._log(f"scaled from {current} to {n} worker(s)")
            return None

    # -- adding -----------------------------------------------------------------------------------
    async def _add(self, indices: list[int], timeout_s: float) -> str | None:
        deadline = time.monotonic() + timeout_s
        bundle = worker_bundle(self.config)
        slots = self.slots.free()[:len(indices)]
        try:
            if len(slots) < len(indices):
                slots += await self.slots.reserve(self.config, len(indices) - len(slots), bundle, timeout_s)
        except ValueError as e:
            return str(e)
        gone_before = {i: self.workers.why_gone[i] for i in indices if i < len(self.workers)}
        for i, slot in zip(indices, slots):
            if i == len(self.workers):
                self.workers.append()
            self.workers.renew(i)
            self.quarantine.forget(i)
            self.dispatcher.affinity.forget(i)
            self.workers.slots[i] = slot
            self.slots.hold(slot)
            self.workers.handles[i] = start_worker(self.config, slot, i, self.reward_actors, self.engine_factory)
        healths = await asyncio.gather(*[self._health(i, deadline) for i in indices])
        failed = [(i, h) for i, h in zip(indices, healths) if isinstance(h, str)]
        if failed:
            self._undo(indices, gone_before)
            (i, reason), more = failed[0], len(failed) - 1
            return f"rollout worker {i}{f' (and {more} more)' if more else ''} failed to start: {reason}"
        for i, h in zip(indices, healths):
            self.workers.on_health(i, h)
            self._watch(i, self.workers.generation[i])
        await asyncio.gather(*[self.recovery.admit(i, h) for i, h in zip(indices, healths)])
        return None

    async def _health(self, i: int, deadline: float) -> dict | str:
        """Worker i's health() once its engine is built, or why it will not serve (by the deadline)."""
        try:
            h = await asyncio.wait_for(asyncio.wrap_future(self.workers.handles[i].health.remote().future()),
                                       max(0.0, deadline - time.monotonic()))
        except asyncio.TimeoutError:
            return (f"not started within {self.config.placement.timeout_s:g}s (no node can take its bundle "
                    f"{worker_bundle(self.config)}?)")
        except Exception as e:
            return error_text(e)
        return h["startup_error"] or h

    def _undo(self, indices: list[int], gone_before: dict[int, str | None]) -> None:
        """A failed start: end the workers it started, free what it reserved, and put the table back."""
        for i in indices:
            ray.kill(self.workers.handles[i])
            self.slots.release(self.workers.slots[i])
            self.workers.slots[i] = None
        self.slots.drop_unheld()
        for i, why in gone_before.items():
            self.workers.renew(i)  # (a new generation: nothing watches the worker just ended)
            self.workers.mark_gone(i, why or "replaced by a worker that failed to start")
        self.workers.truncate(min([i for i in indices if i not in gone_before], default=len(self.workers)))

    # -- removing ---------------------------------------------------------------------------------
    async def _remove(self, indices: list[int], drain_s: float) -> None:
        for i in indices:
            self.workers.draining[i] = True
        ledger, deadline = self.dispatcher.ledger, time.monotonic() + drain_s
        while any(ledger.on_worker(i) for i in indices) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        async with self.control.lock:  # no refresh, sleep or wake-up addresses these workers meanwhile
            for i in indices:
                await self._hand_back(i)
            for i in indices:
                self.workers.generation[i] += 1  # its result loop stops without taking this for a death
                self.workers.mark_down(i)
                ray.kill(self.workers.handles[i])
                if self.workers.slots[i] is not None:
                    self.slots.release(self.workers.slots[i])
                self.quarantine.forget(i)
                self.dispatcher.affinity.forget(i)
            self.workers.truncate(min(indices))

    async def _hand_back(self, i: int) -> None:
        """Worker i's unfinished requests go to the others (the samples it finished are kept)."""
        left = self.dispatcher.ledger.on_worker(i)
        if not left:
            return
        for r in await self.dispatcher.abort_jobs(left):
            if r.finish_reason != "abort" or r.error is not None:  # finished, or failed, before the abort
                self.dispatcher.on_result(r)
        left = self.dispatcher.ledger.on_worker(i)
        self.counters["handed_back"] += len(left)
        self._log(f"worker {i} removed: {len(left)} unfinished request(s) handed to the other workers")
        await self.dispatcher.dispatch(left)
