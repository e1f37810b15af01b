"""The OpenAI endpoint in front of a Ray service (two CPU workers on openai_setup's word model, loaded from a
folder as a deployment would), talked to by the official `openai` client over HTTP: a chat call is
token-exact against the service's own generate with the same seed, and a session keeps every token it sampled
across a worker killed during one of its calls (the router generates that call again, with its seed, on a
live worker)."""
from __future__ import annotations

import threading

import numpy as np
import pytest
from openai_setup import TOKEN, word_model, word_tokenizer

from ray_fixtures import kill_worker, tiny_service_config, wait_for
from rollout_service import RolloutClient, SamplingParams
from rollout_service.openai import serve_openai, trajectories

pytest_plugins = ["ray_fixtures"]
pytestmark = pytest.mark.ray

Q = [{"role": "user", "content": "yes or no ?"}]


@pytest.fixture(scope="module")
def tok():
    return word_tokenizer()


@pytest.fixture(scope="module")
def svc(ray_cluster, tok, tmp_path_factory):
    folder = tmp_path_factory.mktemp("word_model")
    word_model(tok).save_pretrained(folder)
    tok.save_pretrained(folder)
    with RolloutClient.launch(tiny_service_config(str(folder), name="svc-openai", max_restarts=4)) as client:
        yield client


@pytest.fixture(scope="module")
def api(svc, tok):
    import openai

    server = serve_openai(svc, port=0, token=TOKEN, block=False, tokenizer=tok)
    yield openai.OpenAI(base_url=server.url, api_key=TOKEN, max_retries=0, timeout=300), server
    server.stop()


def _chat(client, messages: list, session: str, **kw):
    return client.chat.completions.create(model="m", messages=messages, seed=7, temperature=1.0, logprobs=True,
                                          extra_headers={"X-Session-Id": session}, **kw)


def test_a_chat_call_equals_the_services_own_generate(api, svc, tok):
    client, _ = api
    out = client.chat.completions.create(model="m", messages=Q, n=2, max_tokens=6, seed=5, temperature=1.0,
                                         logprobs=True)
    prompt = tok.apply_chat_template(Q, add_generation_prompt=True, tokenize=True)
    prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    assert out.model_extra["prompt_token_ids"] == prompt
    want = svc.generate(prompt, SamplingParams(n=2, max_tokens=6, seed=5, temperature=1.0))
    for choice, res in zip(out.choices, want):
        assert choice.model_extra["token_ids"] == res.token_ids
        assert np.array_equal(np.float32([t.logprob for t in choice.logprobs.content]), res.logprobs)
    stream = client.chat.completions.create(model="m", messages=Q, n=2, max_tokens=6, seed=5, temperature=1.0,
                                            stream=True)
    pieces = {0: [], 1: []}
    for chunk in stream:
        for c in chunk.choices:
            if c.delta.content:
                pieces[c.index].append(c.delta.content)
    for choice in out.choices:  # token by token through the router, adding up to the whole answer
        assert len(pieces[choice.index]) > 1 and "".join(pieces[choice.index]) == choice.message.content


def test_a_sessions_calls_stay_on_the_worker_of_its_first(api, svc):
    """The session id reaches the router with each call (metadata), which sends every call after the first to the
    first one's worker (actors/affinity.py)."""
    client, _ = api
    before = svc.info()["routing"]["by_session"]
    history = list(Q)
    for _ in range(3):
        out = _chat(client, history, "pinned", max_tokens=3)
        history += [{"role": "assistant", "content": out.choices[0].message.content}] + Q
    assert svc.info()["routing"]["by_session"] - before == 2


def _holding_worker(svc) -> int | None:
    """The worker holding a sequence, queued or running (None: none does)."""
    return next((i for i, s in enumerate(svc.stats())
                 if s.get("alive", True) and (s.get("queued") or s.get("running"))), None)


