"""Ray's token authentication as this project uses it: token mode where Ray would use it, a new local instance's
token readable by this user alone, a warning for a token file others can read, and a cluster that refuses this
process's token told in one line before ray.init's retries.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path

import ray

logger = logging.getLogger(__name__)


NO_TOKEN_ADVICE = ("this machine has no token: copy the cluster's to ~/.ray/auth_token (chmod 600), or point "
                    "$RAY_AUTH_TOKEN_PATH at it (docs/service.md: \"Security\")")


def auth_failure(e: BaseException | None) -> bool:
    # Ray < 2.52 has no token authentication, and so no AuthenticationError
    auth_error = getattr(ray.exceptions, "AuthenticationError", ())
    while e is not None:
        if auth_error and isinstance(e, auth_error):
            return True
        e = e.__cause__ or e.__context__
    return False


def use_token_auth(address: str) -> None:
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


def check_token_accepted(address: str) -> None:
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
        raise ConnectionError(f"RAY_AUTH_MODE=token, but {NO_TOKEN_ADVICE}")
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
                f"from sending: set RAY_AUTH_MODE=token (docs/service.md: \"Security\")")
    if source is None:
        return f"wants Ray's auth token; {NO_TOKEN_ADVICE}"
    held = "$RAY_AUTH_TOKEN" if source == "env" else str(source)
    return (f"refused the token in {held}: not the cluster's token (every node and client needs the same one; "
            f"docs/service.md: \"Security\")")


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


