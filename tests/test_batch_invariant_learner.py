"""The bitwise learner's gradients: GRPO's loss through InvariantForward's log-probs has the gradient of the same
loss through the transformers forward (mismatch.token_logprobs), as close to a float64 computation as that
reference's own float32 error (tests/numerics.py), on the rollouts of a batch-invariant engine."""
import numpy as np
import pytest
import torch
from numerics import assert_as_close_as_the_reference, float64_copy
from tiny_models import tiny_hf_model

from rollout_service.engine.engine import Engine
from rollout_service.training.mismatch import token_logprobs
from rollout_service.training import InvariantForward
from rollout_service.training.loss import ppo_clip_loss
from rollout_service.api.types import RolloutRequest, SamplingParams

PROMPTS = [[1, 5, 9, 33], list(range(40, 75)), [7]]  # 35 tokens: crosses a 16-row tile of the products
ADVANTAGES = [1.0, -0.5, -0.5]  # per sample of a group of 3


def _rollouts(policy, temperature: float) -> list:
    engine = Engine(model_source=policy, device="cpu", num_pages=64, batch_invariant=True, enable_cuda_graphs=False)
    sp = SamplingParams(n=3, temperature=temperature, max_tokens=12, ignore_eos=True, seed=5, logprobs_mode="scaled")
    for i, p in enumerate(PROMPTS):
        engine.add_request(RolloutRequest(prompt=p, sampling=sp, request_id=str(i)))
    return sorted(engine.run_until_done(), key=lambda r: (int(r.request_id), r.sample_index))


def _loss_grads(policy, results, logprobs) -> list[torch.Tensor]:
    policy.zero_grad()
    loss = sum(ppo_clip_loss(lp, torch.from_numpy(np.asarray(r.logprobs)), ADVANTAGES[r.sample_index], 0.2, 2.0)
               for lp, r in zip(logprobs, results))
    loss.backward()
    return [p.grad.clone() for p in policy.parameters()]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_grpo_loss_gradient_matches_the_reference_forward(arch, temperature):
    policy = tiny_hf_model(arch, seed=4)
    results = _rollouts(policy, temperature)
    ours = _loss_grads(policy, results, InvariantForward(policy).logprobs(results, temperature))
    ref = _loss_grads(policy, results, token_logprobs(policy, results, temperature))
    exact_policy = float64_copy(policy)
    exact = _loss_grads(exact_policy, results, token_logprobs(exact_policy, results, temperature))
    for (name, _), a, b, e in zip(policy.named_parameters(), ours, ref, exact):
        assert b.abs().max() > 0, f"{name}: no gradient"
        assert_as_close_as_the_reference(a, b, e, name)
