"""The endpoint's bearer token: given, or generated into a file only this user can read (0600), as
connections/ray_auth.py makes Ray's. Agents in other processes read the file (or are handed the token)."""
from __future__ import annotations

import hmac
import os
import secrets
from pathlib import Path

from rollout_service.openai.schemas import ApiError


def default_token_file() -> Path:
    return Path.home() / ".rollout_service" / "openai_token"


def write_token_file(path: Path, token: str) -> None:
    """Write `token` to `path`, readable by this user alone from its first byte (created 0600, then renamed
    over any older file, so no reader ever sees it half written or with wider permissions)."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(token + "\n")
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def resolve_token(token: str | None, token_file: str | os.PathLike | None) -> tuple[str, Path | None]:
    """(the token, the file it was written to): a given token is used as is (and written only if a file is
    named); otherwise a new random one goes into `token_file` (default ~/.rollout_service/openai_token)."""
    if token is not None:
        if not (isinstance(token, str) and len(token) >= 16 and token.isprintable() and " " not in token):
            raise ValueError("token: must be a printable string of at least 16 characters, without spaces")
    path = None if token_file is None and token is not None else Path(token_file or default_token_file()).expanduser()
    token = token or secrets.token_urlsafe(32)
    if path is not None:
        write_token_file(path, token)
    return token, path


def check_bearer(header: str | None, token: str) -> None:
    """401 unless `Authorization: Bearer <token>` (compared in constant time)."""
    scheme, _, given = (header or "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), token.encode()):
        raise ApiError(401, "missing or wrong bearer token: send `Authorization: Bearer <token>` (the token "
                            "serve_openai was given, or the one in its token file)", None, "invalid_api_key",
                       "authentication_error", {"WWW-Authenticate": "Bearer"})
