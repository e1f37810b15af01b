"""Token-exact sessions: the tokens a session's calls actually sampled, kept so the learner trains on them.

A session is one trajectory: the first call's prompt, then for each call the tokens added before it (the
new messages, mask 0) and the tokens sampled (mask 1). A later call resends the whole chat history; if its
rendering starts with the recorded tokens it is used as is. If it does not (a template that drops earlier
`<think>` blocks, a client that re-serialises tool calls or trims whitespace, a stop string cut from the
text), the recorded tokens win: only the new messages are rendered, as a continuation after the last turn,
and the call counts one drift. Either way the model sees, and the learner gets, the tokens really sampled.

The store is bounded: at most `max_sessions`, the least recently used idle one evicted (with a log line)
to make room; a session idle for `idle_s` is dropped. One call per session at a time (a second is a 409):
`begin` hands the call its session with a new `hold`, and `settle` / `end` act only while that hold is the
session's (a session released and begun again meanwhile is another's).

An endpoint served by several processes keeps its sessions in one Ray actor (shared_sessions.py), a
SessionStore behind the same methods.
"""
from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable

from rollout_service.api.types import RolloutResult
from rollout_service.openai.schemas import ApiError
from rollout_service.openai.templates import ChatRenderer

logger = logging.getLogger("rollout_service.openai")


@dataclass
class Session:
    session_id: str
    prompt_ids: list[int] | None = None  # the first call's prompt; None until a call finishes
    token_ids: list[int] = field(default_factory=list)  # every token after it, sampled or added
    mask: list[int] = field(default_factory=list)  # 1: sampled by the model, 0: prompt / tool / user
    logprobs: list[float] = field(default_factory=list)  # 0.0 where mask is 0
    versions: list[int] = field(default_factory=list)
    turns: list[dict] = field(default_factory=list)
    messages_seen: int = 0  # messages of the last call plus its answer
    closed_by: int | None = None  # the EOS token that ended the last turn
    drift: int = 0
    reward: float | None = None
    busy: bool = False
    last_used: float = 0.0
    hold: int = 0  # which call holds it (SessionStore.begin)

    @property
    def recorded(self) -> list[int]:
        return (self.prompt_ids or []) + self.token_ids

    def view(self) -> "Session":
        """What a call needs to build its prompt (the recorded tokens, where the history stands) and its hold;
        not the log-probs, versions or turns."""
        return Session(self.session_id, self.prompt_ids, list(self.token_ids), messages_seen=self.messages_seen,
                       closed_by=self.closed_by, busy=self.busy, hold=self.hold)

    def as_result(self) -> RolloutResult:
        """The session as the learner gets it (trajectories.py says what each field holds)."""
        return RolloutResult(
            request_id=self.session_id, sample_index=0, prompt_token_ids=list(self.prompt_ids or []),
            token_ids=list(self.token_ids), logprobs=list(self.logprobs), token_versions=list(self.versions),
            finish_reason=self.turns[-1]["finish_reason"], loss_mask=list(self.mask),
            turns=[dict(t) for t in self.turns], reward=self.reward,
            metadata={"session_id": self.session_id, "drift": self.drift, "calls": len(self.turns)})

    def _extend(self, ids: list[int], logprobs: list[float], versions: list[int], mask: int) -> None:
        self.token_ids += ids
        self.logprobs += logprobs
        self.versions += versions
        self.mask += [mask] * len(ids)


def prompt_for(session: Session, messages: list[dict], renderer: ChatRenderer, tools: Any = None,
               tool_choice: Any = None) -> tuple[list[int], bool]:
    """(the prompt of this call, whether it drifted): the recorded tokens plus the new messages' tokens."""
    if session.prompt_ids is None:
        return renderer.render(messages, tools, tool_choice), False
    new = messages[session.messages_seen:]
    if not new:
        raise ApiError(400, f"messages: session {session.session_id!r} has seen {session.messages_seen} messages "
                            f"(its calls' and their answers); this call sends {len(messages)}: resend the history "
                            "and add the new messages (or start a new session)", "messages", "session_history")
    full = renderer.render(messages, tools, tool_choice)
    recorded = session.recorded
    if len(full) > len(recorded) and full[:len(recorded)] == recorded:
        return full, False
    return recorded + renderer.continuation(new, session.closed_by), True


def record(session: Session, prompt_ids: list[int], drifted: bool, result: RolloutResult, n_messages: int,
           closed_by: int | None) -> None:
    """Add a finished call to its session: the tokens added before it (mask 0), then those it sampled."""
    if session.prompt_ids is None:
        session.prompt_ids = list(prompt_ids)
    else:
        added = prompt_ids[len(session.recorded):]
        last = session.versions[-1] if session.versions else (result.token_versions or [0])[0]
        session._extend(added, [0.0] * len(added), [last] * len(added), 0)  # versions: the turn before them
    start = len(session.token_ids)
    session._extend(list(result.token_ids), result.logprobs.tolist(), list(result.token_versions), 1)
    version = result.token_versions[0] if result.token_versions else (session.versions or [0])[-1]
    session.turns.append({"start": start, "end": len(session.token_ids), "version": version,
                          "finish_reason": result.finish_reason, "reward": None, "drift": drifted})
    session.drift += drifted
    session.messages_seen = n_messages + 1
    session.closed_by = closed_by


