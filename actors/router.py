"""Router: the service's front door, a Ray actor. The clients (connections/ray.py) call it; it spreads requests over
the rollout workers and streams their results back. Each concern has its own file:

- actors/dispatch.py: requests accepted all or none, sent to the least-loaded live worker, results delivered
  once each (actors/ledger.py is the book), stale ones regenerated (`max_staleness`);
- actors/recovery.py: a loop per worker collecting its results; a worker that goes down has its requests
  resubmitted (or quarantined: actors/quarantine.py), is restarted by Ray, catches up and serves again;
- actors/refresh.py: weight refreshes, on every worker or none;
- actors/control.py: pause and resume, sleep and wake-up for a colocated learner;
- actors/scaling.py: the workers started, added, replaced and removed (actors/slots.py: their placement groups);
- actors/shards.py: with several routers, the first one's view of the others (each has its own workers and
  requests; the first coordinates refreshes, sleep, pause and scale, and answers for the whole service);
- here: leases (a client that stops renewing its streams or its sleep is gone: they are cancelled or ended),
  fidelity reports, stats and info, start-up and shutdown. A method named `..._here` is this router's own part
  of what the one without the suffix does for the whole service.
"""
from __future__ import annotations

import asyncio
from typing import Any, Callable

import ray

from actors.affinity import Affinity
from actors.control import Control
from actors.dispatch import Dispatcher
from actors.ledger import Ledger
from actors.placement import learner_options
from actors.quarantine import Quarantine
from actors.recovery import Recovery
from actors.refresh import RefreshCoordinator
from rollout_service.connections.remote_errors import error_text
from actors.reward_pool import create_reward_actors, kill_reward_actors
from actors.scaling import Scaler
from actors.shards import BROADCAST_REFUSED, Shards
from actors.slots import Slots
from actors.workers import WorkerTable
from rollout_service.config import ServiceConfig
from rollout_service.fidelity import FidelityLog
from rollout_service.api.types import RolloutResult
from rollout_service.api.values import is_int


