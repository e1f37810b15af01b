"""The OpenAI endpoint's calls, in-process (FastAPI's TestClient) on a real local client: token-exact against
the client itself, logprobs, n > 1, streaming, tools through the template, auth, bad bodies, overload."""
from __future__ import annotations

import json
import time

import numpy as np
import pytest
from fastapi.testclient import TestClient
from openai_setup import TOKEN, auth

from rollout_service import SamplingParams
from rollout_service.openai import openai_app

pytest_plugins = ["openai_setup"]  # the tok and client fixtures

USER = [{"role": "user", "content": "yes or no ?"}]


@pytest.fixture(scope="module")
def http(client, tmp_path_factory):
    app = openai_app(client, token=TOKEN, max_body_bytes=4096, max_total_tokens=1000, max_in_flight=1)
    with TestClient(app) as h:
        yield h


def post(http, path: str, body: dict, token: str = TOKEN, **kw):
    return http.post(path, headers=auth(token), json={"model": "m", **body}, **kw)


def test_chat_is_token_exact_against_the_client(http, client, tok):
    body = {"messages": USER, "n": 2, "temperature": 0.9, "top_p": 0.95, "max_tokens": 8, "seed": 11,
            "logprobs": True, "top_logprobs": 2}
    r = post(http, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    got = r.json()
    prompt = tok.apply_chat_template(USER, add_generation_prompt=True, tokenize=True)
    prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    assert got["prompt_token_ids"] == prompt
    want = client.generate(prompt, SamplingParams(n=2, temperature=0.9, top_p=0.95, max_tokens=8, seed=11,
                                                  logprobs=2))
    assert [c["index"] for c in got["choices"]] == [0, 1]
    for choice, res in zip(got["choices"], want):
        assert choice["token_ids"] == res.token_ids and choice["policy_versions"] == res.token_versions
        lps = [e["logprob"] for e in choice["logprobs"]["content"]]
        assert np.array_equal(np.float32(lps), res.logprobs)  # float32 -> JSON double -> float32: exact
        assert choice["message"] == {"role": "assistant", "content": res.text}
        top = choice["logprobs"]["content"][0]["top_logprobs"]
        assert [t["token"] for t in top] == ["yes", "no"]  # the two likeliest words, most likely first
    assert got["choices"][0]["token_ids"] != got["choices"][1]["token_ids"]  # two samples, not one twice
    assert got["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": 16, "total_tokens": len(prompt) + 16}


def test_completions_take_token_ids_or_text(http, client, tok):
    ids = tok.encode("user : yes", add_special_tokens=False)
    r = post(http, "/v1/completions", {"prompt": ids, "max_tokens": 6, "seed": 3, "logprobs": 1})
    assert r.status_code == 200, r.text
    (want,) = client.generate(ids, SamplingParams(max_tokens=6, seed=3, logprobs=1))
    choice = r.json()["choices"][0]
    assert choice["token_ids"] == want.token_ids and choice["text"] == want.text
    assert np.array_equal(np.float32(choice["logprobs"]["token_logprobs"]), want.logprobs)
    r = post(http, "/v1/completions", {"prompt": "user : yes", "max_tokens": 6, "seed": 3})
    assert r.json()["choices"][0]["token_ids"] == want.token_ids  # the same ids from the text


def _events(text: str) -> list:
    lines = [ln for ln in text.split("\n\n") if ln]
    assert all(ln.startswith("data: ") for ln in lines), lines
    return [ln[len("data: "):] for ln in lines]


def test_stream_concatenates_to_the_plain_answer_and_ends_with_done(http):
    body = {"messages": USER, "n": 2, "max_tokens": 6, "seed": 5}
    plain = post(http, "/v1/chat/completions", body).json()
    r = post(http, "/v1/chat/completions", {**body, "stream": True, "stream_options": {"include_usage": True}})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = _events(r.text)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    text = {0: "", 1: ""}
    for c in chunks[:-1]:
        (choice,) = c["choices"]
        text[choice["index"]] += choice["delta"].get("content", "")
    assert text == {c["index"]: c["message"]["content"] for c in plain["choices"]}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == plain["usage"]


def _pieces(chunks: list, index: int) -> list:
    return [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == index]


def test_a_stream_shows_each_token_as_sampled_and_nothing_a_stop_string_cuts(http):
    """Chunks carry a choice's text a token at a time with that token's logprobs, adding up to the plain
    answer's text and logprobs. With a stop string, text that may be the start of one waits: the plain answer,
    cut where the stop string begins, still equals the chunks, over seeds where it cut and where it did not."""
    body = {"messages": USER, "n": 2, "max_tokens": 8, "seed": 5, "logprobs": True, "top_logprobs": 2}
    plain = post(http, "/v1/chat/completions", body).json()
    chunks = [json.loads(e) for e in _events(post(http, "/v1/chat/completions", {**body, "stream": True}).text)[:-1]]
    for want in plain["choices"]:
        got = _pieces(chunks, want["index"])
        assert sum(1 for c in got if c["delta"].get("content")) == 8, "one chunk per token"
        assert "".join(c["delta"].get("content", "") for c in got) == want["message"]["content"]
        assert [e for c in got if c["logprobs"] for e in c["logprobs"]["content"]] == want["logprobs"]["content"]
        assert got[-1]["finish_reason"] == "length" and got[-1]["token_ids"] == want["token_ids"]
    reasons = set()
    for seed in range(8):
        body = {"messages": USER, "max_tokens": 5, "seed": seed, "stop": ["no yes"]}
        want = post(http, "/v1/chat/completions", body).json()["choices"][0]
        stream = [json.loads(e) for e in _events(post(http, "/v1/chat/completions", {**body, "stream": True}).text)[:-1]]
        got = _pieces(stream, 0)
        assert "".join(c["delta"].get("content", "") for c in got) == want["message"]["content"], seed
        reasons.add(want["finish_reason"])
    assert reasons == {"stop", "length"}, "seeds where the stop string cut the text and where it did not"


def test_a_call_offering_tools_streams_its_text_as_sampled(http):
    """The tests' model writes no tool calls: its text is content, streamed as sampled (tool_choice "none":
    a chunk per token; "auto": as soon as it cannot be the start of a call) and adding up to the plain answer."""
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    for choice in ("auto", "none"):
        body = {"messages": USER, "max_tokens": 6, "seed": 2, "tools": tools, "tool_choice": choice}
        want = post(http, "/v1/chat/completions", body).json()["choices"][0]
        chunks = [json.loads(e) for e in _events(post(http, "/v1/chat/completions", {**body, "stream": True}).text)[:-1]]
        got = [c for c in _pieces(chunks, 0) if c["delta"].get("content")]
        assert len(got) == 6 if choice == "none" else len(got) > 1, choice
        assert "".join(c["delta"]["content"] for c in got) == want["message"]["content"], choice
        assert _pieces(chunks, 0)[-1]["finish_reason"] == want["finish_reason"]


def test_tools_are_rendered_by_the_template(http, tok):
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    r = post(http, "/v1/chat/completions", {"messages": USER, "tools": tools, "tool_choice": "auto", "max_tokens": 2})
    assert r.status_code == 200, r.text
    ids = r.json()["prompt_token_ids"]
    assert ids[:3] == tok.convert_tokens_to_ids(["tools", ":", "add"])
    tool_turn = USER + [{"role": "assistant", "content": None, "tool_calls": []},
                        {"role": "tool", "content": "3", "tool_call_id": "c1"}]
    r = post(http, "/v1/chat/completions", {"messages": tool_turn, "tools": tools, "max_tokens": 2})
    assert r.status_code == 200, r.text


def test_models_and_health(http):
    assert http.get("/health").json() == {"status": "ok"}
    models = http.get("/v1/models", headers=auth(TOKEN)).json()
    assert models["object"] == "list" and models["data"][0]["object"] == "model"


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong-token-0123456789"},
                                     {"Authorization": TOKEN}])
