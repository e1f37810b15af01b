"""The bitwise learner's gradients: GRPO's loss through InvariantForward's log-probs has the gradient of the same
loss through the transformers forward (mismatch.token_logprobs), to float32 rounding, on the rollouts of a
batch-invariant engine."""
import numpy as np
import pytest
import torch
from tiny_models import tiny_hf_model

from actors.grpo import grpo_token_loss
from rollout_service.engine.engine import Engine
from rollout_service.mismatch import token_logprobs
from rollout_service.training import InvariantForward
from rollout_service.types import RolloutRequest, SamplingParams

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
    loss = sum(grpo_token_loss(lp, torch.from_numpy(np.asarray(r.logprobs)), ADVANTAGES[r.sample_index], 0.2, 2.0)
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
    for (name, _), a, b in zip(policy.named_parameters(), ours, ref):
        assert b.abs().max() > 0, f"{name}: no gradient"
        # Both sides are float32 roundings of one gradient (each a few 1e-6 from a float64 forward's, in norm): a
        # fixed atol would be below the rounding of the largest entries, so atol follows the parameter's scale.
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5 * float(b.abs().max()), msg=lambda m: f"{name}: {m}")
