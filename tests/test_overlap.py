"""Overlapped decode (EngineConfig.overlap_decode): launching step t+1 on the device-side ids of step t before
reading them must give exactly what stepping one decode at a time gives, through arrivals, stops, forks,
penalties, preemption, aborts and weight refreshes."""
import numpy as np
import pytest
import torch
from tiny_models import tiny_hf_model

from rollout_service import RolloutRequest, SamplingParams
from rollout_service.engine.engine import Engine
from rollout_service.engine.sampler import Sampler
from rollout_service.engine.sequence import Sequence


@pytest.fixture(scope="module")
def llama():
    return tiny_hf_model("llama")


def prompt(seed: int, n: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


MIXED = [  # (request id, prompt, sampling, the step() call at which it arrives)
    ("greedy", prompt(1, 9), SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=2), 0),
    ("forks", prompt(2, 21), SamplingParams(temperature=0.9, top_k=20, max_tokens=15, n=3, seed=4), 0),
    ("nucleus", prompt(3, 5), SamplingParams(temperature=1.0, top_p=0.9, min_p=0.02, max_tokens=30, seed=7,
                                            logprobs_mode="processed"), 0),
    ("late", prompt(4, 17), SamplingParams(temperature=0.7, max_tokens=12, seed=1, ignore_eos=True), 6),
    ("penalised", prompt(5, 8), SamplingParams(temperature=0.8, repetition_penalty=1.3, max_tokens=10, seed=2), 9),
    ("short", prompt(6, 4), SamplingParams(temperature=0, max_tokens=1), 11),
]


def drive(model, overlap: bool, requests=MIXED, events=None, **opts):
    """Step an engine by hand: requests arrive at given step() calls, events[k](engine) runs before call k."""
    eng = Engine(model_source=model, overlap_decode=overlap, **{"num_pages": 256, **opts})
    return eng, step_by_hand(eng, requests, events)


def step_by_hand(eng, requests, events=None, after_step=lambda eng: None):
    """The results of stepping `eng` until done, each request added at its step() call, events[k](eng) run before
    call k and after_step(eng) after every call; sorted by (request, sample)."""
    events = events or {}
    results, k = [], 0
    while k <= max(a for *_, a in requests) or eng.has_unfinished():
        for rid, p, sp, at in requests:
            if at == k:
                eng.add_request(RolloutRequest(prompt=p, sampling=sp, request_id=rid))
        if k in events:
            results += events[k](eng) or []
        results += eng.step()
        after_step(eng)
        k += 1
        assert k < 500, "the engine did not finish"
    return sorted(results, key=lambda r: (r.request_id, r.sample_index))


def assert_same(a, b):
    assert [(r.request_id, r.sample_index) for r in a] == [(r.request_id, r.sample_index) for r in b]
    for x, y in zip(a, b):
        where = f"{x.request_id}#{x.sample_index}"
        assert x.token_ids == y.token_ids, where
        assert x.finish_reason == y.finish_reason, where
        assert x.token_versions == y.token_versions, where
        np.testing.assert_allclose(x.logprobs, y.logprobs, atol=1e-5, err_msg=where)
        assert (x.top_logprobs is None) == (y.top_logprobs is None), where
        if x.top_logprobs:
            assert [sorted(t) for t in x.top_logprobs] == [sorted(t) for t in y.top_logprobs], where


def test_overlap_matches_one_step_at_a_time(llama):
    eng_on, on = drive(llama, True)
    eng_off, off = drive(llama, False)
    assert_same(on, off)
    assert eng_on.counters.overlapped_steps > 10 and eng_off.counters.overlapped_steps == 0
    assert eng_on.stats()["overlapped_steps"] == eng_on.counters.overlapped_steps
    # overlap never computes fewer rows; what it wastes is at most one step per finished sequence
    assert eng_on.counters.generated_tokens == eng_off.counters.generated_tokens
    assert eng_on.kv.blocks.num_used == 0 and eng_off.kv.blocks.num_used == 0


def test_overlap_with_preemption_gives_the_same_tokens(llama):
    reqs = [(f"r{i}", prompt(10 + i, 12 + i), SamplingParams(temperature=0.8, max_tokens=30, seed=3 + i,
                                                               ignore_eos=True), 0) for i in range(8)]
    eng_on, on = drive(llama, True, reqs, num_pages=14, page_size=8)
    eng_off, off = drive(llama, False, reqs, num_pages=14, page_size=8)
    assert eng_off.scheduler.num_preemptions > 0, "the pool was meant to be too small"
    assert eng_on.scheduler.num_preemptions > 0
    assert [r.token_ids for r in on] == [r.token_ids for r in off]
    assert eng_on.kv.blocks.num_used == 0


def test_overlap_across_abort_and_refresh(llama):
    """An abort and a weight refresh each land between two step() calls while a step is in flight: its
    tokens are recorded first (with the old version), exactly as without overlap."""
    torch.manual_seed(0)
    perturbed = {k: v + 0.05 * torch.randn_like(v) for k, v in llama.state_dict().items()}
    events = {5: lambda e: e.abort(["nucleus"]), 8: lambda e: e.update_weights(perturbed, version=2)}
    _, on = drive(llama, True, MIXED[:4], events)
    _, off = drive(llama, False, MIXED[:4], events)
    assert_same(on, off)
    aborted = [r for r in on if r.request_id == "nucleus"]
    assert aborted[0].finish_reason == "abort" and len(aborted[0].token_ids) == 5  # prefill + 4 decodes
    versions = {v for r in on if r.request_id == "greedy" for v in r.token_versions}
    assert versions == {0, 2}


def test_sampler_refuses_penalties_one_step_ahead():
    seq = Sequence("x", [1, 2, 3], SamplingParams(temperature=0, repetition_penalty=1.2), seed=0)
    with pytest.raises(ValueError, match="penalties"):
        Sampler()(torch.randn(1, 16), [seq], ahead=1)


def test_overlap_decode_config_is_checked():
    with pytest.raises(ValueError, match="overlap_decode"):
        Engine(model_source=tiny_hf_model("llama"), overlap_decode="yes")


def test_overlap_stops_at_max_model_len(llama):
    """A sequence that reaches max_model_len is never scheduled a step ahead past it (its pages would run out)."""
    reqs = [(f"r{i}", prompt(20 + i, 10 + 7 * i), SamplingParams(temperature=0.5, max_tokens=200, seed=i), 0)
            for i in range(3)]
    eng_on, on = drive(llama, True, reqs, max_model_len=40, page_size=8)
    _, off = drive(llama, False, reqs, max_model_len=40, page_size=8)
    assert_same(on, off)
    assert all(r.finish_reason in ("length", "stop") and len(r.prompt_token_ids) + len(r.token_ids) <= 40 for r in on)
    assert any(r.finish_reason == "length" for r in on) and eng_on.counters.overlapped_steps > 0
