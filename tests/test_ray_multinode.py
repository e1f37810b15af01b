"""cluster_configs/multi-node.yaml on a real multi-node Ray cluster (ray.cluster_utils.Cluster: a head
and two nodes advertising the custom resource `rollout_node`), plus staleness and a permanent death."""
from __future__ import annotations

import time
from pathlib import Path

import pytest
import ray

from rollout_service.config import ServiceConfig
from rollout_service.connections.ray import RayConnection
from rollout_service.api.types import RolloutRequest, SamplingParams

pytest_plugins = ["ray_fixtures"]
pytestmark = pytest.mark.ray
MULTI_NODE = str(Path(__file__).resolve().parents[1] / "cluster_configs" / "multi-node.yaml")


@pytest.fixture(scope="module")
def backend(ray_cluster, tiny_model_dir):
    cfg = ServiceConfig.load(MULTI_NODE, name="svc-multi", max_restarts=0, max_staleness=0,
                             engine={"model": tiny_model_dir, "num_pages": 256, "kv_cache_memory_gb": 0.05})
    b = RayConnection.start_service(cfg)
    yield b
    b.close()


def test_workers_land_one_per_rollout_node(ray_cluster, backend):
    cfg = ServiceConfig.from_yaml(MULTI_NODE)
    assert cfg.placement.strategy == "STRICT_SPREAD" and cfg.resources.custom == {"rollout_node": 1}
    nodes = [s["node_id"] for s in backend.stats()]
    rollout_nodes = {n.node_id for n in ray_cluster.rollout_nodes}
    assert len(nodes) == 2 and set(nodes) == rollout_nodes
    assert ray_cluster.head_node.node_id not in nodes
    res = list(backend.submit([RolloutRequest([1, 2, 3], SamplingParams(n=2, max_tokens=5))]))
    assert sorted(r.sample_index for r in res) == [0, 1]


def test_placement_that_cannot_fit_fails_clearly(ray_cluster, tiny_model_dir):
    # three STRICT_SPREAD workers need three rollout nodes; the cluster has two
    with pytest.raises(ValueError, match="cannot place 3 rollout worker.*STRICT_SPREAD"):
        RayConnection.start_service(MULTI_NODE, name="svc-too-big", num_workers=3,
                          placement={"timeout_s": 3}, engine={"model": tiny_model_dir})


def test_stale_results_are_regenerated_with_the_current_policy(backend, make_tiny_llama, refresh_mid_generation):
    it = backend.submit([RolloutRequest([5, 6, 7, i], SamplingParams(max_tokens=300, ignore_eos=True),
                                        request_id=f"st{i}") for i in range(4)])
    refresh_mid_generation(backend, make_tiny_llama(seed=3).state_dict(), 1)
    results = list(it)
    assert sorted(r.request_id for r in results) == [f"st{i}" for i in range(4)]
    # max_staleness=0: nothing generated (even partly) by version 0 is delivered
    assert all(r.token_versions == [1] * 300 for r in results), \
        [(r.request_id, sorted(set(r.token_versions))) for r in results]
    assert backend.info()["stale_regenerated"] >= 1


def test_worker_dead_for_good_its_requests_finish_elsewhere(backend):
    workers = ray.get(backend.router.__ray_call__.remote(lambda router: router.workers))
    lengths = [10 + 25 * i for i in range(8)]
    it = backend.submit([RolloutRequest([9, i], SamplingParams(max_tokens=lengths[i], ignore_eos=True),
                                        request_id=f"d{i}") for i in range(8)])
    got = [next(it)]
    ray.kill(workers[1], no_restart=True)  # max_restarts=0 as well: it never comes back
    got += list(it)
    assert sorted(r.request_id for r in got) == [f"d{i}" for i in range(8)]
    assert all(len(r.token_ids) == lengths[int(r.request_id[1:])] for r in got)
    deadline = time.time() + 30
    while backend.info()["alive"][1] and time.time() < deadline:
        time.sleep(0.2)
    assert [s["alive"] for s in backend.stats()] == [True, False]
    assert len(list(backend.submit([RolloutRequest([1], SamplingParams(max_tokens=3))]))) == 1
