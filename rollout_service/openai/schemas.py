"""OpenAI request bodies -> our SamplingParams, and OpenAI-shaped errors.

Every field is checked here, before anything reaches the client, so a bad body is a 4xx naming the field in
OpenAI's error shape ({"error": {"message", "type", "param", "code"}}), which OpenAI SDKs surface as their
BadRequestError and friends. Fields OpenAI defines that change nothing here (user, metadata, store,
parallel_tool_calls, ...) are accepted and ignored, as agents send them routinely; fields whose meaning we
cannot honour (echo, suffix, best_of, logit_bias) are refused rather than silently dropped.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from rollout_service.api.types import SamplingParams
from rollout_service.api.values import MAX_INT32, is_int, is_real

ROLES = ("system", "developer", "user", "assistant", "tool", "function")
MAX_STOP = 16          # stop strings per request (OpenAI allows 4; a few more cost nothing)
MAX_SESSION_ID = 256   # characters: ids are dict keys held for the session's life


@dataclass
class Limits:
    """The bounds one app enforces. `max_total_tokens` bounds n × max_tokens of one request (the tokens
    it may make the service generate); `default_max_tokens` applies when a body names neither max_tokens nor
    max_completion_tokens."""

    max_body_bytes: int = 1 << 20
    max_total_tokens: int = 32768
    max_n: int = 64
    default_max_tokens: int = 512
    max_in_flight: int = 64
    max_sessions: int = 10000
    session_idle_s: float = 3600.0

    def __post_init__(self) -> None:
        for name, v in vars(self).items():
            if not (is_real(v) and not isinstance(v, bool) and v > 0) or (name != "session_idle_s" and not is_int(v)):
                raise ValueError(f"openai limits: {name}={v!r} must be a positive "
                                 f"{'number' if name == 'session_idle_s' else 'int'}")

    @classmethod
    def of(cls, limits: "Limits | None", **overrides: Any) -> "Limits":
        """`limits` (default: the defaults) with some fields replaced, checked again."""
        return cls(**{**(vars(limits) if limits else {}), **overrides})


class ApiError(Exception):
    """An HTTP error in OpenAI's shape. `param`: the body field at fault (None when none is)."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error", headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type
        self.headers = headers or {}

    def __reduce__(self) -> tuple:  # whole across a process boundary (the shared sessions' actor)
        return ApiError, (self.status, self.message, self.param, self.code, self.type, self.headers)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(param: str, why: str, value: Any = None, code: str = "invalid_value") -> ApiError:
    shown = "" if value is None else f" (got {value!r:.80})"
    return ApiError(400, f"{param}: {why}{shown}", param, code)


@dataclass
class ChatCall:
    messages: list[dict]
    sampling: SamplingParams
    tools: list | None = None
    tool_choice: Any = None
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False
    session_id: str | None = None


@dataclass
class CompletionCall:
    prompt: str | list[int]
    sampling: SamplingParams
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False


def _get(body: dict, name: str, check: Any, why: str, default: Any = None) -> Any:
    v = body.get(name)
    if v is None:
        return default
    if not check(v):
        raise bad(name, why, v)
    return v


def _number(lo: float, hi: float):
    return lambda v: is_real(v) and not isinstance(v, bool) and lo <= v <= hi and math.isfinite(v)


def _int(lo: int, hi: int):
    return lambda v: is_int(v) and not isinstance(v, bool) and lo <= v <= hi


