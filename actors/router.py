"""Router: the service's front door. Spreads requests over the RolloutWorkers and streams results back.

- Dispatch: each request goes to the live worker with the fewest outstanding tokens (prompt tokens
  estimate + max_tokens, per sample still to come).
- Tracking: every request is tracked until its n samples were delivered. Each dispatch of a request is
  a "job" with its own engine request id, so the same request can be in flight twice (resubmitted)
  and results are matched back to it; a (request_id, sample_index) is delivered once, later copies
  are dropped. A batch is validated (tokenized, on its worker) before any of it is queued; a refused
  batch leaves nothing behind.
- Streams end when read to the end, closed by the client, or, when the client process is gone, when
  their lease runs out (a live client renews the leases of the streams it holds).
- Faults: when a worker dies its jobs go to live workers, request by request (one that fails there ends
  alone, its error on its results); when Ray restarts it (new incarnation, empty engine) it replays the
  weight refreshes and serves again (or waits for the learner's next full push: actors/refresh.py). A
  worker that cannot come back is given up with the reason in the log. Nothing a worker or a result
  does ends the loop that collects a worker's results.
- Refresh: actors/refresh.py (all workers or none). Results older than `max_staleness` versions are
  regenerated.
- Sleep: every worker frees its device memory; requests wait (or are refused) until wake_up. A client's
  sleep is leased like its streams: when the client process that asked for it stops renewing it, the
  workers are woken (they serve the last weights).
- Colocation (`colocate: true`): a learner may share each worker's bundle (`learner_options`) and reports
  how closely the rollouts' log-probs match its own (`report_fidelity`; the last 256 are in info()).
"""
from __future__ import annotations

import asyncio
import time
from collections import deque

import ray
from ray.exceptions import ActorDiedError, RayTaskError

from actors.ledger import Ledger, Tracked, decode_request
from actors.placement import create_workers, learner_options
from actors.quarantine import Quarantine
from actors.refresh import RefreshCoordinator
from actors.remote_errors import ACTOR_DOWN as _ACTOR_DOWN, error_text, is_down
from actors.reward_pool import create_reward_actors, kill_reward_actors
from rollout_service.client import FIDELITY_KEPT, check_fidelity, fidelity_line
from rollout_service.config import ServiceConfig
from rollout_service.types import RolloutRequest, RolloutResult

RESTART_TIMEOUT_S = 900.0  # a worker that Ray has not brought back by then is given up (a model load fits)
STATS_TIMEOUT_S = 2.0      # a worker that does not answer stats() by then is reported without its counters
# a request regenerated this often, because each time a refresh came before it finished, never would: it fails
MAX_STALE_REGENERATIONS = 8


