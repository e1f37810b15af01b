"""Token-exact sessions of the OpenAI endpoint and the learner's view of them, on a real local client: a
resent history that renders back to the sampled tokens, one rewritten by the client (drift), the loss mask,
log-probs and versions, rewards, save_results, release, and the store's bounds (eviction, idle expiry)."""
from __future__ import annotations

import logging

import numpy as np
import pytest
from fastapi.testclient import TestClient
from openai_setup import TOKEN, auth

from rollout_service.openai import openai_app, release, set_reward, trajectories
from rollout_service.openai.schemas import ApiError
from rollout_service.api.types import RolloutResult
from rollout_service.openai.sessions import SessionStore
from rollout_service.results import load_results, save_results

pytest_plugins = ["openai_setup"]  # the tok and client fixtures

Q1 = {"role": "user", "content": "yes or no ?"}
Q2 = {"role": "user", "content": "1 2 3 ?"}


@pytest.fixture(scope="module")
def app(client):
    return openai_app(client, token=TOKEN)


@pytest.fixture(scope="module")
def http(app):
    with TestClient(app) as h:
        yield h


def chat(http, messages, session=None, header=True, **body):
    headers = {**auth(TOKEN), **({"X-Session-Id": session} if session and header else {})}
    extra = {"session_id": session} if session and not header else {}
    r = http.post("/v1/chat/completions", headers=headers,
                  json={"model": "m", "messages": messages, "max_tokens": 4, "seed": 1, **extra, **body})
    assert r.status_code == 200, r.text
    return r.json()


