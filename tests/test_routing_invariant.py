"""Batch-invariant mode with routing replay: InvariantForward takes the experts a batch-invariant engine recorded
(RolloutResult.routed_experts + prompt_routed_experts) and still recomputes the rollout's log-prob bytes; that it
does take them shows when the recorded experts are changed."""
import numpy as np
import pytest
import torch
from engine_waves import serve_in_waves
from test_batch_invariant import _prompts
from test_moe import moe_model

from actors.grpo import GRPOConfig, GRPOLearner
from rollout_service.client import RolloutClient
from rollout_service.engine.engine import Engine
from rollout_service.training.invariant_forward import InvariantForward
from rollout_service.api.types import SamplingParams

SP = SamplingParams(temperature=0.7, max_tokens=14, ignore_eos=True, seed=3, n=2, logprobs_mode="scaled",
                    return_routed_experts=True, return_prompt_routed_experts=True)


def rollouts(policy, **config) -> tuple[list, dict]:
    eng = Engine(model_source=policy, device="cpu", batch_invariant=True, **{"num_pages": 512, **config})
    out = serve_in_waves(eng, [(p, SP) for p in _prompts(4, 7)])
    return [r for k, r in out.items() if k != "stats"], out["stats"]


def with_routing(r, routed: np.ndarray):
    return type(r)(**{**vars(r), "routed_experts": routed})


@pytest.mark.parametrize("name", ["qwen3_moe-sparse_step", "mixtral"])
def test_the_recorded_routing_is_taken_and_the_bytes_stay(name):
    policy = moe_model(name, seed=2)
    results, stats = rollouts(policy, num_pages=14, page_size=8, max_num_batched_tokens=24)
    assert stats["recomputes"] > 0 and max(len(r.prompt_token_ids) for r in results) > 24  # preempted, chunked
    assert all(r.routed_experts is not None for r in results)
    with torch.no_grad():
        replayed = InvariantForward(policy).logprobs(results, 0.7)
    assert all(lp.numpy().tobytes() == r.logprobs.tobytes() for lp, r in zip(replayed, results))

    r = results[0]
    other = r.routed_experts.copy()
    other[5, 0] = [e for e in range(4) if e not in other[5, 0]][:2]  # token 5's first MoE layer: two other experts
    with torch.no_grad():
        changed = InvariantForward(policy).logprobs([with_routing(r, other)], 0.7)[0].numpy()
    assert np.array_equal(changed[:5], r.logprobs[:5]) and not np.array_equal(changed[5:], r.logprobs[5:])


def test_grpo_bitwise_with_routing_replay_keeps_the_ratio_at_one():
    policy = moe_model("qwen3_moe", seed=1)
    client = RolloutClient.local(policy, backend="torch", dtype="float32", enable_cuda_graphs=False,
                                 kv_cache_memory_gb=0.01, max_num_seqs=16, batch_invariant=True)
    cfg = GRPOConfig(group_size=4, prompts_per_step=2, max_tokens=6, lr=1e-3, seed=3, temperature=0.7, micro_batch=4,
                     bitwise=True, routing_replay=True)
    learner = GRPOLearner(policy, client, cfg, prompt_fn=lambda p: [1, 2 + p, 3],
                          reward_fn=lambda r: float(np.mean([t % 2 == 0 for t in r.token_ids])))
    results, _ = learner.rollout([0, 1])
    assert all(r.prompt_routed_experts is not None for r in results)
    row = learner.step([0, 1])
    assert row["routing_replay"] and row["ratio_first_minibatch_max_abs_dev"] == 0.0 and row["mismatch_max"] == 0.0
    client.close()
