"""RayConnection: the Connection (connections/__init__.py) that talks to a Ray rollout service (router + workers).

`RolloutClient.launch(config)` starts a service on the current Ray cluster (or a new local Ray instance) and
`RolloutClient.connect(name)` attaches to a running one; both wrap a RayConnection.
"""
from __future__ import annotations

import dataclasses
import functools
import os
import time
import uuid
from typing import TYPE_CHECKING, Any, Callable, Iterator

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from rollout_service.connections.ray_cluster import actor_env, ensure_ray, starts_local_ray
from rollout_service.connections.capacity import resolve_auto
from rollout_service.connections.request_shards import split
from rollout_service.connections.remote_errors import error_text
from rollout_service.config import ServiceConfig
from rollout_service.results.sharded_stream import ShardedStream
from rollout_service.results.stream import (READ_S, ResultStream, close_streams, hold_sleep, release_sleep,
                                            send_closes)
from rollout_service.api.types import RolloutResult

if TYPE_CHECKING:
    from rollout_service.weights.push import WeightPusher


def _check_model_here(cfg: ServiceConfig) -> None:
    """Refuse an unknown model source before anything starts, where this process can judge it."""
    from rollout_service.model.loader import check_source_here

    check_source_here(cfg.engine.model, local=starts_local_ray(cfg.address))


