"""The learner's view of OpenAI sessions: each one as a RolloutResult shaped like a multi-turn episode's.

So a session trains and saves as `run_episodes` results do (`save_results` writes them as msgpack):
`prompt_token_ids` is the first call's prompt; `token_ids` every token after it; `loss_mask` 1 where the
model sampled the token, 0 where a prompt / tool / user message (or the template between turns) added it;
`logprobs` the behaviour policy's log-prob of each sampled token and 0.0 where the mask is 0 (as episodes
have it: a plain float32 array, no None); `token_versions` the policy version of each sampled token, and
for an added token that of the turn before it; `turns` one dict per call (its [start, end) span, version,
finish_reason, and `drift`: whether its history had to be continued from the recorded tokens); `reward`
what `set_reward` gave; `metadata` = {"session_id", "drift" (the count), "calls"}; `finish_reason` that of
the last call.

`client_or_app`: the FastAPI app `openai_app` returned, or the client it was built on (its latest app); for
a Ray service, any client of it (the sessions live in the service's actor: shared_sessions.py).
"""
from __future__ import annotations

import sys
import weakref
from typing import Any, Iterable

from rollout_service.api.types import RolloutResult
from rollout_service.api.values import is_real
from rollout_service.openai.schemas import Limits
from rollout_service.openai.sessions import SessionStore

_STORES: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()  # client -> its app's store


def ray_connection_of(client: Any) -> Any:
    """The client's RayConnection, or None (a local client; Ray is not imported for one)."""
    ray_connections = sys.modules.get("rollout_service.connections.ray")
    conn = getattr(client, "_connection", None)
    return conn if ray_connections is not None and isinstance(conn, ray_connections.RayConnection) else None


def sessions_for(client: Any, limits: Limits) -> Any:
    """Where an endpoint on `client` keeps its sessions: in this process for a local client (a SessionStore),
    in the service's actor for a Ray client (a RemoteSessions: every endpoint process and the learner share
    them)."""
    conn = ray_connection_of(client)
    if conn is None:
        return SessionStore(limits.max_sessions, limits.session_idle_s)
    from rollout_service.openai.shared_sessions import RemoteSessions
    return RemoteSessions.attach(conn.name, conn.namespace, limits)


def remember_store(client: Any, store: Any) -> None:
    """Let `trajectories(client, ...)` find the sessions of the app built on `client` (the latest one)."""
    try:
        _STORES[client] = store
    except TypeError:  # a client that cannot be weakly referenced is found through its app only
        pass


def store_of(client_or_app: Any) -> Any:
    """The sessions of an app, of the client it was built on, or of a Ray service (any client of it)."""
    if isinstance(client_or_app, SessionStore):
        return client_or_app
    state = getattr(client_or_app, "state", None)
    store = getattr(state, "sessions", None) if state is not None else None
    if store is None:
        try:
            store = _STORES.get(client_or_app)
        except TypeError:
            store = None
    conn = ray_connection_of(client_or_app) if store is None else None
    if conn is not None:
        from rollout_service.openai.shared_sessions import RemoteSessions
        store = RemoteSessions.find(conn.name, conn.namespace)
        if store is None:
            raise ValueError(f"no OpenAI sessions for service {conn.name!r}: no endpoint has served it "
                             "(`rollout-service serve --openai`, or client.serve_openai())")
    if store is None:
        raise ValueError(f"no OpenAI sessions for this {type(client_or_app).__name__}: pass the app openai_app() "
                         "returned, or the client it was built on")
    return store


def _ids(session_ids: str | Iterable[str]) -> list[str]:
    ids = [session_ids] if isinstance(session_ids, str) else list(session_ids)
    bad = next((s for s in ids if not isinstance(s, str)), None)
    if bad is not None:
        raise ValueError(f"session_ids: expected str ids, got a {type(bad).__name__}")
    return ids


def trajectories(client_or_app: Any, session_ids: str | Iterable[str]) -> list[RolloutResult]:
    """One RolloutResult per session id, in their order (see the module's docstring); ValueError naming an id
    that has no finished call (never used, released, expired or evicted), or one with a call in flight
    (its trajectory is not settled yet)."""
    store = store_of(client_or_app)
    try:
        return store.trajectories(_ids(session_ids))
    except KeyError as e:
        raise ValueError(str(e).strip("'\"")) from None


def set_reward(client_or_app: Any, session_id: str, value: float | None) -> None:
    """The reward of a session's trajectory (None clears it)."""
    if value is not None and not (is_real(value) and not isinstance(value, bool)):
        raise ValueError(f"set_reward: value={value!r} must be a finite number or None")
    try:
        store_of(client_or_app).set_reward(session_id, None if value is None else float(value))
    except KeyError as e:
        raise ValueError(str(e).strip("'\"")) from None


def release(client_or_app: Any, session_ids: str | Iterable[str]) -> int:
    """Forget finished sessions (their memory is freed); returns how many were held."""
    return store_of(client_or_app).release(_ids(session_ids))
