"""RayBackend: the RolloutClient backend that talks to a Ray rollout service (router + workers).

`RolloutClient.launch(config)` starts a service on the current Ray cluster (or a new local Ray
instance) and `RolloutClient.connect(name)` attaches to a running one; both wrap a RayBackend.
"""
from __future__ import annotations

import os
import time
from typing import Any, Iterator

import ray

from rollout_service.config import ServiceConfig
from rollout_service.types import RolloutResult
from rollout_service.weights.push import WeightPusher


def ensure_ray(address: str | None = None, namespace: str | None = None) -> None:
    """Use the Ray this process is connected to; else join `address` / $RAY_ADDRESS (set inside a Ray
    job); else start a new local instance. A cluster merely running on this machine is joined only
    when asked (`address: auto`), so two users' services never land in each other's clusters."""
    if ray.is_initialized():
        return
    address = address or os.environ.get("RAY_ADDRESS") or "local"
    ray.init(address=address, namespace=namespace, log_to_driver=True,
             **({"include_dashboard": False} if address == "local" else {}))


def resolve_auto(config: ServiceConfig) -> ServiceConfig:
    """Turn num_gpus/num_workers 'auto' into numbers using the cluster's resources."""
    gpus = int(ray.cluster_resources().get("GPU", 0))
    if config.resources.num_gpus == "auto":
        config.resources.num_gpus = 1 if gpus else 0
    if config.num_workers == "auto":
        per = config.resources.num_gpus
        config.num_workers = max(1, int(gpus // per)) if per else 1
    return config


class RayBackend:
    """The client backend interface: submit, update_weights, pause, resume, abort, stats, close (plus weight
    groups and sleep/wake)."""

    def __init__(self, router: Any, name: str, owner: bool, namespace: str = "rollout_service"):
        self.router = router
        self.name = name
        self.namespace = namespace
        self._owner = owner  # a launched service is shut down by close(); a connected one is left running
        self.weights = WeightPusher(router)  # this process is the learner side of every refresh

    @classmethod
    def launch(cls, config: str | dict | ServiceConfig | None = None, **overrides: Any) -> "RayBackend":
        from actors.router import RouterActor

        cfg = ServiceConfig.load(config, **overrides)
        ensure_ray(cfg.address, cfg.namespace)
        cfg = resolve_auto(cfg)
        try:
            ray.get_actor(cfg.name, namespace=cfg.namespace)
            raise ValueError(f"a rollout service named {cfg.name!r} already runs in namespace {cfg.namespace!r}: "
                             f"connect to it, close it, or pick another name")
        except ValueError as e:
            if "already runs" in str(e):
                raise
        router = RouterActor.options(name=cfg.name, namespace=cfg.namespace, num_cpus=0, max_restarts=0,
                                     lifetime="detached" if cfg.detached else None).remote(cfg)
        try:
            err = ray.get(router.start.remote())
        except ray.exceptions.RayActorError as e:  # the router process itself died
            cause = getattr(e, "cause", None) or e
            ray.kill(router)
            raise ValueError(f"rollout service {cfg.name!r} failed to start: {_message(cause)}") from None
        if err is not None:
            ray.get(router.shutdown.remote())
            ray.kill(router)
            raise ValueError(f"rollout service {cfg.name!r} failed to start: {err}")
        return cls(router, cfg.name, owner=True, namespace=cfg.namespace)

    @classmethod
    def connect(cls, name: str = "rollout_service", namespace: str = "rollout_service",
                address: str | None = None) -> "RayBackend":
        ensure_ray(address or os.environ.get("RAY_ADDRESS") or "auto", namespace)
        try:
            router = ray.get_actor(name, namespace=namespace)
        except ValueError:
            raise ValueError(f"no rollout service named {name!r} in namespace {namespace!r} on this Ray cluster") from None
        return cls(router, name, owner=False, namespace=namespace)

    # -- the backend interface --------------------------------------------------------------------
    def submit(self, requests: list) -> Iterator[RolloutResult]:
        """Validate and dispatch now (ValueError naming the bad requests); then yield results as they
        finish, each (request_id, sample_index) exactly once. `requests` may hold RolloutRequests,
        request dicts or msgpack-encoded requests."""
        reply = ray.get(self.router.submit.remote(list(requests)))
        if "errors" in reply:
            raise ValueError("; ".join(f"request {i}: {msg}" if i >= 0 else msg for i, msg in reply["errors"]))
        return self._results(reply["stream"])

    def _results(self, sid: str) -> Iterator[RolloutResult]:
        done = False
        try:
            while not done:
                results, done, starved = ray.get(self.router.next_results.remote(sid, 1.0))
                if starved:  # no worker can serve until this learner re-sends its last broadcast
                    self.weights.heal()
                yield from results
        finally:
            if not done:  # the consumer stopped early: free the workers
                try:
                    ray.get(self.router.close_stream.remote(sid))
                except ray.exceptions.RayActorError:
                    pass

    def update_weights(self, named_tensors, version: int, transport: str = "auto", partial: bool = False,
                       check_finite: bool = True) -> str:
        """Validated on every worker before any swaps (rollout_service/weights/push.py)."""
        return self.weights.update_weights(named_tensors, version, transport, partial, check_finite)

    def init_weight_group(self, master_address: str | None = None, backend: str = "auto",
                          timeout_s: float = 300.0) -> None:
        self.weights.init_group(master_address, backend, timeout_s)

    def release_weight_buffers(self) -> None:
        self.weights.release()

    def weights_digests(self) -> list[str | None]:
        return ray.get(self.router.weights_digests.remote())

    def sleep(self, level: int = 1, fail_if_asleep: bool = False) -> None:
        err = ray.get(self.router.sleep.remote(level, fail_if_asleep))
        if err is not None:
            raise ValueError(err)

    def wake_up(self) -> None:
        err = ray.get(self.router.wake_up.remote())
        if err is not None:
            raise ValueError(err)

    def pause(self) -> None:
        ray.get(self.router.pause.remote())

    def resume(self) -> None:
        ray.get(self.router.resume.remote())

    def abort(self, request_ids: list[str]) -> list[RolloutResult]:
        """Abort now; the "abort" results (tokens so far) also end the requests' streams."""
        return ray.get(self.router.abort.remote(list(request_ids)))

    def stats(self) -> list[dict]:
        return ray.get(self.router.stats.remote())

    def info(self) -> dict:
        return ray.get(self.router.info.remote())

    def close(self) -> None:
        if self.router is None:
            return
        self.weights.close()
        if self._owner:
            try:
                ray.get(self.router.shutdown.remote())
            finally:
                ray.kill(self.router)
            _wait_name_released(self.name, self.namespace)
        self.router = None


def _wait_name_released(name: str, namespace: str, timeout: float = 10.0) -> None:
    """ray.kill is asynchronous: wait until the name is free so a relaunch under it succeeds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            ray.get_actor(name, namespace=namespace)
        except ValueError:
            return
        time.sleep(0.1)


def _message(e: BaseException) -> str:
    from actors.router import error_text
    return error_text(e)
