"""serve_openai_replicas: the endpoint on a Ray cluster as Ray Serve replicas, so the HTTP ingress grows with nodes.

Serve's proxy (on every node by default) takes the connections and spreads the calls over `replicas` processes,
each an openai_app on its own client of the service. A session's calls may land on any replica: the sessions
live in the service's actor (shared_sessions.py), so a replica holds no state a call needs, and one that dies
is restarted by Serve while the others go on. The deployment outlives the process that made it (as a detached
service does); `rollout-service stop`, OpenAIReplicas.stop() or the service's owner closing it removes it.

Needs Ray Serve (`pip install "rollout-service[serve]"`, i.e. ray[serve]).
"""
from __future__ import annotations

import inspect
import ipaddress
import json
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import ray

from rollout_service.connections.ray import openai_app_name, stop_openai_app
from rollout_service.connections.ray_cluster import actor_env
from rollout_service.openai.auth import resolve_token
from rollout_service.openai.schemas import Limits
from rollout_service.openai.trajectories import ray_connection_of

START_TIMEOUT_S = 600.0  # replicas import torch and load a tokenizer each: minutes on a busy CPU node
# Serve kills a proxy not ready within 5 s (three times in a row, and serve.start fails with it): on a node whose
# CPUs are busy (rollout workers, a learner) starting one takes longer. Seconds, for the controller's env.
SERVE_PATIENCE = {"RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "120", "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S": "60"}


@dataclass
class OpenAIReplicas:
    """A running deployment: where it listens, its token, and how to remove it."""

    url: str  # http://host:port/v1, an OpenAI client's base_url
    token: str
    token_file: Path | None
    service: str
    replicas: int

    def stop(self) -> None:
        stop_openai_app(self.service)


def serve_module() -> Any:
    """ray.serve; ValueError saying what to install where it (or one of its own dependencies) is missing."""
    try:
        from ray import serve
    except ImportError as e:
        raise ValueError(f"OpenAI replicas need Ray Serve ({e}): pip install \"rollout-service[serve]\"") from None
    return serve


def _builder(service: str, namespace: str, token: str, model: str, model_name: str | None,
             limits: Limits) -> Callable[[], Any]:
    """The function each replica runs at start to make its app (Serve calls it in the replica's process)."""
    def build() -> Any:
        from rollout_service.client import RolloutClient
        from rollout_service.openai.app import openai_app
        from rollout_service.openai.server import tokenizer_for

        client = RolloutClient.connect(service, namespace=namespace)
        return openai_app(client, token=token, tokenizer=tokenizer_for(model), model_name=model_name or model,
                          limits=limits)
    return build


def serve_openai_replicas(client: Any, replicas: int = 2, host: str = "127.0.0.1", port: int = 8000,
                          token: str | None = None, token_file: Any = None, *, model_name: str | None = None,
                          num_cpus: float = 1.0, proxy_location: str = "EveryNode", limits: Limits | None = None,
                          timeout_s: float = START_TIMEOUT_S, **limit_overrides: Any) -> OpenAIReplicas:
    """Serve the OpenAI endpoint of `client`'s Ray service as `replicas` Ray Serve replicas behind Serve's
    proxy on host:port (one per node with `proxy_location="EveryNode"`, Serve's default; "HeadOnly" for one).
    `num_cpus` each replica reserves; `limits` / `limit_overrides` as openai_app's (max_in_flight is per
    replica; the session bounds are the service's, set by the first endpoint that serves it). Returns once
    every replica answers, within `timeout_s`. Serve runs once per cluster: host, port and proxy_location
    apply when this starts it (a running Serve keeps its own). The replicas are clients of the service: stop()
    them before the service's owner closes it (`rollout-service stop` does both, in that order)."""
    conn = ray_connection_of(client)
    if not (isinstance(replicas, int) and not isinstance(replicas, bool) and replicas >= 1):
        raise ValueError(f"replicas={replicas!r}: must be an int >= 1")
    if conn is None:
        raise ValueError("OpenAI replicas serve a Ray service: pass a client of one (RolloutClient.launch / "
                         "connect); a local client is served by serve_openai()")
    serve = serve_module()
    limits = Limits.of(limits, **limit_overrides)
    token, path = resolve_token(token, token_file)
    model = client.info()["model"]
    _start(serve, proxy_location, host, port)
    ingress = serve.deployment(
        serve.ingress(_builder(conn.name, conn.namespace, token, model, model_name, limits))(),
        name="openai", num_replicas=replicas, max_ongoing_requests=limits.max_in_flight,
        health_check_timeout_s=120, ray_actor_options={"num_cpus": num_cpus, "runtime_env": actor_env()})
    serve.run(ingress.bind(), name=openai_app_name(conn.name), route_prefix="/", blocking=False)
    url = f"http://{_reachable(host)}:{port}"
    _wait_healthy(url, timeout_s)
    return OpenAIReplicas(f"{url}/v1", token, path, conn.name, replicas)


def _start(serve: Any, proxy_location: str, host: str, port: int) -> None:
    """Serve on this cluster, if it does not run yet: its controller and proxies at the normal CPU priority
    (actor_env) and patient with a busy node (SERVE_PATIENCE), where this Ray lets us say so (2.60+)."""
    options: dict = {"proxy_location": proxy_location, "http_options": {"host": host, "port": port}}
    if "controller_options" in inspect.signature(serve.start).parameters:
        options["controller_options"] = {"runtime_env": actor_env(**SERVE_PATIENCE)}
    serve.start(**options)


def _reachable(host: str) -> str:
    """The address a client dials for a server bound to `host` (this node's IP for 0.0.0.0)."""
    try:
        unspecified = ipaddress.ip_address(host).is_unspecified
    except ValueError:
        return host
    return ray.util.get_node_ip_address() if unspecified else host


def _wait_healthy(url: str, timeout_s: float) -> None:
    deadline, last = time.monotonic() + timeout_s, "no answer"
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as r:
                if json.loads(r.read()).get("status") == "ok":
                    return
        except (urllib.error.URLError, OSError, ValueError) as e:
            last = str(e)
        time.sleep(0.5)
    raise RuntimeError(f"OpenAI replicas: {url}/health did not answer within {timeout_s:g} s ({last})")

