"""GRPO on multi-turn episodes: the loss, the token counts and the fidelity report use only the tokens the model
sampled (loss_mask == 1), and a GRPO step runs on episode groups end to end (tiny random models; seconds)."""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

from actors.grpo import GRPOConfig, GRPOLearner
from benchmarks.harness.multiturn import SyntheticEnv
from rollout_service.client import RolloutClient
from rollout_service.training.mismatch import logprob_mismatch, num_model_tokens, token_logprobs
from rollout_service.api.types import RolloutResult
from tiny_models import tiny_hf_model

MASK = [1, 1, 0, 0, 0, 1, 1]  # a model turn, three environment tokens, the next model turn


def _client(policy):
    return RolloutClient.local(policy, backend="torch", dtype="float32", enable_cuda_graphs=False,
                               kv_cache_memory_gb=0.01, max_num_seqs=16)


@pytest.fixture(scope="module")
def episodes():
    """Two episode-like results of one group: behaviour log-probs = the policy's own on the model's tokens,
    0.0 on the environment's (as the engine reports them)."""
    policy = tiny_hf_model("llama", seed=1)
    results = [RolloutResult("g", k, [1, 2, 3], tokens, np.zeros(7), [0] * 7, "done", loss_mask=list(MASK))
               for k, tokens in enumerate(([10, 11, 12, 13, 14, 15, 16], [20, 21, 22, 23, 24, 25, 26]))]
    with torch.no_grad():
        lps = token_logprobs(policy, results)
    return [dataclasses.replace(r, logprobs=lp.numpy() * np.array(MASK)) for r, lp in zip(results, lps)]


def _train(results, client):
    learner = GRPOLearner(tiny_hf_model("llama", seed=1), client, GRPOConfig(group_size=2, lr=1e-2, seed=0))
    before = [p.detach().clone() for p in learner.policy.parameters()]
    stats = learner.train_on(results, [1.0, 0.0])
    return stats, before, [p.detach().clone() for p in learner.policy.parameters()]


def _with_logprob(results, i, value):
    out = [dataclasses.replace(r, logprobs=r.logprobs.copy()) for r in results]
    out[0].logprobs[i] = value
    return out


def test_mismatch_compares_and_counts_the_models_tokens_only():
    r = RolloutResult("r", 0, [1, 2], [3, 4, 5, 6], [-1.0, 0.0, 0.0, -2.0], [0, 0, 0, 1], "done",
                      loss_mask=[1, 0, 0, 1])
    rep = logprob_mismatch([r], [np.array([-1.1, -9.0, -9.0, -2.0])])
    assert rep["n_tokens"] == 2 and rep["max_abs"] == pytest.approx(0.1, abs=1e-6) and rep["versions"] == [0, 1]
    assert num_model_tokens([r, dataclasses.replace(r, loss_mask=None)]) == 2 + 4


def test_train_on_ignores_the_environments_tokens(episodes):
    client = _client(tiny_hf_model("llama", seed=1))
    base, before, after = _train(episodes, client)
    assert math.isfinite(base["loss"]) and math.isfinite(base["grad_norm"]) and base["grad_norm"] > 0
    assert base["trained_samples"] == 2 and base["mismatch"]["n_tokens"] == 2 * sum(MASK)
    assert base["mismatch"]["max_abs"] <= 1e-5  # on-policy on the model's tokens (the env's 0.0 is not compared)
    assert any(not torch.equal(a, b) for a, b in zip(before, after))
    # a mask-0 token's behaviour log-prob changes nothing: loss, gradient and update are the same
    env_changed, _, env_after = _train(_with_logprob(episodes, 3, -7.0), client)
    assert env_changed["loss"] == base["loss"] and env_changed["grad_norm"] == base["grad_norm"]
    assert all(torch.equal(a, b) for a, b in zip(after, env_after))
    # a mask-1 token's does (the test can fail), and so would every token without a mask
    model_changed, _, _ = _train(_with_logprob(episodes, 5, float(episodes[0].logprobs[5]) - 0.5), client)
    unmasked, _, _ = _train([dataclasses.replace(r, loss_mask=None) for r in episodes], client)
    assert model_changed["loss"] != base["loss"] and unmasked["mismatch"]["n_tokens"] == 14
    assert unmasked["loss"] != base["loss"]
    client.close()


def test_a_grpo_step_on_episode_groups():
    torch.manual_seed(0)
    policy = tiny_hf_model("llama", seed=2)
    client = _client(policy)
    cfg = GRPOConfig(group_size=4, prompts_per_step=2, max_tokens=5, lr=1e-3, seed=3, max_turns=3,
                     max_total_tokens=64)

    def parity(r):  # differs within a group, so every group trains
        return float(np.mean([t % 2 == 0 for t, m in zip(r.token_ids, r.loss_mask) if m]))

    learner = GRPOLearner(policy, client, cfg, env_fn=lambda p: SyntheticEnv(p, 4, 3, 256), reward_fn=parity)
    before = {k: v.clone() for k, v in learner.policy.state_dict().items()}
    row = learner.step([0, 1], full_mismatch=True)
    model_tokens = 2 * 4 * 3 * 5
    assert row["rollout_tokens"] == model_tokens and row["mismatch_full_tokens"] == model_tokens
    # the engine's log-probs of every turn (its KV of the history, the environment's tokens in it) agree with
    # the learner's forward over the whole episode
    assert row["mismatch_full_mean"] <= 1e-4 and row["mismatch_max"] <= 1e-3
    assert math.isfinite(row["loss"]) and row["trained_samples"] > 0
    assert any(not torch.equal(v, before[k]) for k, v in learner.policy.state_dict().items())
    results, _ = learner.rollout([2])
    assert client.engine.policy_version == 1 and all(r.finish_reason == "max_turns" for r in results)
    assert all(set(r.token_versions) == {1} and sum(r.loss_mask) == 15 for r in results)
    client.close()
