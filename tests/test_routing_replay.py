"""Routing replay on the learner's side (training/routing_replay.py) over transformers' Qwen3-MoE and Mixtral: the
experts transformers computes with are the engine's recorded ones at every position, the log-prob mismatch of a
bf16 engine against an fp32 learner shrinks with replay, and gradients reach the routers through the softmax at
the recorded experts (equal to transformers' own where the routing agrees, to InvariantForward's with the same
recorded experts where it does not, gradient checkpointing included)."""
import numpy as np
import pytest
import torch
from routing_hf import captured_experts
from test_engine import prompts
from test_moe import moe_model
from tiny_models import tiny_hf_model

from rollout_service import RolloutClient, SamplingParams
from rollout_service.training.mismatch import mismatch_report, token_logprobs
from rollout_service.training import replay_routing
from rollout_service.training.invariant_forward import InvariantForward

SP = SamplingParams(n=4, temperature=1.0, max_tokens=24, seed=3, ignore_eos=True, logprobs_mode="scaled",
                    return_routed_experts=True, return_prompt_routed_experts=True)
NAMES = ["qwen3_moe", "qwen3_moe-norm_topk_prob", "mixtral"]


def rollouts(model, dtype: str, k: int = 8, seed: int = 1) -> list:
    with RolloutClient.local(model, device="cpu", dtype=dtype, backend="torch", num_pages=256) as client:
        return client.generate(prompts(k, seed=seed, lo=4, hi=40), SP)


@pytest.fixture(scope="module", params=NAMES)
def bf16_engine(request):
    """An fp32 policy and the rollouts of a bf16 engine on its weights: bf16 router logits break some near-ties
    the other way, so the engine's routing differs from the policy's on a few tokens."""
    model = moe_model(request.param, seed=1)
    return request.param, model, rollouts(model, "bfloat16")


def recorded(r) -> np.ndarray:
    return np.concatenate([r.prompt_routed_experts, r.routed_experts])


def test_transformers_computes_with_the_recorded_experts_at_every_position(bf16_engine):
    _, model, results = bf16_engine
    own, replayed = [], []
    for replay, out in ((False, own), (True, replayed)):
        with captured_experts(model) as calls, torch.no_grad():
            token_logprobs(model, results, routing_replay=replay)
        out += [calls[0][b, :len(recorded(r))] for b, r in enumerate(results)]
    assert any(not np.array_equal(o, recorded(r)) for o, r in zip(own, results)), "the routing was meant to differ"
    assert all(np.array_equal(got, recorded(r)) for got, r in zip(replayed, results))


def test_replay_shrinks_the_mismatch_of_a_bf16_engine(bf16_engine):
    name, model, results = bf16_engine
    plain = mismatch_report(model, results)
    replay = mismatch_report(model, results, routing_replay=True)
    print(f"{name}: bf16 engine vs fp32 learner, {plain['n_tokens']} tokens; routing differs (>= 1 expert) on "
          f"{plain['routing_differing_share']:.1%} of them; |Δ log-prob| mean {plain['mean_abs']:.4f} max "
          f"{plain['max_abs']:.3f} without replay, {replay['mean_abs']:.4f} / {replay['max_abs']:.3f} with")
    assert plain["routing_differing_share"] > 0 and not plain["routing_replay"] and replay["routing_replay"]
    assert replay["mean_abs"] < 0.85 * plain["mean_abs"] and replay["max_abs"] < 0.5 * plain["max_abs"]


def router_grads(model, results, replay: bool) -> list[torch.Tensor]:
    model.zero_grad()
    with replay_routing(model, results) if replay else torch.enable_grad():
        sum(lp.sum() for lp in token_logprobs(model, results)).backward()
    return [layer.mlp.gate.weight.grad.clone() for layer in model.model.layers]


