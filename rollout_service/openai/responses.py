"""RolloutResults -> OpenAI response bodies and stream chunks.

Each choice carries two extra fields beside OpenAI's: `token_ids` (the tokens sampled, exactly) and
`policy_versions` (the policy version that produced each). A chat call given `tools` has the model's calls read
into `message.tool_calls` (openai/tool_calls.py). A chat response also carries `prompt_token_ids`
(what the model saw: the rendered history, or for a drifted session call the recorded tokens plus the new
messages) and, with a session, `session_id` and `drift` (whether this call's history was continued from
the recorded tokens). OpenAI SDKs keep unknown fields (`choice.token_ids`, or `model_extra`).
"""
from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any, Sequence

from rollout_service.api.types import RolloutResult
from rollout_service.openai.templates import ChatRenderer
from rollout_service.openai.tool_calls import read_turn


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def finish_reason(r: RolloutResult) -> str:
    return "length" if r.finish_reason == "length" else "stop"


def usage(prompt_len: int, results: list[RolloutResult]) -> dict:
    made = sum(len(r.token_ids) for r in results)
    return {"prompt_tokens": prompt_len, "completion_tokens": made, "total_tokens": prompt_len + made}


def _entry(renderer: ChatRenderer, token_id: int, logprob: float) -> dict:
    text = renderer.token_text(token_id)
    return {"token": text, "logprob": float(logprob), "bytes": list(text.encode("utf-8"))}


Span = tuple[list[int], list[float], "list[dict[int, float]] | None"]  # token ids, log-probs, top alternatives


def _span(r: RolloutResult) -> Span:
    return r.token_ids, r.logprobs.tolist(), r.top_logprobs


def chat_logprobs(r: RolloutResult, renderer: ChatRenderer) -> dict:
    return chat_logprobs_of(_span(r), renderer)


def chat_logprobs_of(span: Span, renderer: ChatRenderer) -> dict:
    ids, lps, tops = span
    content = []
    for i, (t, lp) in enumerate(zip(ids, lps)):
        top = (tops or [{}] * len(ids))[i]
        content.append({**_entry(renderer, t, lp),
                        "top_logprobs": [_entry(renderer, k, v) for k, v in sorted(top.items(), key=lambda kv: -kv[1])]})
    return {"content": content}


def completion_logprobs(r: RolloutResult, renderer: ChatRenderer) -> dict:
    return completion_logprobs_of(_span(r), renderer)


def completion_logprobs_of(span: Span, renderer: ChatRenderer, offset: int = 0) -> dict:
    """`offset`: where the span's first token starts in the choice's text (a streamed chunk's)."""
    ids, lps, top_list = span
    tokens = [renderer.token_text(t) for t in ids]
    offsets, at = [], offset
    for s in tokens:
        offsets.append(at)
        at += len(s)
    tops = [{renderer.token_text(k): float(v) for k, v in sorted(top.items(), key=lambda kv: -kv[1])}
            for top in (top_list or [{}] * len(tokens))]
    return {"tokens": tokens, "token_logprobs": list(lps), "top_logprobs": tops, "text_offset": offsets}


def _extras(r: RolloutResult) -> dict:
    return {"token_ids": list(r.token_ids), "policy_versions": list(r.token_versions)}


@dataclass(frozen=True)
class Tools:
    """What a chat call offered the model: its tools and tool_choice, and the prompt the turn followed."""
    tools: list | None = None
    tool_choice: Any = None
    prompt_ids: Sequence[int] = ()


def turn_of(r: RolloutResult, renderer: ChatRenderer, offered: Tools) -> tuple[dict, str]:
    """The message fields of a chat choice (content, and tool_calls when the model called tools) and its
    finish reason ("tool_calls" for a turn that ended with calls)."""
    turn = read_turn(r.text, r.token_ids, offered.prompt_ids, renderer.tokenizer, offered.tools,
                     offered.tool_choice)
    if not turn.tool_calls:
        return {"content": r.text}, finish_reason(r)
    reason = "tool_calls" if finish_reason(r) == "stop" else finish_reason(r)
    return {"content": turn.content, "tool_calls": turn.tool_calls}, reason


