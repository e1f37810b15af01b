"""A service of two routers (ServiceConfig.routers: 2) on the session's Ray cluster: each owns one of the two
tiny CPU workers and the requests that hash to it; the first coordinates refreshes, sleep and pause."""
from __future__ import annotations

import os

import numpy as np
import pytest
import ray
import torch

from ray_fixtures import cpu_engine
from rollout_service.api.types import RolloutRequest, SamplingParams
from rollout_service.client import RolloutClient
from rollout_service.config import ServiceConfig

pytest_plugins = ["ray_fixtures"]
pytestmark = pytest.mark.ray
NAME = "svc-routers"


@pytest.fixture(scope="module")
def client(ray_cluster, service_config):
    with RolloutClient.launch(service_config(name=NAME, routers=2)) as c:
        yield c


@pytest.fixture(scope="module")
def local(tiny_model_dir):
    with cpu_engine(tiny_model_dir, num_pages=256) as c:
        yield c


def _requests(k: int, seed: int = 0, metadata=None, **sampling) -> list[RolloutRequest]:
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, 256, (int(torch.randint(3, 20, (1,), generator=g)),), generator=g).tolist()
               for _ in range(k)]
    sampling = {"n": 2, "temperature": 0.9, "max_tokens": 8, "ignore_eos": True, **sampling}
    return [RolloutRequest(p, SamplingParams(seed=100 + i, **sampling), request_id=f"r{seed}-{i}", metadata=metadata)
            for i, p in enumerate(prompts)]


def _by_router(client) -> list[int]:
    return [r["requests"] for r in client.info()["routers"]]


def test_requests_spread_over_the_routers_and_equal_an_in_process_engine(client, local):
    before = _by_router(client)
    got, want = client.generate(_requests(16)), local.generate(_requests(16))
    taken = [a - b for a, b in zip(_by_router(client), before)]
    assert len(taken) == 2 and sum(taken) == 16 and min(taken) > 0
    assert [(r.request_id, r.sample_index) for r in got] == [(r.request_id, r.sample_index) for r in want]
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids
        np.testing.assert_allclose(g.logprobs, w.logprobs, rtol=1e-5, atol=1e-5)
    info = client.info()
    assert info["num_workers"] == 2 and len(info["alive"]) == 2 and all(info["alive"])
    assert len(client.stats()) == 2 and all(s["generated_tokens"] > 0 for s in client.stats())


def test_routers_and_workers_run_at_the_normal_cpu_priority(client):
    """Ray starts its workers at nice 15: beside any busy process at nice 0 they would get a few percent of a
    core (rollout_service/connections/ray_cluster.py, actor_env)."""
    routers = client._connection.routers
    workers = [w for r in routers for w in ray.get(r.__ray_call__.remote(lambda r: r.workers))]
    assert len(routers) == 2 and len(workers) == 2
    assert ray.get([a.__ray_call__.remote(lambda a: os.nice(0)) for a in routers + workers]) == [0] * 4


def test_a_sessions_requests_stay_on_one_router(client):
    before = _by_router(client)
    for turn in range(6):  # prompts that differ call by call, as an agent's history grows
        client.generate(_requests(1, seed=50 + turn, metadata={"session_id": "agent-7"}, n=1))
    taken = sorted(a - b for a, b in zip(_by_router(client), before))
    assert taken == [0, 6]


def test_a_refresh_reaches_every_router_or_none(client, local, make_tiny_llama):
    before = client.weights_digests()
    assert len(before) == 2 and before[0] == before[1] == local.weights_digests()[0]
    new = make_tiny_llama(seed=1).state_dict()
    bad = dict(new, **{"lm_head.weight": torch.zeros(3, 3)})
    with pytest.raises(ValueError, match="lm_head.weight"):
        client.update_weights(bad, version=1)
    assert client.weights_digests() == before
    assert [r["policy_version"] for r in client.info()["routers"]] == [0, 0]

    client.update_weights(new, version=1)
    local.update_weights(new, version=1)
    after = client.weights_digests()
    assert after[0] == after[1] == local.weights_digests()[0] != before[0]
    assert [r["policy_version"] for r in client.info()["routers"]] == [1, 1]
    results = client.generate(_requests(8, seed=2))
    assert {v for r in results for v in r.token_versions} == {1}


def test_sleep_pause_and_abort_span_the_routers(client):
    client.sleep()
    assert [r["asleep"] for r in client.info()["routers"]] == [1, 1]
    client.wake_up()
    assert [r["asleep"] for r in client.info()["routers"]] == [0, 0]

    client.pause()
    assert [r["paused"] for r in client.info()["routers"]] == [True, True]
    reqs = _requests(8, seed=3, max_tokens=400)
    stream = client.stream(reqs)
    aborted = client.abort([r.request_id for r in reqs])
    client.resume()
    assert sorted((r.request_id, r.sample_index) for r in aborted) == sorted(
        (r.request_id, i) for r in reqs for i in range(2))
    assert {r.finish_reason for r in aborted} == {"abort"}
    assert len(list(stream)) == 16  # the stream ends with them


def test_a_broadcast_and_a_scale_below_one_worker_per_router_are_refused(client):
    with pytest.raises(RuntimeError, match="needs one router"):
        client.init_weight_group()
    with pytest.raises(ValueError, match="one worker per router"):
        client.scale(1)
    assert client.generate(_requests(2, seed=4))  # still serving


def test_a_client_that_connects_reads_from_every_router(client):
    with RolloutClient.connect(NAME) as other:
        got = other.generate(_requests(8, seed=5, temperature=0.0, n=1))
    want = client.generate(_requests(8, seed=5, temperature=0.0, n=1))
    assert sorted((r.request_id, r.token_ids) for r in got) == sorted((r.request_id, r.token_ids) for r in want)


def test_router_counts_are_checked():
    with pytest.raises(ValueError, match="routers"):
        ServiceConfig(routers=0)
    with pytest.raises(ValueError, match=r"routers=3: must be an int in \[1, num_workers=2\]"):
        ServiceConfig(num_workers=2, routers=3)
