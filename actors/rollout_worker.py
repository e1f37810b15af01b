"""RolloutWorker: a Ray actor around one EngineHost (rollout_service/host.py: the engine and its stepping thread).

The actor is threaded (max_concurrency > 1): while the host's thread steps, other calls (submit, poll, abort,
weights, pause, stats) are served, each landing between two engine steps. Finished results wait in an outbox
that the router drains with `poll` (a long poll: it returns as soon as something finished, or as soon as user
code starts or ends: actors/quarantine.py), with the new tokens of requests that stream them (TokenDelta). A
result whose request names a reward function (or the service's default one) gets its reward first, in this
process's reward threads or in the service's reward actors (actors/reward_pool.py). `stats` and `health` do not wait for a step.

An engine that fails to build does not fail the constructor: that would make Ray print the traceback and a
crash dump of every attempt and restart the actor into the same failure. The actor stays up, does nothing,
and reports the one-line reason in `health()`; the router stops the service (at start) or gives the worker up
(after a restart).
"""
from __future__ import annotations

import os
import threading
import time
import uuid
from typing import TYPE_CHECKING, Any, Callable

import ray

from actors.quarantine import UserCodeWatch, announce_exits
from rollout_service.connections.remote_errors import error_text
from actors.reward_pool import RewardPool
from rollout_service.results.payloads import Header, pack
from rollout_service.api.deltas import TokenDelta
from rollout_service.api.types import RolloutRequest, RolloutResult

if TYPE_CHECKING:
    from rollout_service.weights.manifest import GroupSpec


