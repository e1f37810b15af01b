"""The GRPO learner with routing replay (GRPOConfig.routing_replay) on a tiny Qwen3-MoE, in-process: a bf16 engine
routes some tokens otherwise than the fp32 learner would; with replay the learner recomputes with the engine's
experts, its step rows and fidelity reports say so, and its mismatch is smaller than a plain learner's on the
same rollouts."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from test_moe import moe_model
from tiny_models import tiny_hf_model

from actors.grpo import GRPOConfig, GRPOLearner
from rollout_service.client import RolloutClient
from rollout_service.training.mismatch import token_logprobs


def learner(replay: bool, policy=None) -> tuple[RolloutClient, GRPOLearner]:
    policy = policy if policy is not None else moe_model("qwen3_moe", seed=1)
    client = RolloutClient.local(policy, backend="torch", dtype="bfloat16", enable_cuda_graphs=False,
                                 kv_cache_memory_gb=0.01, max_num_seqs=32)
    cfg = GRPOConfig(group_size=4, prompts_per_step=4, max_tokens=16, lr=1e-3, seed=3, micro_batch=8,
                     routing_replay=replay)
    try:
        return client, GRPOLearner(policy, client, cfg, prompt_fn=lambda p: [1, 2 + p, 3, 7 + p, 11],
                                   reward_fn=lambda r: float(np.mean([t % 2 == 0 for t in r.token_ids])))
    except ValueError:
        client.close()
        raise


def test_two_steps_with_routing_replay_and_a_smaller_mismatch():
    client, replaying = learner(True)
    results, _ = replaying.rollout([0, 1])
    assert all(r.routed_experts is not None and r.prompt_routed_experts is not None for r in results)
    with torch.no_grad():
        got = replaying.recompute(results)
        want = token_logprobs(replaying.policy, results, routing_replay=True)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    rows = [replaying.step([0, 1, 2, 3], full_mismatch=True), replaying.step([4, 5, 6, 7])]
    assert [r["step"] for r in rows] == [1, 2] and all(math.isfinite(r["loss"]) for r in rows)
    assert all(r["routing_replay"] and 0.0 <= r["routing_differing_share"] < 0.2 for r in rows)
    reports = client.info()["fidelity"]
    assert [f["routing_replay"] for f in reports] == [1, 1] and "routing_differing_share" in reports[0]
    client.close()

    plain_client, plain = learner(False)
    plain_row = plain.step([0, 1, 2, 3])  # the same rollouts: same weights, seeds and engine
    plain_client.close()
    print(f"GRPO step 1, bf16 engine, fp32 learner: mismatch mean {plain_row['mismatch_mean']:.4f} max "
          f"{plain_row['mismatch_max']:.3f} plain; {rows[0]['mismatch_mean']:.4f} / {rows[0]['mismatch_max']:.3f} "
          f"with replay ({rows[0]['mismatch_tokens']} tokens; in the replayed forward the policy's routers differ on "
          f"{rows[0]['routing_differing_share']:.1%})")
    assert plain_row["rollout_tokens"] == rows[0]["rollout_tokens"] and plain_row["routing_differing_share"] is None
    assert rows[0]["mismatch_max"] < plain_row["mismatch_max"] and rows[0]["mismatch_mean"] < plain_row["mismatch_mean"]


def test_routing_replay_is_checked():
    with pytest.raises(ValueError, match="GRPOConfig.routing_replay='yes': must be true or false"):
        GRPOConfig(routing_replay="yes")
    with pytest.raises(ValueError, match=r"GRPOConfig.routing_replay: the policy \(llama\) has no mixture-of-experts"):
        learner(True, tiny_hf_model("llama"))
