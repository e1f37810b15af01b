"""Batch-invariant mode on mixture-of-experts models (torch backend): a sequence's tokens and log-prob bytes
are the same alone, among batch mates (whose tokens change how many rows each expert's product takes) and after
a preemption, and InvariantForward over the transformers MoE policy recomputes the rollout's bytes, with the
reference math's gradients."""
import pytest
import torch
from engine_waves import serve_in_waves
from numerics import assert_as_close_as_the_reference, float64_copy
from test_batch_invariant import _prompts, same_bytes
from test_moe import moe_model

from rollout_service.engine.engine import Engine
from rollout_service.training.mismatch import token_logprobs
from rollout_service.training.invariant_forward import InvariantForward
from rollout_service.api.types import SamplingParams

SAMPLED = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True, seed=11, logprobs_mode="scaled")
TARGET = list(range(3, 44))  # 41 tokens: crosses a 16-row tile and a partial page
NAMES = ["qwen3_moe-sparse_step", "mixtral"]


def run(model, requests, **config) -> dict:
    eng = Engine(model_source=model, device="cpu", num_pages=config.pop("num_pages", 512), batch_invariant=True,
                 **config)
    return serve_in_waves(eng, requests)


def results(out: dict) -> list:
    return [r for k, r in out.items() if k != "stats"]


@pytest.fixture(scope="module", params=NAMES)
def model_and_alone(request):
    model = moe_model(request.param)
    return model, run(model, [(TARGET, SAMPLED)])[(0, 0)]


@pytest.mark.parametrize("mates,seed", [(1, 0), (9, 2)])
def test_same_bytes_in_batches_of_any_size(model_and_alone, mates, seed):
    model, alone = model_and_alone
    greedy = SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True)
    others = [(p, SAMPLED if i % 2 else greedy) for i, p in enumerate(_prompts(mates, seed))]
    batch = others[: mates // 2] + [(TARGET, SAMPLED)] + others[mates // 2:]
    assert same_bytes(run(model, batch)[(mates // 2, 0)], alone)


def test_same_bytes_after_preemption_and_chunked_prefill(model_and_alone):
    model, alone = model_and_alone
    requests = [(p, SAMPLED) for p in _prompts(5, 3, longest=40)] + [(TARGET, SAMPLED)]
    got = run(model, requests, num_pages=14, page_size=8, max_num_batched_tokens=24)
    assert got["stats"]["recomputes"] > 0
    assert same_bytes(got[(5, 0)], alone)


@pytest.mark.parametrize("name", ["qwen3_moe", "qwen3_moe-norm_topk_prob", "qwen3_moe-sparse_step", "mixtral"])
def test_learner_recompute_equals_rollout_bytes(name):
    policy = moe_model(name, seed=2)
    sp = SamplingParams(temperature=0.7, max_tokens=14, ignore_eos=True, seed=3, n=2, logprobs_mode="scaled")
    rollouts = results(run(policy, [(p, sp) for p in _prompts(4, 7)]))
    with torch.no_grad():
        recomputed = InvariantForward(policy).logprobs(rollouts, 0.7)
    assert all(lp.numpy().tobytes() == r.logprobs.tobytes() for lp, r in zip(recomputed, rollouts))


@pytest.mark.parametrize("name", ["qwen3_moe-sparse_step", "mixtral"])
def test_gradients_match_the_reference_forward(name):
    """InvariantForward's backward (the experts held at the engine's choice) is as close to a float64
    computation as the same gradients through the transformers forward (tests/numerics.py)."""
    policy = moe_model(name, seed=5)
    sp = SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True, seed=2, logprobs_mode="scaled")
    rollouts = results(run(policy, [(p, sp) for p in _prompts(3, 9)]))
    exact_policy = float64_copy(policy)
    exact_policy.set_experts_implementation("eager")  # transformers' default grouped_mm has no float64 kernel

    def grads(model, fn):
        model.zero_grad()
        sum(lp.sum() for lp in fn()).backward()
        return [p.grad.clone() for p in model.parameters()]

    ours = grads(policy, lambda: InvariantForward(policy).logprobs(rollouts))
    ref = grads(policy, lambda: token_logprobs(policy, rollouts))
    exact = grads(exact_policy, lambda: token_logprobs(exact_policy, rollouts))
    for (param_name, _), a, b, e in zip(policy.named_parameters(), ours, ref, exact):
        assert b.abs().max() > 0, f"{param_name}: no gradient"
        assert_as_close_as_the_reference(a, b, e, param_name)
