"""Routed experts (R3) through the Ray service on a GPU worker whose MoE layers run the fused kernels in CUDA
graphs: a generate and a stream bring back, byte for byte, the tokens and routing of an in-process engine on the
same weights (needs Ray; on the lent GPU, scripts/device_ray_env.sh provides it)."""
import tempfile

import pytest
from kv_utils import requires_cuda
from test_moe_gpu import moe_hf

from rollout_service.api.types import SamplingParams

pytestmark = pytest.mark.skipif(**requires_cuda)
ray = pytest.importorskip("ray")

PROMPTS = [[1, 2, 3, 4], [7] * 20, list(range(30, 90))]
ENGINE = dict(dtype="bfloat16", device="cuda", backend="cuda", num_pages=1024, max_num_seqs=16,
              cuda_graph_max_batch=16)
ROUTED = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=20, ignore_eos=True, return_routed_experts=True,
                        return_prompt_routed_experts=True)


@pytest.fixture(scope="module")
def folder():
    path = tempfile.mkdtemp()
    moe_hf().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def local(folder):
    from rollout_service import RolloutClient
    with RolloutClient.local(folder, **ENGINE) as c:
        assert c.engine.runner.graphs is not None  # the MoE decode is captured
        yield c


@pytest.fixture(scope="module")
def service(folder):
    from rollout_service import RolloutClient
    ray.init(address="local", num_cpus=4, num_gpus=1, include_dashboard=False)
    client = RolloutClient.launch({"name": "gpu-moe", "num_workers": 1, "resources": {"num_cpus": 1, "num_gpus": 1},
                                   "engine": {"model": folder, **ENGINE}})
    yield client
    client.close()
    ray.shutdown()


def test_routed_experts_through_the_service_and_its_streams(service, local):
    key = lambda r: (tuple(r.prompt_token_ids), r.sample_index)  # noqa: E731
    want = {key(r): r for r in local.generate(PROMPTS, ROUTED)}
    for got in (service.generate(PROMPTS, ROUTED), list(service.stream(PROMPTS, ROUTED))):
        assert sorted(map(key, got)) == sorted(want)
        for r in got:
            w = want[key(r)]
            assert r.token_ids == w.token_ids and r.logprobs.tobytes() == w.logprobs.tobytes()
            assert r.routed_experts.shape == (20, 3, 4) and r.routed_experts.tobytes() == w.routed_experts.tobytes()
            assert r.prompt_routed_experts.tobytes() == w.prompt_routed_experts.tobytes()
