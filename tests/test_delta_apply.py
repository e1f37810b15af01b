"""A delta applied inside the engine, no Ray: decoded against the engine's own weights and written in place
(Engine.patch_weights), bit for bit what a dense push of the same tensors gives, on fused q/k/v, gate/up and
tied weights; refused, with nothing changed, when the engine no longer runs the delta's base."""
from __future__ import annotations

import pytest
import torch

from rollout_service.api.types import RolloutRequest, SamplingParams
from rollout_service.engine.engine import Engine
from rollout_service.model.weight_update import current_weights
from rollout_service.weights.buckets import named_items
from rollout_service.weights.delta import decode, encode
from rollout_service.weights.refusals import NO_BASE
from test_delta_encoding import _base
from tiny_models import tiny_hf_model

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def _engine(hf) -> Engine:
    return Engine(model_source=hf, dtype="bfloat16", num_pages=64, max_num_seqs=4)


def _step(state: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """A learner's update: a few elements of every tensor move by much more than a bf16 ulp, the rest by far
    less (they round back to the same bf16)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for k, v in state.items():
        big = (torch.rand(v.shape, generator=g) < 0.02).float()
        out[k] = v + (1e-6 + big * 0.05) * torch.randn(v.shape, generator=g)
    return out


def _delta(state, new, version: int):
    """The learner's side: the manifest and a delta from `state` (what the engine holds) to `new`."""
    manifest, base = _base(state)
    delta, buffers = encode(manifest, named_items(new), base, version)
    assert not delta.all_dense  # (the test is about sparse writes)
    return manifest, delta, buffers


def _generate(eng: Engine) -> list[list[int]]:
    for i, p in enumerate([[1, 2, 3], [7] * 9]):
        eng.add_request(RolloutRequest(prompt=p, sampling=GREEDY, request_id=str(i)))
    return [r.token_ids for r in sorted(eng.run_until_done(), key=lambda r: r.request_id)]


@pytest.mark.parametrize("model_type,tied", [("llama", False), ("qwen2", True)])
def test_a_chain_of_deltas_in_place_equals_a_dense_push_bit_for_bit(model_type, tied):
    hf = tiny_hf_model(model_type, seed=3, tie_word_embeddings=tied)
    state = {k: v.detach().clone() for k, v in hf.state_dict().items() if not (tied and k == "lm_head.weight")}
    patched, dense = _engine(hf), _engine(hf)
    params = {n: p for n, p in patched.model.named_parameters()}
    for version in (1, 2, 3):
        new = _step(state, version)
        manifest, delta, buffers = _delta(state, new, version - 1)
        writes = decode(manifest, delta, buffers, dict(current_weights(patched.model, manifest.entries)))
        patched.patch_weights(writes, manifest.entries, version - 1, version)
        dense.update_weights(new, version)
        state = {k: v.to(torch.bfloat16).float() for k, v in new.items()}
        assert patched.policy_version == version
        assert patched.weights_digest() == dense.weights_digest()
    # in place: the parameters are the ones the engine started with (graphs and fused views point at them)
    assert all(p is params[n] for n, p in patched.model.named_parameters())
    assert _generate(patched) == _generate(dense)


def test_a_delta_for_another_base_or_dropped_weights_is_refused_and_changes_nothing():
    hf = tiny_hf_model("llama", seed=5)
    state = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    eng = _engine(hf)
    manifest, delta, buffers = _delta(state, _step(state, 1), 0)
    writes = decode(manifest, delta, buffers, dict(current_weights(eng.model, manifest.entries)))
    before = eng.weights_digest()
    eng.update_weights(state, 1)  # the same values under a new version: the delta's base (0) is gone
    with pytest.raises(ValueError, match=NO_BASE):
        eng.patch_weights(writes, manifest.entries, 0, 2)
    assert eng.policy_version == 1 and eng.weights_digest() == before
    eng.sleep(2)  # the weights dropped: nothing to patch
    with pytest.raises(ValueError, match="level 2"):
        eng.patch_weights(writes, manifest.entries, 1, 2)
    assert eng.policy_version == 1
