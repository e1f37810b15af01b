"""ResultStream: what RayConnection.submit returns, an iterator over one stream of results in the router.

Each read gets the results the router holds whole and, for the others, where their payload is: this process
fetches it from the worker's node (rollout_service/results/payloads.py) and reports on its next read what was lost
with a node, for the router to generate again. The read that completes a stream needs no read after it when every
payload was fetched: the router keeps the stream until this process's thread says so (one call per router for all
such streams, twice a second), so a one-request stream costs the router one submit and one read; a caller that
reads at once gets that read with the submit (RayConnection.submit(read_now=True): take() its "first").

A stream holds requests in flight on the workers, so its end must reach the router however its consumer
goes: read to the end (the router then forgets it, at once or when told, above), closed (`close()`, or its
client closed), dropped unread (garbage-collected: a finalizer queues its close), or its process died (the router
cancels a stream whose lease is not renewed; a thread of this process renews the leases of every stream still
referenced here, so a stream kept for later, e.g. rollouts submitted before a training step, lives on).
The finalizer only queues the close: the thread sends it, or the next submit/info/close of this process.

The same thread renews a client's sleep lease (`hold_sleep`): a service put to sleep by this process stays
asleep while the process lives, until the client wakes it or is closed.
"""
from __future__ import annotations

import threading
import time
import weakref
from collections import deque
from typing import Any, Callable, Iterator

import ray

from rollout_service.results.payloads import unpack
from rollout_service.api.deltas import TokenDelta
from rollout_service.api.types import RolloutResult

_TICK_S = 0.5  # how often the thread sends queued closes and checks whether leases are due
READ_S = 1.0   # the longest a read waits in the router for a result (then the client asks again)


class ResultStream(Iterator[RolloutResult | TokenDelta]):
    def __init__(self, router: Any, sid: str, lease_s: float, on_starved: Callable[[], Any], owner: Any):
        self.router, self.sid, self.lease_s = router, sid, float(lease_s)
        self.owner = owner              # the client it was submitted through (closed with it)
        self._on_starved = on_starved  # no worker can serve until the learner re-sends its last broadcast
        self._buffer: deque[RolloutResult | TokenDelta] = deque()
        self._lost: list[tuple[str, int]] = []  # samples of the last read whose payload could not be fetched
        self._done = False
        self._finalizer = weakref.finalize(self, _pending.append, (router, sid))
        _keeper.add(self)

    def __iter__(self) -> "ResultStream":
        return self

    def __next__(self) -> RolloutResult | TokenDelta:
        while not self._buffer:
            if self._done:
                raise StopIteration
            self.take(ray.get(self.ask()))
        return self._buffer.popleft()

    def ask(self) -> Any:
        """The router's next read of this stream (an ObjectRef for take(); one at a time)."""
        return self.router.next_results.remote(self.sid, READ_S, self._lost)

    def take(self, reply: tuple) -> None:
        whole, batches, done, starved, deltas = reply
        if starved:
            self._on_starved()
        fetched, self._lost = unpack(batches)
        if done and not self._lost:  # (with some lost, the next read reports them: they are generated again)
            self._done = True
            if self._finalizer.detach() is not None and batches:
                _keeper.settle(self.router, self.sid)  # the router holds it until told the payloads were fetched
        self._buffer.extend(deltas)  # (first: they came before these results)
        self._buffer.extend(whole + fetched)

    def pop(self) -> RolloutResult | TokenDelta | None:
        """A result already read, if any (without asking the router)."""
        return self._buffer.popleft() if self._buffer else None

    @property
    def finished(self) -> bool:
        """Every result read and handed out."""
        return self._done and not self._buffer

    @property
    def open(self) -> bool:
        """Still known to the router: neither read to the end nor closed."""
        return self._finalizer.alive

    def close(self) -> None:
        """Stop the stream now: the router forgets it and aborts what still runs for it."""
        self._done = True
        if self._finalizer.detach() is not None:
            try:
                ray.get(self.router.close_stream.remote(self.sid))
            except ray.exceptions.RayActorError:
                pass  # the service is gone, and the stream with it


def close_streams(owner: Any) -> None:
    """Close every open stream submitted through `owner` (a client that is closing)."""
    for s in _keeper.streams():
        if s.owner is owner:
            s.close()
    send_closes()
    send_settles()


