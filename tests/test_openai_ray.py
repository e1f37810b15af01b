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


def _replica_actors() -> list:
    import ray
    return [ray.get_actor(a["name"], namespace=a["namespace"])
            for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith("SERVE_REPLICA::")]


def test_ray_serve_replicas_share_a_session_that_outlives_every_replica(svc, tok):
    """The endpoint as two Ray Serve replicas: a session's first call, then every replica killed (Serve starts
    new ones), then its next call: the new replica never saw the session, yet continues it from the recorded
    tokens, and the learner's own client reads the trajectory (sessions live in the service's actor)."""
    import openai
    import ray
    from ray import serve
    from ray_fixtures import free_ports

    from rollout_service.openai.replicas import serve_openai_replicas

    eps = serve_openai_replicas(svc, replicas=2, port=free_ports(1)[0], token=TOKEN, num_cpus=0, proxy_location="HeadOnly")
    try:
        assert eps.url.endswith("/v1") and len(_replica_actors()) == 2
        client = openai.OpenAI(base_url=eps.url, api_key=TOKEN, max_retries=0, timeout=300)
        history, sampled = list(Q), []
        first = _chat(client, history, "replicas", max_tokens=5)
        prompt = first.model_extra["prompt_token_ids"]
        want = svc.generate(prompt, SamplingParams(max_tokens=5, seed=7, temperature=1.0))[0]
        assert first.choices[0].model_extra["token_ids"] == want.token_ids  # token-exact through Serve too
        sampled.append(want.token_ids)

        for replica in _replica_actors():
            ray.kill(replica, no_restart=True)
        wait_for(lambda: serve.status().applications[f"{svc._connection.name}-openai"].deployments["openai"]
                 .replica_states.get("RUNNING", 0) == 2 and len(_replica_actors()) == 2, "Serve replacing both replicas", 600)

        history += [{"role": "assistant", "content": first.choices[0].message.content}] + Q
        second = _chat_retried(client, history, "replicas", max_tokens=5)
        assert second.model_extra["drift"] is False
        assert second.model_extra["prompt_token_ids"][:len(prompt) + 5] == prompt + sampled[0]
        sampled.append(second.choices[0].model_extra["token_ids"])

        (t,) = svc.trajectories(["replicas"])  # the learner's client, not a replica's
        assert t.metadata["calls"] == 2 and [tid for tid, m in zip(t.token_ids, t.loss_mask) if m] == sampled[0] + sampled[1]
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=eps.url, api_key="wrong", max_retries=0).models.list()
    finally:
        eps.stop()
        serve.shutdown()


def _chat_retried(client, messages: list, session: str, **kw):
    """A call the Serve proxy may first route to a replica it has not yet seen die: a 5xx, then a retry."""
    import openai

    for attempt in range(5):
        try:
            return _chat(client, messages, session, **kw)
        except openai.InternalServerError:
            if attempt == 4:
                raise