def test_a_session_loses_nothing_to_a_worker_killed_during_its_call(api, svc):
    client, server = api
    history, sampled = list(Q), []
    first = _chat(client, history, "agent", max_tokens=4)
    sampled.append(first.choices[0].model_extra["token_ids"])
    history += [{"role": "assistant", "content": first.choices[0].message.content}] + Q

    # the workers held between steps (pause) take the call but cannot finish it: it is in flight on one of them
    # when that one is killed, however fast or slow this machine is
    got = {}
    svc.pause()
    try:
        call = threading.Thread(target=lambda: got.update(r=_chat(client, history, "agent", max_tokens=300)))
        call.start()
        wait_for(lambda: _holding_worker(svc) is not None, "the call reaching a worker", 120)
        kill_worker(svc, _holding_worker(svc))
    finally:
        svc.resume()
    call.join(timeout=600)
    assert not call.is_alive() and "r" in got, "the call did not come back after its worker died"
    second = got["r"]
    assert len(second.choices[0].model_extra["token_ids"]) == 300 and second.model_extra["drift"] is False
    sampled.append(second.choices[0].model_extra["token_ids"])

    (t,) = trajectories(server.app, ["agent"])
    assert t.metadata["calls"] == 2 and t.metadata["drift"] == 0
    model_tokens = [tid for tid, m in zip(t.token_ids, t.loss_mask) if m == 1]
    assert model_tokens == [tid for turn in sampled for tid in turn]  # every sampled token, in order, once
    assert len(t.logprobs) == len(t.token_ids) == len(t.token_versions)



def test_ray_serve_replicas_and_the_uvicorn_endpoint_share_the_services_sessions(api, svc):
    """The endpoint as two Ray Serve replicas beside the uvicorn one of `api` (this process): one session's calls
    alternate between the two, so every call after the first is served by a process that did not serve the one
    before it, yet continues from the recorded tokens; and the learner's own client reads the trajectory (the
    sessions live in the service's actor, not in any endpoint process)."""
    import openai
    from ray import serve
    from ray_fixtures import free_ports

    from rollout_service.openai.replicas import serve_openai_replicas

    here, _ = api
    eps = serve_openai_replicas(svc, replicas=2, port=free_ports(1)[0], token=TOKEN, num_cpus=0,
                                proxy_location="HeadOnly")
    try:
        status = serve.status().applications[f"{svc._connection.name}-openai"].deployments["openai"]
        assert eps.url.endswith("/v1") and status.replica_states.get("RUNNING") == 2
        there = openai.OpenAI(base_url=eps.url, api_key=TOKEN, max_retries=0, timeout=300)
        history, sampled, prompts = list(Q), [], []
        for client in (here, there, here):
            out = _chat(client, history, "both", max_tokens=5)
            assert out.model_extra["drift"] is False
            prompts.append(out.model_extra["prompt_token_ids"])
            sampled.append(out.choices[0].model_extra["token_ids"])
            history += [{"role": "assistant", "content": out.choices[0].message.content}] + Q
        want = svc.generate(prompts[1], SamplingParams(max_tokens=5, seed=7, temperature=1.0))[0]
        assert sampled[1] == want.token_ids  # token-exact through Serve too
        for k in (1, 2):  # the replica continued this process's call, and this process the replica's
            assert prompts[k][:len(prompts[k - 1]) + len(sampled[k - 1])] == prompts[k - 1] + sampled[k - 1]

        (t,) = svc.trajectories(["both"])  # the learner's client, not an endpoint's
        assert t.metadata["calls"] == 3 and [tid for tid, m in zip(t.token_ids, t.loss_mask) if m] == sum(sampled, [])
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=eps.url, api_key="wrong", max_retries=0).models.list()
        app = f"{svc._connection.name}-openai"
        svc.close()  # (the module's last test) the owner closing its service removes its endpoint replicas too
        assert app not in serve.status().applications
    finally:
        eps.stop()  # (nothing left to remove once the service closed)
        serve.shutdown()
