"""EngineHost: one engine and the thread that steps it, the one driver of an engine. The in-process connection
(connections/local.py) and the Ray rollout worker (actors/rollout_worker.py) both run their engine through one.

One lock guards the engine, so every call (submit, abort, a weight swap, sleep) lands between two steps. The
stepping thread runs while there is work and the host is neither paused nor asleep. Finished results go to
`on_results` once their rewards are computed, off the stepping thread (rollout_service/rewards/runner.py). `stats`
reads without the lock, so it answers at once even in the middle of a long step.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Iterator

from rollout_service.ops import omp_pool
from rollout_service.rewards.runner import REWARD_THREADS, RewardBook, RewardRunner, Starter
from rollout_service.api.deltas import TokenDelta
from rollout_service.api.types import RolloutRequest, RolloutResult
from rollout_service.user_code import Guard, describe_error, unguarded

OnResults = Callable[[list[RolloutResult]], None]
OnDeltas = Callable[[list[TokenDelta]], None]


class EngineHost:
    def __init__(self, engine: Any, on_results: OnResults, reward: str | None = None,
                 reward_start: Starter | None = None, reward_parts: int = REWARD_THREADS,
                 guard: Guard = unguarded, name: str = "engine", on_deltas: OnDeltas | None = None):
        """`reward`: the default reward function for requests that name none; `reward_start`/`reward_parts`:
        where rewards are computed (default: this process's threads); `guard`: how user code (rewards in
        this process, environments) is entered (actors/quarantine.py); `on_deltas`: where the new tokens of
        requests with stream_tokens go after each step (on the stepping thread; None drops them)."""
        self.engine = engine
        engine.user_code = guard
        self._on_results = on_results
        self._on_deltas = on_deltas
        self._lock = threading.Lock()      # guards the engine
        self._cv = threading.Condition()   # guards paused/stop/wakeups and wakes the loop
        self._paused = False
        self._stop = False
        self._wakeups = 0
        self.steps = 0
        self.error: str | None = None      # why the stepping thread ended, if it failed
        self._reward_of = RewardBook(reward)
        self._rewards = RewardRunner(on_results, reward_start, reward_parts, guard)
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()
        omp_pool.release()  # the caller built the engine; from now on the stepping thread runs it

    @property
    def reward(self) -> str | None:
        return self._reward_of.default

    @property
    def alive(self) -> bool:
        """The stepping thread runs (or was stopped by close()); False once it has failed."""
        return self.error is None and (self._stop or self._thread.is_alive())

    @property
    def busy(self) -> bool:
        """The engine holds unfinished requests: more results are coming. Read without the engine's lock (held
        for a whole step): a glance at its queues, which may be a step old."""
        return self.engine.has_unfinished()

    # -- the stepping thread ----------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cv:
                if self._stop:
                    return
                paused, wakeups = self._paused, self._wakeups
            if paused or self.engine.is_sleeping or not self._has_work():
                omp_pool.release()  # idle: another thread may run torch meanwhile (ops/omp_pool.py)
                with self._cv:  # sleep until submit/resume/wake/close (unless one came in meanwhile)
                    if self._wakeups == wakeups and not self._stop:
                        self._cv.wait(1.0)
                continue
            try:
                with self._lock:
                    if self.engine.is_sleeping:  # sleep() landed since the check above
                        continue
                    finished = self.engine.step()
                    deltas = self.engine.token_deltas() if self._on_deltas else []
                    self.steps += 1
            except BaseException as e:  # an engine bug must be visible, not a silent hang
                self.error = f"{type(e).__name__}: {e}"
                raise
            if deltas:  # (before the step's results: a sample's last delta precedes its result)
                self._on_deltas(deltas)
            if finished:
                done = self._rewards.finished(finished, self._reward_of)
                if done:
                    self._on_results(done)

    def _has_work(self) -> bool:
        with self._lock:
            return self.engine.has_unfinished()

    def _wake(self) -> None:
        with self._cv:
            self._wakeups += 1
            self._cv.notify_all()

    # -- requests ---------------------------------------------------------------------------------
    def submit(self, requests: list[RolloutRequest], atomic: bool = True) -> list[str | None]:
        """Validate and tokenize every request, then queue them: all or none when `atomic`, else each one that
        passed. Whatever a request raises is its error, never the call's: one message (or None) per request."""
        errors: list[str | None] = [None] * len(requests)
        prepared: list[Any] = [None] * len(requests)
        names: list[str | None] = [None] * len(requests)
        with self._lock:
            for i, req in enumerate(requests):
                try:
                    names[i] = self._reward_of.name_for(req)
                    prepared[i] = self.engine.prepare(req)
                except Exception as e:
                    errors[i] = _text(e)
            if atomic and any(errors):
                return errors
            for i, (req, seq) in enumerate(zip(requests, prepared)):
                if seq is None:
                    continue
                try:
                    self._reward_of.add(req.request_id, names[i], seq.sampling.n)  # before a step can finish it
                    self.engine.add_request(req, seq)
                except Exception as e:
                    errors[i] = _text(e)
        self._wake()
        return errors

    def abort(self, request_ids: list[str]) -> list[RolloutResult]:
        """Finish these requests now; their results ("abort", tokens so far), and those of theirs that had
        finished but whose reward was still being computed (marked so), come back here, not to on_results."""
        with self._lock:
            results = self.engine.abort(list(request_ids))
        for r in results:
            self._reward_of.take(r)  # (an aborted sample gets no reward; this counts it as out)
        return results + self._rewards.cancel(request_ids)

    # -- engine state -----------------------------------------------------------------------------
    @contextlib.contextmanager
    def at_step_boundary(self) -> Iterator[Any]:
        """The engine, held between two steps for the caller's changes (a weight swap)."""
        with self._on_caller():
            yield self.engine

    @contextlib.contextmanager
    def _on_caller(self) -> Iterator[None]:
        """Engine work on the calling thread, between two steps; the caller's OpenMP workers are freed after,
        so that they do not slow the stepping thread's parallel ops (ops/omp_pool.py)."""
        try:
            with self._lock:
                yield
        finally:
            omp_pool.release()

    def update_weights(self, named_tensors: Any, version: int, partial: bool = False,
                       check_finite: bool = True) -> None:
        with self._on_caller():
            self.engine.update_weights(named_tensors, version, partial, check_finite)

    def sleep(self, level: int = 1) -> None:
        with self._on_caller():
            self.engine.sleep(level)

    def wake_up(self) -> None:
        with self._on_caller():
            self.engine.wake_up()
        self._wake()

    def pause(self) -> None:
        """Returns once the step under way has finished: nothing runs after pause() until resume()."""
        with self._cv:
            self._paused = True
        with self._lock:
            pass

    def resume(self) -> None:
        with self._cv:
            self._paused = False
        self._wake()

    @property
    def paused(self) -> bool:
        return self._paused

    def stats(self) -> dict:
        """The engine's counters, read without the engine lock (mid-step they may be a step apart)."""
        return {**self.engine.stats(), "paused": self._paused, "rewards_pending": self._rewards.pending,
                "steps": self.steps}

    def close(self) -> None:
        with self._cv:
            self._stop = True
        self._wake()
        self._thread.join(timeout=10)
        self._rewards.close()


def _text(e: BaseException) -> str:
    return str(e) if isinstance(e, ValueError) else describe_error(e)