def _stop(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not (isinstance(stops, list) and len(stops) <= MAX_STOP and all(isinstance(s, str) and s for s in stops)):
        raise bad("stop", f"must be a non-empty string or a list of at most {MAX_STOP} of them", stop)
    return list(stops)


def _max_tokens(body: dict, limits: Limits) -> int:
    # max_completion_tokens is the newer name; where both are given it wins, as in OpenAI's API
    for name in ("max_completion_tokens", "max_tokens"):
        v = _get(body, name, _int(1, MAX_INT32), "must be an int >= 1")
        if v is not None:
            return v
    return limits.default_max_tokens


def sampling_from(body: dict, limits: Limits, top_logprobs: int) -> SamplingParams:
    """The SamplingParams a body asks for, its bounds checked (n × max_tokens included)."""
    n = _get(body, "n", _int(1, limits.max_n), f"must be an int in [1, {limits.max_n}]", 1)
    temperature = _get(body, "temperature", _number(0, 2), "must be a number in [0, 2]", 1.0)
    if 0 < temperature < 0.01:  # greedy in all but name, and below SamplingParams' floor (float32 overflow)
        temperature = 0.0
    max_tokens = _max_tokens(body, limits)
    if n * max_tokens > limits.max_total_tokens:
        raise ApiError(400, f"max_tokens: n × max_tokens = {n} × {max_tokens} exceeds this server's bound of "
                            f"{limits.max_total_tokens} tokens per request", "max_tokens", "too_many_tokens")
    kw = dict(n=n, temperature=float(temperature), max_tokens=max_tokens, stop=_stop(body), logprobs=top_logprobs,
              top_p=float(_get(body, "top_p", lambda v: _number(0, 1)(v) and v > 0, "must be in (0, 1]", 1.0)),
              seed=_get(body, "seed", _int(0, 2**63 - 1), "must be an int in [0, 2**63)"),
              frequency_penalty=float(_get(body, "frequency_penalty", _number(-2, 2), "must be in [-2, 2]", 0.0)),
              presence_penalty=float(_get(body, "presence_penalty", _number(-2, 2), "must be in [-2, 2]", 0.0)),
              # vLLM's extra sampling fields, which agents written against vLLM send
              top_k=_get(body, "top_k", lambda v: v == -1 or _int(1, MAX_INT32)(v), "must be -1 or an int >= 1", -1),
              min_p=float(_get(body, "min_p", _number(0, 1), "must be in [0, 1]", 0.0)),
              repetition_penalty=float(_get(body, "repetition_penalty", _number(0.01, 10), "must be in [0.01, 10]",
                                            1.0)))
    try:
        return SamplingParams(**kw)
    except ValueError as e:  # "SamplingParams.<field>=...": name the field as the body does
        name = str(e).split("=", 1)[0].removeprefix("SamplingParams.")
        raise bad(name if name in body else "body", str(e)) from None


def _refuse_unsupported(body: dict) -> None:
    for name, unset in (("echo", False), ("suffix", None), ("logit_bias", None), ("best_of", None)):
        v = body.get(name)
        if v is not None and v != unset and v != {} and not (name == "best_of" and v == body.get("n", 1)):
            raise bad(name, "is not supported by this server", v, "unsupported_parameter")


def _stream_options(body: dict) -> tuple[bool, bool]:
    stream = _get(body, "stream", lambda v: isinstance(v, bool), "must be a bool", False)
    opts = _get(body, "stream_options", lambda v: isinstance(v, dict), "must be an object", {})
    usage = opts.get("include_usage", False)
    if not isinstance(usage, bool):
        raise bad("stream_options.include_usage", "must be a bool", usage)
    return stream, usage


def _content(i: int, m: dict) -> dict:
    """A message for the chat template: content as a str (text parts joined), other keys (tool_calls,
    tool_call_id, name) as sent, for the template to render."""
    content = m.get("content")
    if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                   for p in content):
            raise bad(f"messages[{i}].content", "only text parts are supported", content)
        content = "".join(p["text"] for p in content)
    elif content is None:
        if m.get("role") != "assistant":  # an assistant message may carry tool_calls instead
            raise bad(f"messages[{i}].content", "is required for this role")
        content = ""
    elif not isinstance(content, str):
        raise bad(f"messages[{i}].content", "must be a string or a list of text parts", content)
    return {**m, "content": content}


def parse_messages(messages: Any) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise bad("messages", "must be a non-empty list of messages", messages)
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise bad(f"messages[{i}].role", f"must be one of {ROLES}", m.get("role") if isinstance(m, dict) else m)
        out.append(_content(i, m))
    return out


def session_id_from(body: dict, header: str | None) -> str | None:
    sid = body.get("session_id", header)
    if sid is None:
        return None
    if not (isinstance(sid, str) and 0 < len(sid) <= MAX_SESSION_ID and sid.isprintable()):
        raise bad("session_id", f"must be a printable string of 1 to {MAX_SESSION_ID} characters", sid)
    return sid


def parse_chat(body: dict, limits: Limits, session_header: str | None = None) -> ChatCall:
    _refuse_unsupported(body)
    logprobs = _get(body, "logprobs", lambda v: isinstance(v, bool), "must be a bool", False)
    top = _get(body, "top_logprobs", _int(0, 20), "must be an int in [0, 20]", 0)
    if top and not logprobs:
        raise bad("top_logprobs", "needs logprobs: true", top)
    tools = _get(body, "tools", lambda v: isinstance(v, list) and all(isinstance(t, dict) for t in v),
                 "must be a list of tool objects")
    stream, usage = _stream_options(body)
    call = ChatCall(parse_messages(body.get("messages")), sampling_from(body, limits, top), tools or None,
                    body.get("tool_choice"), stream, usage, logprobs, session_id_from(body, session_header))
    if call.session_id is not None and call.sampling.n != 1:
        raise bad("n", "a session continues one sample: n must be 1 with a session id", call.sampling.n)
    return call


def _prompt(body: dict) -> str | list[int]:
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]  # a batch of one
    if isinstance(p, str) and p:
        return p
    if isinstance(p, list) and p and all(_int(0, MAX_INT32)(t) for t in p):
        return [int(t) for t in p]
    raise bad("prompt", "must be a non-empty string or a non-empty list of token ids (one prompt per request)",
              p if not isinstance(p, list) else f"list of {len(p)}")


def parse_completion(body: dict, limits: Limits) -> CompletionCall:
    _refuse_unsupported(body)
    top = _get(body, "logprobs", _int(0, 20), "must be an int in [0, 20] (top alternatives per token)")
    stream, usage = _stream_options(body)
    return CompletionCall(_prompt(body), sampling_from(body, limits, top or 0), stream, usage, top is not None)
