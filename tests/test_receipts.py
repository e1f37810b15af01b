"""Rollout receipts (rollout_service/results/receipts.py): a batch-invariant engine signs what it computed with the
weights digest of its version; InvariantForward.verify recomputes the log-probs and the receipt on the learner
and names the first token that differs. Tampering with one log-prob, a token or the receipt is caught."""
import dataclasses

import numpy as np
import pytest
import torch
from tiny_models import tiny_hf_model

from rollout_service import RolloutRequest, RolloutResult, SamplingParams
from rollout_service.engine.engine import Engine
from rollout_service.results.receipts import receipt_of, weights_digest
from rollout_service.training import InvariantForward

PROMPTS = [[1, 5, 9, 33], list(range(40, 75)), [7]]


@pytest.fixture(scope="module")
def policy():
    return tiny_hf_model("llama", seed=8)


def rollouts(model, sampling, **opts) -> list[RolloutResult]:
    eng = Engine(model_source=model, device="cpu", num_pages=64, **{"batch_invariant": True, **opts})
    for i, p in enumerate(PROMPTS):
        eng.add_request(RolloutRequest(prompt=p, sampling=sampling, request_id=str(i)))
    return sorted(eng.run_until_done(), key=lambda r: (int(r.request_id), r.sample_index))


SAMPLED = SamplingParams(n=2, temperature=0.8, max_tokens=10, ignore_eos=True, seed=3, logprobs_mode="scaled")


