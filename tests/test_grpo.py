"""GRPO learner, logprob mismatch report and the arithmetic task set (tiny random models; seconds)."""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

from actors.grpo import GRPOConfig, GRPOLearner
from rollout_service.training.engine_match import check_bitwise_engine
from rollout_service.training.loss import ppo_clip_loss
from actors.learner import group_advantages
from rollout_service.examples import tasks
from rollout_service.client import RolloutClient
from rollout_service.training.mismatch import learner_logprobs, logprob_mismatch, token_logprobs
from rollout_service.api.types import RolloutResult
from tiny_models import tiny_hf_model


def _result(prompt, tokens, logprobs, version=0):
    return RolloutResult(request_id="r", sample_index=0, prompt_token_ids=list(prompt), token_ids=list(tokens),
                         logprobs=np.asarray(logprobs, dtype=np.float32), token_versions=[version] * len(tokens),
                         finish_reason="length")


def test_logprob_mismatch_figures():
    results = [_result([1, 2], [3, 4], [-1.0, -2.0]), _result([5], [6, 7, 8], [-0.5, -0.5, -0.5], version=3)]
    learner = [np.array([-1.1, -2.0]), np.array([-0.5, -0.2, -0.5])]
    rep = logprob_mismatch(results, learner)
    assert rep["n_tokens"] == 5 and rep["n_sequences"] == 2 and rep["versions"] == [0, 3]
    assert rep["max_abs"] == pytest.approx(0.3, abs=1e-6)
    assert rep["mean_abs"] == pytest.approx(0.4 / 5, abs=1e-6)
    assert rep["mean_signed"] == pytest.approx(0.2 / 5, abs=1e-6)
    d = np.array([-0.1, 0, 0, 0.3, 0])
    assert rep["kl"] == pytest.approx(float(np.mean(np.exp(d) - 1 - d)), rel=1e-5) and rep["kl"] > 0
    same = logprob_mismatch(results, [r.logprobs.copy() for r in results])
    assert same["max_abs"] == 0.0 and same["kl"] == 0.0


def test_logprob_mismatch_rejects_bad_input():
    results = [_result([1], [2, 3], [-1.0, -1.0])]
    with pytest.raises(ValueError, match="learner log-prob arrays"):
        logprob_mismatch(results, [])
    with pytest.raises(ValueError, match="result 0"):
        logprob_mismatch(results, [np.zeros(3)])
    with pytest.raises(ValueError, match="scaled"):
        logprob_mismatch([_result([1], [2], [-np.inf])], [np.zeros(1)])


def test_padded_recompute_matches_one_sequence_forward():
    torch.manual_seed(0)
    model = tiny_hf_model("llama")
    results = [_result([5, 9, 11], [3, 4, 7, 8], np.zeros(4)), _result([2], [6], np.zeros(1))]
    padded = learner_logprobs(model, results, temperature=0.7)
    for r, lp in zip(results, padded):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([r.prompt_token_ids + r.token_ids])).logits[0].float() / 0.7
        ref = torch.log_softmax(logits, -1)[len(r.prompt_token_ids) - 1:-1].gather(
            1, torch.tensor(r.token_ids)[:, None])[:, 0]
        np.testing.assert_allclose(lp, ref.numpy(), atol=1e-5)
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(model, results, temperature=0)


def test_group_advantages_normalise_within_groups():
    adv = group_advantages([1, 0, 0, 0, 0.1, 0.1, 0.1, 0.1], group_size=4)
    assert adv[:4].sum() == pytest.approx(0, abs=1e-5) and adv[0] > 0 > adv[1]
    assert np.all(adv[4:] == 0)  # a tied group teaches nothing
    with pytest.raises(ValueError):
        group_advantages([1, 0, 0], group_size=2)


def test_loss_truncates_importance_weight():
    old = torch.zeros(3)
    new = torch.tensor([0.0, math.log(5.0), math.log(0.5)], requires_grad=True)
    loss = ppo_clip_loss(new, old, advantage=-1.0, clip_eps=0.2, tis_cap=2.0)
    loss.backward()
    # token 0: ratio 1 -> grad 1; token 1: ratio 5 (unclipped for A<0) -> weight capped at 2;
    # token 2: ratio 0.5 < 1 - eps, clipped for A<0 -> no gradient.
    np.testing.assert_allclose(new.grad.numpy(), [1.0, 2.0, 0.0], atol=1e-6)


def test_task_reward_and_split():
    assert tasks.parse_answer("3 + 4 = 7\n\nmore") == 7 and tasks.parse_answer("Answer: 12") == 12
    assert tasks.parse_answer("To add 3 and 4 we") is None
    assert tasks.reward("7", 7) == pytest.approx(1 + tasks.FORMAT_REWARD)
    assert tasks.reward("8", 7) == pytest.approx(tasks.FORMAT_REWARD) and tasks.reward("seven", 7) == 0
    train, held = tasks.split(64)
    assert len(held) == 64 and not set(train) & set(held) and tasks.split(64) == (train, held)
    assert all(p.answer >= 0 for p in train + held)
    with pytest.raises(ValueError):
        tasks.split(0)


