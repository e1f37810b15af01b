"""Which Ray cluster this process joins, or the local instance it starts: an explicit address, $RAY_ADDRESS, else
a new local instance on loopback without dashboard or metrics. No cluster to join, or one that refuses this
machine's token, is a ConnectionError of one sentence that says what to do (the token rules: ray_auth.py).
"""
from __future__ import annotations

import contextlib
import logging
import os
import socket
from typing import Iterator

import ray

from rollout_service.connections.ray_auth import (NO_TOKEN_ADVICE, auth_failure, check_token_accepted,
                                               use_token_auth)
from rollout_service.config import local_ray_wanted


def actor_env(**env_vars: str) -> dict:
    """The runtime_env of the service's actors (router, workers, reward actors): `env_vars`, at the normal CPU
    priority. Ray starts its worker processes at nice 15, so that its own daemons stay responsive; a rollout
    worker would then get a few percent of a core it shares with any process at the normal priority (a learner,
    a data loader, another job), and run 10x slower beside one."""
    return {"env_vars": {"RAY_worker_niceness": "0", **env_vars}}


def _local_instance_options() -> dict:
    """A local instance started here serves this process alone: no dashboard, and no metrics agent exporting
    to Prometheus (plain HTTP, no token). A new dict each time: ray.init may keep or amend what it is given."""
    return {"include_dashboard": False, "_system_config": {"enable_metrics_collection": False}}


@contextlib.contextmanager
def _on_loopback() -> Iterator[None]:
    """Start a local instance on 127.0.0.1, as Ray does on macOS and Windows: its GCS, raylet and workers then
    listen on loopback, and so do the HTTP endpoints Ray binds to every interface for a routable node IP (the
    autoscaler's and dashboard's Prometheus metrics, the runtime-env agent), none of which wants a token.
    Ray reads the switch at import: the constant is set for the start and put back, so a later connection of
    this process to a real cluster gets its routable IP again."""
    from ray._private import ray_constants

    if not hasattr(ray_constants, "ENABLE_RAY_CLUSTER"):  # a Ray without the switch: its own choice of address
        yield
        return
    var = getattr(ray_constants, "ENABLE_RAY_CLUSTERS_ENV_VAR", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")
    old, old_env = ray_constants.ENABLE_RAY_CLUSTER, os.environ.get(var)
    ray_constants.ENABLE_RAY_CLUSTER = False
    os.environ[var] = "0"  # for the instance's own processes, which inherit this environment
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = old
        if old_env is None:
            os.environ.pop(var, None)
        else:
            os.environ[var] = old_env


def ensure_ray(address: str | None = None, namespace: str | None = None) -> None:
    """Use the Ray this process is connected to; else join `address` / $RAY_ADDRESS (set inside a Ray
    job); else start a new local instance. A cluster merely running on this machine is joined only
    when asked (`address: auto`), so two users' services never land in each other's clusters.
    No cluster to join, or one that refuses this machine's token, is a ConnectionError of one sentence
    that says what to do."""
    if ray.is_initialized():
        return
    address = address or os.environ.get("RAY_ADDRESS") or "local"
    use_token_auth(address)
    _check_reachable(address)
    check_token_accepted(address)
    try:
        # logging_level: Ray's INFO lines ("Started a local Ray instance", ...) are not this CLI's output
        with _on_loopback() if address == "local" else contextlib.nullcontext():
            ray.init(address=address, namespace=namespace, log_to_driver=True, logging_level=logging.WARNING,
                     **(_local_instance_options() if address == "local" else {}))
    except ConnectionError as e:
        # Ray's first sentence says what failed; the advice after it is replaced by ours
        first = str(e).strip().splitlines()[0].split(". ")[0].rstrip(".")
        if auth_failure(e):
            raise ConnectionError(f"{first}: the cluster wants Ray's auth token; {NO_TOKEN_ADVICE}") from None
        raise ConnectionError(f"{first}. Start one with `ray start --head` (docs/service.md: \"A long-lived "
                              f"service\"), or pass its address.") from None
    except Exception as e:
        if not auth_failure(e):
            raise
        # RAY_AUTH_MODE=token without any token: Ray's AuthenticationError, a paragraph and a traceback
        raise ConnectionError(f"RAY_AUTH_MODE=token, but {NO_TOKEN_ADVICE}") from None


def _check_reachable(address: str) -> None:
    """A HOST:PORT nobody listens on fails now, not after Ray's minutes of retries."""
    host, sep, port = address.rpartition(":")
    if "://" in address or not sep or not port.isdigit():
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=5).close()
    except OSError as e:
        raise ConnectionError(f"no Ray cluster at {address} ({e.strerror or e}). Start one with `ray start "
                              f"--head` (docs/service.md: \"A long-lived service\"), or pass its address.") from None


def starts_local_ray(address: str | None) -> bool:
    """Whether ensure_ray(address) will start a new Ray instance, which ends with this process."""
    return not ray.is_initialized() and local_ray_wanted(address)