class Router:
    def __init__(self, config: ServiceConfig):
        self.config = config
        self.workers: list = []
        self.placement_group = None
        n = int(config.num_workers)
        self._alive = [False] * n
        self._gone = [False] * n           # dead for good (no restarts left)
        self._awaiting = [False] * n       # restarted, waiting for the learner's weights before it serves
        self._incarnation: list[str | None] = [None] * n
        self._killed: list[str | None] = [None] * n  # the incarnation the router itself ended, per worker
        self._places: list[dict] = [{} for _ in range(n)]  # node_id and device, from health()
        self.ledger = Ledger()
        self.refresh = RefreshCoordinator(self)
        self.quarantine = Quarantine(n)
        self._paused = False
        self._asleep = 0
        self._fail_if_asleep = False
        self._sleep_holder: str | None = None  # the client whose live process keeps the service asleep
        self._sleep_renewed = 0.0
        self._wake_after_refresh = False       # its holder is gone and sleep(2) dropped the weights: wake with them
        # sleep, wake_up and refreshes one at a time: interleaved at the workers, two clients' sleep and wake
        # could leave the workers asleep while the router thinks them awake
        self._control = asyncio.Lock()
        self._closed = False
        self._tasks: list[asyncio.Task] = []
        # seconds without a renewal after which a client's streams are cancelled and its sleep ends
        self.stream_lease_s = self.sleep_lease_s = float(config.client_lease_s)
        self.fidelity: deque[dict] = deque(maxlen=FIDELITY_KEPT)
        self.counters = {"resubmitted": 0, "stale_regenerated": 0, "worker_deaths": 0, "streams_expired": 0,
                         "sleep_expired": 0, "quarantined": 0}

    # -- start-up ---------------------------------------------------------------------------------
    async def start(self) -> str | None:
        """Place the workers (and the reward actors they share, if any) and wait until each has built its
        engine; returns an error message or None."""
        self.reward_actors = create_reward_actors(self.config)
        try:
            self.workers, self.placement_group = await create_workers(self.config, self.reward_actors)
        except ValueError as e:
            return str(e)
        healths = await asyncio.gather(*[w.health.remote() for w in self.workers], return_exceptions=True)
        failed = []
        for i, h in enumerate(healths):
            reason = error_text(h) if isinstance(h, BaseException) else h["startup_error"]
            if reason:
                failed.append((i, reason))
            else:
                self._on_health(i, h)
                self._alive[i] = True
        if failed:
            (i, reason), more = failed[0], len(failed) - 1
            return f"rollout worker {i}{f' (and {more} more)' if more else ''} failed to start: {reason}"
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._poll_loop(i)) for i in range(len(self.workers))]
        self._tasks.append(loop.create_task(self._lease_loop()))
        return None

    # -- requests ---------------------------------------------------------------------------------
    async def submit(self, items: list) -> dict:
        """Accept a batch, all or none: every request decoded, validated and tokenized (on the worker it
        goes to) before any is queued. Returns {"stream": id, "lease_s": seconds} or {"errors": [(index,
        message), ...]}; a refused batch leaves nothing behind."""
        if self._closed:
            return {"errors": [(-1, "the service is closed")]}
        if self._asleep and self._fail_if_asleep:
            return {"errors": [(-1, f"the service is asleep (sleep level {self._asleep}): call wake_up() first")]}
        reqs, errors = self._decode(items)
        if errors:
            return {"errors": errors}
        if not reqs:
            return {"errors": [(-1, "empty batch")]}
        if all(self._gone):
            return {"errors": [(-1, "no rollout worker is alive")]}
        sid, tracked = self.ledger.open_stream(reqs)
        try:
            errors = await self._dispatch(tracked, atomic=True)
        except Exception:
            await self.close_stream(sid)
            raise
        if errors:
            await self.close_stream(sid)
            index = {r.request_id: i for i, r in enumerate(reqs)}
            return {"errors": [(index.get(rid, -1), msg) for rid, msg in errors]}
        return {"stream": sid, "lease_s": self.stream_lease_s}

    def _decode(self, items: list) -> tuple[list[RolloutRequest], list[tuple[int, str]]]:
        reqs, errors, seen = [], [], set()
        for i, item in enumerate(items):
            try:
                r = decode_request(item)
                if r.request_id in self.ledger.tracked or r.request_id in seen:
                    raise ValueError(f"request_id {r.request_id!r} is already in flight")
                seen.add(r.request_id)
                reqs.append(r)
            except ValueError as e:
                errors.append((i, str(e)))
        return reqs, errors

    async def _dispatch(self, tracked: list[Tracked], atomic: bool = False) -> list[tuple[str, str]]:
        """Send each request (as a new job) to the least-loaded live worker; with none alive they wait
        (worker None) until one comes back. `atomic` (a client's batch): a worker queues its share all or
        none and the errors are returned for the caller to drop the batch. Otherwise (a resubmission) each
        request stands alone: one that fails ends with its error, the others go on. Returns (request_id,
        error) pairs."""
        live = [i for i, a in enumerate(self._alive) if a]
        if not live:
            for t in tracked:
                t.worker = None
            return []
        loads = self.ledger.loads(len(self.workers))
        batches: dict[int, list[RolloutRequest]] = {}
        for t in sorted(tracked, key=lambda t: -t.cost_per_sample * t.missing):
            i = min(live, key=lambda j: loads[j])
            job = self.ledger.new_job(t, i, self.refresh.version)
            loads[i] += t.cost_per_sample * t.missing
            batches.setdefault(i, []).append(job)
        calls = [self.workers[i].submit.remote(jobs, atomic) for i, jobs in batches.items()]
        outcomes = await asyncio.gather(*calls, return_exceptions=True)
        errors = []
        for jobs, out in zip(batches.values(), outcomes):
            if is_down(out):
                continue  # its poll loop sees the death and moves these jobs on
            verdicts = [error_text(out)] * len(jobs) if isinstance(out, BaseException) else out
            for job, err in zip(jobs, verdicts):
                t = self.ledger.owner(job.request_id)
                if err is not None and t is not None:  # (None: the request ended meanwhile)
                    rid = t.request.request_id
                    errors.append((rid, err.replace(job.request_id, rid)))  # the client knows its own id
        if not atomic:
            for rid, msg in errors:
                self._fail(rid, msg)
        return errors

    # -- results ----------------------------------------------------------------------------------
    async def _poll_loop(self, i: int) -> None:
        """Collect worker i's results for as long as the service runs. A fault in here is logged and the
        loop goes on: were it to end, the worker would be lost to the service."""
        while not self._closed and not self._gone[i]:
            try:
                await self._poll(i)
            except Exception as e:
                self._log(f"worker {i}: {error_text(e)} while collecting its results; carrying on")
                await asyncio.sleep(0.5)

    async def _poll(self, i: int) -> None:
        try:
            incarnation, results, running = await self.workers[i].poll.remote(
                0.5, self.quarantine.confirmation(i, self._incarnation[i]))
        except _ACTOR_DOWN:
            return await self._worker_down(i)
        except RayTaskError as e:  # the engine loop crashed: restart the actor
            return await self._restart(i, f"worker {i} failed ({error_text(e)}); restarting it")
        if incarnation != self._incarnation[i]:  # restarted between two polls
            return await self._worker_down(i)
        self.quarantine.read(i, incarnation, running)
        for r in results:
            try:
                self._on_result(r)
            except Exception as e:  # one bad result must not cost the others
                self._log(f"worker {i}: a result could not be handled ({error_text(e)}); dropped")
        late = self.quarantine.overdue(i, self.config.user_code_timeout_s)
        if late:
            rid, what, seconds, _ = late[0]
            await self._restart(i, f"worker {i} is wedged: the {what} of request {rid} has run for {seconds:.0f} s "
                                   f"(user_code_timeout_s={self.config.user_code_timeout_s:g}); restarting it")

    async def _restart(self, i: int, why: str) -> None:
        self._log(why)
        self._killed[i] = self._incarnation[i]  # until it is gone, that process may still answer health()
        ray.kill(self.workers[i], no_restart=False)
        await self._worker_down(i)

    def _on_result(self, r: RolloutResult) -> None:
        t = self.ledger.is_new(r)
        if t is None:
            return
        k = self.config.max_staleness
        version = self.refresh.version
        if k is not None and r.token_versions and r.finish_reason != "abort" and version - min(r.token_versions) > k:
            if t.fresh_as_of < version:  # regenerate once per refresh, not once per stale sample
                t.fresh_as_of, t.regenerations = version, t.regenerations + 1
                if t.regenerations > MAX_STALE_REGENERATIONS:
                    self._spawn(self._abort_jobs([t]))
                    self._fail(t.request.request_id, _starved(t.regenerations - 1, k))
                    return
                self.counters["stale_regenerated"] += 1
                self._spawn(self._regenerate(t))
            return
        self.ledger.deliver(t, r)

    def _fail(self, rid: str, msg: str) -> None:
        """End a request that cannot run any more: its missing samples come as "abort" results with `msg`."""
        t = self.ledger.tracked.get(rid)
        if t is not None:
            self._log(f"request {rid} failed: {msg}")
            self.ledger.fill_aborted(t, error=msg)

    async def _regenerate(self, t: Tracked) -> None:
        old = (t.worker, t.jobs[-1]) if t.worker is not None else None
        await self._dispatch([t])
        if old is not None and self._alive[old[0]]:
            try:  # the superseded job is stale anyway: free its pages
                await self.workers[old[0]].abort.remote([old[1]])
            except _ACTOR_DOWN:
                pass

    async def next_results(self, sid: str, timeout: float = 1.0) -> tuple[list[RolloutResult], bool, bool]:
        """Results of stream `sid` delivered since the last call (waits up to `timeout` for one); whether
        the stream is complete (it is then forgotten); whether no worker can serve until the learner pushes
        weights (a restarted worker after a broadcast refresh)."""
        out, done = await self.ledger.next_results(sid, timeout)
        if not out and not done and all(self._gone):
            raise RuntimeError("every rollout worker is dead; the stream cannot finish")
        return out, done, not any(self._alive) and any(self._awaiting)

    async def close_stream(self, sid: str) -> None:
        """The consumer went away: forget the stream (at once) and abort what still runs for it."""
        await self._abort_jobs(self.ledger.close_stream(sid))

    def renew_streams(self, sids: list[str]) -> None:
        """The client process still holds these streams: extend their leases."""
        self.ledger.renew(sids)

    async def _lease_loop(self) -> None:
        """Cancel the streams whose lease ran out, and end a sleep whose lease ran out: their client process
        is gone."""
        while not self._closed:
            await asyncio.sleep(min(self.stream_lease_s / 4, self.sleep_lease_s / 4, 5.0))
            if self._sleep_holder is not None and time.monotonic() - self._sleep_renewed > self.sleep_lease_s:
                await self._end_orphaned_sleep()
            for sid in self.ledger.expired(self.stream_lease_s):
                self.counters["streams_expired"] += 1
                self._log(f"stream {sid} cancelled: its client has not renewed it for {self.stream_lease_s:g} s")
                try:
                    await self.close_stream(sid)
                except Exception as e:
                    self._log(f"stream {sid}: its jobs could not all be aborted ({error_text(e)})")

    # -- faults -----------------------------------------------------------------------------------
    async def _worker_down(self, i: int) -> None:
        if self._alive[i] or self._awaiting[i]:
            self._alive[i] = self._awaiting[i] = False
            self.counters["worker_deaths"] += 1
        self._quarantine_suspects(i)
        lost = self.ledger.on_worker(i)
        if lost:
            self.counters["resubmitted"] += len(lost)
            await self._dispatch(lost)
        await self._recover(i)

    def _quarantine_suspects(self, i: int) -> None:
        """Worker i went down while running user code: end the requests it was running for, or give them a
        strike (actors/quarantine.py), before the others are resubmitted."""
        for s in self.quarantine.on_death(i):
            t = self.ledger.owner(s.request_id)
            if t is None or t.worker != i or t.jobs[-1] != s.request_id:  # ended, or its job is elsewhere now
                continue
            t.strikes += 1
            why = s.verdict(t.strikes)
            if why is not None:
                self.counters["quarantined"] += 1
                self._fail(t.request.request_id, why)

    async def _recover(self, i: int) -> None:
        """Wait for Ray to restart worker i, give it the current weights and put it back in service; or give
        it up, saying why."""
        deadline = time.monotonic() + RESTART_TIMEOUT_S
        while not self._closed:
            try:
                if await self._restore(i, await self._health_when_back(i, deadline)):
                    return
            except ActorDiedError:
                return self._give_up(i, f"Ray restarts it no more (max_restarts={self.config.max_restarts})")
            except asyncio.TimeoutError:
                return self._give_up(i, f"it was not back {RESTART_TIMEOUT_S:g} s after it went down")
            except _CannotServe as e:
                return self._give_up(i, str(e))
            except _ACTOR_DOWN:
                pass  # it went down again
            except Exception as e:
                self._log(f"worker {i} came back but could not be put in service ({error_text(e)}); trying again")
                await asyncio.sleep(1.0)

    async def _health_when_back(self, i: int, deadline: float) -> dict:
        """Worker i's health() as soon as it answers. A call made while Ray restarts the actor fails only
        ~2 s later, even if the actor is back meanwhile: ask every 0.1 s, the calls overlapping, and take
        the first answer (no back-off: every second of a restart is a worker's throughput lost)."""
        pending: set[asyncio.Future] = set()
        try:
            while time.monotonic() < deadline:
                if len(pending) < 32:  # (an actor waiting for resources may not answer at all)
                    pending.add(asyncio.wrap_future(self.workers[i].health.remote().future()))
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
        if h["error"] or h["incarnation"] == self._killed[i]:  # the incarnation Ray has yet to replace
            await asyncio.sleep(0.05)
            return False
        self._on_health(i, h)
        has = h["policy_version"]
        while True:
            reached = await self.refresh.bring_up_to_date(i, has)
            await self.refresh.idle()  # a refresh in flight did not include this worker: wait for it, then
            async with self._control:  # no sleep, wake or refresh between this check and serving
                if reached == self.refresh.version and not self.refresh.busy:
                    await self._join_as_the_others_are(i)
                    await self.back_in_service(i)
                    return True
                if reached is None and self.refresh.replay is None and not self.refresh.busy:
                    await self._join_as_the_others_are(i)
                    self._awaiting[i] = True
                    self._log(f"worker {i} restarted; it serves again once the learner pushes the full weights")
                    return True
            has = has if reached is None else reached  # a refresh landed meanwhile: catch up with it

    async def _join_as_the_others_are(self, i: int) -> None:
        """A restarted worker i, before it serves: paused and asleep if the service is."""
        if self._paused:
            await self.workers[i].pause.remote()
        if self._asleep:
            await self.workers[i].sleep.remote(self._asleep)

    def _give_up(self, i: int, reason: str) -> None:
        self._gone[i] = True
        self._alive[i] = self._awaiting[i] = False
        self._log(f"worker {i} is gone for good: {reason}")
        ray.kill(self.workers[i])  # no restart: free its resources
        if all(self._gone):
            for t in list(self.ledger.tracked.values()):
                self.ledger.fill_aborted(t, error="every rollout worker is gone")

    async def back_in_service(self, i: int) -> None:
        """Worker i runs the current weights: dispatch to it again, starting with requests that waited."""
        self._awaiting[i] = False
        self._alive[i] = True
        waiting = self.ledger.on_worker(None) + self.ledger.on_worker(i)
        if waiting:
            await self._dispatch(waiting)

    def _on_health(self, i: int, h: dict) -> None:
        self._incarnation[i] = h["incarnation"]
        self._places[i] = {"node_id": h.get("node_id"), "device": h.get("device", "cpu")}

    # -- control ----------------------------------------------------------------------------------
    async def abort(self, request_ids: list[str]) -> list[RolloutResult]:
        """Abort requests now. Their remaining samples end with finish_reason "abort" (tokens so far);
        those results go to the requests' streams (so they finish) and are returned here as well."""
        ts = [self.ledger.tracked[r] for r in request_ids if r in self.ledger.tracked]
        out: list[RolloutResult] = []
        for r in await self._abort_jobs(ts):
            t = self.ledger.owner(r.request_id)
            if t is not None and r.sample_index not in t.delivered:
                self.ledger.deliver(t, r)
                out.append(r)
        for t in ts:
            out += self.ledger.fill_aborted(t)
        return out

    async def _abort_jobs(self, ts: list[Tracked]) -> list[RolloutResult]:
        """Abort the jobs of these requests on their workers; returns the partial results."""
        by_worker: dict[int, list[str]] = {}
        for t in ts:
            if t.worker is not None:
                by_worker.setdefault(t.worker, []).extend(t.jobs)
        outcomes = await asyncio.gather(*[self.workers[i].abort.remote(jobs) for i, jobs in by_worker.items()],
                                        return_exceptions=True)
        return [r for out in outcomes if not isinstance(out, BaseException) for r in out]

    # -- weights (actors/refresh.py) ----------------------------------------------------------------
    async def update_weights(self, payload: dict, version: int, partial: bool = False) -> str | None:
        """Object store or CUDA IPC refresh; returns an error message or None."""
        async with self._control:
            err = await self.refresh.update(payload, version, partial)
            if err is None:
                await self._wake_if_orphaned()
            return err

    async def broadcast_begin(self, payload: dict, version: int, partial: bool = False, resend: bool = False,
                              timeout_s: float = 300.0) -> str | None:
        async with self._control:
            return await self.refresh.broadcast_begin(payload, version, partial, resend, timeout_s)

    async def broadcast_finish(self) -> str | None:
        async with self._control:
            err = await self.refresh.broadcast_finish()
            if err is None:
                await self._wake_if_orphaned()
            return err

    def weight_targets(self) -> list[dict]:
        """Workers a refresh goes to, with where they run (the learner picks the transport from this)."""
        return [{"index": i, **self._places[i]} for i in self.refresh.targets()]

    async def form_weight_group(self, spec, members: list[int]) -> str | None:
        return await self.refresh.form_group(spec, members)

    async def weights_digests(self) -> list[str | None]:
        """Per worker: the sha256 of its weights (None for a worker that is down)."""
        out = []
        for i, w in enumerate(self.workers):
            try:
                out.append(await w.weights_digest.remote() if self._alive[i] or self._awaiting[i] else None)
            except _ACTOR_DOWN:
                out.append(None)
        return out

    async def release_weight_buffers(self) -> None:
        await self.refresh.release()

    # -- sleep ------------------------------------------------------------------------------------
    async def sleep(self, level: int = 1, fail_if_asleep: bool = False, holder: str | None = None) -> str | None:
        """Put every worker to sleep. `holder`: the client whose process keeps renewing this sleep
        (renew_sleep); None: asleep until wake_up, whoever lives. A later sleep replaces the holder."""
        if level not in (1, 2):
            return f"sleep: level={level!r} must be 1 (weights kept in host memory) or 2 (dropped)"
        async with self._control:
            self._asleep, self._fail_if_asleep = max(self._asleep, level), bool(fail_if_asleep)
            self._sleep_holder, self._sleep_renewed = holder, time.monotonic()
            self._wake_after_refresh = False
            return await self._sleep_or_wake("sleep", level)

    async def wake_up(self) -> str | None:
        async with self._control:
            return await self._wake_up()

    async def _wake_up(self) -> str | None:
        err = await self._sleep_or_wake("wake_up")
        if err is None:
            self._fail_if_asleep = False
            self._sleep_holder, self._wake_after_refresh = None, False
        return err

    def renew_sleep(self, holder: str) -> None:
        """The client process that put the service to sleep still lives (anyone else's renewal is ignored:
        a renewal may also overtake the sleep call it belongs to)."""
        if holder == self._sleep_holder:
            self._sleep_renewed = time.monotonic()

    async def _end_orphaned_sleep(self) -> None:
        """Its holder stopped renewing the sleep: wake the workers, which serve the last weights. Nothing
        here may end the lease loop."""
        self._sleep_holder = None
        self.counters["sleep_expired"] += 1
        self._log(f"the client that put the service to sleep is gone (no renewal for {self.sleep_lease_s:g} s); "
                  "waking the workers")
        try:
            err = await self.wake_up()
        except Exception as e:
            err = error_text(e)
        if err is not None:  # sleep(2) dropped the weights: a full refresh must bring them first
            self._wake_after_refresh = True
            self._log(f"the workers stay asleep ({err}); they wake after the next full refresh")

    async def _wake_if_orphaned(self) -> None:
        if not self._wake_after_refresh:
            return
        err = await self._wake_up()  # (the caller holds self._control)
        self._log("the refresh brought the weights back: the workers are awake" if err is None else
                  f"the workers stay asleep after the refresh ({err}); they wake after the next full refresh")

    # -- colocated learners -----------------------------------------------------------------------
    def learner_options(self, i: int) -> tuple[dict | None, str | None]:
        """(options, None): `Actor.options(**options)` that place an actor in worker i's bundle, on the half
        of its CPUs and GPUs the worker leaves; or (None, why not)."""
        if not self.config.colocate:
            return None, (f"colocated_options: the service {self.config.name!r} was not started with "
                          "colocate: true, so its workers leave no room for a learner in their bundles")
        n = len(self.workers)
        if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < n:
            return None, f"colocated_options: worker={i!r} must be an int in [0, {n})"
        return learner_options(self.config, self.placement_group, i), None

    def report_fidelity(self, version: int, report: dict) -> str | None:
        """A learner's measure of how its log-probs match the rollouts of policy `version`: kept (the last
        256) and logged. Returns an error message or None."""
        try:
            entry = check_fidelity(version, report)
        except ValueError as e:
            return str(e)
        self.fidelity.append(entry)
        self._log(fidelity_line(entry))
        return None

    async def _sleep_or_wake(self, method: str, *args) -> str | None:
        """Every worker's sleep or wake_up; the service's sleep level is then the deepest one a worker reports
        (one that failed to wake still sleeps), so the router's view is the workers'. Hold self._control."""
        targets = self.refresh.targets()
        outcomes = await asyncio.gather(*[getattr(self.workers[i], method).remote(*args) for i in targets],
                                        return_exceptions=True)
        failed = [(i, o) for i, o in zip(targets, outcomes) if isinstance(o, BaseException) and not is_down(o)]
        stats = [o for o in outcomes if isinstance(o, dict)]
        stats += await asyncio.gather(*[self.workers[i].stats.remote() for i, _ in failed], return_exceptions=True)
        levels = [s["sleep_level"] for s in stats if isinstance(s, dict)]
        if levels:
            self._asleep = max(levels)
        return f"{method} failed on " + "; ".join(f"worker {i}: {error_text(o)}" for i, o in failed) if failed else None

    async def pause(self) -> None:
        self._paused = True
        await self._broadcast("pause")

    async def resume(self) -> None:
        self._paused = False
        await self._broadcast("resume")

    async def _broadcast(self, method: str) -> None:
        for i in self.refresh.targets():
            try:
                await getattr(self.workers[i], method).remote()
            except _ACTOR_DOWN:
                pass

    async def stats(self) -> list[dict]:
        """Per worker, its counters (the workers read them without waiting for an engine step)."""
        return list(await asyncio.gather(*[self._worker_stats(i) for i in range(len(self.workers))]))

    async def _worker_stats(self, i: int) -> dict:
        s = {"worker": i, "alive": False, "queued": None, "running": None, "kv_pages_used": None,
             "kv_pages_total": None, "tokens_per_s": None, "policy_version": None}
        if self._alive[i] or self._awaiting[i]:
            try:
                got = await asyncio.wait_for(asyncio.wrap_future(self.workers[i].stats.remote().future()),
                                             STATS_TIMEOUT_S)
                s = {**got, "alive": self._alive[i]}
            except (asyncio.TimeoutError, *_ACTOR_DOWN):
                s["alive"] = self._alive[i]
        s["awaiting_weights"] = self._awaiting[i]
        return s

    def info(self) -> dict:
        return {"name": self.config.name, "policy_version": self.refresh.version, "num_workers": len(self.workers),
                "alive": list(self._alive), "awaiting_weights": list(self._awaiting), "gone": list(self._gone),
                "in_flight": len(self.ledger.tracked), "streams": len(self.ledger.streams), "paused": self._paused,
                "asleep": self._asleep, "loads": self.ledger.loads(len(self.workers)),
                "duplicates_dropped": self.ledger.duplicates_dropped, "colocate": self.config.colocate,
                "client_lease_s": self.sleep_lease_s, "fidelity": [dict(e) for e in self.fidelity],
                "reward": self.config.reward, "reward_workers": self.config.reward_workers,
                **self.counters}

    async def shutdown(self) -> None:
        self._closed = True
        for t in self._tasks:
            t.cancel()
        for w in self.workers:
            try:
                ray.kill(w)
            except Exception:
                pass
        kill_reward_actors(getattr(self, "reward_actors", []))
        if self.placement_group is not None:
            ray.util.remove_placement_group(self.placement_group)

    # -- helpers ----------------------------------------------------------------------------------
    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.append(task)
        task.add_done_callback(lambda t: self._tasks.remove(t) if t in self._tasks else None)

    @staticmethod
    def _log(msg: str) -> None:
        print(f"[rollout_service.router] {msg}", flush=True)


def _starved(regenerations: int, max_staleness: int) -> str:
    return (f"stale: regenerated {regenerations} times with the current weights, and each time a weight refresh "
            f"came before it finished (max_staleness={max_staleness}); refresh less often than a request takes, "
            "or allow more staleness")


class _CannotServe(Exception):
    """A restarted worker that will not be able to serve, whatever the router waits for."""


RouterActor = ray.remote(Router)
