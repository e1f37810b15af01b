"""RayBackend: the RolloutClient backend that talks to a Ray rollout service (router + workers).

`RolloutClient.launch(config)` starts a service on the current Ray cluster (or a new local Ray
instance) and `RolloutClient.connect(name)` attaches to a running one; both wrap a RayBackend.
"""
from __future__ import annotations

import contextlib
import logging
import os
import socket
import time
import uuid
from pathlib import Path
from typing import Any, Iterator

import ray

from rollout_service.config import ServiceConfig
from rollout_service.result_stream import ResultStream, close_streams, hold_sleep, release_sleep, send_closes
from rollout_service.types import RolloutResult
from rollout_service.weights.push import WeightPusher

logger = logging.getLogger(__name__)


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
    _use_token_auth(address)
    _check_reachable(address)
    _check_token_accepted(address)
    try:
        # logging_level: Ray's INFO lines ("Started a local Ray instance", ...) are not this CLI's output
        with _on_loopback() if address == "local" else contextlib.nullcontext():
            ray.init(address=address, namespace=namespace, log_to_driver=True, logging_level=logging.WARNING,
                     **(_local_instance_options() if address == "local" else {}))
    except ConnectionError as e:
        # Ray's first sentence says what failed; the advice after it is replaced by ours
        first = str(e).strip().splitlines()[0].split(". ")[0].rstrip(".")
        if _auth_failure(e):
            raise ConnectionError(f"{first}: the cluster wants Ray's auth token; {_NO_TOKEN_ADVICE}") from None
        raise ConnectionError(f"{first}. Start one with `ray start --head` (README: \"A long-lived "
                              f"service\"), or pass its address.") from None
    except Exception as e:
        if not _auth_failure(e):
            raise
        # RAY_AUTH_MODE=token without any token: Ray's AuthenticationError, a paragraph and a traceback
        raise ConnectionError(f"RAY_AUTH_MODE=token, but {_NO_TOKEN_ADVICE}") from None


_NO_TOKEN_ADVICE = ("this machine has no token: copy the cluster's to ~/.ray/auth_token (chmod 600), or point "
                    "$RAY_AUTH_TOKEN_PATH at it (README: \"Security\")")


def _auth_failure(e: BaseException | None) -> bool:
    # Ray < 2.52 has no token authentication, and so no AuthenticationError
    auth_error = getattr(ray.exceptions, "AuthenticationError", ())
    while e is not None:
        if auth_error and isinstance(e, auth_error):
            return True
        e = e.__cause__ or e.__context__
    return False


def _use_token_auth(address: str) -> None:
    """Authenticate with Ray's token where Ray would, and say so explicitly: a new local instance makes one
    (Ray's default, which otherwise warns on every start), and a token on this machine is used for an
    explicit address too, as Ray itself does only for `auto`. RAY_AUTH_MODE, when set, is respected.
    A token this code makes is private to the user (0600); a ~/.ray/auth_token others can read gets a warning."""
    if not hasattr(ray.exceptions, "AuthenticationError"):  # Ray < 2.52: no token authentication
        return
    if "RAY_AUTH_MODE" not in os.environ and (address == "local" or _token_source() is not None):
        os.environ["RAY_AUTH_MODE"] = "token"
        # Ray reads its config once, at import: re-read it, as Ray does when it turns token auth on itself
        from ray._raylet import Config
        Config.initialize("")
    if os.environ.get("RAY_AUTH_MODE", "").lower() != "token":
        return
    if address == "local" and _token_source() is None:
        _make_private_token(_default_token_path())
    if _token_source() == _default_token_path():  # a $RAY_AUTH_TOKEN_PATH file is the user's own arrangement
        _warn_if_others_can_read(_default_token_path())


def _default_token_path() -> Path:  # Ray's default; read at each call, as HOME may differ
    return Path.home() / ".ray" / "auth_token"


