"""RolloutWorker: a Ray actor that owns one Engine and steps it in a background thread.

The actor is threaded (max_concurrency > 1): while the engine thread steps, other calls (submit, poll,
abort, update_weights, pause, stats) are served. One lock guards the engine, so every engine call
happens between two steps — that is the step boundary at which a weight refresh is applied.
Finished results wait in an outbox that the router drains with `poll` (a long poll: it returns as soon
as something finished, so results stream back as they finish). A result whose request names a reward
function (or the service's default one) gets its reward first, off the engine thread: in this process's
reward threads, or in the service's reward actors (actors/reward_pool.py). `stats` and `health` read
without the lock, so they answer at once even in the middle of a long step.

An engine that fails to build does not fail the constructor: that would make Ray print the traceback and
a crash dump of every attempt and restart the actor into the same failure. The actor stays up, does
nothing, and reports the one-line reason in `health()`; the router stops the service (at start) or gives
the worker up (after a restart).
"""
from __future__ import annotations

import os
import threading
import time
import uuid
from typing import Any

import ray

from actors.quarantine import UserCodeWatch, announce_exits
from actors.remote_errors import error_text
from actors.reward_pool import RewardPool
from rollout_service.rewards import RewardBook, RewardRunner
from rollout_service.types import RolloutRequest, RolloutResult
from rollout_service.weights.group import GroupSpec
from rollout_service.weights.receiver import WeightReceiver


