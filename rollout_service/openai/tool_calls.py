"""Tool calls in a sampled assistant turn, as OpenAI's `message.tool_calls`.

A model given `tools` writes a call in its own format. Where its tokenizer ships a response template,
transformers' `parse_response` reads it; otherwise the convention most open tool-calling models were trained on
(Qwen2.5 and Qwen3, Hermes, ...): each call a JSON object {"name": ..., "arguments": {...}} between <tool_call>
and </tool_call>. A call that does not parse stays in the content: it is what the model wrote, and the agent
sees it as text (an error here would lose the turn). The tokens are untouched either way: a session records
what was sampled, not how it was read. While a turn streams, `surely_content` says how much of its text is
content whatever comes next (token_stream.py shows that much).
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Sequence

_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
OPEN = "<tool_call>"


@dataclass
class Turn:
    """An assistant turn read for the response: its text content (None when it is only calls) and its calls,
    each {"id", "type": "function", "function": {"name", "arguments": JSON text}}."""
    content: str | None
    tool_calls: list[dict] = field(default_factory=list)


def read_turn(text: str, token_ids: Sequence[int] = (), prompt_ids: Sequence[int] = (), tokenizer: Any = None,
              tools: list | None = None, tool_choice: Any = None) -> Turn:
    """The turn's content and tool calls; plain content when no tools were offered or tool_choice is "none".
    A response template reads the sampled `token_ids` after the `prompt_ids` (templates pre-write part of a
    turn); the common convention reads the `text`."""
    if not tools or tool_choice == "none":
        return Turn(text)
    found = _by_template(token_ids, prompt_ids, tokenizer, tools)
    if found is None:
        found = _hermes(text)
    content, calls = found
    return Turn(content if calls is None or (content and content.strip()) else None,
                [_openai_call(name, args) for name, args in calls or ()])


def reads_by_template(tokenizer: Any) -> bool:
    """Whether calls are read by the tokenizer's response template (a format only known once the turn is done)."""
    return getattr(tokenizer, "response_template", None) is not None and hasattr(tokenizer, "parse_response")


def surely_content(text: str) -> int:
    """How much of a turn's text so far is content whatever comes next (the common convention): the text before
    the first <tool_call> or before what may be its start, less trailing whitespace (content around calls is
    stripped). A turn that starts with whitespace: none until done (its content is stripped only if it calls)."""
    if text[:1].isspace():
        return 0
    end = text.find(OPEN)
    if end < 0:
        end = len(text) - next((k for k in range(min(len(OPEN) - 1, len(text)), 0, -1)
                                if OPEN.startswith(text[-k:])), 0)
    while end and text[end - 1].isspace():
        end -= 1
    return end


def _by_template(token_ids: Sequence[int], prompt_ids: Sequence[int], tokenizer: Any,
                 tools: list) -> tuple[str | None, list] | None:
    """(content, [(name, arguments)]) by the tokenizer's response template; None where it has none or it fails."""
    if not reads_by_template(tokenizer):
        return None
    try:
        msg = tokenizer.parse_response(list(token_ids), prefix=list(prompt_ids), tools=tools)
        calls = [(c["function"]["name"], c["function"].get("arguments", {})) for c in msg.get("tool_calls") or ()]
    except Exception:  # a template that does not fit this output: read it the common way
        return None
    return msg.get("content"), calls


def _hermes(text: str) -> tuple[str, list | None]:
    """(the text outside well-formed <tool_call> blocks, [(name, arguments)]); calls None when there are none."""
    calls, kept, at = [], [], 0
    for m in _HERMES.finditer(text):
        call = _json_call(m.group(1))
        if call is None:
            continue  # not a call: it stays in the content
        kept.append(text[at:m.start()])
        at = m.end()
        calls.append(call)
    if not calls:
        return text, None
    kept.append(text[at:])
    return "".join(kept).strip(), calls


def _json_call(body: str) -> tuple[str, Any] | None:
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return obj["name"], args


def _openai_call(name: str, arguments: Any) -> dict:
    """OpenAI's shape: the arguments as JSON text (a model that wrote them as a string keeps its string)."""
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {"name": name, "arguments": args}}