class Router:
    def __init__(self, config: ServiceConfig, engine_factory: Callable[[dict], Any] | None = None):
        """`engine_factory`: the workers' engine, for the control-plane benchmark only (actors/rollout_worker.py);
        no config can name one."""
        self.config = config
        self.table = WorkerTable()
        self.slots = Slots()
        self.reward_actors: list = []
        self.ledger = Ledger()
        self.counters = {"resubmitted": 0, "stale_regenerated": 0, "stale_pinned": 0, "refresh_held_s": 0.0,
                         "worker_deaths": 0, "streams_expired": 0,
                         "sleep_expired": 0, "quarantined": 0, "handed_back": 0, "payloads_lost": 0,
                         "polls": 0, "polled_results": 0, "requests": 0}
        self._closed = False
        self._tasks: list[asyncio.Task] = []
        self.shards: Shards | None = None  # the other routers, when this is the first of several
        # seconds without a renewal after which a client's streams are cancelled and its sleep ends
        self.stream_lease_s = float(config.client_lease_s)
        self.fidelity = FidelityLog(self._log)
        self.dispatcher = Dispatcher(self.table, self.ledger, lambda: self.refresh.version, config.max_staleness,
                                     self.counters, self._spawn, self._log,
                                     Affinity(config.engine.page_size, enabled=config.routing == "prefix"))
        self.control = Control(self.table, float(config.client_lease_s), self.counters, self._log)
        self.refresh = RefreshCoordinator(self.table, self._log, lambda i: self.recovery.back_in_service(i),
                                          float(config.refresh_stall_s))
        quarantine = Quarantine()
        self.recovery = Recovery(self.table, self.dispatcher, self.refresh, self.control, quarantine,
                                 float(config.user_code_timeout_s), config.max_restarts, self.counters,
                                 lambda: self._closed, self._log, self._release_slot)
        self.scaler = Scaler(config, self.table, self.slots, self.recovery, self.dispatcher, self.control, quarantine,
                             self._watch, self.counters, self._log, engine_factory)

    @property
    def workers(self) -> list:
        """The workers' actor handles."""
        return self.table.handles

    # -- start-up and scaling (actors/scaling.py) ---------------------------------------------------
    async def start(self) -> str | None:
        """Place the workers (and the reward actors they share, if any) and wait until each has built its
        engine; returns an error message or None."""
        self.reward_actors = self.scaler.reward_actors = create_reward_actors(self.config)
        err = await self.scaler.start(int(self.config.num_workers))
        if err is None:
            self._tasks.append(asyncio.get_running_loop().create_task(self._lease_loop()))
        return err

    async def scale(self, num_workers: int, drain_s: float = 60.0, timeout_s: float | None = None) -> str | None:
        """num_workers from now on: added, gone ones replaced, the last ones drained and removed; an error
        message (the service as it was) or None."""
        if self.shards:
            return await self.shards.scale(num_workers, drain_s, timeout_s)
        return await self.scale_here(num_workers, drain_s, timeout_s)

    async def scale_here(self, num_workers: int, drain_s: float, timeout_s: float | None) -> str | None:
        if self._closed:
            return "the service is closed"
        return await self.scaler.scale(num_workers, drain_s, timeout_s)

    def attach_shards(self, others: list) -> None:
        """This router is the first of several: `others` are the rest, in order (actors/shards.py)."""
        self.shards = Shards(self, others)

    def shard_routers(self) -> list:
        """The other routers' handles (a client sends them their share of the requests); [] with one router."""
        return list(self.shards.others) if self.shards else []

    def _watch(self, i: int, generation: int) -> None:
        self._spawn(self.recovery.poll_loop(i, generation))

    def _release_slot(self, i: int) -> None:
        if self.table.slots[i] is not None:
            self.slots.release(self.table.slots[i])
            self.table.slots[i] = None

    # -- requests and streams ---------------------------------------------------------------------
    async def submit(self, items: list, first_read_s: float = 0.0) -> dict:
        """A client's batch (actors/dispatch.py): {"stream": id, "lease_s": s} or {"errors": [(index, msg)]}.
        `first_read_s` > 0: the client reads at once, so the reply also carries the stream's first read as
        next_results gives it ("first", waiting up to that long), unless that read fails (the client's own read
        then says why)."""
        if self._closed:
            return {"errors": [(-1, "the service is closed")]}
        c = self.control
        if c.asleep and c.fail_if_asleep:
            return {"errors": [(-1, f"the service is asleep (sleep level {c.asleep}): call wake_up() first")]}
        reply = await self.dispatcher.submit(items, self.stream_lease_s)
        if "stream" in reply:
            self.counters["requests"] += len(items)
            if first_read_s > 0:
                try:
                    reply["first"] = await self.next_results(reply["stream"], first_read_s)
                except (ValueError, RuntimeError):
                    pass
        return reply

    async def next_results(self, sid: str, timeout: float = 1.0, lost: list[tuple[str, int]] = ()
                           ) -> tuple[list[RolloutResult], list, bool, bool, list]:
        """Results of stream `sid` delivered since the last call (waits up to `timeout` for one): those the router
        holds whole, and payload batches for the client to fetch (rollout_service/results/payloads.py); whether
        the stream is complete (it is then forgotten); whether no worker can serve until the learner pushes
        weights (a restarted worker after a broadcast refresh); the token deltas of its requests with
        stream_tokens. `lost`: the (request_id, sample_index) of the last call's batches whose payload the
        client could not fetch: they are generated again."""
        if lost:
            self.counters["payloads_lost"] += len(lost)
            self._log(f"stream {sid}: {len(lost)} result(s) lost with their node before the client read them; "
                      "generating them again")
            self.dispatcher.regenerate_lost(self.ledger.reopen(sid, lost))
        whole, batches, done, deltas = await self.ledger.next_results(sid, timeout)
        if not whole and not batches and not done and all(self.table.gone):
            raise RuntimeError("every rollout worker is dead; the stream cannot finish")
        return whole, batches, done, not any(self.table.alive) and any(self.table.awaiting), deltas

    async def close_stream(self, sid: str) -> None:
        await self.dispatcher.close_stream(sid)

    def settle_streams(self, sids: list[str]) -> None:
        """The client fetched every payload of these complete streams (their last read handed some out)."""
        self.ledger.settle(sids)

    def renew_streams(self, sids: list[str]) -> None:
        """The client process still holds these streams: extend their leases."""
        self.ledger.renew(sids)

    async def abort(self, request_ids: list[str]) -> list[RolloutResult]:
        return await self.dispatcher.abort(request_ids)

    async def _lease_loop(self) -> None:
        """Cancel the streams whose lease ran out, and end a sleep whose lease ran out: their client process is
        gone."""
        while not self._closed:
            await asyncio.sleep(min(self.stream_lease_s / 4, self.control.lease_s / 4, 5.0))
            if self.control.orphaned:
                await self.control.end_orphaned_sleep()
            for sid in self.ledger.expired(self.stream_lease_s):
                self.counters["streams_expired"] += 1
                self._log(f"stream {sid} cancelled: its client has not renewed it for {self.stream_lease_s:g} s")
                try:
                    await self.close_stream(sid)
                except Exception as e:
                    self._log(f"stream {sid}: its jobs could not all be aborted ({error_text(e)})")

    # -- weights (actors/refresh.py), one at a time with sleep and wake-up ---------------------------
    async def update_weights(self, payload: dict, version: int, partial: bool = False) -> str | None:
        """Object store or CUDA IPC refresh; returns an error message or None. Held back while requests that
        refreshes kept making stale are in flight (actors/dispatch.py, hold_refresh)."""
        if self.shards:
            return await self.shards.update(payload, version, partial)
        await self._hold_refresh()
        async with self.control.lock:
            err = await self.refresh.update(payload, version, partial)
            if err is None:
                await self.control.after_refresh()
            return err

    async def refresh_begin(self, payload: dict, version: int, partial: bool = False) -> str | None:
        """A refresh over several routers (actors/shards.py): prepare this router's workers."""
        await self._hold_refresh()
        async with self.control.lock:
            return await self.refresh.begin(payload, version, partial)

    async def refresh_finish(self) -> str | None:
        return await self._finish(self.refresh.finish)

    async def refresh_cancel(self) -> None:
        await self.refresh.cancel()

    async def broadcast_begin(self, payload: dict, version: int, partial: bool = False, resend: bool = False,
                              timeout_s: float = 300.0) -> str | None:
        if self.shards:
            return "update_weights: " + BROADCAST_REFUSED.format(n=self.shards.count)
        await self._hold_refresh()
        async with self.control.lock:
            return await self.refresh.broadcast_begin(payload, version, partial, resend, timeout_s)

    async def broadcast_finish(self) -> str | None:
        return await self._finish(self.refresh.broadcast_finish)

    async def _finish(self, apply: Callable[[], Any]) -> str | None:
        """Apply a prepared refresh (the workers swap); an orphaned level-2 sleep then wakes with the weights."""
        async with self.control.lock:
            err = await apply()
            if err is None:
                await self.control.after_refresh()
            return err

    async def _hold_refresh(self) -> None:
        held = await self.dispatcher.hold_refresh()
        if held:
            self.counters["refresh_held_s"] = round(self.counters["refresh_held_s"] + held, 3)

    async def weight_targets(self) -> list[dict]:
        """Workers a refresh goes to, with where they run (the learner picks the transport from this)."""
        return await self.shards.weight_targets() if self.shards else self.weight_targets_here()[1]

    def weight_targets_here(self) -> tuple[int, list[dict]]:
        return len(self.table), [{"index": i, **self.table.places[i]} for i in self.refresh.targets()]

    async def form_weight_group(self, spec, members: list[int]) -> str | None:
        if self.shards:
            return "init_weight_group: " + BROADCAST_REFUSED.format(n=self.shards.count)
        return self.refresh.form_group(spec, members)

    async def weight_group_joined(self, group_id: str) -> str | None:
        """After form_weight_group: None once every worker has joined, else why one could not."""
        return await self.refresh.joined(group_id)

    async def weights_digests(self) -> list[str | None]:
        """Per worker: the sha256 of its weights (None for a worker that is down)."""
        return await self.shards.joined("weights_digests_here") if self.shards else await self.weights_digests_here()

    async def weights_digests_here(self) -> list[str | None]:
        up = set(self.table.targets())
        outcomes = dict(await self.table.each(sorted(up), "weights_digest"))
        return [outcomes[i] if i in up and not isinstance(outcomes[i], BaseException) else None
                for i in range(len(self.table))]

    async def release_weight_buffers(self) -> str | None:
        return await self._everywhere("release_here")

    async def release_here(self) -> None:
        await self.refresh.release()

    # -- control (actors/control.py) --------------------------------------------------------------
    async def sleep(self, level: int = 1, fail_if_asleep: bool = False, holder: str | None = None) -> str | None:
        return await self._everywhere("sleep_here", level, fail_if_asleep, holder)

    async def sleep_here(self, level: int, fail_if_asleep: bool, holder: str | None) -> str | None:
        return await self.control.sleep(level, fail_if_asleep, holder)

    async def wake_up(self) -> str | None:
        return await self._everywhere("wake_up_here")

    async def wake_up_here(self) -> str | None:
        return await self.control.wake_up()

    def renew_sleep(self, holder: str) -> None:
        self.control.renew(holder)
        for r in self.shards.others if self.shards else ():
            r.renew_sleep.remote(holder)  # (a notification: a lost one is made up by the next)

    async def pause(self) -> str | None:
        return await self._everywhere("pause_here")

    async def pause_here(self) -> None:
        await self.control.pause()

    async def resume(self) -> str | None:
        return await self._everywhere("resume_here")

    async def resume_here(self) -> None:
        await self.control.resume()

    async def _everywhere(self, method: str, *args: Any) -> Any:
        """`method` (a `..._here`) on every router (their error messages joined), or on this one alone."""
        if self.shards:
            return Shards.errors(await self.shards.each(method, *args))
        return await getattr(self, method)(*args)

    # -- colocated learners and their reports -----------------------------------------------------
    async def learner_options(self, i: int) -> tuple[dict | None, str | None]:
        """(options, None): `Actor.options(**options)` that place an actor in worker i's bundle, on the half of
        its CPUs and GPUs the worker leaves; or (None, why not)."""
        if not self.shards:
            return self.learner_options_here(i)
        sizes = [n for n, _ in await self.shards.parts("weight_targets_here")]
        at = self.shards.where(sizes, i) if is_int(i) and i >= 0 else None
        if at is None:
            return None, f"colocated_options: worker={i!r} must be an int in [0, {sum(sizes)})"
        k, j = at
        if k == 0:
            return self.learner_options_here(j)
        return await self.shards.others[k - 1].learner_options_here.remote(j)

    def learner_options_here(self, i: int) -> tuple[dict | None, str | None]:
        if not self.config.colocate:
            return None, (f"colocated_options: the service {self.config.name!r} was not started with "
                          "colocate: true, so its workers leave no room for a learner in their bundles")
        n = len(self.table)
        if not is_int(i) or not 0 <= i < n:
            return None, f"colocated_options: worker={i!r} must be an int in [0, {n})"
        if self.table.slots[i] is None:
            return None, f"colocated_options: worker {i} is gone ({self.table.why_gone[i]}); scale() replaces it"
        return learner_options(self.config, self.table.slots[i]), None

    def report_fidelity(self, version: int, report: dict) -> str | None:
        """A learner's measure of how its log-probs match the rollouts of policy `version`: kept (the last 256)
        and logged. Returns an error message or None."""
        try:
            self.fidelity.report(version, report)
        except ValueError as e:
            return str(e)
        return None

    # -- introspection and shutdown ---------------------------------------------------------------
    async def stats(self) -> list[dict]:
        """Per worker, its counters (the workers read them without waiting for an engine step)."""
        return await self.shards.joined("stats_here") if self.shards else await self.stats_here()

    async def stats_here(self) -> list[dict]:
        return list(await asyncio.gather(*[self.table.stats(i) for i in range(len(self.table))]))

    async def info(self) -> dict:
        return await self.shards.info() if self.shards else self.info_here()

    def info_here(self) -> dict:
        t = self.table
        return {"name": self.config.name, "model": str(self.config.engine.model),
                "policy_version": self.refresh.version, "num_workers": len(t),
                "alive": list(t.alive), "awaiting_weights": list(t.awaiting), "gone": list(t.gone),
                "gone_reasons": list(t.why_gone), "draining": list(t.draining),
                "in_flight": len(self.ledger.tracked), "streams": self.ledger.open_streams(),
                "paused": self.control.paused, "asleep": self.control.asleep, "loads": self.ledger.loads(len(t)),
                "duplicates_dropped": self.ledger.duplicates_dropped, "colocate": self.config.colocate,
                "client_lease_s": self.control.lease_s, "fidelity": self.fidelity.entries(),
                "routing": {"mode": self.config.routing, **self.dispatcher.affinity.counts},
                "reward": self.config.reward, "reward_workers": self.config.reward_workers, **self.counters}

    async def shutdown(self) -> None:
        if self.shards:
            await self.shards.shutdown()
        self._closed = True
        for t in self._tasks:
            t.cancel()
        for w in self.workers:
            try:
                ray.kill(w)
            except Exception:
                pass
        kill_reward_actors(self.reward_actors)
        self.slots.release_all()

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.append(task)
        task.add_done_callback(lambda t: self._tasks.remove(t) if t in self._tasks else None)

    @staticmethod
    def _log(msg: str) -> None:
        print(f"[rollout_service.router] {msg}", flush=True)


RouterActor = ray.remote(Router)
