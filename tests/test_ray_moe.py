"""A mixture-of-experts model through the Ray service: two workers load a tiny Qwen3-MoE saved as a HF folder
(per-expert names on disk), and refreshes over the object store, with transformers' stacked names or the
per-expert ones, leave every worker bitwise equal to an in-process engine given the same tensors; routed experts
come back through the service as the in-process engine returns them."""
from __future__ import annotations

import pytest
from ray_fixtures import cpu_engine, tiny_service_config
from test_moe_weights import per_expert
from tiny_models import tiny_hf_model

from rollout_service.client import RolloutClient
from rollout_service.api.types import SamplingParams

pytest_plugins = ["ray_fixtures"]
pytestmark = pytest.mark.ray

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PROMPTS = [[5, 6, 7], [9, 1]]
SHAPE = dict(num_hidden_layers=2, norm_topk_prob=True)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_qwen3_moe")
    tiny_hf_model("qwen3_moe", seed=0, **SHAPE).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def svc(ray_cluster, moe_dir):
    with RolloutClient.launch(tiny_service_config(moe_dir, name="svc-moe")) as c:
        yield c


@pytest.fixture(scope="module")
def local(moe_dir):
    with cpu_engine(moe_dir, num_pages=64) as c:
        yield c


def tokens(client) -> list:
    return [r.token_ids for r in client.generate(PROMPTS, GREEDY)]


def test_workers_load_the_folder_as_the_local_engine_does(svc, local):
    assert svc.weights_digests() == [local.weights_digests()[0]] * 2 and tokens(svc) == tokens(local)


@pytest.mark.parametrize("version,names", [(1, "stacked"), (2, "per_expert")])
def test_object_store_refresh_is_bitwise(svc, local, version, names):
    state = tiny_hf_model("qwen3_moe", seed=version, **SHAPE).state_dict()
    named = state if names == "stacked" else per_expert(state)
    assert svc.update_weights(named, version) == "object_store"
    local.update_weights(named, version)
    assert svc.weights_digests() == [local.weights_digests()[0]] * 2
    assert tokens(svc) == tokens(local)


def test_a_refresh_missing_an_expert_changes_nothing(svc):
    before = svc.weights_digests()
    named = per_expert(tiny_hf_model("qwen3_moe", seed=9, **SHAPE).state_dict())
    del named["model.layers.0.mlp.experts.2.down_proj.weight"]
    with pytest.raises(ValueError, match=r"missing, e.g. \['model.layers.0.mlp.experts.2.down_proj.weight'\]"):
        svc.update_weights(named, 3)
    assert svc.weights_digests() == before


def test_routed_experts_come_back_through_the_service_and_its_streams(svc, local):
    """Results travel pickled from the workers through the router: their routing arrives as the in-process
    engine's, in a generate and in a stream, with a reward computed by the workers too."""
    sp = SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=6, ignore_eos=True, return_routed_experts=True,
                        return_prompt_routed_experts=True)
    key = lambda r: (tuple(r.prompt_token_ids), r.sample_index)  # noqa: E731
    want = {key(r): r for r in local.generate(PROMPTS, sp)}
    reward = "rollout_service.rewards.examples:length_reward"
    for got in (svc.generate(PROMPTS, sp), list(svc.stream(PROMPTS, sp, reward=reward))):
        assert sorted(map(key, got)) == sorted(want)
        for r in got:
            w = want[key(r)]
            assert r.token_ids == w.token_ids and r.routed_experts.dtype == w.routed_experts.dtype
            assert r.routed_experts.tobytes() == w.routed_experts.tobytes()
            assert r.prompt_routed_experts.tobytes() == w.prompt_routed_experts.tobytes()
