"""Router: the service's front door. Spreads requests over the RolloutWorkers and streams results back.

- Dispatch: each request goes to the live worker with the fewest outstanding tokens (prompt tokens
  estimate + max_tokens, per sample still to come).
- Tracking: every request is tracked until its n samples were delivered. Each dispatch of a request is
  a "job" with its own engine request id, so the same request can be in flight twice (resubmitted)
  and results are matched back to it; a (request_id, sample_index) is delivered once, later copies
  are dropped.
- Faults: when a worker dies its jobs go to live workers; when Ray restarts it (new incarnation, empty
  engine) it first gets the latest weights, then serves again (or, after a broadcast, waits for the
  learner's next push: actors/refresh.py).
- Refresh: actors/refresh.py (all workers or none). Results older than `max_staleness` versions are
  regenerated.
- Sleep: every worker frees its device memory; requests wait (or are refused) until wake_up.
"""
from __future__ import annotations

import asyncio

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from actors.ledger import Ledger, Tracked, decode_request
from actors.placement import create_workers
from actors.refresh import RefreshCoordinator
from rollout_service.config import ServiceConfig
from rollout_service.types import RolloutRequest, RolloutResult

_ACTOR_DOWN = (RayActorError, getattr(ray.exceptions, "ActorUnavailableError", RayActorError))


def is_down(e: BaseException) -> bool:
    return isinstance(e, _ACTOR_DOWN)