def _token_source() -> Path | str | None:
    """Where Ray will read the token from: "env" ($RAY_AUTH_TOKEN), a file, or None (no token)."""
    if os.environ.get("RAY_AUTH_TOKEN"):
        return "env"
    for path in (os.environ.get("RAY_AUTH_TOKEN_PATH"), _default_token_path()):
        if path and Path(path).expanduser().is_file():
            return Path(path).expanduser()
    return None


def _make_private_token(path: Path) -> None:
    """Make the token Ray would make for a new local instance, but readable by this user alone: Ray writes
    it with open(), so under the usual umask 022 anyone on the machine could read the cluster's secret."""
    try:
        from ray._private.authentication.authentication_token_generator import generate_new_authentication_token
    except ImportError:  # moved in a later Ray: the same format, 256 random bits as hex
        import secrets
        token = secrets.token_hex(32)
    else:
        token = generate_new_authentication_token()
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token)
    try:
        os.link(tmp, path)  # atomic and exclusive: a process starting at the same time keeps its token
    except FileExistsError:
        pass
    finally:
        tmp.unlink()
    from ray._raylet import AuthenticationTokenLoader
    AuthenticationTokenLoader.instance().reset_cache()  # it may have looked, and found none, already


def _warn_if_others_can_read(path: Path) -> None:
    mode = path.stat().st_mode & 0o777
    if mode & 0o077:
        logger.warning(f"warning: Ray's auth token {path} can be read by other users (mode {mode:o}): "
                       f"chmod 600 {path}")


def _check_reachable(address: str) -> None:
    """A HOST:PORT nobody listens on fails now, not after Ray's minutes of retries."""
    host, sep, port = address.rpartition(":")
    if "://" in address or not sep or not port.isdigit():
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=5).close()
    except OSError as e:
        raise ConnectionError(f"no Ray cluster at {address} ({e.strerror or e}). Start one with `ray start "
                              f"--head` (README: \"A long-lived service\"), or pass its address.") from None


def _check_token_accepted(address: str) -> None:
    """A cluster that refuses this machine's token (or its lack of one) fails now, in one line: Ray's own
    client retries for about 20 s, printing a warning line each second, then advises starting a cluster."""
    target = _gcs_address(address)
    if target is None:
        return
    try:
        import grpc
        from ray._private.authentication.grpc_authentication_client_interceptor import (
            _get_authentication_metadata_tuple)
        from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc
    except ImportError:  # a Ray without token authentication, or one that moved these: Ray judges alone
        return
    if os.environ.get("RAY_AUTH_MODE", "").lower() == "token" and _token_source() is None:
        raise ConnectionError(f"RAY_AUTH_MODE=token, but {_NO_TOKEN_ADVICE}")
    with grpc.insecure_channel(target) as channel:
        try:
            gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel).GetClusterId(
                gcs_service_pb2.GetClusterIdRequest(), timeout=5, metadata=_get_authentication_metadata_tuple())
        except grpc.RpcError as e:
            # anything but a refusal (not a GCS, not up yet, a Ray of another version) is left to ray.init
            if e.code() == grpc.StatusCode.UNAUTHENTICATED:
                raise ConnectionError(f"the Ray cluster at {target} {_refusal()}") from None


def _refusal() -> str:
    """Why a cluster refused this process: the token it sent, or that it sent none."""
    source = _token_source()
    if os.environ.get("RAY_AUTH_MODE", "").lower() != "token" and source is not None:
        return (f"wants Ray's auth token, which RAY_AUTH_MODE={os.environ['RAY_AUTH_MODE']} keeps this process "
                f"from sending: set RAY_AUTH_MODE=token (README: \"Security\")")
    if source is None:
        return f"wants Ray's auth token; {_NO_TOKEN_ADVICE}"
    held = "$RAY_AUTH_TOKEN" if source == "env" else str(source)
    return (f"refused the token in {held}: not the cluster's token (every node and client needs the same one; "
            f"README: \"Security\")")