class RolloutWorker:
    def __init__(self, engine_config: dict, worker_index: int = 0, model_source: Any = None,
                 reward: str | None = None, reward_actors: list | None = None):
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # N workers' load bars would interleave in the driver's log
        self.worker_index = worker_index
        # A restarted actor gets a new incarnation: the router uses it to tell that the engine is empty.
        self.incarnation = uuid.uuid4().hex
        self.startup_error: str | None = None
        try:
            from rollout_service.config import EngineConfig
            from rollout_service.engine.engine import Engine
            self.engine = Engine(EngineConfig.from_dict(dict(engine_config)), model_source=model_source)
        except Exception as e:
            self.startup_error = " ".join(error_text(e).split())
            return
        self.receiver = WeightReceiver(self.engine.device)
        self.last_refresh: dict[str, float] = {}  # seconds of each phase of the last refresh, for stats()
        self._lock = threading.Lock()            # guards self.engine
        self._cv = threading.Condition()         # guards outbox/paused/stop and wakes the loop
        self._outbox: list[RolloutResult] = []
        self._paused = False
        self._stop = False
        self._steps = 0
        self._wakeups = 0
        self._error: str | None = None
        # user code (rewards in this process, environments) is announced to the router before it runs
        self._watch = UserCodeWatch(self._cv)
        self.engine.user_code = self._watch.running
        announce_exits(self._watch)
        self._reward_of = RewardBook(reward)  # the service's default reward applies where a request names none
        if reward_actors:  # one batch of results per reward actor at a time
            self._rewards = RewardRunner(self._deliver, RewardPool(reward_actors).start, len(reward_actors))
        else:
            self._rewards = RewardRunner(self._deliver, guard=self._watch.running)
        self._thread = threading.Thread(target=self._loop, name=f"engine-{worker_index}", daemon=True)
        self._thread.start()

    # -- engine loop ------------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cv:
                if self._stop:
                    return
                paused, wakeups = self._paused, self._wakeups
            if paused or self.engine.is_sleeping or not self._has_work():
                with self._cv:  # sleep until submit/resume/shutdown (unless one came in meanwhile)
                    if self._wakeups == wakeups and not self._stop:
                        self._cv.wait(1.0)
                continue
            try:
                with self._lock:
                    if self.engine.is_sleeping:  # sleep() landed since the check above
                        continue
                    finished = self.engine.step()
                    self._steps += 1
            except BaseException as e:  # an engine bug must be visible, not a silent hang
                self._error = f"{type(e).__name__}: {e}"
                raise
            if finished:
                self._finished(finished)

    def _wake(self) -> None:
        with self._cv:
            self._wakeups += 1
            self._cv.notify_all()

    def _has_work(self) -> bool:
        with self._lock:
            return self.engine.has_unfinished()

    def _finished(self, results: list[RolloutResult]) -> None:
        """To the outbox, once their rewards are computed (off this thread)."""
        done = self._rewards.finished(results, self._reward_of)
        if done:
            self._deliver(done)

    def _deliver(self, results: list[RolloutResult]) -> None:
        with self._cv:
            self._outbox.extend(results)
            self._cv.notify_all()

    # -- requests ---------------------------------------------------------------------------------
    def submit(self, requests: list[RolloutRequest], atomic: bool = True) -> list[str | None]:
        """Validate and tokenize every request, then queue them: all or none when `atomic` (a client's
        batch), else each one that passed (a resubmission: one bad request must not hold back the others).
        Whatever a request raises is its error, never the call's. Returns one error message (or None) per
        request."""
        errors: list[str | None] = [None] * len(requests)
        with self._lock:
            seqs: list = [None] * len(requests)
            names: list = [None] * len(requests)
            for i, req in enumerate(requests):
                try:
                    names[i] = self._reward_of.name_for(req)
                    seqs[i] = self.engine.prepare(req)
                except Exception as e:
                    errors[i] = error_text(e)
            if atomic and any(errors):
                return errors
            for i, (req, seq) in enumerate(zip(requests, seqs)):
                if seq is not None:
                    try:
                        self.engine.add_request(req, seq)
                        self._reward_of.add(req.request_id, names[i], seq.sampling.n)
                    except Exception as e:
                        errors[i] = error_text(e)
        self._wake()
        return errors

    def poll(self, timeout: float = 1.0, confirmed: tuple[str | None, int] | None = None
             ) -> tuple[str, list[RolloutResult], dict]:
        """Wait up to `timeout` s for finished results, or for user code to start or end; returns
        (incarnation, results, the user code running: actors/quarantine.py) and clears the results.
        `confirmed`: (incarnation, change) of the last user-code report the router has read."""
        deadline = time.monotonic() + timeout
        with self._cv:
            if confirmed is not None and confirmed[0] == self.incarnation:
                self._watch.confirm(confirmed[1])
            while not self._outbox and not self._stop and not self._watch.unreported:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cv.wait(left)
            out, self._outbox = self._outbox, []
            report = self._watch.report()
        if self._error is not None or not (self._stop or self._thread.is_alive()):
            # the router restarts the worker; the requests it held go to the others
            raise RuntimeError(f"worker {self.worker_index} engine loop failed: {self._error or 'it ended'}")
        return self.incarnation, out, report

    def abort(self, request_ids: list[str]) -> list[RolloutResult]:
        """Abort now; the partial results are returned here (not through poll)."""
        with self._lock:
            results = self.engine.abort(list(request_ids))
        for r in results:
            self._reward_of.take(r)  # (an aborted sample gets no reward; this counts it as out)
        ids = set(request_ids)
        waiting = self._rewards.cancel(ids)  # finished, their reward not computed yet: marked as such
        with self._cv:  # results that finished just before the abort are not lost: return them too
            done = [r for r in self._outbox if r.request_id in ids]
            self._outbox = [r for r in self._outbox if r.request_id not in ids]
        return done + waiting + list(results)

    # -- weights (the learner's side is RolloutClient.update_weights; the protocol is actors/refresh.py) --
    def weights_prepare(self, payload: dict, partial: bool = False) -> None:
        """Check the refresh's manifest against the model and get its transport ready; nothing changes
        yet. ValueError naming what is wrong."""
        t0 = time.perf_counter()
        self.engine.validate_manifest(payload["manifest"], partial)
        self.receiver.prepare(payload)
        self.last_refresh = {"transport": payload["transport"], "prepare_s": time.perf_counter() - t0}

    def weights_receive(self, payload: dict) -> None:
        """Broadcast: take the bytes into staging while the engine keeps generating."""
        t0 = time.perf_counter()
        self.receiver.receive(payload)
        self.last_refresh["receive_s"] = time.perf_counter() - t0

    def weights_apply(self, payload: dict, version: int, partial: bool = False) -> int:
        """Swap between two steps (the engine lock); returns the new policy version. A worker that already
        runs `version` (a re-sent refresh) keeps its weights."""
        t0 = time.perf_counter()
        with self._lock:
            t1 = time.perf_counter()
            if version != self.engine.policy_version:
                # finite values were checked on the learner, before anything was sent
                self.engine.update_weights(self.receiver.views(payload), version, partial, check_finite=False)
            self.receiver.discard()
            self.last_refresh.update(lock_wait_s=t1 - t0, apply_s=time.perf_counter() - t1)
            return self.engine.policy_version

    def weights_digest(self) -> str:
        return self.engine.weights_digest()

    def weights_discard(self) -> None:
        self.receiver.discard()

    def join_weight_group(self, spec: GroupSpec, rank: int) -> None:
        self.receiver.join(spec, rank)

    def leave_weight_group(self) -> None:
        self.receiver.leave()

    def release_weight_buffers(self) -> None:
        self.receiver.release()

    # -- sleep / wake -----------------------------------------------------------------------------
    def sleep(self, level: int = 1) -> dict:
        with self._lock:
            self.engine.sleep(level)
        return self.stats()

    def wake_up(self) -> dict:
        with self._lock:
            self.engine.wake_up()
        self._wake()
        return self.stats()

    # -- control ----------------------------------------------------------------------------------
    def pause(self) -> None:
        with self._cv:
            self._paused = True
        with self._lock:  # returns once the current step has finished: nothing runs after pause()
            pass

    def resume(self) -> None:
        with self._cv:
            self._paused = False
        self._wake()

    def stats(self) -> dict:
        """The engine's counters, read without the engine lock (mid-step they may be a step apart from each
        other), so that a long step does not hold this up."""
        s = dict(self.engine.stats())
        with self._cv:
            s.update(worker=self.worker_index, incarnation=self.incarnation, paused=self._paused,
                     last_refresh={k: round(v, 4) if isinstance(v, float) else v for k, v in self.last_refresh.items()},
                     outbox=len(self._outbox), rewards_pending=self._rewards.pending, steps=self._steps,
                     pid=os.getpid(),
                     node_id=ray.get_runtime_context().get_node_id())
        return s

    def health(self) -> dict:
        """Cheap liveness check that does not wait for the engine lock. `startup_error`: why the engine
        could not be built (nothing else is then reported); `error`: why the engine loop stopped."""
        h = {"worker": self.worker_index, "incarnation": self.incarnation, "startup_error": self.startup_error,
             "node_id": ray.get_runtime_context().get_node_id(), "pid": os.getpid()}
        if self.startup_error is not None:
            return h
        return {**h, "alive": self._thread.is_alive(), "error": self._error, "device": str(self.engine.device),
                "policy_version": self.engine.policy_version, "weight_group": self.receiver.group_id()}

    def shutdown(self) -> None:
        with self._cv:
            self._stop = True
        self._wake()
        self._watch.close()
        self._thread.join(timeout=10)
        self._rewards.close()
        self.receiver.leave()


RolloutWorkerActor = ray.remote(RolloutWorker)
