"""The service on a GPU (needs Ray; on the lent H200, scripts/device_ray_env.sh provides it): CUDA IPC refresh
from this process (the learner) into a GPU worker, bitwise equal to an in-process engine on the same
weights; a bad refresh changes nothing; a refresh mid-generation shows in token_versions; sleep/wake."""
import tempfile

import pytest
import torch
from kv_utils import requires_cuda
from model_utils import tiny_hf_model

from rollout_service.api.types import RolloutRequest, SamplingParams

pytestmark = pytest.mark.skipif(**requires_cuda)
ray = pytest.importorskip("ray")

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
PROMPTS = [[1, 2, 3, 4], [7] * 20, list(range(30, 60))]
ENGINE = dict(dtype="bfloat16", device="cuda", num_pages=2048, max_num_seqs=16, cuda_graph_max_batch=16)


def weights(seed: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    m = tiny_hf_model("llama")
    with torch.no_grad():
        m.lm_head.weight.mul_(20.0)  # peaked logits: greedy tokens tell weights apart
    return {k: v.to("cuda", torch.bfloat16) for k, v in m.state_dict().items()}


def local_tokens(sd: dict) -> list:
    """The same engine in this process, on the same weights: what the worker must produce, bitwise."""
    from rollout_service import RolloutClient
    m = tiny_hf_model("llama")
    m.load_state_dict({k: v.float().cpu() for k, v in sd.items()})
    with RolloutClient.local(m, **ENGINE) as c:
        return [(r.token_ids, r.logprobs.tolist()) for r in c.generate(PROMPTS, GREEDY)]


@pytest.fixture(scope="module")
def service():
    from rollout_service import RolloutClient
    folder = tempfile.mkdtemp()
    tiny_hf_model("llama").config.save_pretrained(folder)
    ray.init(address="local", num_cpus=4, num_gpus=1, include_dashboard=False)
    client = RolloutClient.launch({"name": "gpu-svc", "num_workers": 1, "resources": {"num_cpus": 1, "num_gpus": 1},
                                   "engine": {"model": folder, "load_format": "dummy", **ENGINE}})
    yield client
    client.close()
    ray.shutdown()


def tokens(client) -> list:
    return [(r.token_ids, r.logprobs.tolist()) for r in client.generate(PROMPTS, GREEDY)]


def test_cuda_ipc_refresh_is_bitwise_and_bad_ones_change_nothing(service):
    a, b = weights(1), weights(2)
    assert service.update_weights(a, 1) == "cuda_ipc"  # auto: GPU tensors on the workers' node
    assert tokens(service) == local_tokens(a)
    bad = dict(b)
    bad["model.layers.1.mlp.down_proj.weight"] = b["model.layers.1.mlp.down_proj.weight"][:, :-1]
    with pytest.raises(ValueError, match="down_proj.*shape"):
        service.update_weights(bad, 2, transport="cuda_ipc")
    nan = dict(b)
    nan["model.norm.weight"] = b["model.norm.weight"].clone()
    nan["model.norm.weight"][5] = float("nan")
    with pytest.raises(ValueError, match="model.norm.weight.*NaN"):
        service.update_weights(nan, 2, transport="cuda_ipc")
    assert service.stats()[0]["policy_version"] == 1
    assert tokens(service) == local_tokens(a)
    assert service.update_weights(b, 2, transport="cuda_ipc") == "cuda_ipc"  # the same buckets, refilled
    assert tokens(service) == local_tokens(b)


def test_refresh_mid_generation_shows_in_token_versions(service):
    from ray_fixtures import _refresh_mid_generation
    version = service.stats()[0]["policy_version"] + 1
    it = service.stream([RolloutRequest([3, 1, 4], SamplingParams(max_tokens=2000, ignore_eos=True),
                                        request_id=f"long{i}") for i in range(2)])
    _refresh_mid_generation(service, weights(3), version)
    for r in it:
        v = r.token_versions
        assert v[0] == version - 1 and v[-1] == version and v == sorted(v), v


def test_sleep_level2_frees_the_gpu_then_ipc_refresh_and_wake(service):
    awake = service.stats()[0]
    service.sleep(2)
    asleep = service.stats()[0]
    print(f"worker GPU memory: awake {awake['device_memory_bytes'] / 2**20:.0f} MiB (process "
          f"{(awake['process_gpu_bytes'] or 0) / 2**20:.0f}), asleep(2) {asleep['device_memory_bytes'] / 2**20:.0f} "
          f"MiB (process {(asleep['process_gpu_bytes'] or 0) / 2**20:.0f})")
    assert asleep["sleep_level"] == 2 and asleep["weights"] == "dropped"
    assert asleep["device_memory_bytes"] < 0.25 * awake["device_memory_bytes"]
    it = service.stream(PROMPTS, GREEDY)  # waits while asleep
    with pytest.raises(ValueError, match="level=2"):
        service.wake_up()
    c = weights(4)
    service.update_weights(c, asleep["policy_version"] + 1)
    service.wake_up()
    got = sorted(((r.token_ids, r.logprobs.tolist()) for r in it), key=lambda t: len(t[0]))
    assert len(got) == 3 and tokens(service) == local_tokens(c)
    service.release_weight_buffers()