def test_two_grpo_steps_on_a_tiny_model():
    torch.manual_seed(0)
    policy = tiny_hf_model("llama", seed=1)
    client = RolloutClient.local(policy, backend="torch", dtype="float32", enable_cuda_graphs=False,
                                 kv_cache_memory_gb=0.01, max_num_seqs=16)
    cfg = GRPOConfig(group_size=4, prompts_per_step=2, max_tokens=6, lr=1e-3, seed=3)
    learner = GRPOLearner(policy, client, cfg, prompt_fn=lambda p: [1, 2 + p, 3],
                          reward_fn=lambda r: float(np.mean([t % 2 == 0 for t in r.token_ids])))
    before = {k: v.clone() for k, v in learner.policy.state_dict().items()}
    rows = [learner.step([0, 1], full_mismatch=True), learner.step([2, 3])]
    assert [r["step"] for r in rows] == [1, 2] and [r["policy_version_oldest"] for r in rows] == [0, 1]
    assert client.engine.policy_version == 2 and all(r["staleness"] == 0 for r in rows)
    assert all(math.isfinite(r["loss"]) and r["rollout_tokens"] == 2 * 4 * 6 for r in rows)
    assert rows[0]["mismatch_full_tokens"] == 48 and rows[0]["mismatch_full_mean"] <= 1e-4
    assert rows[0]["trained_samples"] > 0 and rows[0]["mismatch_tokens"] > 0 and rows[0]["mismatch_max"] <= 1e-3
    changed = [k for k, v in learner.policy.state_dict().items() if not torch.equal(v, before[k])]
    assert changed, "the update left every weight unchanged"
    # the engine serves the pushed weights: its log-probs match the learner's again after two updates
    results, _ = learner.rollout([5])
    rep = logprob_mismatch(results, learner_logprobs(learner.policy, results))
    assert rep["versions"] == [2] and rep["mean_abs"] <= 1e-4
    # prefetching: the next batch is submitted before the update; a step must then train on exactly it
    learner.step([6], prefetch=[7])
    with pytest.raises(ValueError, match="prefetched"):
        learner.step([8])
    row = learner.step([7])
    # submitted under version 2, and generated as soon as submitted (the engine steps in its own thread), so
    # while the learner trained on version 2's batch: its oldest tokens come from 2, or, if the update beat
    # the engine to them, 3
    assert row["step"] == 4 and row["policy_version_submitted"] == 2 and row["policy_version_oldest"] in (2, 3)
    client.close()


def _bitwise_setup(bitwise: bool, batch_invariant: bool = True, engine_dtype: str = "float32", **config):
    policy = tiny_hf_model("qwen3", seed=1)
    client = RolloutClient.local(policy, backend="torch", dtype=engine_dtype, enable_cuda_graphs=False,
                                 kv_cache_memory_gb=0.01, max_num_seqs=16, batch_invariant=batch_invariant)
    cfg = GRPOConfig(group_size=4, prompts_per_step=2, max_tokens=6, lr=1e-3, seed=3, temperature=0.7,
                     micro_batch=4, bitwise=bitwise, **config)
    learner = GRPOLearner(policy, client, cfg, prompt_fn=lambda p: [1, 2 + p, 3],
                          reward_fn=lambda r: float(np.mean([t % 2 == 0 for t in r.token_ids])))
    return client, learner


def test_bitwise_learner_ratio_is_exactly_one_against_a_batch_invariant_engine():
    client, learner = _bitwise_setup(bitwise=True)
    results, _ = learner.rollout([0, 1])
    with torch.no_grad():
        recomputed = learner.recompute(results)
    assert all(lp.numpy().tobytes() == r.logprobs.tobytes() for lp, r in zip(recomputed, results))
    rows = [learner.step([0, 1], full_mismatch=True), learner.step([2, 3])]
    first = rows[0]
    assert first["learner_bitwise"] and first["trained_samples"] > 4  # more than the first micro-batch
    assert first["ratio_first_minibatch_tokens"] > 0 and first["ratio_first_minibatch_max_abs_dev"] == 0.0
    assert first["mismatch_max"] == 0.0 and first["mismatch_full_max"] == 0.0 and first["ratio_max"] == 1.0
    # fp32 weights pushed as they are: on-policy after the update too
    assert rows[1]["step"] == 2 and rows[1]["ratio_first_minibatch_max_abs_dev"] == 0.0
    # each step checks 4 of its 8 rollouts' receipts (config.verify_receipts) against the weights it holds
    assert [row["receipts"] for row in rows] == [{"verified": 4, "failed": 0, "skipped": 4}] * 2
    results, _ = learner.rollout([0, 1])
    lp = results[0].logprobs.copy()
    lp[-1] += 1e-3
    tampered = [dataclasses.replace(results[0], logprobs=lp)] + results[1:]
    assert learner.verify_receipts(tampered) == {"verified": 3, "failed": 1, "skipped": 4}
    client.close()


