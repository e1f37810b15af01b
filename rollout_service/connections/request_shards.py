"""Which router of a service with several (ServiceConfig.routers > 1) a request goes to: a stable hash of its
`metadata["session_id"]` when it has one (an agent's calls, whose prompts grow turn by turn), else of its prompt
(a prompt's samples and its resubmissions), else of its request id. So one session or one prompt stays on one
router's workers and their prefix cache, and many of them spread evenly. The hash is the same in every process
(crc32, not Python's salted hash()), so clients that connect later route alike.
"""
from __future__ import annotations

import zlib
from typing import Any

import msgpack

from rollout_service.api.types import RolloutRequest


def _fields(item: Any) -> tuple[Any, Any, Any]:
    """(metadata, prompt, request_id) of a request, a request dict or msgpack bytes (None where unreadable:
    the router refuses what it cannot decode, with the reason)."""
    if isinstance(item, RolloutRequest):
        return item.metadata, item.prompt, item.request_id
    if isinstance(item, (bytes, bytearray, memoryview)):
        try:
            item = msgpack.unpackb(bytes(item), raw=False, strict_map_key=False)
        except Exception:
            return None, None, bytes(item)
    if isinstance(item, dict):
        return item.get("metadata"), item.get("prompt"), item.get("request_id")
    return None, None, None


def route_key(item: Any) -> bytes:
    metadata, prompt, request_id = _fields(item)
    session = metadata.get("session_id") if isinstance(metadata, dict) else None
    if isinstance(session, str):
        return b"s" + session.encode()
    if prompt is not None:
        try:
            return b"p" + msgpack.packb(prompt)
        except Exception:  # not something a request can carry: the router says why
            return b"?"
    return b"r" + (request_id if isinstance(request_id, bytes) else str(request_id).encode())


def split(items: list, routers: int) -> dict[int, list[int]]:
    """Router -> the indices of `items` it takes, in order (routers with none left out)."""
    out: dict[int, list[int]] = {}
    for i, item in enumerate(items):
        out.setdefault(zlib.crc32(route_key(item)) % routers, []).append(i)
    return out
