"""Ledger: the router's book of requests — what each client asked for, which job (dispatch) of it
runs where, what was delivered, and the client streams results wait in.

Each dispatch of a request is a "job" with its own engine request id, so the same request can be in
flight twice (resubmitted after a fault, regenerated when stale) and every result still maps back
to it. A (request_id, sample_index) is delivered once; later copies are dropped.

A stream holds results the router has whole (aborts) and, for polled ones, the payload's ref and the result's
place in it (rollout_service/results/payloads.py): the client fetches those. A stream whose last read handed out
refs ends only at the client's next read, which reports the samples whose payload was lost (its node died): they
are missing again, and the router generates them anew.

Token deltas (requests with stream_tokens) go to their stream beside its results, renamed to the client's request
id and numbered by the dispatch they come from (TokenDelta.attempt); those of an older dispatch are dropped.

A stream is leased: reading it or renewing it (the client process does so while it holds the stream)
extends the lease; a stream whose lease ran out has lost its client and is cancelled by the router.
"""
from __future__ import annotations

import asyncio
import copy
import itertools
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from rollout_service.results.payloads import Batch, Header
from rollout_service.api.deltas import TokenDelta
from rollout_service.api.types import RolloutRequest, RolloutResult


@dataclass
class Tracked:
    request: RolloutRequest
    stream: str
    cost_per_sample: int
    delivered: set[int] = field(default_factory=set)
    jobs: list[str] = field(default_factory=list)   # engine request ids of every dispatch, newest last
    worker: int | None = None                       # worker of the newest job (None: waiting for one)
    fresh_as_of: int = -1                           # policy version the newest job was dispatched at
    strikes: int = 0                                # worker deaths while its user code ran (actors/quarantine.py)
    regenerations: int = 0                          # times regenerated for staleness
    pinned: bool = False                            # refreshes wait for it (actors/dispatch.py, hold_refresh)
    charged: tuple[int | None, int] = (None, 0)      # (worker, cost) it counts for in the ledger's loads

    @property
    def missing(self) -> int:
        return self.request.sampling.n - len(self.delivered)


@dataclass
class Stream:
    expected: int
    requests: dict[str, RolloutRequest]   # by request id, until the stream ends (a lost payload reopens one)
    # whole, or (payload, header, client request id)
    results: list[RolloutResult | tuple[Any, Header, str]] = field(default_factory=list)
    deltas: list[TokenDelta] = field(default_factory=list)
    delivered: int = 0
    event: asyncio.Event = field(default_factory=asyncio.Event)
    renewed: float = field(default_factory=time.monotonic)  # when its client last read or renewed it
    # complete, but its last read handed out payloads: kept until the client says it fetched them (settle), or
    # reports some lost (their node died: they are generated again), or stops renewing it
    settling: bool = False