class RayConnection:
    """The client connection interface: submit, update_weights, pause, resume, abort, stats, close (plus weight
    groups, sleep/wake, colocated learners and fidelity reports)."""

    def __init__(self, router: Any, name: str, owner: bool, namespace: str = "rollout_service",
                 others: list | None = None):
        """`router`: the service's (first) router; `others`: the rest, when it runs several (else asked)."""
        self.router = router
        self.routers = [router] + list(ray.get(router.shard_routers.remote()) if others is None else others)
        self.name = name
        self.namespace = namespace
        self._owner = owner  # a launched service is shut down by close(); a connected one is left running
        self._holder = uuid.uuid4().hex      # who this client is to a sleep lease

    @functools.cached_property
    def weights(self) -> "WeightPusher":
        """This process as the learner side of every refresh, made at the first use: a connection that only reads
        (`rollout-service stats`, `stop`, `scale`) never imports torch (~1.5 s)."""
        from rollout_service.weights.push import WeightPusher
        return WeightPusher(self.router)

    def _heal(self) -> bool:
        """A restarted worker waits for weights only this learner may hold (weights/push.py: heal)."""
        return "weights" in vars(self) and self.weights.heal()

    @classmethod
    def start_service(cls, config: str | dict | ServiceConfig | None = None, **overrides: Any) -> "RayConnection":
        cfg = ServiceConfig.load(config, **overrides)
        if cfg.detached and starts_local_ray(cfg.address):
            raise ValueError("detached: true needs a Ray cluster that outlives this process: start one with "
                             "`ray start --head` and set address: auto (or use `rollout-service serve`)")
        _check_model_here(cfg)
        ensure_ray(cfg.address, cfg.namespace)
        cfg = resolve_auto(cfg)
        try:
            ray.get_actor(cfg.name, namespace=cfg.namespace)
            raise ValueError(f"a rollout service named {cfg.name!r} already runs in namespace {cfg.namespace!r}: "
                             f"connect to it, close it, or pick another name")
        except ValueError as e:
            if "already runs" in str(e):
                raise
        # The router runs on this process's node (the learner's, or the head's for a job), never on a rollout
        # node: a lost rollout node costs its workers, not the service.
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        routers = start_routers(cfg, {"namespace": cfg.namespace, "num_cpus": 0, "max_restarts": 0,
                                      "scheduling_strategy": here, "lifetime": "detached" if cfg.detached else None})
        return cls(routers[0], cfg.name, owner=True, namespace=cfg.namespace, others=routers[1:])

    @classmethod
    def connect(cls, name: str = "rollout_service", namespace: str = "rollout_service",
                address: str | None = None) -> "RayConnection":
        ensure_ray(address or os.environ.get("RAY_ADDRESS") or "auto", namespace)
        try:
            router = ray.get_actor(name, namespace=namespace)
        except ValueError:
            raise ValueError(f"no rollout service named {name!r} in namespace {namespace!r} on this Ray cluster "
                             f"(start one with `rollout-service serve --config ...`)") from None
        return cls(router, name, owner=False, namespace=namespace)

    # -- the connection interface --------------------------------------------------------------------
    def submit(self, requests: list, read_now: bool = False) -> Iterator[RolloutResult]:
        """Validate and dispatch now (ValueError naming the bad requests); then yield results as they
        finish, each (request_id, sample_index) exactly once. `requests` may hold RolloutRequests,
        request dicts or msgpack-encoded requests. The stream (rollout_service/results/stream.py) ends in
        the router however its consumer goes: read to the end, `close()`d, dropped unread, the client
        closed, or this process gone. `read_now`: the caller reads at once, so each router answers the submit with
        the stream's first read too, waiting as a read does: one Ray call less (a one-request stream then costs
        its router one call of this process's)."""
        send_closes()
        items = list(requests)
        if len(self.routers) == 1:
            parts = {0: list(range(len(items)))}
        else:  # each router its share (connections/request_shards.py), all or none
            ids = [getattr(r, "request_id", None) for r in items]
            seen = [i for i in ids if i is not None]
            if len(set(seen)) != len(seen):
                raise ValueError("duplicate request_id in one call")
            parts = split(items, len(self.routers))
        first = READ_S if read_now else 0.0
        calls = [self.routers[k].submit.remote([items[i] for i in idx] if len(parts) > 1 else items, first)
                 for k, idx in parts.items()]
        streams, errors = [], []
        for (k, idx), reply in zip(parts.items(), ray.get(calls)):
            if "errors" in reply:
                errors += [(idx[i] if i >= 0 else -1, msg) for i, msg in reply["errors"]]
            else:
                streams.append(ResultStream(self.routers[k], reply["stream"], reply["lease_s"], self._heal,
                                            owner=self))
                if "first" in reply:
                    streams[-1].take(reply["first"])
        if errors:
            for s in streams:  # (a batch is taken all or none)
                s.close()
            raise ValueError("; ".join(f"request {i}: {msg}" if i >= 0 else msg for i, msg in sorted(errors)))
        return streams[0] if len(streams) == 1 else ShardedStream(streams)

    def update_weights(self, named_tensors, version: int, transport: str = "auto", partial: bool = False,
                       check_finite: bool = True, delta: bool | str = "auto") -> str:
        """Validated on every worker before any swaps (rollout_service/weights/push.py)."""
        return self.weights.update_weights(named_tensors, version, transport, partial, check_finite, delta)

    def init_weight_group(self, master_address: str | None = None, backend: str = "auto",
                          timeout_s: float = 300.0) -> None:
        self.weights.init_group(master_address, backend, timeout_s)

    def release_weight_buffers(self) -> None:
        self.weights.release()

    def weights_digests(self) -> list[str | None]:
        return ray.get(self.router.weights_digests.remote())

    def sleep(self, level: int = 1, fail_if_asleep: bool = False) -> None:
        """The service sleeps while this process lives: a thread renews the lease (from before the call, so a
        sleep that takes longer than the lease is not woken midway) until wake_up() or close()."""
        lease_s = ray.get(self.router.info.remote())["client_lease_s"]
        hold_sleep(self.router, self._holder, lease_s)
        try:
            err = ray.get(self.router.sleep.remote(level, fail_if_asleep, self._holder))
        except BaseException:  # the service is gone (or the call was interrupted): nothing to hold
            release_sleep(self._holder)
            raise
        if err is not None:  # some worker failed to sleep; the others sleep, leased as ever
            raise ValueError(err)

    def wake_up(self) -> None:
        err = ray.get(self.router.wake_up.remote())
        if err is not None:
            raise ValueError(err)
        release_sleep(self._holder)

    def colocated_options(self, worker: int) -> dict:
        options, err = ray.get(self.router.learner_options.remote(worker))
        if err is not None:
            raise ValueError(err)
        return options

    def report_fidelity(self, version: int, report: dict) -> None:
        err = ray.get(self.router.report_fidelity.remote(version, dict(report)))
        if err is not None:
            raise ValueError(err)

    def scale(self, num_workers: int, drain_s: float, timeout_s: float | None) -> None:
        err = ray.get(self.router.scale.remote(num_workers, drain_s, timeout_s))
        if err is not None:
            raise ValueError(err)

    def pause(self) -> None:
        ray.get(self.router.pause.remote())

    def resume(self) -> None:
        ray.get(self.router.resume.remote())

    def abort(self, request_ids: list[str]) -> list[RolloutResult]:
        """Abort now; the "abort" results (tokens so far) also end the requests' streams."""
        ids = list(request_ids)
        return [r for part in ray.get([router.abort.remote(ids) for router in self.routers]) for r in part]

    def stats(self) -> list[dict]:
        return ray.get(self.router.stats.remote())

    def info(self) -> dict:
        """The router's counters; the closes of streams dropped unread are sent first, so they count."""
        send_closes()
        return ray.get(self.router.info.remote())

    def shutdown(self) -> None:
        """Stop the service for every client (`rollout-service stop`), whether this client launched it or
        merely connected to it."""
        self._owner = True
        self.close()

    def close(self) -> None:
        """End this client's streams (a service this client merely connected to keeps running), then shut
        down a service this client launched."""
        if self.router is None:
            return
        close_streams(self)
        release_sleep(self._holder)  # a sleep it asked for ends once the service sees no renewal
        if "weights" in vars(self):  # (else nothing was pushed from here)
            self.weights.close()
        if self._owner:
            _stop_openai_app(self.name)  # (first: its replicas are clients of the service)
            try:
                ray.get(self.router.shutdown.remote())  # (the first router stops the others)
            finally:
                for router in self.routers:
                    ray.kill(router)
                _kill_named(openai_sessions_name(self.name), self.namespace)
            for k in range(len(self.routers)):
                _wait_name_released(router_name(self.name, k), self.namespace)
        self.router = None