def error_text(e: BaseException) -> str:
    """The user-facing message of an exception that crossed a Ray actor boundary."""
    cause = getattr(e, "cause", None) if isinstance(e, RayTaskError) else None
    e = cause if cause is not None else e
    if isinstance(e, ValueError):
        return str(e)
    text = str(e)
    if isinstance(e, RayActorError) and "creation task" in text:  # keep the constructor's own error
        lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
        return f"constructor failed: {lines[-1]}"
    return f"{type(e).__name__}: {text}"


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
        self._places: list[dict] = [{} for _ in range(n)]  # node_id and device, from health()
        self.ledger = Ledger()
        self.refresh = RefreshCoordinator(self)
        self._paused = False
        self._asleep = 0
        self._fail_if_asleep = False
        self._closed = False
        self._tasks: list[asyncio.Task] = []
        self.counters = {"resubmitted": 0, "stale_regenerated": 0, "worker_deaths": 0}

    # -- start-up ---------------------------------------------------------------------------------
    async def start(self) -> str | None:
        """Place the workers and wait until each has built its engine; returns an error message or None."""
        try:
            self.workers, self.placement_group = await create_workers(self.config)
        except ValueError as e:
            return str(e)
        for i, w in enumerate(self.workers):
            try:
                self._on_health(i, await w.health.remote())
                self._alive[i] = True
            except Exception as e:
                return f"rollout worker {i} failed to start: {error_text(e)}"
        self._tasks = [asyncio.get_running_loop().create_task(self._poll_loop(i)) for i in range(len(self.workers))]
        return None

    # -- requests ---------------------------------------------------------------------------------
    async def submit(self, items: list) -> dict:
        """Accept a batch (all or none). Returns {"stream": id} or {"errors": [(index, message), ...]}."""
        if self._closed:
            return {"errors": [(-1, "the service is closed")]}
        if self._asleep and self._fail_if_asleep:
            return {"errors": [(-1, f"the service is asleep (sleep level {self._asleep}): call wake_up() first")]}
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
        if errors:
            return {"errors": errors}
        if not reqs:
            return {"errors": [(-1, "empty batch")]}
        if not any(self._alive) and not any(self._awaiting) and all(self._gone):
            return {"errors": [(-1, "no rollout worker is alive")]}
        sid, tracked = self.ledger.open_stream(reqs)
        errors = await self._dispatch(tracked, report_errors=True)
        if errors:
            await self._abort_tracked(tracked, deliver=False)
            self.ledger.close_stream(sid)
            index = {r.request_id: i for i, r in enumerate(reqs)}
            return {"errors": [(index.get(rid, -1), msg) for rid, msg in errors]}
        return {"stream": sid}

    async def _dispatch(self, tracked: list[Tracked], report_errors: bool = False) -> list[tuple[str, str]]:
        """Send each request (as a new job) to the least-loaded live worker. With no live worker the
        requests wait (worker None) until one comes back. Returns (request_id, error) pairs."""
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
        calls = {i: self.workers[i].submit.remote(jobs) for i, jobs in batches.items()}
        errors = []
        for i, ref in calls.items():
            try:
                for job, err in zip(batches[i], await ref):
                    if err is not None:
                        errors.append((self.ledger.owner(job.request_id).request.request_id, err))
            except _ACTOR_DOWN:
                pass  # its poll loop sees the death and moves these jobs on
        if errors and not report_errors:  # cannot happen for requests accepted before; do not lose them
            for rid, msg in errors:
                self._fail(rid, msg)
        return errors

    # -- results ----------------------------------------------------------------------------------
    async def _poll_loop(self, i: int) -> None:
        while not self._closed and not self._gone[i]:
            try:
                incarnation, results = await self.workers[i].poll.remote(0.5)
            except _ACTOR_DOWN:
                await self._worker_down(i)
                continue
            except RayTaskError as e:  # the engine loop crashed: restart the actor
                self._log(f"worker {i} failed ({error_text(e)}); restarting it")
                ray.kill(self.workers[i], no_restart=False)
                await self._worker_down(i)
                continue
            if incarnation != self._incarnation[i]:  # restarted between two polls
                await self._worker_down(i)
                continue
            for r in results:
                self._on_result(r)

    def _on_result(self, r: RolloutResult) -> None:
        t = self.ledger.is_new(r)
        if t is None:
            return
        k = self.config.max_staleness
        version = self.refresh.version
        if k is not None and r.token_versions and r.finish_reason != "abort" and version - min(r.token_versions) > k:
            if t.fresh_as_of < version:  # regenerate once per refresh, not once per stale sample
                t.fresh_as_of = version
                self.counters["stale_regenerated"] += 1
                self._spawn(self._regenerate(t))
            return
        self.ledger.deliver(t, r)

    def _fail(self, rid: str, msg: str) -> None:
        t = self.ledger.tracked.get(rid)
        if t is not None:
            self._log(f"request {rid} failed on resubmission: {msg}")
            self.ledger.fill_aborted(t)

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
        """The consumer went away: abort what is still running for it."""
        await self._abort_tracked(self.ledger.close_stream(sid), deliver=False)

    # -- faults -----------------------------------------------------------------------------------
    async def _worker_down(self, i: int) -> None:
        if self._alive[i] or self._awaiting[i]:
            self._alive[i] = self._awaiting[i] = False
            self.counters["worker_deaths"] += 1
        lost = self.ledger.on_worker(i)
        if lost:
            self.counters["resubmitted"] += len(lost)
            await self._dispatch(lost)
        await self._recover(i)

    async def _recover(self, i: int) -> None:
        """Wait for Ray to restart worker i, bring it to the current weights, put it back in service."""
        for attempt in range(120):
            try:
                h = await asyncio.wait_for(asyncio.wrap_future(self.workers[i].health.remote().future()), 10)
            except (asyncio.TimeoutError, GetTimeoutError, *_ACTOR_DOWN) as e:
                if isinstance(e, ray.exceptions.ActorDiedError) and attempt >= 3:
                    break
                await asyncio.sleep(min(0.25 * (attempt + 1), 2.0))
                continue
            try:
                self._on_health(i, h)
                current = await self.refresh.bring_up_to_date(i)
                if self._paused:
                    await self.workers[i].pause.remote()
                if self._asleep:
                    await self.workers[i].sleep.remote(self._asleep)
            except Exception as e:
                self._log(f"worker {i} came back but could not be brought up to date: {error_text(e)}")
                await asyncio.sleep(1.0)
                continue
            if current:
                await self.back_in_service(i)
            else:
                self._awaiting[i] = True
                self._log(f"worker {i} restarted; it serves again once the learner pushes weights")
            return
        self._gone[i] = True
        self._log(f"worker {i} is gone for good")
        if not any(self._alive):
            for t in list(self.ledger.tracked.values()):
                self.ledger.fill_aborted(t)

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
        return await self._abort_tracked(ts, deliver=True)

    async def _abort_tracked(self, ts: list[Tracked], deliver: bool) -> list[RolloutResult]:
        out: list[RolloutResult] = []
        by_worker: dict[int, list[str]] = {}
        for t in ts:
            if t.worker is not None:
                by_worker.setdefault(t.worker, []).extend(t.jobs)
        for i, jobs in by_worker.items():
            try:
                partial = await self.workers[i].abort.remote(jobs)
            except _ACTOR_DOWN:
                partial = []
            for r in partial if deliver else []:
                t = self.ledger.owner(r.request_id)
                if t is not None and r.sample_index not in t.delivered:
                    self.ledger.deliver(t, r)
                    out.append(r)
        for t in ts:
            if deliver:
                out += self.ledger.fill_aborted(t)
            else:
                self.ledger.forget(t)
        return out

    # -- weights (actors/refresh.py) ----------------------------------------------------------------
    async def update_weights(self, payload: dict, version: int, partial: bool = False) -> str | None:
        """Object store or CUDA IPC refresh; returns an error message or None."""
        return await self.refresh.update(payload, version, partial)

    async def broadcast_begin(self, payload: dict, version: int, partial: bool = False, resend: bool = False,
                              timeout_s: float = 300.0) -> str | None:
        return await self.refresh.broadcast_begin(payload, version, partial, resend, timeout_s)

    async def broadcast_finish(self) -> str | None:
        return await self.refresh.broadcast_finish()

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
    async def sleep(self, level: int = 1, fail_if_asleep: bool = False) -> str | None:
        if level not in (1, 2):
            return f"sleep: level={level!r} must be 1 (weights kept in host memory) or 2 (dropped)"
        self._asleep, self._fail_if_asleep = max(self._asleep, level), bool(fail_if_asleep)
        return await self._on_every_worker("sleep", level)

    async def wake_up(self) -> str | None:
        err = await self._on_every_worker("wake_up")
        if err is None:
            self._asleep, self._fail_if_asleep = 0, False
        return err

    async def _on_every_worker(self, method: str, *args) -> str | None:
        targets = self.refresh.targets()
        outcomes = await asyncio.gather(*[getattr(self.workers[i], method).remote(*args) for i in targets],
                                        return_exceptions=True)
        errors = [f"worker {i}: {error_text(o)}" for i, o in zip(targets, outcomes)
                  if isinstance(o, BaseException) and not is_down(o)]
        return f"{method} failed on " + "; ".join(errors) if errors else None

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
        out = []
        for i, w in enumerate(self.workers):
            s = {"worker": i, "alive": False, "queued": None, "running": None, "kv_pages_used": None,
                 "kv_pages_total": None, "tokens_per_s": None, "policy_version": None}
            if self._alive[i] or self._awaiting[i]:
                try:
                    s = {**await w.stats.remote(), "alive": self._alive[i]}
                except _ACTOR_DOWN:
                    pass
            s["awaiting_weights"] = self._awaiting[i]
            out.append(s)
        return out

    def info(self) -> dict:
        return {"name": self.config.name, "policy_version": self.refresh.version, "num_workers": len(self.workers),
                "alive": list(self._alive), "awaiting_weights": list(self._awaiting), "in_flight": len(self.ledger.tracked),
                "streams": len(self.ledger.streams), "paused": self._paused, "asleep": self._asleep,
                "loads": self.ledger.loads(len(self.workers)), "duplicates_dropped": self.ledger.duplicates_dropped,
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


RouterActor = ray.remote(Router)