def cost_estimate(req: RolloutRequest) -> int:
    """Outstanding-token cost of one sample: prompt tokens (estimated for text) + max_tokens, or + the
    completion a scoring request prefills; an episode's token limit."""
    p = req.prompt
    if req.episode is not None:
        return req.episode.max_total_tokens
    if isinstance(p, str):
        prompt = len(p) // 4 + 1
    elif p and isinstance(p[0], dict):
        prompt = sum(len(m["content"]) // 4 + 4 for m in p)
    else:
        prompt = len(p)
    return prompt + (req.sampling.max_tokens if req.completion is None else len(req.completion))


def decode_request(item, checked: dict | None = None) -> RolloutRequest:
    """A checked RolloutRequest of the router's own from a request, a dict or msgpack bytes (untrusted:
    never unpickled; a request object is checked again, since its fields may have been set after it was
    built). `checked`: RolloutRequest.validated's, for the requests of one batch."""
    try:
        if isinstance(item, RolloutRequest):
            return item.validated(checked)
        if isinstance(item, (bytes, bytearray, memoryview)):
            return RolloutRequest.from_msgpack(bytes(item))
        if isinstance(item, dict):
            return RolloutRequest.from_dict(item)
    except ValueError:
        raise
    except Exception as e:  # malformed records raise all sorts of things; the caller gets a ValueError
        raise ValueError(f"malformed request record: {type(e).__name__}: {e}") from None
    raise ValueError(f"expected a RolloutRequest, a dict or msgpack bytes, got {type(item).__name__}")


class Ledger:
    def __init__(self):
        self.tracked: dict[str, Tracked] = {}
        self.streams: dict[str, Stream] = {}
        self._job_owner: dict[str, str] = {}   # engine request id -> client request id
        self._ids = itertools.count()
        self.duplicates_dropped = 0
        # per worker, the outstanding cost of the requests it runs: kept up to date (a dispatch reads it, and
        # adding it up over every request in flight for each one made a stream of small submits quadratic)
        self._loads: dict[int, int] = {}

    def open_stream(self, reqs: list[RolloutRequest]) -> tuple[str, list[Tracked]]:
        sid = uuid.uuid4().hex
        self.streams[sid] = Stream(sum(r.sampling.n for r in reqs), {r.request_id: r for r in reqs})
        ts = [Tracked(r, sid, cost_estimate(r)) for r in reqs]
        self.tracked.update((t.request.request_id, t) for t in ts)
        return sid, ts

    def close_stream(self, sid: str) -> list[Tracked]:
        """Forget a stream and its requests; returns those that were still running (to abort their jobs)."""
        s = self.streams.pop(sid, None)
        running = [self.tracked[r] for r in (s.requests if s else ()) if r in self.tracked]
        for t in running:
            self.forget(t)
        return running

    def renew(self, sids: list[str]) -> None:
        now = time.monotonic()
        for sid in sids:
            if sid in self.streams:
                self.streams[sid].renewed = now

    def expired(self, lease_s: float) -> list[str]:
        """Streams neither read nor renewed for `lease_s` seconds. Settling ones past it are forgotten here: their
        client read them whole and is gone before saying so, and nothing of them runs."""
        now = time.monotonic()
        old = [sid for sid, s in self.streams.items() if now - s.renewed > lease_s]
        self.settle([sid for sid in old if self.streams[sid].settling])
        return [sid for sid in old if sid in self.streams]

    def settle(self, sids: list[str]) -> None:
        """The client fetched every payload of these complete streams: forget them."""
        for sid in sids:
            s = self.streams.get(sid)
            if s is not None and s.settling:
                del self.streams[sid]

    def open_streams(self) -> int:
        """Streams whose client has not read them whole yet (settling ones apart)."""
        return sum(not s.settling for s in self.streams.values())

    def new_job(self, t: Tracked, worker: int, version: int) -> RolloutRequest:
        job_id = f"{t.request.request_id}#{next(self._ids)}"
        t.jobs.append(job_id)
        t.worker, t.fresh_as_of = worker, version
        self._charge(t)
        self._job_owner[job_id] = t.request.request_id
        job = copy.copy(t.request)  # (checked when it was accepted: replace() would check it all again)
        job.request_id = job_id
        return job

    def owner(self, job_id: str) -> Tracked | None:
        rid = self._job_owner.get(job_id)
        return self.tracked.get(rid) if rid is not None else None

    def is_new(self, job_id: str, sample_index: int) -> Tracked | None:
        """The request a worker's result belongs to, or None (counted) if it is a late duplicate."""
        t = self.owner(job_id)
        if t is None or sample_index in t.delivered:
            self.duplicates_dropped += 1
            return None
        return t

    def deliver(self, t: Tracked, r: RolloutResult) -> None:
        r.request_id = t.request.request_id
        r.metadata = t.request.metadata
        self._append(t, r.sample_index, r)

    def deliver_ref(self, t: Tracked, h: Header, payload: Any) -> None:
        """A polled result, left in its payload for the client to fetch."""
        self._append(t, h.sample_index, (payload, h, t.request.request_id))

    def deliver_delta(self, d: TokenDelta) -> None:
        t = self.owner(d.request_id)
        if t is None or t.jobs[-1] != d.request_id or d.sample_index in t.delivered:
            return
        s = self.streams.get(t.stream)
        if s is not None:
            d.request_id, d.attempt = t.request.request_id, len(t.jobs) - 1
            s.deltas.append(d)
            s.event.set()

    def _append(self, t: Tracked, sample_index: int, item: RolloutResult | tuple[Any, Header, str]) -> None:
        t.delivered.add(sample_index)
        self._charge(t)
        s = self.streams.get(t.stream)
        if s is not None:
            s.results.append(item)
            s.delivered += 1
            s.event.set()
        if t.missing == 0:
            self.forget(t)

    def reopen(self, sid: str, lost: list[tuple[str, int]]) -> list[Tracked]:
        """The client could not fetch these delivered samples (their payload's node died): missing again. Returns
        their requests, to be generated again."""
        s, out = self.streams.get(sid), {}
        for rid, index in lost if s is not None else ():
            req = s.requests.get(rid)
            if req is None:
                continue
            t = self.tracked.get(rid)
            if t is not None and t.stream != sid:  # its id was reused by a request in flight in another stream
                s.results.append(RolloutResult(rid, index, [], [], [], [], "abort", metadata=req.metadata, error=(
                    "its result was lost with its worker's node before it was read, and its request_id is in "
                    "flight again in another stream, so it cannot be generated again")))
                s.event.set()
                continue
            if t is None:  # it had been delivered whole and forgotten
                t = self.tracked[rid] = Tracked(req, sid, cost_estimate(req), set(range(req.sampling.n)))
            if index in t.delivered:
                t.delivered.discard(index)
                self._charge(t)
                s.delivered -= 1
                s.settling = False  # incomplete again: open until the samples come back
                out[rid] = t
        return list(out.values())

    def forget(self, t: Tracked) -> None:
        self.tracked.pop(t.request.request_id, None)
        self._charge(t)
        for j in t.jobs:
            self._job_owner.pop(j, None)

    def unassign(self, t: Tracked) -> None:
        """No worker runs it now: it waits for one."""
        t.worker = None
        self._charge(t)

    def _charge(self, t: Tracked) -> None:
        """Count t for its worker's load as it is now: its missing samples' cost, while it is in the book."""
        worker, cost = t.charged
        if worker is not None:
            self._loads[worker] -= cost
        live = t.worker is not None and self.tracked.get(t.request.request_id) is t
        t.charged = (t.worker, t.cost_per_sample * t.missing) if live else (None, 0)
        if live:
            self._loads[t.worker] = self._loads.get(t.worker, 0) + t.charged[1]

    def fill_aborted(self, t: Tracked, error: str | None = None) -> list[RolloutResult]:
        """Deliver an empty "abort" result (carrying `error`, if the request failed) for every sample that
        has none, so its stream ends."""
        out = []
        for idx in range(t.request.sampling.n):
            if idx not in t.delivered and t.request.request_id in self.tracked:
                out.append(RolloutResult(t.request.request_id, idx, [], [], [], [], "abort",
                                         metadata=t.request.metadata, error=error))
                self.deliver(t, out[-1])
        return out

    def on_worker(self, i: int | None) -> list[Tracked]:
        return [t for t in self.tracked.values() if t.worker == i]

    def loads(self, num_workers: int) -> list[int]:
        """Per worker, the outstanding cost (cost_estimate per missing sample) of the requests it runs."""
        return [self._loads.get(i, 0) for i in range(num_workers)]

    async def next_results(self, sid: str, timeout: float
                           ) -> tuple[list[RolloutResult], list[Batch], bool, list[TokenDelta]]:
        """The stream's results since the last call (waiting up to `timeout` for one, or for a token delta): those
        held whole, the others as payload batches; whether the stream is complete; and its token deltas. A
        complete stream is forgotten, unless this call hands out batches: it then settles until the client
        says it fetched them (settle(), sent in batches, with no read of its own) or reports some lost on one more
        read, which makes them missing again."""
        s = self.streams.get(sid)
        if s is None:
            raise ValueError(f"unknown stream {sid!r}: finished, closed, or cancelled when its client stopped "
                             "renewing it")
        s.renewed = time.monotonic()
        if not s.results and not s.deltas and s.delivered < s.expected:
            try:
                await asyncio.wait_for(s.event.wait(), timeout)
            except asyncio.TimeoutError:
                pass
        items, s.results = s.results, []
        deltas, s.deltas = s.deltas, []
        s.event.clear()
        whole = [x for x in items if isinstance(x, RolloutResult)]
        batches: dict[tuple[int, str | None], Batch] = {}
        for x in items:
            if not isinstance(x, RolloutResult):
                payload, h, rid = x
                batches.setdefault((id(payload), h.group), (payload, h.group, []))[2].append(
                    (h.position, rid, h.sample_index))
        done = s.delivered >= s.expected
        s.settling = done and bool(batches)
        if done and not batches:
            del self.streams[sid]
        return whole, list(batches.values()), done, deltas