def router_name(name: str, k: int) -> str:
    """The actor name of a service's router k (the first one's is the service's)."""
    return name if k == 0 else f"{name}.router{k}"


def openai_sessions_name(name: str) -> str:
    """The actor name of the service's OpenAI sessions (rollout_service/openai/shared_sessions.py): detached, as
    they outlive any one endpoint process, so the service's shutdown ends them."""
    return f"{name}.openai-sessions"


def openai_app_name(name: str) -> str:
    """The Ray Serve application of the service's OpenAI endpoint replicas (rollout_service/openai/replicas.py)."""
    return f"{name}-openai"


def stop_openai_app(name: str) -> bool:
    """Remove the service's endpoint replicas; False if none run (or Ray Serve is not installed)."""
    try:  # Serve's controller, by its name in Ray 2.x: asking for it costs nothing where Serve never started
        ray.get_actor("SERVE_CONTROLLER_ACTOR", namespace="serve")
        from ray import serve
        from ray.serve.exceptions import RayServeException
    except (ValueError, ImportError):
        return False
    try:
        running = openai_app_name(name) in serve.status().applications
    except RayServeException:  # Serve shut down meanwhile
        return False
    if running:
        serve.delete(openai_app_name(name))
    return running


def _stop_openai_app(name: str) -> None:
    try:
        stop_openai_app(name)
    except Exception as e:  # the service's own shutdown must go on
        print(f"[rollout_service] could not remove the OpenAI endpoint replicas of {name!r}: {e}", flush=True)


def _kill_named(name: str, namespace: str) -> None:
    try:
        ray.kill(ray.get_actor(name, namespace=namespace))
    except ValueError:  # none was started
        pass


def start_routers(cfg: ServiceConfig, options: dict, engine_factory: Callable | None = None) -> list:
    """Start the service's routers (actors/router.py; `options`: their actor options) and their workers; returns
    their handles, the first one's first. With several, each gets its share of the workers (actors/shards.py) and
    the first one the others. A failure stops every one of them and raises ValueError."""
    from actors.router import RouterActor
    from actors.shards import share

    n = cfg.routers
    if n > cfg.num_workers:
        raise ValueError(f"ServiceConfig.routers={n}: must be at most num_workers ({cfg.num_workers}): each router "
                         "owns one worker at least")
    configs = [cfg] if n == 1 else [
        dataclasses.replace(cfg, name=router_name(cfg.name, k), routers=1, num_workers=share(cfg.num_workers, k, n),
                            reward_workers=max(1, share(cfg.reward_workers, k, n)) if cfg.reward_workers else 0)
        for k in range(n)]
    extra = () if engine_factory is None else (engine_factory,)
    options = {"runtime_env": actor_env(), **options}
    routers = [RouterActor.options(name=c.name, **options).remote(c, *extra) for c in configs]
    try:
        errors = ray.get([r.start.remote() for r in routers])
    except ray.exceptions.RayActorError as e:  # a router process itself died
        _stop(routers)
        raise ValueError(f"rollout service {cfg.name!r} failed to start: {error_text(getattr(e, 'cause', None) or e)}"
                         ) from None
    err = next((f"router {k}: {e}" if k else e for k, e in enumerate(errors) if e is not None), None)
    if err is not None:
        _stop(routers)
        raise ValueError(f"rollout service {cfg.name!r} failed to start: {err}")
    if n > 1:
        ray.get(routers[0].attach_shards.remote(routers[1:]))
    return routers


def _stop(routers: list) -> None:
    for r in routers:
        try:
            ray.get(r.shutdown.remote())
        except Exception:  # (its process is gone)
            pass
        ray.kill(r)


def _wait_name_released(name: str, namespace: str, timeout: float = 10.0) -> None:
    """ray.kill is asynchronous: wait until the name is free so a relaunch under it succeeds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            ray.get_actor(name, namespace=namespace)
        except ValueError:
            return
        time.sleep(0.1)
