"""The router's watch over each worker: a loop per worker that collects its results for as long as the service
runs, and what happens when the worker goes down. Its requests go to live workers, request by request (but
those whose user code took it down are quarantined: actors/quarantine.py); Ray restarts it (new incarnation,
empty engine); it replays the weight refreshes (actors/refresh.py), or waits for the learner's next full
push; it is paused or put to sleep as the others are; then it serves again. A worker that cannot come back (no
restarts left, an engine that fails to build, its node dead: actors/nodes.py) is given up with the reason in the
log and in info()["gone_reasons"]. Nothing a worker or a result does ends a worker's loop; it ends when the
worker is given up, replaced or removed (actors/scaling.py).
"""
from __future__ import annotations

import asyncio
import time
from typing import Callable

import ray
from ray.exceptions import ActorDiedError, RayTaskError

from actors.control import Control
from actors.dispatch import Dispatcher
from actors.nodes import node_dead, until_node_dead
from actors.quarantine import Quarantine
from actors.refresh import RefreshCoordinator
from rollout_service.connections.remote_errors import ACTOR_DOWN, error_text, is_down
from actors.workers import WorkerTable

RESTART_TIMEOUT_S = 900.0  # a worker that Ray has not brought back by then is given up (a model load fits)
# A busy worker's results come in batches, one poll at most every max(20 ms, workers / 500 s): a poll costs the
# router ~1 ms of CPU, a result's header ~15 us (benchmarks/harness/control_plane.py), so its busy polls stay under ~500/s,
# half a core, however many workers it has. 20-128 ms (64 workers) is little next to a rollout's seconds, and a
# lone result is not held back.
MIN_BATCH_S, MAX_POLLS_PER_S = 0.02, 500.0