def ids(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def test_a_resent_history_continues_the_recorded_tokens(http, app, client, tok):
    first = chat(http, [Q1], "clean")
    (c1,) = first["choices"]
    answer = {"role": "assistant", "content": c1["message"]["content"]}
    second = chat(http, [Q1, answer, Q2], "clean", header=False, seed=2)  # the body field names it this time
    added = ids(tok, "user : 1 2 3 ? assistant :")
    recorded = first["prompt_token_ids"] + c1["token_ids"]
    assert second["prompt_token_ids"] == recorded + added and second["drift"] is False
    (c2,) = second["choices"]
    (t,) = trajectories(app, ["clean"])
    assert t.prompt_token_ids == first["prompt_token_ids"]
    assert t.token_ids == c1["token_ids"] + added + c2["token_ids"]
    assert t.loss_mask == [1] * 4 + [0] * len(added) + [1] * 4
    mask = np.array(t.loss_mask)  # log-probs: kept whether or not the call asked for them; 0.0 where mask is 0
    assert np.all(t.logprobs[mask == 0] == 0.0) and np.all(t.logprobs[mask == 1] < 0)
    assert t.token_versions == [0] * len(t.token_ids) and t.metadata == {"session_id": "clean", "drift": 0, "calls": 2}
    assert [(x["start"], x["end"], x["drift"]) for x in t.turns] == [(0, 4, False), (4 + len(added), len(t.token_ids), False)]


def test_logprobs_of_a_session_are_the_sampled_ones(http, app):
    out = chat(http, [Q1], "lp", logprobs=True)
    (t,) = trajectories(app, "lp")
    assert np.array_equal(t.logprobs, np.float32([e["logprob"] for e in out["choices"][0]["logprobs"]["content"]]))


def test_a_rewritten_history_keeps_the_sampled_tokens_and_counts_drift(http, app, tok):
    first = chat(http, [Q1], "drift")
    sampled = first["choices"][0]["token_ids"]
    dropped = {"role": "assistant", "content": ""}  # a client (or template) that drops the earlier answer
    second = chat(http, [Q1, dropped, Q2], "drift", seed=3)
    recorded = first["prompt_token_ids"] + sampled
    # the new messages only, rendered as a continuation after the recorded turn
    assert second["prompt_token_ids"] == recorded + ids(tok, "user : 1 2 3 ? assistant :") and second["drift"] is True
    rewritten = {"role": "assistant", "content": "no " * 4}  # or re-serialised into other tokens
    third = chat(http, [Q1, dropped, Q2, rewritten, Q1], "drift", seed=4)
    assert third["drift"] is True
    assert third["prompt_token_ids"][:len(second["prompt_token_ids"])] == second["prompt_token_ids"]
    (t,) = trajectories(app, ["drift"])
    assert t.metadata["drift"] == 2 and [x["drift"] for x in t.turns] == [False, True, True]
    assert t.token_ids[:4] == sampled and sum(t.loss_mask) == 12


def test_a_session_must_resend_its_history(http):
    first = chat(http, [Q1], "short")
    r = http.post("/v1/chat/completions", headers={**auth(TOKEN), "X-Session-Id": "short"},
                  json={"messages": [Q1], "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = http.post("/v1/chat/completions", headers={**auth(TOKEN), "X-Session-Id": "short"},
                  json={"messages": [Q1], "max_tokens": 2, "n": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"
    answer = {"role": "assistant", "content": first["choices"][0]["message"]["content"]}
    assert chat(http, [Q1, answer, Q2], "short")["drift"] is False  # the refusals changed nothing


def test_rewards_save_and_release(http, app, client, tmp_path):
    chat(http, [Q1], "r1")
    chat(http, [Q2], "r2")
    client.set_reward("r1", 1.0)  # through the client the app was built on (RolloutClient's methods)
    set_reward(app, "r2", -0.5)
    got = client.trajectories(["r1", "r2"])
    assert [t.reward for t in got] == [1.0, -0.5]
    assert save_results(tmp_path / "t.msgpack", got) == 2
    assert load_results(tmp_path / "t.msgpack") == got
    assert client.release_sessions(["r1", "never"]) == 1 and release(app, ["r2"]) == 1
    with pytest.raises(ValueError, match="no session 'r1'"):
        trajectories(app, ["r1"])
    with pytest.raises(ValueError, match="finite number"):
        set_reward(app, "lp", float("nan"))


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _used(store: SessionStore, sid: str) -> None:
    s = store.begin(sid)
    s.prompt_ids = [1]  # as if a call had finished (a session no call finished is not kept)
    store.end(s)


def test_the_store_evicts_the_least_recently_used_idle_session(caplog):
    clock = Clock()
    store = SessionStore(max_sessions=2, idle_s=100, clock=clock)
    _used(store, "a")
    clock.t = 1
    _used(store, "b")
    clock.t = 2
    _used(store, "a")  # a is used again: b is now the oldest
    held = store.begin("b")  # ... but busy, so a third session evicts a
    with caplog.at_level(logging.WARNING, logger="rollout_service.openai"):
        _used(store, "c")
    assert "evicted session 'a'" in caplog.text and "max_sessions=2" in caplog.text
    with pytest.raises(ApiError) as busy:
        store.begin("b")
    assert busy.value.status == 409
    with pytest.raises(ApiError) as full:  # both held: no room, and nothing to evict
        store.begin("c") and store.begin("d")
    assert full.value.status == 429
    store.end(held)
    assert len(store) == 2


def test_the_store_drops_idle_sessions():
    clock = Clock()
    store = SessionStore(max_sessions=10, idle_s=100, clock=clock)
    _used(store, "old")
    clock.t = 50
    _used(store, "new")
    clock.t = 120
    _used(store, "newer")  # any call expires what has been idle too long
    with pytest.raises(KeyError):
        store.get("old")
    assert store.get("new") and len(store) == 2
    s = store.begin("fresh")
    store.end(s)  # a session whose only call failed is not kept
    assert len(store) == 2


def test_a_call_whose_session_was_released_meanwhile_touches_only_its_own_hold():
    """A learner releases a session while its call runs and a new call begins the same id: the old call's
    settle records nothing and its end does not free the new call's hold."""
    store = SessionStore(max_sessions=10, idle_s=100)
    old = store.begin("s")
    assert store.release(["s"]) == 1
    new = store.begin("s")
    result = RolloutResult(request_id="r", sample_index=0, prompt_token_ids=[1, 2], token_ids=[3],
                           logprobs=[-0.5], token_versions=[0], finish_reason="stop")
    store.settle(old, [1, 2], False, result, 1, None)
    store.end(old)
    assert store.busy("s")  # still the new call's
    with pytest.raises(KeyError):
        store.get("s")  # the old call recorded nothing
    store.settle(new, [1, 2], False, result, 1, None)
    store.end(new)
    assert not store.busy("s") and store.get("s").token_ids == [3]


def test_a_sessions_calls_carry_its_id_so_that_they_share_a_router(http, client, monkeypatch):
    """Over Ray with several routers, a request goes to the router its metadata's session id hashes to
    (rollout_service/connections/request_shards.py): every call of a session must carry it."""
    from rollout_service.connections.request_shards import split

    sent, stream = [], client.stream
    monkeypatch.setattr(client, "stream", lambda request, *a, **k: sent.append(request) or stream(request, *a, **k))
    first = chat(http, [Q1], "routed")
    answer = {"role": "assistant", "content": first["choices"][0]["message"]["content"]}
    chat(http, [Q1, answer, Q2], "routed")
    chat(http, [Q2])  # no session: no id
    assert [r.metadata for r in sent] == [{"session_id": "routed"}] * 2 + [None]
    assert sent[0].prompt != sent[1].prompt and len(split(sent[:2], 4)) == 1
