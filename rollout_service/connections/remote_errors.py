"""Errors that crossed a Ray actor boundary: whether the actor is down, and the message a user should see."""
from __future__ import annotations

import ray
from ray.exceptions import RayActorError, RayTaskError

ACTOR_DOWN = (RayActorError, getattr(ray.exceptions, "ActorUnavailableError", RayActorError))


def is_down(e: BaseException) -> bool:
    return isinstance(e, ACTOR_DOWN)


def error_text(e: BaseException) -> str:
    """The user-facing message of an exception that crossed a Ray actor boundary."""
    cause = getattr(e, "cause", None) if isinstance(e, RayTaskError) else None
    e = cause if cause is not None else e
    if isinstance(e, ValueError):
        return str(e)
    text = str(e)
    if isinstance(e, RayActorError) and "creation task" in text:  # keep the constructor's own error
        lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
        return f"constructor failed: {lines[-1]}"
    return f"{type(e).__name__}: {text}"