class Recovery:
    def __init__(self, workers: WorkerTable, dispatcher: Dispatcher, refresh: RefreshCoordinator, control: Control,
                 quarantine: Quarantine, user_code_timeout_s: float, max_restarts: int, counters: dict,
                 closed: Callable[[], bool], log: Callable[[str], None], on_gone: Callable[[int], None]):
        """`on_gone(i)`: worker i was given up (its bundle is released)."""
        self.workers, self.dispatcher, self.refresh, self.control = workers, dispatcher, refresh, control
        self.quarantine, self.user_code_timeout_s, self.max_restarts = quarantine, user_code_timeout_s, max_restarts
        self.counters, self._closed, self._log, self._on_gone = counters, closed, log, on_gone

    def watching(self, i: int, generation: int) -> bool:
        """Worker i of that generation is still the router's to watch."""
        return not self._closed() and self.workers.current(i, generation) and not self.workers.gone[i]

    # -- collecting results -----------------------------------------------------------------------
    async def poll_loop(self, i: int, generation: int = 0) -> None:
        """Collect worker i's results for as long as the service runs. A fault in here is logged and the loop
        goes on: were it to end, the worker would be lost to the service."""
        while self.watching(i, generation):
            try:
                await self._poll(i, generation)
            except Exception as e:
                if not self.watching(i, generation):
                    return  # removed meanwhile (actors/scaling.py)
                self._log(f"worker {i}: {error_text(e)} while collecting its results; carrying on")
                await asyncio.sleep(0.5)

    async def _poll(self, i: int, generation: int) -> None:
        w = self.workers
        try:
            head, payload = w.handles[i].poll.options(num_returns=2).remote(
                0.5, self.quarantine.confirmation(i, w.incarnation[i]), max(MIN_BATCH_S, len(w) / MAX_POLLS_PER_S))
            incarnation, headers, running, deltas = await head
        except ACTOR_DOWN:
            if not self.watching(i, generation):
                return  # the router ended it (removed)
            return await self.worker_down(i, generation)
        except RayTaskError as e:  # the engine loop failed: restart the actor
            return await self._restart(i, generation, f"worker {i} failed ({error_text(e)}); restarting it")
        if incarnation != w.incarnation[i]:  # restarted between two polls
            return await self.worker_down(i, generation)
        self.quarantine.read(i, incarnation, running)
        self.counters["polls"] += 1
        self.counters["polled_results"] += len(headers)
        if deltas:  # (first: a sample's last delta came before its result)
            self.dispatcher.on_deltas(deltas)
        for h in headers:  # the payload stays unread: it goes to the client (rollout_service/results/payloads.py)
            try:
                self.dispatcher.on_header(h, payload)
            except Exception as e:  # one bad result must not cost the others
                self._log(f"worker {i}: a result could not be handled ({error_text(e)}); dropped")
        late = self.quarantine.overdue(i, self.user_code_timeout_s)
        if late:
            rid, what, seconds, _ = late[0]
            await self._restart(i, generation, f"worker {i} is wedged: the {what} of request {rid} has run for "
                                               f"{seconds:.0f} s (user_code_timeout_s={self.user_code_timeout_s:g}); "
                                               "restarting it")

    async def _restart(self, i: int, generation: int, why: str) -> None:
        self._log(why)
        self.workers.killed[i] = self.workers.incarnation[i]  # until it is gone, that process may answer health()
        ray.kill(self.workers.handles[i], no_restart=False)
        await self.worker_down(i, generation)

    # -- a worker down ----------------------------------------------------------------------------
    async def worker_down(self, i: int, generation: int) -> None:
        if self.workers.mark_down(i):
            self.counters["worker_deaths"] += 1
        self.dispatcher.affinity.forget(i)  # it comes back with an empty cache
        self._quarantine_suspects(i)
        lost = self.dispatcher.ledger.on_worker(i)
        if lost:
            self.counters["resubmitted"] += len(lost)
            await self.dispatcher.dispatch(lost)
        await self._recover(i, generation)

    def _quarantine_suspects(self, i: int) -> None:
        """Worker i went down while running user code: end the requests it was running for, or give them a
        strike (actors/quarantine.py), before the others are resubmitted."""
        ledger = self.dispatcher.ledger
        for s in self.quarantine.on_death(i):
            t = ledger.owner(s.request_id)
            if t is None or t.worker != i or t.jobs[-1] != s.request_id:  # ended, or its job is elsewhere now
                continue
            t.strikes += 1
            why = s.verdict(t.strikes)
            if why is not None:
                self.counters["quarantined"] += 1
                self.dispatcher.fail(t.request.request_id, why)

    async def _recover(self, i: int, generation: int) -> None:
        """Wait for Ray to restart worker i, give it the current weights and put it back in service; or give it
        up, saying why."""
        deadline = time.monotonic() + RESTART_TIMEOUT_S
        while self.watching(i, generation):
            try:
                if await self._restore(i, await self._back_unless_node_dead(i, deadline)):
                    return
            except ActorDiedError:
                node = self.workers.places[i].get("node_id")
                return self._give_up(i, _node_died(node) if await node_dead(node) else
                                     f"Ray restarts it no more (max_restarts={self.max_restarts})")
            except asyncio.TimeoutError:
                return self._give_up(i, f"it was not back {RESTART_TIMEOUT_S:g} s after it went down")
            except _CannotServe as e:
                return self._give_up(i, str(e))
            except ACTOR_DOWN:
                pass  # it went down again
            except Exception as e:
                self._log(f"worker {i} came back but could not be put in service ({error_text(e)}); trying again")
                await asyncio.sleep(1.0)

    async def _back_unless_node_dead(self, i: int, deadline: float) -> dict:
        """Worker i's health() once Ray has restarted it; _CannotServe as soon as its node is declared dead."""
        node = self.workers.places[i].get("node_id")
        back = asyncio.ensure_future(self._health_when_back(i, deadline))
        lost = asyncio.ensure_future(until_node_dead(node))
        try:
            await asyncio.wait({back, lost}, return_when=asyncio.FIRST_COMPLETED)
            if back.done():
                return back.result()
            raise _CannotServe(_node_died(node))
        finally:
            back.cancel()
            lost.cancel()

    async def _health_when_back(self, i: int, deadline: float) -> dict:
        """Worker i's health() as soon as it answers. A call made while Ray restarts the actor fails only ~2 s
        later, even if the actor is back meanwhile: ask every 0.1 s, the calls overlapping, and take the first
        answer (no back-off: every second of a restart is a worker's throughput lost)."""
        pending: set[asyncio.Future] = set()
        try:
            while time.monotonic() < deadline:
                if len(pending) < 32:  # (an actor waiting for resources may not answer at all)
                    pending.add(asyncio.wrap_future(self.workers.handles[i].health.remote().future()))
                done, pending = await asyncio.wait(pending, timeout=0.1, return_when=asyncio.FIRST_COMPLETED)
                for f in done:
                    if f.exception() is None:
                        return f.result()
                    if not is_down(f.exception()) or isinstance(f.exception(), ActorDiedError):
                        raise f.exception()
            raise asyncio.TimeoutError
        finally:
            for f in pending:
                f.cancel()

    async def _restore(self, i: int, h: dict) -> bool:
        """Bring worker i, whose health() is `h`, into service (or to wait for weights); False: not yet."""
        if h["startup_error"]:
            raise _CannotServe(f"its engine failed to start again: {h['startup_error']}")
        if h["error"] or h["incarnation"] == self.workers.killed[i]:  # the incarnation Ray has yet to replace
            await asyncio.sleep(0.05)
            return False
        self.workers.on_health(i, h)
        has = h["policy_version"]
        while True:
            reached = await self.refresh.bring_up_to_date(i, has)
            await self.refresh.idle()  # a refresh in flight did not include this worker: wait for it, then
            async with self.control.lock:  # no sleep, wake or refresh between this check and serving
                if reached == self.refresh.version and not self.refresh.busy:
                    await self.control.join(i)
                    await self.back_in_service(i)
                    return True
                if reached is None and self.refresh.replay is None and not self.refresh.busy:
                    await self.control.join(i)
                    self.workers.awaiting[i] = True
                    self._log(f"worker {i} restarted; it serves again once the learner pushes the full weights")
                    return True
            has = has if reached is None else reached  # a refresh landed meanwhile: catch up with it

    def _give_up(self, i: int, reason: str) -> None:
        self.workers.mark_gone(i, reason)
        self._log(f"worker {i} is gone for good: {reason}")
        ray.kill(self.workers.handles[i])  # no restart: free its resources
        self._on_gone(i)
        if all(self.workers.gone):
            self.dispatcher.fail_all("every rollout worker is gone")

    async def admit(self, i: int, h: dict) -> None:
        """A new worker (actors/scaling.py) whose health() is `h`: brought to the current weights (or left
        waiting for the learner's next full refresh), paused or asleep as the others are, then serving."""
        while not await self._restore(i, h):
            h = await self.workers.handles[i].health.remote()

    async def back_in_service(self, i: int) -> None:
        """Worker i runs the current weights: dispatch to it again, starting with requests that waited."""
        self.workers.awaiting[i] = False
        self.workers.alive[i] = True
        ledger = self.dispatcher.ledger
        waiting = ledger.on_worker(None) + ledger.on_worker(i)
        if waiting:
            await self.dispatcher.dispatch(waiting)


def _node_died(node: str | None) -> str:
    return f"its node {node} died (Ray's health checks of its raylet failed); its requests went to the other workers"


class _CannotServe(Exception):
    """A restarted worker that will not be able to serve, whatever the router waits for."""
