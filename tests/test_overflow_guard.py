"""A finite weight that overflows the forward (issue 45, item 3): refused before any swap by the canary
(weights/canary.py) in-process and through the service, with real weights never refused; and whatever still
overflows (the check turned off) ends its result with an error instead of NaN log-probs that look successful."""
import math

import numpy as np
import pytest
import torch

from rollout_service.engine.engine import Engine
from rollout_service.api.types import RolloutRequest, SamplingParams
from rollout_service.weights.buckets import named_items
from rollout_service.weights.canary import LIMIT, reject_overflowing
from tiny_models import tiny_hf_model

pytest_plugins = ["ray_fixtures"]
SAMPLED = SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True, seed=1)


def _engine(model, **kw) -> Engine:
    return Engine(model_source=model, device="cpu", backend="torch", num_pages=64, **kw)


def _poisoned(model, name: str = "model.layers.0.mlp.down_proj.weight", value: float = 3e38) -> dict:
    state = {k: v.clone() for k, v in model.state_dict().items()}
    state[name].view(-1)[5] = value
    return state


def test_real_and_random_weights_pass_the_canary(smollm2):
    reject_overflowing(named_items(smollm2[0].state_dict()))  # trained weights: SmolLM2-135M-Instruct
    for arch in ("llama", "qwen2", "qwen3_moe"):
        model = tiny_hf_model(arch)
        reject_overflowing(named_items(model.state_dict()))
        reject_overflowing(named_items({k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}))


@pytest.mark.parametrize("value", [3e38, 1e12, -5e7])
def test_a_finite_weight_that_would_overflow_is_named(value):
    state = _poisoned(tiny_hf_model("llama"), value=value)
    with pytest.raises(ValueError, match=r"'model.layers.0.mlp.down_proj.weight' would overflow the forward"):
        reject_overflowing(named_items(state))
    reject_overflowing([("scalar", torch.tensor(3.0)), ("empty", torch.zeros(0, 4)), ("ids", torch.arange(5)),
                        ("e4m3", torch.randn(8, 16).to(torch.float8_e4m3fn))])
    norm = {"model.norm.weight": torch.full((64,), 2 * LIMIT)}
    with pytest.raises(ValueError, match="'model.norm.weight' would overflow"):
        reject_overflowing(named_items(norm))


@pytest.mark.parametrize("dtype,quantization", [("float32", None), ("bfloat16", None), ("bfloat16", "fp8")])
def test_the_engine_refuses_it_before_any_swap_and_keeps_serving(dtype, quantization):
    model = tiny_hf_model("llama", seed=3)
    engine = _engine(model, dtype=dtype, quantization=quantization)
    before = engine.weights_digest()
    with pytest.raises(ValueError, match="would overflow the forward.*nothing was changed"):
        engine.update_weights(_poisoned(model), 1)
    assert engine.weights_digest() == before and engine.policy_version == 0
    engine.add_request(RolloutRequest([1, 2, 3], SAMPLED, request_id="ok"))
    (result,) = engine.run_until_done()
    assert result.error is None and np.isfinite(result.logprobs).all() and len(result.token_ids) == 6


def test_an_overflow_let_through_ends_results_with_an_error_not_nan():
    model = tiny_hf_model("llama", seed=3)
    engine = _engine(model, dtype="float32")
    engine.update_weights(_poisoned(model), 1, check_finite=False)  # the caller turned the checks off
    engine.add_request(RolloutRequest([1, 2, 3], SAMPLED, request_id="bad"))
    (result,) = engine.run_until_done()
    assert result.finish_reason == "abort" and "non-finite log-prob" in result.error
    # stopped at the first non-finite one (3e38 times a small activation can still be finite)
    last = len(result.token_ids) - 1
    assert not math.isfinite(result.logprobs[last]) and np.isfinite(result.logprobs[:last]).all()
    assert f"at output token {last}" in result.error and last < 5
    # scoring the same tokens meets the same overflow
    engine.add_request(RolloutRequest([1, 2, 3], SAMPLED, request_id="s", completion=result.token_ids))
    (scored,) = engine.run_until_done()
    assert scored.finish_reason == "abort" and "non-finite log-prob" in scored.error


@pytest.mark.ray
def test_the_service_refuses_it_on_the_sender_and_every_worker_keeps_its_version(ray_cluster, service_config,
                                                                                 make_tiny_llama):
    from rollout_service.client import RolloutClient
    svc = RolloutClient.launch(service_config(name="svc-overflow", num_workers=1))
    try:
        state = make_tiny_llama(seed=9).state_dict()
        digests = svc.weights_digests()
        bad = {k: v.clone() for k, v in state.items()}
        bad["lm_head.weight"].view(-1)[0] = 1e30
        with pytest.raises(ValueError, match="'lm_head.weight' would overflow the forward"):
            svc.update_weights(bad, 1)
        assert svc.weights_digests() == digests
        assert svc.update_weights(state, 1) == "object_store"  # the next good refresh goes through
        (r,) = svc.generate([[1, 2, 3]], SAMPLED)
        assert r.error is None and r.token_versions == [1] * 6
    finally:
        svc.close()