def test_default_learner_ratio_is_only_close_to_one():
    """The transformers forward sums in another order than the invariant engine: float noise, not zero
    (nonzero in every tiny llama/qwen2/qwen3 set-up measured at temperature 1.0 and 0.7)."""
    client, learner = _bitwise_setup(bitwise=False)
    row = learner.step([0, 1])
    assert not row["learner_bitwise"] and row["ratio_first_minibatch_tokens"] > 0 and row["receipts"] is None
    assert 0.0 < row["ratio_first_minibatch_max_abs_dev"] < 1e-4
    client.close()


def test_bitwise_learner_refuses_an_engine_it_cannot_match():
    with pytest.raises(ValueError, match="rollout worker 0 is not batch-invariant"):
        _bitwise_setup(bitwise=True, batch_invariant=False)
    with pytest.raises(ValueError, match="runs in bfloat16, the learner in float32"):
        _bitwise_setup(bitwise=True, engine_dtype="bfloat16")
    with pytest.raises(ValueError, match="gradient_checkpointing"):
        GRPOConfig(bitwise=True, gradient_checkpointing=True)
    with pytest.raises(ValueError, match="bitwise"):
        GRPOConfig(bitwise="yes")


def test_bitwise_check_of_what_ray_workers_report(caplog):
    """Over Ray a worker's stats give its backend and device only: a worker on other ops than the learner's, or
    on another kind of device, is refused; one that does not say whether it is batch-invariant gets a warning."""
    cpu, f32 = torch.device("cpu"), torch.float32
    worker = {"batch_invariant": None, "dtype": None, "device": "cpu", "backend": "torch"}
    with pytest.raises(ValueError, match="rollout worker 1 runs the 'cuda' ops, the learner the 'torch' ops"):
        check_bitwise_engine([worker, {**worker, "backend": "cuda", "device": "cuda:0"}], f32, cpu)
    with pytest.raises(ValueError, match="rollout worker 0 is not batch-invariant"):
        check_bitwise_engine([{**worker, "batch_invariant": False}], f32, cpu)
    with pytest.raises(ValueError, match="same kind of device"):
        check_bitwise_engine([{**worker, "device": "cuda:0"}], f32, cpu)
    check_bitwise_engine([{**worker, "batch_invariant": True, "dtype": "float32"}], f32, cpu)
    assert "cannot check" not in caplog.text
    check_bitwise_engine([worker], f32, cpu)
    assert "cannot check" in caplog.text


@pytest.mark.parametrize("correction", ["tis", "mis"])
def test_grpo_with_a_rollout_correction(correction):
    """rollout_correction: each token weighed by the learner's and the engine's probability ratio; the fidelity
    report carries the ratio band's share and which correction ran."""
    torch.manual_seed(0)
    policy = tiny_hf_model("llama", seed=1)
    client = RolloutClient.local(policy, backend="torch", dtype="float32", enable_cuda_graphs=False,
                                 kv_cache_memory_gb=0.01, max_num_seqs=16)
    cfg = GRPOConfig(group_size=4, prompts_per_step=2, max_tokens=6, lr=1e-3, seed=3, rollout_correction=correction,
                     correction_cap=1.5)
    learner = GRPOLearner(policy, client, cfg, prompt_fn=lambda p: [1, 2 + p, 3],
                          reward_fn=lambda r: float(np.mean([t % 2 == 0 for t in r.token_ids])))
    before = {k: v.clone() for k, v in learner.policy.state_dict().items()}
    row = learner.step([0, 1])
    assert math.isfinite(row["loss"]) and row["trained_samples"] > 0
    assert any(not torch.equal(v, before[k]) for k, v in learner.policy.state_dict().items())
    (report,) = [f for f in client.info()["fidelity"] if f["version"] == 0]
    assert report["rollout_correction"] == correction and report["ratio_cap"] == 1.5
    assert report["ratio_outside_share"] == 0.0  # fp32 engine and learner on the same weights: ratios ~1
    client.close()


def test_grpo_config_refuses_an_unknown_correction():
    with pytest.raises(ValueError, match="rollout_correction='is'"):
        GRPOConfig(rollout_correction="is")
    with pytest.raises(ValueError, match="correction_cap=1"):
        GRPOConfig(correction_cap=1)
