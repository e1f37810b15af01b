"""The learner actor against a live service: behaviour log-probs equal the learner's HF recomputation,
a policy step + push switches the service to the new weights (log-probs match again, exactly)."""
from __future__ import annotations

import numpy as np
import pytest
import ray

from actors.learner import LearnerActor, group_advantages
from rollout_service.connections.ray import RayConnection

pytest_plugins = ["ray_fixtures"]
pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def service(ray_cluster, service_config):
    b = RayConnection.start_service(service_config(name="svc-learn", namespace="rollout_service"))
    yield b
    b.close()


def test_group_advantages():
    a = group_advantages([1, 0, 0, 1, 2, 2], 2)
    np.testing.assert_allclose(a, [1, -1, -1, 1, 0, 0], atol=1e-5)
    with pytest.raises(ValueError, match="groups of 4"):
        group_advantages([1, 2, 3], 4)


def test_learner_actor_round_trip(service, tiny_model_dir):
    learner = LearnerActor.options(num_cpus=0).remote(tiny_model_dir, service="svc-learn", lr=1e-2)
    prompts = [[1, 2, 3], [4, 5, 6, 7]]
    sampling = {"n": 4, "temperature": 1.0, "max_tokens": 12, "ignore_eos": True, "seed": 3}
    results = ray.get(learner.rollout.remote(prompts, sampling))
    assert len(results) == 8 and all(r.token_versions == [0] * 12 for r in results)
    # the service's behaviour log-probs are what HF transformers computes on the same weights and tokens
    assert ray.get(learner.behaviour_gap.remote(results)) < 1e-4

    rewards = [float(np.mean(r.token_ids) > 128) for r in results]
    if len(set(rewards)) == 1:
        rewards[0] = 1.0 - rewards[0]
    step = ray.get(learner.policy_step.remote(results, group_advantages(rewards, 4)))
    assert np.isfinite(step["loss"]) and abs(step["mean_ratio"] - 1.0) < 1e-3  # on-policy: ratios are 1
    assert ray.get(learner.push_weights.remote()) == 1
    assert [s["policy_version"] for s in service.stats()] == [1, 1]

    after = ray.get(learner.rollout.remote(prompts, sampling))
    assert all(r.token_versions == [1] * 12 for r in after)
    assert any(a.token_ids != b.token_ids for a, b in zip(after, results)), "the step changed the policy"
    assert ray.get(learner.behaviour_gap.remote(after)) < 1e-4  # the refresh delivered exactly these weights
    ray.kill(learner)
