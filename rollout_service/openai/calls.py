"""One endpoint call's work against the client, synchronous (the app runs it on its threads): the prompt
(rendered, or continued from a session's recorded tokens), the RolloutRequest, the results, the session's
record. Requests go through `client.generate` / `client.stream`, so over Ray the router's rules (exactly
once, staleness, refresh, recovery) hold for them as for any learner's.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

from rollout_service.api.deltas import TokenDelta
from rollout_service.api.types import RolloutRequest, RolloutResult
from rollout_service.openai.schemas import ApiError, ChatCall, CompletionCall, Limits
from rollout_service.openai.sessions import Session, SessionStore, prompt_for
from rollout_service.openai.templates import ChatRenderer


@dataclass
class Service:
    """What an app serves: the client, its model's renderer, the sessions and the bounds."""

    client: Any
    renderer: ChatRenderer
    sessions: SessionStore  # or shared_sessions.RemoteSessions: the same methods
    limits: Limits
    model: str


@dataclass
class Prepared:
    """A call ready to run. While `session` is set, the call holds it: `done()` must follow."""

    request: RolloutRequest
    param: str  # the body field a refusal of the prompt names
    session: Session | None = None
    drifted: bool = False
    n_messages: int = 0

    @property
    def prompt_ids(self) -> list[int]:
        return self.request.prompt


def prepare_chat(svc: Service, call: ChatCall) -> Prepared:
    session = svc.sessions.begin(call.session_id) if call.session_id is not None else None
    try:
        if session is None:
            ids, drifted = svc.renderer.render(call.messages, call.tools, call.tool_choice), False
        else:
            ids, drifted = prompt_for(session, call.messages, svc.renderer, call.tools, call.tool_choice)
        request = _request(ids, call.sampling, "messages", call.session_id)
        return Prepared(request, "messages", session, drifted, len(call.messages))
    except BaseException:
        if session is not None:
            svc.sessions.end(session)
        raise


def prepare_completion(svc: Service, call: CompletionCall) -> Prepared:
    r = svc.renderer
    ids = r.encode_text(call.prompt) if isinstance(call.prompt, str) else r.check_ids(call.prompt)
    return Prepared(_request(ids, call.sampling, "prompt"), "prompt")


def _request(ids: list[int], sampling: Any, param: str, session_id: str | None = None) -> RolloutRequest:
    """The request of a call; a session's carries its id, which keeps its calls on one router of several
    (rollout_service/connections/request_shards.py) and so on its workers' prefix cache."""
    metadata = None if session_id is None else {"session_id": session_id}
    try:
        return RolloutRequest(prompt=ids, sampling=sampling, apply_chat_template=False, metadata=metadata)
    except ValueError as e:
        raise ApiError(400, f"{param}: {e}", param) from None


def _refused(e: Exception, param: str) -> ApiError:
    """The client's refusal as an HTTP error: bad input (a prompt longer than the model's context, ...) is
    the caller's 400; a service that cannot take requests now (paused, asleep, closed) a 503."""
    if isinstance(e, ValueError):
        return ApiError(400, f"{param}: the service refused the request: {e}", param, "refused")
    return ApiError(503, f"the rollout service cannot take requests now: {e}", None, "unavailable", "server_error",
                    {"Retry-After": "1"})


def open_stream(svc: Service, p: Prepared, tokens: bool = False) -> Iterator[RolloutResult | TokenDelta]:
    """The call's samples as they finish; with `tokens`, their new tokens before (TokenDelta). Read at once: over
    Ray the submit brings the first read too."""
    try:
        return svc.client.stream(p.request, tokens=tokens, read_now=True)
    except (ValueError, RuntimeError) as e:
        raise _refused(e, p.param) from None


def next_result(it: Iterator[RolloutResult | TokenDelta], p: Prepared) -> RolloutResult | TokenDelta | None:
    """The next finished sample or token delta (None after the last); an aborted sample is a 503."""
    try:
        r = next(it, None)
    except (ValueError, RuntimeError) as e:
        raise _refused(e, p.param) from None
    if isinstance(r, RolloutResult) and r.finish_reason == "abort":
        raise ApiError(503, f"the service aborted the request ({r.error or 'no reason given'})", None, "aborted", "server_error",
                       {"Retry-After": "1"})
    return r


def collect(it: Iterator[RolloutResult], p: Prepared) -> list[RolloutResult]:
    """Every sample of the call, by index."""
    out = []
    while (r := next_result(it, p)) is not None:
        out.append(r)
    return sorted(out, key=lambda r: r.sample_index)


def settle(svc: Service, p: Prepared, results: list[RolloutResult]) -> None:
    """Record the call's sample in its session (a session call has n = 1)."""
    if p.session is not None:
        r = results[0]
        svc.sessions.settle(p.session, p.prompt_ids, p.drifted, r, p.n_messages,
                            svc.renderer.closed_by(r.token_ids, r.finish_reason))


def done(svc: Service, p: Prepared) -> None:
    """Release the call's hold on its session (recorded by settle(), or not: a failed call leaves it as it was)."""
    if p.session is not None:
        svc.sessions.end(p.session)
        p.session = None