def _gcs_address(address: str) -> str | None:
    """HOST:PORT of the GCS that ray.init(address) will join, where that is known without joining."""
    if address == "local" or "://" in address:
        return None
    if address == "auto":
        from ray._private.services import canonicalize_bootstrap_address
        services_log = logging.getLogger("ray._private.services")
        level = services_log.level
        services_log.setLevel(logging.ERROR)  # its "Found multiple active Ray instances" is ray.init's to say
        try:
            return canonicalize_bootstrap_address("auto")
        except Exception:  # no cluster on this machine: ray.init says so
            return None
        finally:
            services_log.setLevel(level)
    return address


def _starts_local_ray(address: str | None) -> bool:
    """Whether ensure_ray(address) will start a new Ray instance, which ends with this process."""
    return not ray.is_initialized() and (address or os.environ.get("RAY_ADDRESS") or "local") == "local"


def _check_model_here(cfg: ServiceConfig) -> None:
    """Refuse an unknown model source before anything starts, where this process can judge it: a bare name
    (the embedded model, or a typo of it) always, and a path when every worker will run on this machine
    (a new local Ray instance). A path on a cluster may exist only on its other nodes: the workers judge it."""
    from rollout_service.model.loader import check_source

    source = cfg.engine.model
    bare_name = isinstance(source, str) and "/" not in source and os.sep not in source
    if bare_name or _starts_local_ray(cfg.address):
        check_source(source)


