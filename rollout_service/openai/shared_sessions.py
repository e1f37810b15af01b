"""The sessions of an endpoint in front of a Ray service: one named Ray actor per service holds them.

Any process that serves the endpoint (Ray Serve replicas, replicas.py, or one uvicorn) and the learner's own
client (client.trajectories) reach the same sessions, so a session's calls may go to any replica, a replica
may die, and the learner may run elsewhere. The actor is a SessionStore behind the same methods; a call
costs two round trips to it (begin, then settle and end in one). It lives as long as the service (detached;
RayConnection.close of the service's owner kills it) and runs at most a process's worth of work: a held
session is a few KiB, its calls a few dict operations. Where the actor is down (its node lost), a call is a
503 and the actor comes back empty: the sessions it held are gone, which the log says.
"""
from __future__ import annotations

import logging
import threading
from typing import Any

import ray
from ray.exceptions import RayTaskError

from rollout_service.api.types import RolloutResult
from rollout_service.connections.ray import openai_sessions_name
from rollout_service.connections.ray_cluster import actor_env
from rollout_service.connections.remote_errors import is_down
from rollout_service.openai.schemas import ApiError, Limits
from rollout_service.openai.sessions import Session, SessionStore

logger = logging.getLogger("rollout_service.openai")


class SessionsActor:
    """A SessionStore in a Ray actor of its own (one call at a time: its methods are short)."""

    def __init__(self, max_sessions: int, idle_s: float):
        self.store = SessionStore(max_sessions, idle_s)
        logger.info(f"openai sessions: a new store for at most {max_sessions} sessions")

    def begin(self, session_id: str) -> Session:
        return self.store.begin(session_id).view()

    def finish(self, session: Session, record: tuple | None) -> None:
        if record is not None:
            self.store.settle(session, *record)
        self.store.end(session)

    def trajectories(self, session_ids: list[str]) -> list[RolloutResult]:
        return self.store.trajectories(session_ids)

    def set_reward(self, session_id: str, value: float | None) -> None:
        self.store.set_reward(session_id, value)

    def release(self, session_ids: list[str]) -> int:
        return self.store.release(session_ids)

    def busy(self, session_id: str) -> bool:
        return self.store.busy(session_id)

    def count(self) -> int:
        return len(self.store)

    def bounds(self) -> tuple[int, float]:
        return self.store.max_sessions, self.store.idle_s


class RemoteSessions:
    """The SessionStore methods the endpoint and the learner use, answered by a service's SessionsActor."""

    def __init__(self, actor: Any, service: str):
        self.actor, self.service = actor, service
        self._records: dict[tuple[str, int], tuple] = {}  # settled calls, sent with their end()
        self._lock = threading.Lock()

    @classmethod
    def attach(cls, service: str, namespace: str, limits: Limits) -> "RemoteSessions":
        """The service's sessions, the actor started if none runs (its bounds then come from `limits`)."""
        actor = ray.remote(SessionsActor).options(
            name=openai_sessions_name(service), namespace=namespace, get_if_exists=True, lifetime="detached",
            num_cpus=0, max_restarts=-1, runtime_env=actor_env()).remote(limits.max_sessions, limits.session_idle_s)
        held = tuple(ray.get(actor.bounds.remote()))
        if held != (limits.max_sessions, limits.session_idle_s):  # an earlier endpoint started it
            logger.warning(f"openai sessions: service {service!r} keeps its sessions with max_sessions={held[0]}, "
                           f"session_idle_s={held[1]:g}, as the endpoint that first served it asked; this one's "
                           f"({limits.max_sessions}, {limits.session_idle_s:g}) do not apply")
        return cls(actor, service)

    @classmethod
    def find(cls, service: str, namespace: str) -> "RemoteSessions | None":
        """The service's sessions if an endpoint ever served it, else None."""
        try:
            return cls(ray.get_actor(openai_sessions_name(service), namespace=namespace), service)
        except ValueError:
            return None

    def _call(self, method: str, *args: Any) -> Any:
        try:
            return ray.get(getattr(self.actor, method).remote(*args))
        except RayTaskError as e:
            if isinstance(e.cause, (ApiError, KeyError, ValueError)):  # the store's own answers, as in-process
                raise e.cause from None
            raise
        except Exception as e:
            if not is_down(e):
                raise
            raise ApiError(503, f"the sessions of service {self.service!r} are unavailable now ({type(e).__name__}); "
                                "they come back empty", None, "sessions_unavailable", "server_error",
                           {"Retry-After": "1"}) from None

    def __len__(self) -> int:
        return self._call("count")

    def begin(self, session_id: str) -> Session:
        return self._call("begin", session_id)

    def settle(self, session: Session, *record: Any) -> None:
        with self._lock:
            self._records[(session.session_id, session.hold)] = record

    def end(self, session: Session) -> None:
        with self._lock:
            record = self._records.pop((session.session_id, session.hold), None)
        stub = Session(session.session_id, hold=session.hold)  # what the store needs to know the call
        try:
            self._call("finish", stub, record)
        except ApiError as e:  # the call is over either way: its answer stands
            logger.warning(f"openai sessions: session {session.session_id!r} not recorded: {e.message}")

    def trajectories(self, session_ids: list[str]) -> list[RolloutResult]:
        return self._call("trajectories", session_ids)

    def set_reward(self, session_id: str, value: float | None) -> None:
        self._call("set_reward", session_id, value)

    def release(self, session_ids: list[str]) -> int:
        return self._call("release", session_ids)

    def busy(self, session_id: str) -> bool:
        return self._call("busy", session_id)