def test_the_learner_reproduces_the_engines_digest_and_verifies_every_result(policy):
    eng = Engine(model_source=policy, device="cpu", num_pages=16, batch_invariant=True)
    assert eng.weights_digest() == weights_digest(policy.named_parameters())
    results = rollouts(policy, SAMPLED)
    assert all(r.receipt is not None and len(r.receipt) == 64 for r in results)
    assert all(v.ok for v in InvariantForward(policy).verify(results, temperature=0.8))
    greedy = rollouts(policy, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    assert all(v.ok for v in InvariantForward(policy).verify(greedy))


def test_tampering_is_caught_and_located(policy):
    results = rollouts(policy, SAMPLED)
    forward = InvariantForward(policy)
    lp = results[1].logprobs.copy()
    lp[4] = np.nextafter(lp[4], np.float32(0))  # one ulp
    (v,) = forward.verify([dataclasses.replace(results[1], logprobs=lp)], temperature=0.8)
    assert not v.ok and v.first_diff == 4 and v.delta != 0 and "token 4" in v.reason
    ids = list(results[2].token_ids)
    ids[6] = (ids[6] + 1) % 256
    (v,) = forward.verify([dataclasses.replace(results[2], token_ids=ids)], temperature=0.8)
    assert not v.ok and v.first_diff == 6
    other = receipt_of(results[0], "0" * 64)
    (v,) = forward.verify([dataclasses.replace(results[0], receipt=other)], temperature=0.8)
    assert not v.ok and "receipt does not match" in v.reason
    (v,) = forward.verify([dataclasses.replace(results[0], prompt_token_ids=[2] + results[0].prompt_token_ids[1:])],
                          temperature=0.8)
    assert not v.ok


def test_other_weights_fail_verification(policy):
    results = rollouts(policy, SAMPLED)
    trained = tiny_hf_model("llama", seed=8)
    with torch.no_grad():
        trained.model.layers[0].mlp.up_proj.weight[0, 0] += 1e-3
    verdicts = InvariantForward(trained).verify(results, temperature=0.8)
    assert not any(v.ok for v in verdicts)
    # the same log-probs by chance would still not pass: the receipt names the weights
    (v,) = InvariantForward(policy).verify(results[:1], temperature=0.8, digest=weights_digest(trained.named_parameters()))
    assert not v.ok and "receipt" in v.reason


def test_no_receipt_without_batch_invariance_or_across_a_refresh(policy):
    plain = rollouts(policy, SAMPLED, batch_invariant=False)
    assert all(r.receipt is None for r in plain)
    assert "no receipt" in InvariantForward(policy).verify(plain[:1], temperature=0.8)[0].reason
    eng = Engine(model_source=policy, device="cpu", num_pages=64, batch_invariant=True)
    eng.add_request(RolloutRequest(prompt=PROMPTS[0], sampling=SAMPLED, request_id="0"))
    eng.step(), eng.step()
    eng.update_weights(tiny_hf_model("llama", seed=9).state_dict(), version=1)
    assert all(r.receipt is None for r in eng.run_until_done())


def test_receipts_travel_and_are_checked_on_the_wire(policy):
    (r, *_) = rollouts(policy, SAMPLED)
    assert RolloutResult.from_msgpack(r.to_msgpack()).receipt == r.receipt
    with pytest.raises(ValueError, match="receipt"):
        RolloutResult.from_dict({**r.to_dict(), "receipt": "abc"})


TOP = SamplingParams(n=2, temperature=0.8, max_tokens=10, ignore_eos=True, seed=3, logprobs_mode="scaled", logprobs=3)


@pytest.mark.parametrize("field, edit", [
    ("kv_versions", lambda r: [-1] + r.kv_versions[1:]),
    ("kv_versions", lambda r: [1] * len(r.kv_versions)),
    ("token_versions", lambda r: [1] * len(r.token_versions)),
    ("finish_reason", lambda r: "stop"),
    ("text", lambda r: r.text + "!"),
    ("top_logprobs", lambda r: [dict(reversed(list(d.items()))) for d in r.top_logprobs]),
    ("top_logprobs", lambda r: [{**d, 7: -0.5} for d in r.top_logprobs]),
])
def test_every_field_a_learner_uses_is_covered(policy, field, edit):
    (r, *_) = rollouts(policy, TOP)
    assert r.top_logprobs and InvariantForward(policy).verify([r], temperature=0.8)[0].ok
    (v,) = InvariantForward(policy).verify([dataclasses.replace(r, **{field: edit(r)})], temperature=0.8)
    assert not v.ok, field


def test_a_keyed_receipt_is_only_made_by_the_key_holder(policy):
    key = "s3cret shared by service and learner"
    (r, *_) = rollouts(policy, SAMPLED, receipt_key=key)
    forward = InvariantForward(policy)
    assert forward.verify([r], temperature=0.8, key=key)[0].ok
    assert not forward.verify([r], temperature=0.8)[0].ok  # an unkeyed verifier does not accept it
    assert not forward.verify([r], temperature=0.8, key="another")[0].ok
    # relabelling the version and re-signing without the key is caught by the key holder
    digest = weights_digest(policy.named_parameters())
    relabelled = dataclasses.replace(r, token_versions=[5] * len(r.token_ids), kv_versions=[5] * len(r.token_ids))
    forged = dataclasses.replace(relabelled, receipt=receipt_of(relabelled, digest))
    (v,) = forward.verify([forged], temperature=0.8, key=key)
    assert not v.ok and "receipt" in v.reason
    assert "receipt_key" not in repr(Engine(model_source=policy, device="cpu", num_pages=8, receipt_key=key).config)


def test_a_malformed_result_is_a_failed_verdict_naming_the_field(policy):
    (r, *_) = rollouts(policy, SAMPLED)
    forward = InvariantForward(policy)
    longer = dataclasses.replace(r)
    longer.logprobs = np.append(r.logprobs, np.float32(-1.0))  # edited in place, past the constructor's checks
    (v,) = forward.verify([longer], temperature=0.8)
    assert not v.ok and "malformed result" in v.reason and "logprobs" in v.reason
    negative = dataclasses.replace(r)
    negative.kv_versions = [-1] * len(r.token_ids)
    (v,) = forward.verify([negative], temperature=0.8)
    assert not v.ok and "kv_versions" in v.reason
    bad_reason = dataclasses.replace(r)
    bad_reason.finish_reason = "finished"
    (v,) = forward.verify([bad_reason], temperature=0.8)
    assert not v.ok and "finish_reason" in v.reason


def test_a_receipt_covering_top_logprobs_and_text_survives_the_wire(policy):
    (r, *_) = rollouts(policy, TOP, receipt_key="k")
    back = RolloutResult.from_msgpack(r.to_msgpack())
    assert back.top_logprobs == r.top_logprobs and back.text == r.text
    assert InvariantForward(policy).verify([back], temperature=0.8, key="k")[0].ok
