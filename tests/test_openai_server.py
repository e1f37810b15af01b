"""The OpenAI endpoint end to end: serve_openai under a real uvicorn on a free port, talked to over HTTP;
its token file; a client that drops its stream mid-call hurts no other session; the CLI flag."""
from __future__ import annotations

import json
import logging
import stat
import threading
import time

import httpx
import pytest
from openai_setup import auth, local_client, word_tokenizer

from rollout_service.openai import serve_openai, trajectories

Q = [{"role": "user", "content": "yes or no ?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tok = word_tokenizer()
    token_file = tmp_path_factory.mktemp("openai") / "token"
    with local_client(tok) as client:
        srv = serve_openai(client, port=0, token_file=token_file, block=False)
        yield srv
        srv.stop()


def test_token_file_is_private_and_required(server):
    assert server.url.startswith("http://127.0.0.1:") and server.token_file is not None
    assert stat.S_IMODE(server.token_file.stat().st_mode) == 0o600
    assert server.token_file.read_text().strip() == server.token
    assert httpx.get(f"{server.url}/models").status_code == 401
    assert httpx.get(f"{server.url}/models", headers=auth(server.token)).status_code == 200
    assert httpx.get(server.url.removesuffix("/v1") + "/health").json() == {"status": "ok"}


def _chat(server, session: str, messages: list, timeout: float = 60, **body) -> httpx.Response:
    return httpx.post(f"{server.url}/chat/completions", headers={**auth(server.token), "X-Session-Id": session},
                      json={"model": "m", "messages": messages, "max_tokens": 4, **body}, timeout=timeout)


def test_a_dropped_stream_hurts_no_other_session(server, caplog):
    first = _chat(server, "keep", Q).json()
    body = {"model": "m", "messages": Q, "max_tokens": 400, "stream": True}
    headers = {**auth(server.token), "X-Session-Id": "drop"}
    with caplog.at_level(logging.INFO, logger="rollout_service.openai"):
        with httpx.stream("POST", f"{server.url}/chat/completions", headers=headers, json=body, timeout=60) as s:
            lines = s.iter_lines()
            assert next(lines).startswith("data: ")  # the call runs; now the client goes away
        answer = {"role": "assistant", "content": first["choices"][0]["message"]["content"]}
        again = _chat(server, "keep", Q + [answer] + Q)  # the other session goes on, token-exact
        assert again.status_code == 200 and again.json()["drift"] is False
        deadline = time.monotonic() + 20
        while (r := _chat(server, "drop", Q)).status_code == 409:  # until the server has seen the drop
            assert time.monotonic() < deadline, "the dropped call never let go of its session"
            time.sleep(0.05)
        assert r.status_code == 200
    assert "client gone mid-stream" in caplog.text  # noticed and aborted, not run to its end
    (t,) = trajectories(server.app, ["drop"])
    assert t.metadata["calls"] == 1  # the dropped call left nothing in its session


def test_a_dropped_call_leaves_its_session_as_it_was(server):
    """A non-streamed call whose client goes away while it waits: its session untouched, and free again."""
    client = server.app.state.runtime.svc.client
    first = _chat(server, "wait", Q).json()
    history = Q + [{"role": "assistant", "content": first["choices"][0]["message"]["content"]}] + Q
    host = client._connection.host
    host._lock.acquire()  # as a long engine step does: the call cannot be queued until its client gives up
    try:
        with pytest.raises(httpx.ReadTimeout):
            _chat(server, "wait", history, max_tokens=400, timeout=0.5)
    finally:
        host._lock.release()
    deadline = time.monotonic() + 60
    while server.app.state.sessions.busy("wait"):  # until the server saw the drop and let go
        assert time.monotonic() < deadline, "the dropped call never let go of its session"
        time.sleep(0.05)
    again = _chat(server, "wait", history)
    assert again.status_code == 200 and again.json()["drift"] is False
    (t,) = trajectories(server.app, ["wait"])
    assert t.metadata["calls"] == 2  # the first call and this one: the dropped call left nothing


def test_a_call_dropped_while_it_samples_is_aborted(server):
    """A non-streamed call whose client goes away while its tokens are sampled: the request is aborted, not run
    to max_tokens, and its session is left as it was and free again."""
    client = server.app.state.runtime.svc.client
    first = _chat(server, "sampling", Q).json()
    history = Q + [{"role": "assistant", "content": first["choices"][0]["message"]["content"]}] + Q
    host, stats = client._connection.host, lambda: client.stats()[0]
    before = stats()["generated_tokens"]
    dropped: list[Exception] = []
    call = threading.Thread(target=lambda: _expect(httpx.ReadTimeout, dropped, _chat, server, "sampling", history,
                                                   max_tokens=480, timeout=1.0))
    call.start()
    deadline = time.monotonic() + 60
    while stats()["generated_tokens"] == before:  # until the call samples
        assert time.monotonic() < deadline and call.is_alive(), "the call never started sampling"
        time.sleep(0.001)
    with host._lock:  # no step until its client gave up
        call.join(60)
    assert dropped and not call.is_alive()
    while stats()["running"] or server.app.state.sessions.busy("sampling"):
        assert time.monotonic() < deadline, "the dropped call was not aborted, or kept its session"
        time.sleep(0.05)
    assert stats()["generated_tokens"] - before < 480  # aborted on the way
    again = _chat(server, "sampling", history)
    assert again.status_code == 200 and again.json()["drift"] is False
    (t,) = trajectories(server.app, ["sampling"])
    assert t.metadata["calls"] == 2  # the first call and this one: the dropped call left nothing


def _expect(error: type, caught: list, fn, *args, **kwargs) -> None:
    try:
        fn(*args, **kwargs)
    except error as e:
        caught.append(e)


def test_sse_over_http(server):
    with httpx.stream("POST", f"{server.url}/completions", headers=auth(server.token), timeout=60,
                      json={"model": "m", "prompt": "user : yes", "max_tokens": 3, "stream": True, "seed": 1}) as s:
        events = [ln.removeprefix("data: ") for ln in s.iter_lines() if ln]
    assert events[-1] == "[DONE]"
    plain = httpx.post(f"{server.url}/completions", headers=auth(server.token), timeout=60,
                       json={"model": "m", "prompt": "user : yes", "max_tokens": 3, "seed": 1}).json()
    chunks = [json.loads(e)["choices"][0] for e in events[:-1]]
    assert [c["text"] for c in chunks if c["text"]] == ["3", " no", " yes"], "a chunk per token, as sampled"
    assert "".join(c["text"] for c in chunks) == plain["choices"][0]["text"]
    assert chunks[-1]["finish_reason"] == "length" and chunks[-1]["token_ids"] == plain["choices"][0]["token_ids"]


def test_the_openai_package_as_client(server):
    import openai  # (a test dependency: pyproject's `test` extra)

    api = openai.OpenAI(base_url=server.url, api_key=server.token)
    out = api.chat.completions.create(model="m", messages=Q, max_tokens=3, seed=1, logprobs=True)
    assert out.choices[0].message.content and len(out.choices[0].logprobs.content) == 3
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url, api_key="wrong-token-0123456789").models.list()


def test_cli_serve_takes_the_openai_flags():
    from rollout_service.cli import parser

    args = parser().parse_args(["serve", "--config", "c.yaml", "--openai", "--openai-port", "9000"])
    assert args.openai and args.openai_port == 9000 and args.openai_host == "127.0.0.1"
    assert not parser().parse_args(["serve", "--config", "c.yaml"]).openai
