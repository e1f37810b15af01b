"""User code — reward functions and environments — as the service calls it.

Such code runs in the service's processes with their rights, and may do anything: raise BaseException
(SystemExit, KeyboardInterrupt), return values that overflow, end the process, never return. The callers
(rewards/runner.py, engine/episode_runner.py) catch everything it raises or returns, so it marks only its own result. What they
cannot catch (the process ending, a call that never returns) is for whoever runs them to survive: each call
is entered through a `Guard`, which a Ray worker uses to tell its router which request's code is running
before it runs (actors/quarantine.py). In-process nothing needs telling: `unguarded`.
"""
from __future__ import annotations

import contextlib
from typing import Callable, ContextManager

# guard(request_id, what) -> a context entered around one call of user code for that request; `what` names
# the code ("reward module:function", "environment Name.step()") for the error a quarantine reports
Guard = Callable[[str, str], ContextManager[None]]


def unguarded(request_id: str, what: str) -> ContextManager[None]:
    return contextlib.nullcontext()


def describe_error(e: BaseException) -> str:
    """'Type: message' of anything user code raised, encodable whatever the message holds (a lone
    surrogate in it would make the result's msgpack record fail to encode)."""
    try:
        text = str(e)
    except BaseException:  # a broken __str__ is user code too
        text = "<the exception's message could not be read>"
    return f"{type(e).__name__}: {text}".encode("utf-8", "backslashreplace").decode("utf-8")
