"""Tool calls read out of a sampled turn into OpenAI's `message.tool_calls`: the common <tool_call> JSON
convention and a tokenizer's own response template (transformers' parse_response), on the embedded model's
tokenizer; responses and stream chunks that the official `openai` package parses into its types."""
from __future__ import annotations

import copy
import json

import numpy as np
import pytest

from rollout_service.api.types import RolloutResult
from rollout_service.openai import responses as out
from rollout_service.openai.templates import ChatRenderer
from rollout_service.openai.tool_calls import read_turn

TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}]
TWO_CALLS = ('Let me add. <tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
             '<tool_call>{"name": "add", "arguments": "{\\"a\\": 3}"}</tool_call>')


@pytest.fixture(scope="module")
def tok(smollm2):
    return smollm2[1]


def _result(tok, text: str, finish: str = "stop") -> RolloutResult:
    ids = tok.encode(text, add_special_tokens=False)
    return RolloutResult(request_id="r", sample_index=0, prompt_token_ids=[1, 2], token_ids=ids,
                         logprobs=np.full(len(ids), -0.5, dtype=np.float32), finish_reason=finish,
                         token_versions=[0] * len(ids), text=text)


def test_tool_call_blocks_become_calls_and_the_rest_stays_content():
    turn = read_turn(TWO_CALLS, tools=TOOLS)
    assert turn.content == "Let me add."
    assert [c["function"]["name"] for c in turn.tool_calls] == ["add", "add"]
    assert json.loads(turn.tool_calls[0]["function"]["arguments"]) == {"a": 1, "b": 2}
    assert turn.tool_calls[1]["function"]["arguments"] == '{"a": 3}'  # a string the model wrote stays as written
    assert len({c["id"] for c in turn.tool_calls}) == 2 and all(c["type"] == "function" for c in turn.tool_calls)
    only = read_turn('<tool_call>{"name": "add", "arguments": {}}</tool_call>', tools=TOOLS)
    assert only.content is None and len(only.tool_calls) == 1


@pytest.mark.parametrize("text", ["<tool_call>{not json}</tool_call>", '<tool_call>{"arguments": {}}</tool_call>',
                                  '<tool_call>["add"]</tool_call>', "no call at all"])
def test_what_does_not_parse_as_a_call_stays_text(text):
    turn = read_turn(text, tools=TOOLS)
    assert turn.content == text and turn.tool_calls == []


def test_no_tools_or_tool_choice_none_reads_no_calls():
    assert read_turn(TWO_CALLS).tool_calls == []
    assert read_turn(TWO_CALLS, tools=TOOLS, tool_choice="none").content == TWO_CALLS


def test_a_tokenizers_response_template_reads_the_sampled_tokens(tok):
    """A template with its own call markers (here <call>...</call>, anchored on the assistant turn's opening):
    the calls come from it, with arguments cast by the tool's schema; the common convention is not used."""
    templated = copy.copy(tok)
    templated.response_template = {"start_anchor": "<|im_start|>assistant\n", "fields": {
        "content": {"content": "text"},
        "tool_calls": {"open": "<call>", "close": "</call>", "content": "json", "repeats": True, "optional": True,
                       "transform": {"type": "function", "function": "{content}"}}}}
    prompt = tok.apply_chat_template([{"role": "user", "content": "1+2?"}], add_generation_prompt=True)
    prompt = prompt["input_ids"] if hasattr(prompt, "keys") else prompt
    text = 'Sure <call>{"name": "add", "arguments": {"a": "1", "b": 2}}</call>'
    ids = tok.encode(text, add_special_tokens=False)
    turn = read_turn(text, ids, prompt, templated, TOOLS)
    assert turn.content == "Sure"
    assert [json.loads(c["function"]["arguments"]) for c in turn.tool_calls] == [{"a": 1, "b": 2}]
    assert read_turn(TWO_CALLS, tok.encode(TWO_CALLS, add_special_tokens=False), prompt, templated,
                     TOOLS).tool_calls == []  # its markers, not <tool_call>