def send_closes() -> None:
    """Send the closes that finalizers of streams dropped unread have queued; returns once they are done,
    those another thread is sending included."""
    with _sending:
        while _pending:
            router, sid = _pending.popleft()
            try:
                ray.get(router.close_stream.remote(sid))
            except Exception:
                pass  # the service (or Ray) is gone, and the stream with it


def send_settles() -> None:
    """Tell each router which of its streams were read whole (one call per router). A router not told forgets them
    once their lease runs out."""
    by_router: dict[Any, list[str]] = {}
    while _settled:
        router, sid = _settled.popleft()
        by_router.setdefault(router, []).append(sid)
    for router, sids in by_router.items():
        try:
            ray.get(router.settle_streams.remote(sids), timeout=10)
        except Exception:
            pass  # the service (or Ray) is gone, and the streams with it


def hold_sleep(router: Any, holder: str, lease_s: float) -> None:
    """Renew client `holder`'s sleep lease with `router` from this process until release_sleep(holder)."""
    _keeper.hold_sleep(router, holder, lease_s)


def release_sleep(holder: str) -> None:
    _keeper.release_sleep(holder)


# Filled by finalizers, which may run in any thread at any allocation: deque.append takes no lock.
_pending: deque[tuple[Any, str]] = deque()
_sending = threading.Lock()
# Streams read whole whose last read handed out payloads, all fetched: the thread tells their routers in one call
# each per tick (a read of its own for each stream would cost the router as much as the stream's submit).
_settled: deque[tuple[Any, str]] = deque()


class _Keeper:
    """One daemon thread per process, running while streams are open, sleep leases held or closes queued."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: weakref.WeakSet[ResultStream] = weakref.WeakSet()
        self._sleeps: dict[str, tuple[Any, float]] = {}  # holder -> (router, lease_s)
        self._thread: threading.Thread | None = None

    def add(self, stream: ResultStream) -> None:
        with self._lock:
            self._open.add(stream)
            self._start()

    def hold_sleep(self, router: Any, holder: str, lease_s: float) -> None:
        """Renew `holder`'s sleep lease with `router` until release_sleep(holder)."""
        with self._lock:
            self._sleeps[holder] = (router, float(lease_s))
            self._start()

    def release_sleep(self, holder: str) -> None:
        with self._lock:
            self._sleeps.pop(holder, None)

    def settle(self, router: Any, sid: str) -> None:
        with self._lock:
            _settled.append((router, sid))
            self._start()

    def _start(self) -> None:  # (with the lock held)
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="rollout-stream-leases", daemon=True)
            self._thread.start()

    def streams(self) -> list[ResultStream]:
        with self._lock:
            return [s for s in self._open if s.open]

    def _run(self) -> None:
        renewed = 0.0
        while True:
            send_closes()
            send_settles()
            with self._lock:  # (strong references to streams only for as long as the lock is held)
                leases = [(s.router, s.sid, s.lease_s) for s in self._open if s.open]
                sleeps = [(router, holder, lease_s) for holder, (router, lease_s) in self._sleeps.items()]
                if not _pending and not _settled and not leases and not sleeps:
                    self._thread = None
                    return
            # each lease is renewed 4 times per its length: a late renewal or two costs nothing
            if (leases or sleeps) and time.monotonic() - renewed >= min(x[2] for x in leases + sleeps) / 4:
                renewed = time.monotonic()
                self._renew(leases, sleeps)
            del leases
            time.sleep(_TICK_S)

    @staticmethod
    def _renew(leases: list[tuple[Any, str, float]], sleeps: list[tuple[Any, str, float]]) -> None:
        by_router: dict[Any, list[str]] = {}
        for router, sid, _ in leases:
            by_router.setdefault(router, []).append(sid)
        calls = [router.renew_streams.remote(sids) for router, sids in by_router.items()]
        calls += [router.renew_sleep.remote(holder) for router, holder, _ in sleeps]
        for call in calls:
            try:
                ray.get(call, timeout=10)
            except Exception:
                pass  # a dead or busy router (or Ray shut down): the next round tries again


_keeper = _Keeper()