class RolloutWorker:
    def __init__(self, engine_config: dict, worker_index: int = 0, model_source: Any = None,
                 reward: str | None = None, reward_actors: list | None = None,
                 engine_factory: Callable[[dict], Any] | None = None):
        """`engine_factory(engine_config)`: builds the engine instead of Engine(...); for the control-plane
        benchmark's fabricating engine only (benchmarks/harness/fabricated.py), which no config can name."""
        # The engine side (torch, the engine, the weight receiver) is imported here, in the worker's process: the
        # router imports this module to start workers and must not pay for torch (~1.5 s of CPU, ~180 MB).
        from transformers.utils import logging as hf_logging

        from rollout_service.host import EngineHost
        from rollout_service.weights.receiver import WeightReceiver

        hf_logging.disable_progress_bar()  # N workers' load bars would interleave in the driver's log
        self.worker_index = worker_index
        # A restarted actor gets a new incarnation: the router uses it to tell that the engine is empty.
        self.incarnation = uuid.uuid4().hex
        self.startup_error: str | None = None
        try:
            engine = (engine_factory(dict(engine_config)) if engine_factory is not None
                      else _build_engine(engine_config, model_source))
        except Exception as e:
            self.startup_error = " ".join(error_text(e).split())
            return
        self.receiver = WeightReceiver(engine.device)
        self.last_refresh: dict[str, float] = {}  # seconds of each phase of the last refresh, for stats()
        self._cv = threading.Condition()          # guards the outbox; poll waits on it
        self._outbox: list[RolloutResult] = []
        self._deltas: list[TokenDelta] = []     # new tokens of requests with stream_tokens, polled with the outbox
        self._groups: dict[str, list] = {}     # job id -> [its delivery group, samples still to come]
        self._last_batch = 0.0                 # when poll last returned results
        self._stop = False
        # user code (rewards in this process, environments) is announced to the router before it runs
        self._watch = UserCodeWatch(self._cv)
        announce_exits(self._watch)
        rewards = ({"reward_start": RewardPool(reward_actors).start, "reward_parts": len(reward_actors)}
                   if reward_actors else {})  # one batch of results per reward actor at a time
        self.host = EngineHost(engine, self._deliver, reward, guard=self._watch.running,
                               name=f"engine-{worker_index}", on_deltas=self._deliver_deltas, **rewards)
        self.engine = engine

    def _deliver(self, results: list[RolloutResult]) -> None:
        with self._cv:
            self._outbox.extend(results)
            self._cv.notify_all()

    def _deliver_deltas(self, deltas: list[TokenDelta]) -> None:
        with self._cv:
            self._deltas.extend(deltas)
            self._cv.notify_all()

    # -- requests ---------------------------------------------------------------------------------
    def submit(self, requests: list[RolloutRequest], atomic: bool = True,
               groups: list[str] | None = None) -> list[str | None]:
        """Queue requests, all or none when `atomic` (a client's batch), else each one that passes (a
        resubmission: one bad request must not hold back the others). `groups`: each request's delivery group
        (its results are packed with the group's in poll's payload). One error message (or None) per request."""
        if groups is not None:
            with self._cv:  # before the host can finish one
                self._groups.update((r.request_id, [g, r.sampling.n]) for r, g in zip(requests, groups))
        errors = self.host.submit(requests, atomic)
        if groups is not None:
            with self._cv:
                for r, err in zip(requests, errors):
                    if err is not None:
                        self._groups.pop(r.request_id, None)
        return errors

    @ray.method(num_returns=2)
    def poll(self, timeout: float = 1.0, confirmed: tuple[str | None, int] | None = None, batch_s: float = 0.0
             ) -> tuple[tuple[str, list[Header], dict, list[TokenDelta]], dict]:
        """Wait up to `timeout` s for finished results (or token deltas), or for user code to start or end;
        returns ((incarnation, the results' headers, the user code running: actors/quarantine.py, the token
        deltas), the results' payload) and clears them. Results found less than `batch_s` after the last ones
        returned wait out the rest of it, with others joining them, unless the engine has nothing else to
        finish. `confirmed`: (incarnation, change) of the last user-code report the router has read."""
        deadline = time.monotonic() + timeout
        with self._cv:
            if confirmed is not None and confirmed[0] == self.incarnation:
                self._watch.confirm(confirmed[1])
            while not self._stop and not self._watch.unreported:
                now = time.monotonic()
                if not self._outbox and not self._deltas:
                    left = deadline - now
                else:  # a lone result (nothing else running) goes at once
                    left = self._last_batch + batch_s - now if self.host.busy else 0
                if left <= 0:
                    break
                self._cv.wait(left)
            out, self._outbox = self._outbox, []
            deltas, self._deltas = self._deltas, []
            report = self._watch.report()
            if out or deltas:
                self._last_batch = time.monotonic()
            results = [r for r in out if isinstance(r, RolloutResult)]
            groups = {r.request_id: self._group_of(r.request_id) for r in results}
        headers, payload = pack(results, groups.get)  # (pickling outside the lock: the engine thread delivers)
        if len(results) < len(out):  # (nothing of ours puts them there; the others must still go out)
            print(f"[rollout_service.worker {self.worker_index}] dropped {len(out) - len(results)} thing(s) in the "
                  "outbox that are not results", flush=True)
        if not self.host.alive:  # the router restarts the worker; the requests it held go to the others
            raise RuntimeError(f"worker {self.worker_index} engine loop failed: {self.host.error or 'it ended'}")
        return (self.incarnation, headers, report, deltas), payload

    def _group_of(self, job_id: str) -> str | None:
        """The job's delivery group, forgotten with its last sample. (with self._cv held)"""
        entry = self._groups.get(job_id)
        if entry is None:
            return None
        entry[1] -= 1
        if entry[1] <= 0:
            del self._groups[job_id]
        return entry[0]

    def abort(self, request_ids: list[str]) -> list[RolloutResult]:
        """Abort now; the partial results are returned here (not through poll), with those that finished just
        before the abort."""
        results = self.host.abort(request_ids)
        ids = set(request_ids)
        with self._cv:
            done = [r for r in self._outbox if r.request_id in ids]
            self._outbox = [r for r in self._outbox if r.request_id not in ids]
            for rid in ids:
                self._groups.pop(rid, None)
        return done + results

    # -- weights (the learner's side is RolloutClient.update_weights; the protocol is actors/refresh.py) --
    def weights_prepare(self, payload: dict, partial: bool = False) -> None:
        """Check the refresh's manifest against the model and get its transport ready; nothing changes yet.
        ValueError naming what is wrong."""
        t0 = time.perf_counter()
        self.engine.validate_manifest(payload["manifest"], partial)
        readable = payload.get("delta") is not None and not self.engine.is_sleeping  # a delta decodes against it
        self.receiver.prepare(payload, self.engine.policy_version, self.engine.model if readable else None)
        self.last_refresh = {"transport": payload["transport"], "prepare_s": time.perf_counter() - t0}

    def weights_receive(self, payload: dict) -> None:
        """Broadcast: take the bytes into staging while the engine keeps generating."""
        t0 = time.perf_counter()
        self.receiver.receive(payload)
        self.last_refresh["receive_s"] = time.perf_counter() - t0

    def weights_apply(self, payload: dict, version: int, partial: bool = False) -> int:
        """Swap between two steps; returns the new policy version. A worker that already runs `version` (a
        re-sent refresh) keeps its weights."""
        t0 = time.perf_counter()
        with self.host.at_step_boundary() as engine:
            t1 = time.perf_counter()
            if version != engine.policy_version:
                # finite values were checked on the learner, before anything was sent (a delta's again, on prepare)
                if payload.get("delta") is not None:
                    engine.patch_weights(self.receiver.writes(payload), payload["manifest"].entries,
                                         payload["delta"].base_version, version)
                else:
                    engine.update_weights(self.receiver.views(payload), version, partial, check_finite=False)
            self.receiver.discard()
            self.last_refresh.update(lock_wait_s=t1 - t0, apply_s=time.perf_counter() - t1)
            return engine.policy_version

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

    # -- sleep, pause, stats ----------------------------------------------------------------------
    def sleep(self, level: int = 1) -> dict:
        self.host.sleep(level)
        return self.stats()

    def wake_up(self) -> dict:
        self.host.wake_up()
        return self.stats()

    def pause(self) -> None:
        self.host.pause()

    def resume(self) -> None:
        self.host.resume()

    def stats(self) -> dict:
        s = self.host.stats()
        with self._cv:
            s.update(worker=self.worker_index, incarnation=self.incarnation, outbox=len(self._outbox),
                     last_refresh={k: round(v, 4) if isinstance(v, float) else v for k, v in self.last_refresh.items()},
                     pid=os.getpid(), node_id=ray.get_runtime_context().get_node_id())
        return s

    def health(self) -> dict:
        """Cheap liveness check that does not wait for the engine. `startup_error`: why the engine could not be
        built (nothing else is then reported); `error`: why the engine loop stopped."""
        h = {"worker": self.worker_index, "incarnation": self.incarnation, "startup_error": self.startup_error,
             "node_id": ray.get_runtime_context().get_node_id(), "pid": os.getpid()}
        if self.startup_error is not None:
            return h
        from rollout_service.weights.cuda_ipc import visible_gpus
        return {**h, "alive": self.host.alive, "error": self.host.error, "device": str(self.engine.device),
                "gpus": visible_gpus(), **_weights_kind(self.engine),
                "policy_version": self.engine.policy_version, "weight_group": self.receiver.group_id()}

    def shutdown(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        self._watch.close()
        self.host.close()
        self.receiver.leave()


def _weights_kind(engine: Any) -> dict:
    """The dtype the engine holds its weights in and its quantization: what a learner casts a delta push to (or
    why it sends dense). None for an engine with no model (the control-plane benchmark's)."""
    from rollout_service.model.weight_update import model_dtype
    model = getattr(engine, "model", None)
    return {"weights_dtype": model_dtype(model) if model is not None else None,
            "quantization": getattr(getattr(engine, "config", None), "quantization", None)}


def _build_engine(engine_config: dict, model_source: Any) -> Any:
    from rollout_service.config import EngineConfig
    from rollout_service.engine.engine import Engine
    return Engine(EngineConfig.from_dict(dict(engine_config)), model_source=model_source)


RolloutWorkerActor = ray.remote(RolloutWorker)