def test_auth_is_required(http, headers):
    for r in (http.post("/v1/chat/completions", headers=headers, json={"messages": USER}),
              http.post("/v1/completions", headers=headers, json={"prompt": "yes"}),
              http.get("/v1/models", headers=headers)):
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        assert r.json()["error"]["type"] == "authentication_error"


BAD = [({"messages": []}, 400, "messages"), ({"messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role"),
       ({"messages": USER, "temperature": 3}, 400, "temperature"), ({"messages": USER, "top_p": 0}, 400, "top_p"),
       ({"messages": USER, "n": 0}, 400, "n"), ({"messages": USER, "max_tokens": 0}, 400, "max_tokens"),
       ({"messages": USER, "n": 4, "max_tokens": 300}, 400, "max_tokens"),  # n × max_tokens over 1000
       ({"messages": USER, "stop": [""]}, 400, "stop"), ({"messages": USER, "seed": -1}, 400, "seed"),
       ({"messages": USER, "top_logprobs": 2}, 400, "top_logprobs"),
       ({"messages": USER, "logit_bias": {"3": 5}}, 400, "logit_bias"),
       ({"messages": USER, "session_id": ""}, 400, "session_id"),
       ({"messages": [{"role": "user", "content": "w5 " * 2000}]}, 413, None)]


@pytest.mark.parametrize("body,status,param", BAD)
def test_bad_bodies_are_openai_errors_naming_the_field(http, body, status, param):
    r = post(http, "/v1/chat/completions", body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["param"] == param
    assert param is None or err["message"].startswith(param)


def test_bad_json_and_bad_prompts(http):
    r = http.post("/v1/chat/completions", headers={**auth(TOKEN), "content-type": "application/json"}, content=b"{")
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    r = post(http, "/v1/completions", {"prompt": [1, 10**6], "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    r = post(http, "/v1/completions", {"prompt": [1] * 600, "max_tokens": 2})  # longer than the model's context
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    assert post(http, "/v1/completions", {"prompt": "yes", "max_tokens": 2}).status_code == 200  # nothing broke


def test_overload_is_429_with_retry_after(http):
    """max_in_flight=1: a stream in progress holds the one slot; the next call is refused until it ends."""
    body = {"messages": USER, "max_tokens": 400, "stream": True}
    with http.stream("POST", "/v1/chat/completions", headers=auth(TOKEN), json={"model": "m", **body}) as s:
        lines = s.iter_lines()  # (kept: a dropped line iterator would close the stream)
        assert next(lines).startswith("data: ")  # the role chunk: the call is in flight
        r = post(http, "/v1/chat/completions", {"messages": USER, "max_tokens": 2})
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["type"] == "rate_limit_error"
    deadline = time.monotonic() + 10
    while (r := post(http, "/v1/chat/completions", {"messages": USER, "max_tokens": 2})).status_code == 429:
        assert time.monotonic() < deadline, "the dropped stream never gave its slot back"
        time.sleep(0.05)
    assert r.status_code == 200