def test_the_openai_client_parses_the_calls_of_a_response_and_of_a_stream(tok):
    from openai.types.chat import ChatCompletion, ChatCompletionChunk

    renderer = ChatRenderer(tok, len(tok), {tok.eos_token_id})
    offered = out.Tools(TOOLS, "auto", [1, 2])
    r = _result(tok, TWO_CALLS)
    body = out.envelope("chat.completion", "chatcmpl-1", "m", choices=[out.chat_choice(r, renderer, True, offered)])
    parsed = ChatCompletion.model_validate(body)
    choice = parsed.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me add."
    assert [c.function.name for c in choice.message.tool_calls] == ["add", "add"]
    assert choice.model_extra["token_ids"] == r.token_ids  # the sampled tokens ride along, untouched
    chunk = ChatCompletionChunk.model_validate(out.chat_chunk(r, renderer, False, "chatcmpl-1", "m", offered))
    delta = chunk.choices[0].delta
    assert [c.index for c in delta.tool_calls] == [0, 1] and delta.tool_calls[0].function.name == "add"
    cut = ChatCompletion.model_validate(out.envelope("chat.completion", "c", "m", choices=[
        out.chat_choice(_result(tok, TWO_CALLS, "length"), renderer, False, offered)]))
    assert cut.choices[0].finish_reason == "length"  # cut by max_tokens: said so, the calls read as far as they go
    plain = ChatCompletion.model_validate(out.envelope("chat.completion", "c", "m", choices=[
        out.chat_choice(r, renderer, False)]))
    assert plain.choices[0].message.tool_calls is None and plain.choices[0].message.content == TWO_CALLS


def _streamed(tok, text: str, sizes: list[int], offered: out.Tools) -> tuple[list[dict], dict]:
    """The chunks of a choice whose tokens arrive in deltas of `sizes` tokens (repeated), then its result."""
    from rollout_service.api.deltas import TokenDelta
    from rollout_service.openai.token_stream import CallStream

    r = _result(tok, text)
    stream = CallStream(ChatRenderer(tok, len(tok), {tok.eos_token_id}), [], True, False, "c", "m", offered)
    chunks, at, k = [], 0, 0
    while at < len(r.token_ids) - 1:  # (the last token comes with the result, as in the engine)
        n = min(sizes[k % len(sizes)], len(r.token_ids) - 1 - at)
        d = TokenDelta("r", 0, at, r.token_ids[at:at + n], [-0.5] * n, [0] * n, None, 0)
        chunks += [c for c in [stream.on_delta(d)] if c is not None]
        at, k = at + n, k + 1
    last = stream.on_result(r)
    return [c["choices"][0]["delta"] for c in chunks], last["choices"][0]


@pytest.mark.parametrize("text", [TWO_CALLS, "No call here, just text  ", "<tool_call>{not json}</tool_call> ok",
                                  ' \nLead <tool_call>{"name": "add", "arguments": {}}</tool_call>',
                                  'Use <tool_ and then <tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'])
@pytest.mark.parametrize("sizes", [[1], [2, 3, 1]])
def test_a_stream_offering_tools_shows_content_as_sampled_and_the_calls_at_the_end(tok, text, sizes):
    offered = out.Tools(TOOLS, "auto", [1, 2])
    whole = out.chat_choice(_result(tok, text), ChatRenderer(tok, len(tok), {tok.eos_token_id}), False, offered)
    live, last = _streamed(tok, text, sizes, offered)
    assert not any("tool_calls" in d for d in live) and all("<tool_call>" not in d["content"] for d in live)
    content = "".join(d["content"] for d in live) + last["delta"]["content"]
    assert content == (whole["message"]["content"] or "")  # the chunks add up to the plain answer's content
    calls = [(c["index"], c["function"]) for c in last["delta"].get("tool_calls", [])]
    assert calls == [(i, c["function"]) for i, c in enumerate(whole["message"].get("tool_calls", []))]
    assert last["finish_reason"] == whole["finish_reason"]
    from openai.types.chat import ChatCompletionChunk
    parsed = ChatCompletionChunk.model_validate(out.envelope("chat.completion.chunk", "c", "m", choices=[last]))
    assert [c.function.name for c in parsed.choices[0].delta.tool_calls or []] == [f["name"] for _, f in calls]
    if not text[:1].isspace() and text.split("<tool_call>")[0].strip():
        assert live, "the content before the first call came before the end"
