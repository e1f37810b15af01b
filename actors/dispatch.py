"""The router's requests: accepted all or none, sent to a live worker (where their prefix is cached, as load
allows: actors/affinity.py), their results matched back and delivered to their streams once each, stale ones
regenerated, failed or aborted ones ended with their reason (actors/ledger.py holds the book).
"""
from __future__ import annotations

import asyncio
from typing import Callable, Coroutine

from actors.affinity import Affinity
from actors.ledger import Ledger, Tracked, decode_request
from rollout_service.connections.remote_errors import ACTOR_DOWN, error_text, is_down
from actors.workers import WorkerTable
from rollout_service.results.payloads import Header, oldest_version
from rollout_service.api.types import RolloutRequest, RolloutResult

# a request regenerated this often, because each time a refresh came before it finished, never would: it fails
MAX_STALE_REGENERATIONS = 8
# Progress under any refresh rate: a request regenerated this often is pinned, and refreshes wait (at most
# REFRESH_HOLD_S each) until no pinned request is in flight, so its next run finishes on the version it started
# on. A storm of refreshes faster than a request takes would otherwise regenerate it until the cap above.
PIN_AFTER_REGENERATIONS = 2
REFRESH_HOLD_S = 30.0


class Dispatcher:
    def __init__(self, workers: WorkerTable, ledger: Ledger, version: Callable[[], int], max_staleness: int | None,
                 counters: dict, spawn: Callable[[Coroutine], None], log: Callable[[str], None],
                 affinity: Affinity):
        """`version()`: the policy version the workers serve now; `spawn`: run a coroutine in the background."""
        self.workers, self.ledger, self._version, self.affinity = workers, ledger, version, affinity
        self.max_staleness = max_staleness
        self.counters, self._spawn, self._log = counters, spawn, log
        self.pinned: set[str] = set()  # request ids refreshes wait for (PIN_AFTER_REGENERATIONS)

    # -- accepting --------------------------------------------------------------------------------
    async def submit(self, items: list, lease_s: float) -> dict:
        """Accept a batch, all or none: every request decoded, validated and tokenized (on the worker it goes
        to) before any is queued. {"stream": id, "lease_s": seconds} or {"errors": [(index, message), ...]}; a
        refused batch leaves nothing behind."""
        reqs, errors = self._decode(items)
        if errors:
            return {"errors": errors}
        if not reqs:
            return {"errors": [(-1, "empty batch")]}
        if all(self.workers.gone):
            return {"errors": [(-1, "no rollout worker is alive")]}
        for r in reqs:  # the engines admit the oldest first; a regeneration keeps its request's version
            if r.submitted_version is None:
                r.submitted_version = self._version()
        sid, tracked = self.ledger.open_stream(reqs)
        try:
            errors = await self.dispatch(tracked, atomic=True)
        except Exception:
            await self.close_stream(sid)
            raise
        if errors:
            await self.close_stream(sid)
            index = {r.request_id: i for i, r in enumerate(reqs)}
            return {"errors": [(index.get(rid, -1), msg) for rid, msg in errors]}
        return {"stream": sid, "lease_s": lease_s}

    def _decode(self, items: list) -> tuple[list[RolloutRequest], list[tuple[int, str]]]:
        reqs, errors, seen, checked = [], [], set(), {}
        for i, item in enumerate(items):
            try:
                r = decode_request(item, checked)
                if r.request_id in self.ledger.tracked or r.request_id in seen:
                    raise ValueError(f"request_id {r.request_id!r} is already in flight")
                seen.add(r.request_id)
                reqs.append(r)
            except ValueError as e:
                errors.append((i, str(e)))
        return reqs, errors

    async def dispatch(self, tracked: list[Tracked], atomic: bool = False) -> list[tuple[str, str]]:
        """Send each request (as a new job) to a live worker (actors/affinity.py); with none alive they wait
        (worker None) until one comes back. `atomic` (a client's batch): a worker queues its share all or none and the
        errors are returned for the caller to drop the batch. Otherwise (a resubmission) each request stands
        alone: one that fails ends with its error, the others go on. Returns (request_id, error) pairs."""
        live = self.workers.live()
        if not live:
            for t in tracked:
                self.ledger.unassign(t)
            return []
        loads = self.ledger.loads(len(self.workers))
        batches: dict[int, list[RolloutRequest]] = {}
        streams: dict[int, list[str]] = {}  # each job's delivery group: its stream
        for t in sorted(tracked, key=lambda t: -t.cost_per_sample * t.missing):
            i = self.affinity.choose(t.request, t.cost_per_sample * t.missing, live, loads)
            batches.setdefault(i, []).append(self.ledger.new_job(t, i, self._version()))
            streams.setdefault(i, []).append(t.stream)
            loads[i] += t.cost_per_sample * t.missing
        calls = [self.workers.handles[i].submit.remote(jobs, atomic, streams[i]) for i, jobs in batches.items()]
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
                self.fail(rid, msg)
        return errors

    # -- results ----------------------------------------------------------------------------------
    def on_result(self, r: RolloutResult) -> None:
        """A result the router holds whole (one handed back by an abort): delivered to its stream as it is."""
        t = self._accept(r.request_id, r.sample_index, r.finish_reason, oldest_version(r))
        if t is not None:
            self.ledger.deliver(t, r)

    def on_deltas(self, deltas: list) -> None:
        """Token deltas of running samples: each to its request's stream, if it comes from the request's newest
        dispatch and its sample is not delivered yet (others are late: dropped)."""
        for d in deltas:
            self.ledger.deliver_delta(d)

    def on_header(self, h: Header, payload) -> None:
        """A polled result's header: its stream gets the payload's ref and the result's place in it."""
        t = self._accept(h.job_id, h.sample_index, h.finish_reason, h.oldest_version)
        if t is not None:
            self.ledger.deliver_ref(t, h, payload)

    def _accept(self, job_id: str, sample_index: int, finish_reason: str, oldest: int | None) -> Tracked | None:
        """The request a worker's result is to be delivered to; None if it is a late copy (dropped) or stale (its
        request is regenerated with the current weights, once per refresh)."""
        t = self.ledger.is_new(job_id, sample_index)
        if t is None:
            return None
        k, version = self.max_staleness, self._version()
        if k is None or oldest is None or finish_reason == "abort" or version - oldest <= k:
            return t
        if t.fresh_as_of >= version:  # regenerate once per refresh, not once per stale sample
            return None
        t.fresh_as_of, t.regenerations = version, t.regenerations + 1
        if t.regenerations > MAX_STALE_REGENERATIONS:
            self._spawn(self.abort_jobs([t]))
            self.fail(t.request.request_id, _starved(t.regenerations - 1, k))
            return None
        self.counters["stale_regenerated"] += 1
        if t.regenerations >= PIN_AFTER_REGENERATIONS and not t.pinned:
            t.pinned = True
            self.pinned.add(t.request.request_id)
            self.counters["stale_pinned"] += 1
        self._spawn(self._regenerate(t))
        return None

    def starved(self) -> set[str]:
        """The pinned requests still in flight (finished or failed ones drop out)."""
        self.pinned &= set(self.ledger.tracked)
        return self.pinned

    async def hold_refresh(self, limit_s: float = REFRESH_HOLD_S) -> float:
        """Wait, at most limit_s, until no pinned request is in flight; returns the seconds waited."""
        t0 = asyncio.get_running_loop().time()
        waited = 0.0
        while self.starved() and waited < limit_s:
            await asyncio.sleep(0.02)
            waited = asyncio.get_running_loop().time() - t0
        return waited

    def regenerate_lost(self, ts: list[Tracked]) -> None:
        """Requests with samples delivered whose payload was lost with its node before the client read it (they
        are missing again: actors/ledger.py): generated again."""
        for t in ts:
            self._spawn(self._regenerate(t))

    async def _regenerate(self, t: Tracked) -> None:
        old = (t.worker, t.jobs[-1]) if t.worker is not None else None
        await self.dispatch([t])
        if old is not None and self.workers.alive[old[0]]:
            try:  # the superseded job is stale anyway: free its pages
                await self.workers.handles[old[0]].abort.remote([old[1]])
            except ACTOR_DOWN:
                pass

    def fail(self, rid: str, msg: str) -> None:
        """End a request that cannot run any more: its missing samples come as "abort" results with `msg`."""
        t = self.ledger.tracked.get(rid)
        if t is not None:
            self._log(f"request {rid} failed: {msg}")
            self.ledger.fill_aborted(t, error=msg)

    def fail_all(self, msg: str) -> None:
        for t in list(self.ledger.tracked.values()):
            self.ledger.fill_aborted(t, error=msg)

    # -- ending early -----------------------------------------------------------------------------
    async def abort(self, request_ids: list[str]) -> list[RolloutResult]:
        """Abort requests now. Their remaining samples end with finish_reason "abort" (tokens so far); those
        results go to the requests' streams (so they finish) and are returned here as well."""
        ts = [self.ledger.tracked[r] for r in request_ids if r in self.ledger.tracked]
        out: list[RolloutResult] = []
        for r in await self.abort_jobs(ts):
            t = self.ledger.owner(r.request_id)
            if t is not None and r.sample_index not in t.delivered:
                self.ledger.deliver(t, r)
                out.append(r)
        for t in ts:
            out += self.ledger.fill_aborted(t)
        return out

    async def abort_jobs(self, ts: list[Tracked]) -> list[RolloutResult]:
        """Abort the jobs of these requests on their workers; returns the partial results."""
        by_worker: dict[int, list[str]] = {}
        for t in ts:
            if t.worker is not None:
                by_worker.setdefault(t.worker, []).extend(t.jobs)
        outcomes = await asyncio.gather(*[self.workers.handles[i].abort.remote(jobs) for i, jobs in by_worker.items()],
                                        return_exceptions=True)
        return [r for out in outcomes if not isinstance(out, BaseException) for r in out]

    async def close_stream(self, sid: str) -> None:
        """The consumer went away: forget the stream (at once) and abort what still runs for it."""
        await self.abort_jobs(self.ledger.close_stream(sid))


def _starved(regenerations: int, max_staleness: int) -> str:
    return (f"stale: regenerated {regenerations} times with the current weights, and each time a weight refresh "
            f"came before it finished (max_staleness={max_staleness}); refresh less often than a request takes, "
            "or allow more staleness")