def chat_choice(r: RolloutResult, renderer: ChatRenderer, logprobs: bool, offered: Tools = Tools()) -> dict:
    message, reason = turn_of(r, renderer, offered)
    return {"index": r.sample_index, "message": {"role": "assistant", **message}, "finish_reason": reason,
            "logprobs": chat_logprobs(r, renderer) if logprobs else None, **_extras(r)}


def completion_choice(r: RolloutResult, renderer: ChatRenderer, logprobs: bool) -> dict:
    return {"index": r.sample_index, "text": r.text, "finish_reason": finish_reason(r),
            "logprobs": completion_logprobs(r, renderer) if logprobs else None, **_extras(r)}


def envelope(kind: str, rid: str, model: str, **fields: Any) -> dict:
    return {"id": rid, "object": kind, "created": int(time.time()), "model": model, **fields}


def sse(data: Any) -> bytes:
    """One server-sent event; `data: [DONE]` ends an OpenAI stream."""
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n".encode()


def chat_role_chunk(index: int, rid: str, model: str) -> dict:
    """A choice's first chunk, sent at once: the role (its text follows as it is sampled; tool calls at its
    end)."""
    choice = {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
    return envelope("chat.completion.chunk", rid, model, choices=[choice])


def chat_chunk(r: RolloutResult, renderer: ChatRenderer, logprobs: bool, rid: str, model: str,
               offered: Tools = Tools()) -> dict:
    """A finished choice's text (and tool calls), with its logprobs, token ids, versions and finish reason, as
    one delta: a call whose turn a tokenizer's response template reads is streamed whole, since its text may be
    read as tool calls only once done."""
    delta, reason = turn_of(r, renderer, offered)
    if "tool_calls" in delta:
        delta["tool_calls"] = indexed(delta["tool_calls"])
    choice = {"index": r.sample_index, "delta": delta, "finish_reason": reason,
              "logprobs": chat_logprobs(r, renderer) if logprobs else None, **_extras(r)}
    return envelope("chat.completion.chunk", rid, model, choices=[choice])


def completion_chunk(r: RolloutResult, renderer: ChatRenderer, logprobs: bool, rid: str, model: str) -> dict:
    return envelope("text_completion", rid, model, choices=[completion_choice(r, renderer, logprobs)])


def indexed(calls: list[dict]) -> list[dict]:
    """Tool calls as a stream's delta carries them: each with its place in the list."""
    return [{"index": i, **c} for i, c in enumerate(calls)]


def chat_piece_chunk(index: int, text: str, logprobs: dict | None, rid: str, model: str,
                     r: RolloutResult | None = None, tool_calls: list[dict] | None = None,
                     reason: str | None = None) -> dict:
    """A token-streamed chat choice's next text (and its tokens' logprobs); with `r`, the last chunk: its
    finish reason (`reason`, else the sample's), token ids and policy versions (of the whole sample), and the
    turn's tool calls if it made any."""
    delta = {"content": text, **({"tool_calls": indexed(tool_calls)} if tool_calls else {})}
    choice = {"index": index, "delta": delta, "logprobs": logprobs,
              "finish_reason": None if r is None else reason or finish_reason(r), **({} if r is None else _extras(r))}
    return envelope("chat.completion.chunk", rid, model, choices=[choice])


def completion_piece_chunk(index: int, text: str, logprobs: dict | None, rid: str, model: str,
                           r: RolloutResult | None = None) -> dict:
    choice = {"index": index, "text": text, "logprobs": logprobs,
              "finish_reason": None if r is None else finish_reason(r), **({} if r is None else _extras(r))}
    return envelope("text_completion", rid, model, choices=[choice])