@pytest.mark.parametrize("name", ["qwen3_moe-norm_topk_prob", "mixtral"])
def test_gradients_reach_the_routers_as_transformers_own_where_routing_agrees(name):
    model = moe_model(name, seed=2)
    results = rollouts(model, "float32", k=3, seed=4)  # fp32 engine: the same routing as the policy's
    assert mismatch_report(model, results)["routing_differing_share"] == 0.0
    replayed, own = router_grads(model, results, True), router_grads(model, results, False)
    for a, b in zip(replayed, own):
        assert a.abs().max() > 0 and torch.allclose(a, b, rtol=1e-5, atol=1e-7)


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def test_gradients_where_replay_overrides_the_router_are_the_replayed_forwards(bf16_engine):
    """Where the recorded experts differ from the policy's choice, the routers' gradients are those of the
    replayed forward: transformers' under replay agree with InvariantForward's (our own ops and backward, given
    the same recorded experts) to float32 rounding, and differ from transformers' own-routing gradients. So do
    they with gradient checkpointing, whose recompute in the backward runs inside the replay block."""
    _, model, results = bf16_engine
    grads, own = router_grads(model, results, True), router_grads(model, results, False)
    model.zero_grad()
    sum(lp.sum() for lp in InvariantForward(model).logprobs(results)).backward()
    ours = [layer.mlp.gate.weight.grad.clone() for layer in model.model.layers]
    assert all(relative(g, o) < 1e-4 and relative(g, w) > 1e-2 for g, o, w in zip(grads, ours, own))
    model.train()
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    try:  # each layer's recompute in the backward runs inside the replay block: the same experts, the same grads
        checkpointed = router_grads(model, results, True)
    finally:
        model.activation_checkpointing_disable()
        model.eval()
    assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-7) for a, b in zip(checkpointed, grads))


def test_what_replay_refuses(bf16_engine):
    _, model, results = bf16_engine
    r = results[0]
    without_prompt = type(r)(**{**vars(r), "prompt_routed_experts": None})
    with pytest.raises(ValueError, match=r"result 1 has no prompt_routed_experts: sample with .*"
                                         "return_prompt_routed_experts=True"):
        token_logprobs(model, [r, without_prompt], routing_replay=True)
    with pytest.raises(ValueError, match=r"the forward has \d+ rows; the replayed results' layout"):
        with replay_routing(model, results[:2]), torch.no_grad():
            token_logprobs(model, results[:3])
    with pytest.raises(ValueError, match=r"the policy \(llama\) has no mixture-of-experts layers"):
        token_logprobs(tiny_hf_model("llama"), [r], routing_replay=True)
    other = tiny_hf_model(model.config.model_type, num_experts_per_tok=3)
    with pytest.raises(ValueError, match=r"result 0's routed_experts has shape \(24, 2, 2\); the policy has 2 MoE "
                                         "layers of top-3"):
        token_logprobs(other, [r], routing_replay=True)


def test_replay_over_episodes():
    """An episode's result replays as any other: its environment's tokens carry routing too, and only the
    model's tokens (loss_mask) are counted."""
    from test_routing_engine import Echo
    model = moe_model("mixtral", seed=1)
    with RolloutClient.local(model, device="cpu", dtype="bfloat16", backend="torch", num_pages=256) as client:
        results = client.run_episodes([Echo(), Echo()], SP, max_turns=3)
    with captured_experts(model) as calls, torch.no_grad():
        token_logprobs(model, results, routing_replay=True)
    assert all(np.array_equal(calls[0][b, :len(recorded(r))], recorded(r)) for b, r in enumerate(results))
    report = mismatch_report(model, results, routing_replay=True)
    assert report["routing_tokens"] == report["n_tokens"] == sum(r.loss_mask.count(1) for r in results)


def test_replay_of_uint16_ids_past_256_experts():
    model = tiny_hf_model("qwen3_moe", seed=3, num_experts=300, num_experts_per_tok=3)
    results = rollouts(model, "bfloat16", k=2)
    assert results[0].routed_experts.dtype == np.uint16 and max(int(recorded(r).max()) for r in results) > 255
    with captured_experts(model) as calls, torch.no_grad():
        token_logprobs(model, results, routing_replay=True)
    assert all(np.array_equal(calls[0][b, :len(recorded(r))], recorded(r)) for b, r in enumerate(results))
