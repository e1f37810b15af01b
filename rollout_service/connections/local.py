"""LocalConnection: the Connection (connections/__init__.py) of an in-process engine, run by an EngineHost in this process.

Each submission is a stream that reads its requests' results as the host finishes them; a stream dropped unread
stops collecting (its results are discarded). pause() holds the engine at the next step boundary until
resume(); a submission made while paused or asleep fails at once instead of waiting (nobody else could wake an
in-process engine). close() ends the streams other threads are reading, with an error saying so.
"""
from __future__ import annotations

import threading
import weakref
from collections import defaultdict, deque
from typing import Any, Iterator

from rollout_service.fidelity import FidelityLog
from rollout_service.host import EngineHost
from rollout_service.ops import omp_pool
from rollout_service.api.deltas import TokenDelta
from rollout_service.api.types import RolloutRequest, RolloutResult
from rollout_service.weights.delta_sender import check_delta, delta_refusal

WAIT_S = 0.05  # a stream's reader looks at the host this often while it waits (to see close() or a failure)


class LocalConnection:
    def __init__(self, engine: Any, reward: str | None = None):
        self.host = EngineHost(engine, self._post, reward, name="engine", on_deltas=self._post)
        self.engine = engine
        self.fidelity = FidelityLog()
        self._closed = False
        self._cv = threading.Condition()  # guards _done and _open; notified when results arrive
        self._done: dict[str, list[RolloutResult | TokenDelta]] = defaultdict(list)  # not yet read by their stream
        self._open: dict[str, object] = {}  # request id -> the stream (a token) that reads its results
        self._forgotten: deque[tuple[list[str], object]] = deque()  # streams gone (filled by finalizers)

    @property
    def reward(self) -> str | None:
        return self.host.reward

    # -- requests ---------------------------------------------------------------------------------
    def submit(self, requests: list[RolloutRequest], read_now: bool = False
               ) -> Iterator[RolloutResult | TokenDelta]:
        # (read_now: results reach an in-process stream without a call of their own: nothing to save)
        if self.host.paused:
            raise RuntimeError("the rollout client is paused: call resume() first")
        if self.engine.is_sleeping:
            raise RuntimeError(f"the engine is asleep (sleep level {self.engine.sleep_level}): call wake_up() first")
        ids = [r.request_id for r in requests]
        if len(set(ids)) != len(ids):
            raise ValueError("duplicate request_id in one call")
        token = object()
        with self._cv:  # open before queuing: a result may come back before submit returns
            self._open.update((rid, token) for rid in ids)
        errors = self.host.submit(requests, atomic=True)
        if any(errors):
            with self._cv:
                for rid in ids:
                    self._open.pop(rid, None)
            raise ValueError(next(e for e in errors if e))
        stream = self._read(set(ids), sum(r.sampling.n for r in requests))
        # a stream gone (read or dropped) stops collecting results (deque.append: finalizers may run anywhere)
        weakref.finalize(stream, self._forgotten.append, (ids, token))
        return stream

    def _read(self, ids: set[str], remaining: int) -> Iterator[RolloutResult | TokenDelta]:
        while remaining:
            with self._cv:
                got = [res for rid in ids & self._done.keys() for res in self._done.pop(rid)]
                if not got:
                    self._check_open(remaining)
                    omp_pool.release()  # this thread waits: the engine's thread gets the CPUs (ops/omp_pool.py)
                    self._cv.wait(WAIT_S)
            for res in got:
                remaining -= isinstance(res, RolloutResult)  # (a TokenDelta is a preview of one)
                yield res

    def _check_open(self, remaining: int) -> None:
        if self._closed:
            raise RuntimeError(f"the rollout client was closed while this stream was read: {remaining} of its "
                               "results never came")
        if not self.host.alive:
            raise RuntimeError(f"the engine failed ({self.host.error}): {remaining} results never came")

    def _post(self, results: list[RolloutResult] | list[TokenDelta]) -> None:
        """Hand results (or token deltas) to the streams that read them (those nobody reads any more are
        dropped)."""
        with self._cv:
            while self._forgotten:
                ids, token = self._forgotten.popleft()
                for rid in ids:
                    if self._open.get(rid) is token:  # (not a later request that reuses the id)
                        del self._open[rid]
                        self._done.pop(rid, None)
            for r in results:
                if r.request_id in self._open:
                    self._done[r.request_id].append(r)
            self._cv.notify_all()

    def abort(self, request_ids: list[str]) -> list[RolloutResult]:
        """As over Ray: the "abort" results (and those whose reward was still being computed) are returned and
        also end the requests' streams."""
        results = self.host.abort(request_ids)
        self._post(results)
        return results

    # -- weights ----------------------------------------------------------------------------------
    def update_weights(self, named_tensors: Any, version: int, transport: str = "auto", partial: bool = False,
                       check_finite: bool = True, delta: bool | str = "auto") -> str:
        """The engine is in this process: every transport is an in-place copy, except a broadcast, which needs a
        weight group (there is none in-process). No bytes move, so a delta would save nothing: the weights are
        copied whole, but delta=True is refused where it is over Ray (partial, CUDA IPC, an FP8 engine)."""
        if transport == "broadcast":
            raise ValueError("update_weights: transport 'broadcast' needs a weight group; an in-process engine "
                             "has none (use transport='auto')")
        check_delta(delta)
        why = delta_refusal(transport, partial, getattr(self.engine.config, "quantization", None))
        if delta is True and why is not None:
            raise ValueError(why)
        self.host.update_weights(named_tensors, version, partial, check_finite)
        return "in_process"

    def init_weight_group(self, *args: Any, **kwargs: Any) -> None:
        raise ValueError("init_weight_group: an in-process engine takes weights directly; no group is needed")

    def release_weight_buffers(self) -> None:
        pass  # an in-process refresh keeps no buffers

    def weights_digests(self) -> list[str]:
        return [self.engine.weights_digest()]

    # -- control ----------------------------------------------------------------------------------
    def sleep(self, level: int = 1, fail_if_asleep: bool = False) -> None:
        self.host.sleep(level)

    def wake_up(self) -> None:
        self.host.wake_up()

    def scale(self, num_workers: int, drain_s: float, timeout_s: float | None) -> None:
        raise ValueError("scale: an in-process client has one engine; start a Ray service "
                         "(RolloutClient.launch) to add or remove workers")

    def pause(self) -> None:
        self.host.pause()

    def resume(self) -> None:
        self.host.resume()

    def stats(self) -> list[dict]:
        return [self.host.stats()]

    def info(self) -> dict:
        return {"policy_version": self.engine.policy_version, "num_workers": 1,
                "in_flight": self.engine.num_requests, "colocate": False, "fidelity": self.fidelity.entries(),
                "reward": self.reward, "reward_workers": 0}

    def colocated_options(self, worker: int) -> dict:
        raise ValueError("colocated_options: an in-process engine shares the caller's process already; there is "
                         "no worker bundle to place a learner in")

    def report_fidelity(self, version: int, report: dict) -> None:
        self.fidelity.report(version, report)

    def close(self) -> None:
        """Stop the engine. A stream another thread is reading ends with a RuntimeError saying so, rather than
        looking complete with results missing."""
        self._closed = True
        self.host.close()
        with self._cv:
            self._cv.notify_all()
