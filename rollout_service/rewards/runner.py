"""Rewards computed by the service, where the results are.

A reward function is named by an importable "package.module:function" (rollout_service/rewards/functions.py; a
result carries its request's `metadata`, e.g. the ground truth). The name travels with the request (or is the
service's default) and is resolved once per process. A function that raises, or returns anything but a finite
number, marks that one result (`reward=None`, `reward_error` says why); the others go on.

`RewardRunner` computes rewards off the caller's thread, so that a slow reward function does not hold up
the engine: in a small thread pool, or wherever its `start` sends them (actors/reward_pool.py).
"""
from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Iterable

from rollout_service.rewards.functions import resolve, score_all
from rollout_service.api.types import RolloutResult
from rollout_service.user_code import Guard, unguarded

# start(name, results) -> a Future of one (reward, reward_error) per result
Starter = Callable[[str, list[RolloutResult]], "Future[list[tuple[float | None, str | None]]]"]

REWARD_THREADS = 4  # a worker's (or local client's) reward threads when no reward actors are configured


def wants_reward(result: RolloutResult) -> bool:
    """Rewards are for finished samples: not for aborted or failed ones, nor for a result that carries a
    reward already (an episode's, from its environment)."""
    return result.finish_reason != "abort" and result.error is None and result.reward is None


class RewardBook:
    """Which reward function each request in flight wants, until its n samples have come out."""

    def __init__(self, default: str | None = None):
        self.default = default
        self._lock = threading.Lock()  # (results come out of the engine's thread and of abort's)
        self._names: dict[str, list] = {}  # request id -> [reward name, samples still to come]

    def name_for(self, request) -> str | None:
        """The request's reward name (its own, else the default), resolved here: ValueError if it cannot be."""
        name = request.reward or self.default
        if name is not None:
            resolve(name, f"request {request.request_id!r}: reward")
        return name

    def add(self, request_id: str, name: str | None, n: int) -> None:
        if name is not None:
            with self._lock:
                self._names[request_id] = [name, n]

    def take(self, result: RolloutResult) -> str | None:
        """The reward name for this result (None: no reward to compute); counts the request's samples."""
        with self._lock:
            entry = self._names.get(result.request_id)
            if entry is None:
                return None
            entry[1] -= 1
            if entry[1] <= 0:
                del self._names[result.request_id]
        return entry[0] if wants_reward(result) else None


class RewardRunner:
    """Computes rewards off the caller's thread and hands the results, their rewards set, to `on_ready`
    (from another thread). `start(name, results)` -> Future of one (reward, reward_error) per result;
    default: this process's reward threads, each call entered through `guard`. Results that finish together
    are scored in up to `parts` batches, not one by one: a handful of hand-offs per engine step instead of
    one per result. A result whose request is aborted before its reward is computed comes back from `cancel`
    instead, marked, and never reaches `on_ready`."""

    def __init__(self, on_ready: Callable[[list[RolloutResult]], None], start: Starter | None = None,
                 parts: int = REWARD_THREADS, guard: Guard = unguarded):
        self._on_ready = on_ready
        self._start = start or self._in_thread
        self._parts = parts
        self._guard = guard  # around each reward call in this process's threads
        self._executor: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._pending: dict[tuple[str, int], RolloutResult] = {}

    @property
    def pending(self) -> int:
        return len(self._pending)

    def finished(self, results: list[RolloutResult], book: RewardBook) -> list[RolloutResult]:
        """Send the results that want a reward (per `book`) to be scored; returns the others."""
        ready: list[RolloutResult] = []
        by_name: dict[str, list[RolloutResult]] = {}
        for r in results:
            name = book.take(r)
            if name is None:
                ready.append(r)
            else:
                by_name.setdefault(name, []).append(r)
        for name, rs in by_name.items():
            self.submit(name, rs)
        return ready

    def submit(self, name: str, results: list[RolloutResult]) -> None:
        parts = max(1, min(self._parts, len(results)))
        for i in range(parts):
            batch = results[i::parts]
            keys = [(r.request_id, r.sample_index) for r in batch]
            with self._lock:
                self._pending.update(zip(keys, batch))
            try:
                future = self._start(name, batch)
            except Exception as e:  # e.g. a shut-down pool: the results must still come out
                future = Future()
                future.set_exception(e)
            future.add_done_callback(lambda f, keys=keys: self._done(keys, f))

    def _in_thread(self, name: str, results: list[RolloutResult]) -> Future:
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(self._parts, thread_name_prefix="reward")
        return self._executor.submit(score_all, name, results, self._guard)

    def _done(self, keys: list[tuple[str, int]], future: Future) -> None:
        try:
            scores = list(future.result())
        except BaseException as e:  # (a cancelled future raises CancelledError, a BaseException)
            scores = [(None, f"the reward could not be computed: {type(e).__name__}: {e}")] * len(keys)
        ready = []
        with self._lock:
            for key, (reward, error) in zip(keys, scores):
                result = self._pending.pop(key, None)
                if result is not None:  # (None: cancelled meanwhile, it went back through cancel())
                    result.reward, result.reward_error = reward, error
                    ready.append(result)
        if ready:
            self._on_ready(ready)

    def cancel(self, request_ids: Iterable[str]) -> list[RolloutResult]:
        """Take back the results of these requests still waiting for their reward, marked as such."""
        ids = set(request_ids)
        with self._lock:
            keys = [k for k in self._pending if k[0] in ids]
            out = [self._pending.pop(k) for k in keys]
        for r in out:
            r.reward_error = "aborted before its reward was computed"
        return out

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