def resolve_auto(config: ServiceConfig) -> ServiceConfig:
    """Turn num_gpus/num_workers 'auto' into numbers using the cluster's resources, then refuse at once a
    service the cluster can never place (check_resources)."""
    gpus = int(ray.cluster_resources().get("GPU", 0))
    if config.resources.num_gpus == "auto":
        config.resources.num_gpus = 1 if gpus else 0
    if config.num_workers == "auto":
        per = config.resources.num_gpus
        config.num_workers = max(1, int(gpus // per)) if per else 1
    check_resources(config)
    return config


def check_resources(config: ServiceConfig) -> None:
    """ValueError, before any placement group exists, when the cluster cannot hold the workers' bundles:
    a resource it has none of (a GPU, a custom resource), too little of one in all, or (strategy permitting)
    no way to put the bundles on its nodes. Otherwise Ray would wait placement.timeout_s, its autoscaler
    printing "No available node types can fulfill resource request" meanwhile. A cluster that an autoscaler
    may grow is judged by what it may grow to, and only by resource totals."""
    from actors.placement import worker_bundle

    bundle, n = worker_bundle(config), int(config.num_workers)
    have, ceiling = ray.cluster_resources(), _autoscaler_ceiling()
    what = (f"cannot place {n} rollout worker(s) of {_resources_text(bundle)} with strategy "
            f"{config.placement.strategy}")
    for kind, per in bundle.items():
        most = max(have.get(kind, 0.0), (ceiling or {}).get(kind, 0.0))
        if most <= 0:
            raise ValueError(f"{what}: the Ray cluster has no {kind} (it has {_resources_text(have)}){_instead(kind)}")
        if most < per * n - 1e-6:
            raise ValueError(f"{what}: they need {kind} {per * n:g} in all, the Ray cluster has {most:g} "
                             f"(lower num_workers or the per-worker resources)")
    if ceiling is None:
        _check_node_fit(config, bundle, n, what)


def _check_node_fit(config: ServiceConfig, bundle: dict, n: int, what: str) -> None:
    """The bundles against each live node's total resources, as the placement strategy would lay them out."""
    fits = [min(int(node["Resources"].get(k, 0.0) / v + 1e-6) for k, v in bundle.items())
            for node in ray.nodes() if node.get("Alive")]
    strategy = config.placement.strategy
    if strategy == "STRICT_PACK" and max(fits, default=0) < n:
        why = f"STRICT_PACK puts every worker on one node, and the most any node holds is {max(fits, default=0)}"
    elif strategy == "STRICT_SPREAD" and sum(1 for f in fits if f) < n:
        why = (f"STRICT_SPREAD puts each worker on a node of its own, and only {sum(1 for f in fits if f)} "
               f"node(s) can hold one")
    elif not any(fits):
        why = "no node has all of one worker's resources"
    elif sum(fits) < n:
        why = f"the cluster's nodes hold only {sum(fits)} such bundle(s) between them"
    else:
        return
    raise ValueError(f"{what}: {why}")


def _autoscaler_ceiling() -> dict | None:
    """The most of each resource an autoscaler may bring up (its node types times their max counts), or None
    for a cluster without one (a local instance, `ray start` by hand): its nodes are all it will have."""
    try:
        from ray._private.state import state
        return state.get_max_resources_from_cluster_config()
    except Exception:  # private API: a Ray that moved it is judged without an autoscaler
        return None


def _resources_text(resources: dict) -> str:
    """{'CPU': 2.0, 'memory': 3.4e9, 'node:10.0.0.1': 1.0, ...} as 'CPU 2, memory 3.2 GiB', Ray's per-node
    bookkeeping entries left out."""
    parts = []
    for k, v in sorted(resources.items()):
        if k.startswith(("node:", "accelerator_type:")) or k == "object_store_memory":
            continue
        parts.append(f"{k} {v / 2**30:.1f} GiB" if k == "memory" else f"{k} {v:g}")
    return ", ".join(parts) or "nothing"


def _instead(kind: str) -> str:
    if kind == "GPU":
        return ("; on a machine without GPUs use cluster_configs/local-cpu.yaml (or set resources.num_gpus: 0 "
                "and engine.device: cpu)")
    if kind in ("CPU", "memory"):
        return ""
    return (f"; workers go only to nodes started with it (`ray start ... --resources='{{\"{kind}\": 1}}'`, "
            f"cluster_configs/multi-node.yaml's header); on one machine use cluster_configs/local-cpu.yaml")


class RayBackend:
    """The client backend interface: submit, update_weights, pause, resume, abort, stats, close (plus weight
    groups, sleep/wake, colocated learners and fidelity reports)."""

    def __init__(self, router: Any, name: str, owner: bool, namespace: str = "rollout_service"):
        self.router = router
        self.name = name
        self.namespace = namespace
        self._owner = owner  # a launched service is shut down by close(); a connected one is left running
        self.weights = WeightPusher(router)  # this process is the learner side of every refresh
        self._holder = uuid.uuid4().hex      # who this client is to a sleep lease

    @classmethod
    def launch(cls, config: str | dict | ServiceConfig | None = None, **overrides: Any) -> "RayBackend":
        from actors.router import RouterActor

        cfg = ServiceConfig.load(config, **overrides)
        if cfg.detached and _starts_local_ray(cfg.address):
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
            raise ValueError(f"no rollout service named {name!r} in namespace {namespace!r} on this Ray cluster "
                             f"(start one with `rollout-service serve --config ...`)") from None
        return cls(router, name, owner=False, namespace=namespace)

    # -- the backend interface --------------------------------------------------------------------
    def submit(self, requests: list) -> Iterator[RolloutResult]:
        """Validate and dispatch now (ValueError naming the bad requests); then yield results as they
        finish, each (request_id, sample_index) exactly once. `requests` may hold RolloutRequests,
        request dicts or msgpack-encoded requests. The stream (rollout_service/result_stream.py) ends in
        the router however its consumer goes: read to the end, `close()`d, dropped unread, the client
        closed, or this process gone."""
        send_closes()
        reply = ray.get(self.router.submit.remote(list(requests)))
        if "errors" in reply:
            raise ValueError("; ".join(f"request {i}: {msg}" if i >= 0 else msg for i, msg in reply["errors"]))
        return ResultStream(self.router, reply["stream"], reply["lease_s"], self.weights.heal, owner=self)

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
    from actors.remote_errors import error_text
    return error_text(e)