class SessionStore:
    """Sessions by id, least recently used first; safe to use from any thread."""

    def __init__(self, max_sessions: int = 10000, idle_s: float = 3600.0, clock: Callable[[], float] = time.monotonic):
        if not (isinstance(max_sessions, int) and max_sessions >= 1):
            raise ValueError(f"max_sessions={max_sessions!r}: must be an int >= 1")
        if not idle_s > 0:
            raise ValueError(f"session_idle_s={idle_s!r}: must be > 0 seconds")
        self.max_sessions, self.idle_s, self._clock = max_sessions, idle_s, clock
        self._sessions: OrderedDict[str, Session] = OrderedDict()
        self._holds = itertools.count(1)
        self.lock = threading.RLock()  # held while a session changes or is read whole (record, trajectories)

    def __len__(self) -> int:
        return len(self._sessions)

    def begin(self, session_id: str) -> Session:
        """The session, held for one call (a new one if the id is new); 409 if a call holds it already."""
        with self.lock:
            now = self._clock()
            self._expire(now)
            s = self._sessions.get(session_id)
            if s is None:
                self._make_room()
                s = self._sessions[session_id] = Session(session_id)
            elif s.busy:
                raise ApiError(409, f"session_id: session {session_id!r} has a call in flight; a session's calls "
                                    "take turns", "session_id", "session_busy")
            s.busy, s.last_used, s.hold = True, now, next(self._holds)
            self._sessions.move_to_end(session_id)
            return s

    def _held(self, session: Session) -> Session | None:
        """The stored session while the call that began `session` (a view of it, maybe) still holds it."""
        s = self._sessions.get(session.session_id)
        return s if s is not None and s.busy and s.hold == session.hold else None

    def settle(self, session: Session, prompt_ids: list[int], drifted: bool, result: RolloutResult, n_messages: int,
               closed_by: int | None) -> None:
        """Record the held session's finished call (a session released meanwhile records nothing)."""
        with self.lock:  # a learner reading the trajectory meanwhile sees it before or after, not half
            s = self._held(session)
            if s is None:
                logger.info(f"openai sessions: session {session.session_id!r} was released during its call; "
                            "the call's tokens are not recorded")
                return
            record(s, prompt_ids, drifted, result, n_messages, closed_by)

    def end(self, session: Session) -> None:
        """The call holding `session` is over (recorded or failed); a session no call ever finished is dropped."""
        with self.lock:
            s = self._held(session)
            if s is None:
                return
            s.busy, s.last_used = False, self._clock()
            if s.prompt_ids is None:
                del self._sessions[s.session_id]

    def busy(self, session_id: str) -> bool:
        """Whether a call holds this session now."""
        with self.lock:
            s = self._sessions.get(session_id)
            return s is not None and s.busy

    def _expire(self, now: float) -> None:
        for sid in [sid for sid, s in self._sessions.items() if not s.busy and now - s.last_used > self.idle_s]:
            logger.info(f"openai sessions: dropped session {sid!r}, idle over {self.idle_s:g} s")
            del self._sessions[sid]

    def _make_room(self) -> None:
        if len(self._sessions) < self.max_sessions:
            return
        victim = next((s for s in self._sessions.values() if not s.busy), None)
        if victim is None:
            raise ApiError(429, f"session_id: all {self.max_sessions} sessions have a call in flight",
                           "session_id", "too_many_sessions", "rate_limit_error", {"Retry-After": "1"})
        logger.warning(f"openai sessions: evicted session {victim.session_id!r} (idle "
                       f"{self._clock() - victim.last_used:.1f} s, {len(victim.token_ids)} tokens) to stay within "
                       f"max_sessions={self.max_sessions}; release finished sessions, or raise max_sessions")
        del self._sessions[victim.session_id]

    def get(self, session_id: str) -> Session:
        """A session that has finished at least one call; KeyError naming the id otherwise."""
        with self.lock:
            s = self._sessions.get(session_id)
            if s is None or s.prompt_ids is None:
                raise KeyError(f"no session {session_id!r} (never used, released, expired or evicted)")
            return s

    def trajectories(self, session_ids: list[str]) -> list[RolloutResult]:
        """Each session as_result(), in order; KeyError as get(), ValueError for one with a call in flight."""
        with self.lock:
            return [_settled(self.get(sid)) for sid in session_ids]

    def set_reward(self, session_id: str, value: float | None) -> None:
        with self.lock:
            self.get(session_id).reward = value

    def release(self, session_ids: list[str]) -> int:
        """Forget these sessions (unknown ids are ignored); returns how many were held."""
        with self.lock:
            return sum(self._sessions.pop(sid, None) is not None for sid in session_ids)


def _settled(s: Session) -> RolloutResult:
    if s.busy:
        raise ValueError(f"session {s.session_id!r} has a call in flight: read its trajectory after the call returns")
    return s.as_result()
