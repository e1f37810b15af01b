"""One colocated GRPO step on the GPU (needs Ray; on the lent H200, scripts/device_ray_env.sh provides it): a
learner actor in the worker's bundle trains in bf16 through fp32 master weights, the worker sleeps around
the learner phase and wakes with the new weights (CUDA IPC). Every phase of the step's log row is checked,
the fidelity report reaches the service, and a learner that runs out of memory says so with its figures
while the worker goes back to serving the last version."""
import math
import tempfile

import pytest
from kv_utils import requires_cuda
from model_utils import tiny_hf_model

# (reward and prompt functions from an importable module: a learner actor unpickles them)
from benchmarks.harness.rl_step import parity_reward, token_prompt  # noqa: E402

pytestmark = pytest.mark.skipif(**requires_cuda)
ray = pytest.importorskip("ray")

PHASES = ("rollout", "reward", "learner", "refresh", "sleep", "wake", "idle")
GRPO = dict(group_size=4, prompts_per_step=4, max_tokens=16, ignore_eos=True, lr=1e-5, device="cuda",
            dtype="bfloat16", optimizer="adamw", colocate=True, sleep_level=1, micro_batch=8)
PROBLEMS = [[1, 2, 3, 4], [7] * 20, list(range(30, 60)), [5, 9, 11]]


@pytest.fixture(scope="module")
def service():
    from rollout_service import RolloutClient
    folder = tempfile.mkdtemp()
    tiny_hf_model("llama").config.save_pretrained(folder)
    ray.init(address="local", num_cpus=4, num_gpus=1, include_dashboard=False)
    client = RolloutClient.launch({
        "name": "gpu-grpo", "num_workers": 1, "colocate": True, "resources": {"num_cpus": 2, "num_gpus": 1},
        "engine": {"model": folder, "load_format": "dummy", "dtype": "bfloat16", "device": "cuda",
                   "num_pages": 512, "max_num_seqs": 32, "cuda_graph_max_batch": 32}})
    client.config = tiny_hf_model("llama").config
    yield client
    client.close()
    ray.shutdown()


def learner(service, config=None, **overrides):
    from actors.grpo import GRPOActor
    return GRPOActor.options(**service.colocated_options(0)).remote(
        config or service.config, "gpu-grpo", {**GRPO, **overrides}, reward_fn=parity_reward, prompt_fn=token_prompt)


def test_one_colocated_step_logs_every_phase_and_reports_fidelity(service):
    actor = learner(service)
    start = ray.get(actor.push_weights.remote())  # the learner's weights on the worker: same weights at step 1
    row = ray.get(actor.step.remote(PROBLEMS, fp32_reference=8))
    for p in PHASES:
        assert math.isfinite(row[f"{p}_s"]) and row[f"{p}_s"] >= 0, p
    for p in ("rollout", "learner", "refresh", "sleep", "wake"):
        assert row[f"{p}_s"] > 0, p
    assert abs(sum(row[f"{p}_s"] for p in PHASES) - row["step_s"]) < 1e-3 * row["step_s"] + 1e-3
    assert 0 < row["overhead_share"] < 1 and row["colocated"] and row["learner_dtype"] == "bfloat16"
    assert row["rollout_tokens"] == 16 * 16 and row["rollout_wait_tokens_per_s"] > 0
    mem = row["learner_memory"]
    assert mem["device"].startswith("cuda") and 0 < mem["allocated"] <= mem["peak_allocated"] <= mem["device_total"]
    assert row["engine_memory_asleep"]["device_memory_bytes"] < 64 * 2**20  # KV cache and graphs freed
    # same weights at step 1: a bf16 learner and a bf16 engine differ by bf16 noise only, and the engine is
    # no further from the fp32 forward than the learner's own bf16 numerics (small slack: 8 sequences)
    assert row["mismatch_tokens"] > 0 and row["mismatch_max"] < 0.5 and row["ratio_max"] < 2
    fid = row["fidelity_vs_fp32"]
    assert fid["rollout_vs_fp32"]["n_tokens"] == 8 * 16 and fid["ratio"] is not None and fid["ratio"] < 1.5
    reports = [f for f in service.info()["fidelity"] if f["version"] == start]
    assert reports and reports[-1]["n_tokens"] == row["mismatch_tokens"]
    s = service.stats()[0]
    assert s["sleep_level"] == 0 and s["policy_version"] == start + 1 == row["step"]
    ray.kill(actor)


def test_learner_out_of_memory_is_reported_and_the_worker_serves_on(service):
    from rollout_service.api.types import SamplingParams
    big = tiny_hf_model("llama").config
    big.vocab_size = 32768  # logits of 64 samples x 44 positions x 32k: over a 0.25 GB cap
    actor = learner(service, big, memory_limit_gb=0.25, micro_batch=64, group_size=16)
    version = service.stats()[0]["policy_version"]
    with pytest.raises(ray.exceptions.RayTaskError) as e:
        ray.get(actor.step.remote(PROBLEMS))
    msg = str(e.value)
    assert "ran out of memory" in msg and "GiB" in msg and f"serve policy version {version}" in msg
    s = service.stats()[0]
    assert s["sleep_level"] == 0 and s["policy_version"] == version
    out = service.generate([[1, 2, 3]], SamplingParams(max_tokens=4, ignore_eos=True))
    assert out[0].token_versions == [version] * 4
    ray.kill(actor)
