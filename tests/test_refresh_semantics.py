"""What a refresh does to sequences in flight (engine/weight_swap.py): on_refresh="recompute" against a fresh
continuation in transformers on the new weights, and KV provenance (RolloutResult.kv_versions) across
refreshes, preemption, forks and the prefix cache."""
import pytest
import torch
from tiny_models import tiny_hf_model

from rollout_service import RolloutRequest, RolloutResult, SamplingParams
from rollout_service.config import EngineConfig
from rollout_service.engine.engine import Engine

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def models():
    return tiny_hf_model("llama", seed=4), tiny_hf_model("llama", seed=5), tiny_hf_model("llama", seed=6)


@torch.no_grad()
def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def started(model, prompts, steps: int, sampling=GREEDY, **opts) -> Engine:
    eng = Engine(model_source=model, device="cpu", num_pages=opts.pop("num_pages", 128), **opts)
    for i, p in enumerate(prompts):
        eng.add_request(RolloutRequest(prompt=p, sampling=sampling, request_id=f"r{i}"))
    for _ in range(steps):
        assert not eng.step(), "a request finished before the refresh"
    return eng


def by_id(results: list[RolloutResult]) -> list[RolloutResult]:
    return sorted(results, key=lambda r: (int(r.request_id[1:]), r.sample_index))


PROMPTS = [[3, 1, 4, 1, 5], list(range(20, 47)), [9] * 12]


@pytest.mark.parametrize("overlap", [True, False])
def test_recompute_continues_as_a_fresh_engine_would_on_the_new_weights(models, overlap):
    old, new, _ = models
    eng = started(old, PROMPTS, 6, on_refresh="recompute", overlap_decode=overlap)
    eng.update_weights(new.state_dict(), version=1)
    assert eng.stats()["refresh_recomputes"] == len(PROMPTS)
    for p, r in zip(PROMPTS, by_id(eng.run_until_done())):
        k = r.token_versions.count(0)
        assert 0 < k < GREEDY.max_tokens and r.token_versions == [0] * k + [1] * (GREEDY.max_tokens - k)
        assert r.token_ids[:k] == hf_greedy(old, p, k)
        assert r.token_ids[k:] == hf_greedy(new, p + r.token_ids[:k], GREEDY.max_tokens - k)
        assert r.kv_versions == [0] * k + [1] * (GREEDY.max_tokens - k)


def test_continue_keeps_the_old_kv_and_says_so(models):
    old, new, _ = models
    eng = started(old, PROMPTS, 6)
    eng.update_weights(new.state_dict(), version=1)
    for r in by_id(eng.run_until_done()):
        k = r.token_versions.count(0)
        assert 0 < k < len(r.token_ids)
        assert r.kv_versions == [0] * len(r.token_ids)  # every token attended to the prompt's v0 KV


def test_kv_provenance_across_two_refreshes(models):
    old, new, newer = models
    for mode in ("continue", "recompute"):
        eng = started(old, PROMPTS[:1], 4, on_refresh=mode)
        eng.update_weights(new.state_dict(), version=1)
        eng.add_request(RolloutRequest(prompt=PROMPTS[1], sampling=GREEDY, request_id="r1"))  # starts at v1
        eng.step(), eng.step(), eng.step()
        eng.update_weights(newer.state_dict(), version=2)
        first, second = by_id(eng.run_until_done())
        for r, born in ((first, 0), (second, 1)):
            assert r.kv_versions is not None and len(r.kv_versions) == len(r.token_ids)
            if mode == "continue":
                assert set(r.kv_versions) == {born}, (mode, r.kv_versions)
            else:  # after each refresh the KV is the new version's
                assert r.kv_versions == r.token_versions, (mode, r.kv_versions)
            assert all(kv <= v for kv, v in zip(r.kv_versions, r.token_versions))


def test_a_preemption_after_a_refresh_recomputes_the_kv_on_the_new_weights(models):
    old, new, _ = models
    eng = started(old, PROMPTS[:1], 4)
    eng.update_weights(new.state_dict(), version=1)
    eng.step()
    eng.sleep(1)  # frees every page: the sequence is prefilled again under v1
    eng.wake_up()
    (r,) = eng.run_until_done()
    k = r.token_versions.count(0)
    assert r.kv_versions[:k + 1] == [0] * (k + 1) and r.kv_versions[k + 1:] == [1] * (len(r.token_ids) - k - 1)


def test_forks_and_prefix_cache_hits_carry_their_pages_age(models):
    old, new, _ = models
    sampling = SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True, n=3, seed=1)
    eng = Engine(model_source=old, device="cpu", num_pages=128, page_size=8, prefix_cache_across_versions=True)
    prompt = list(range(30, 60))
    eng.add_request(RolloutRequest(prompt=prompt, sampling=sampling, request_id="r0"))
    first = eng.run_until_done()
    assert [r.kv_versions for r in first] == [[0] * 6] * 3
    eng.update_weights(new.state_dict(), version=1)
    eng.add_request(RolloutRequest(prompt=prompt, sampling=sampling, request_id="r1"))
    later = eng.run_until_done()
    assert eng.stats()["prefix_cache"]["hit_tokens"] > 0
    for r in later:  # the prompt's first pages are v0's KV, served across versions
        assert r.token_versions == [1] * 6 and r.kv_versions == [0] * 6


def test_recompute_refuses_kv_served_across_versions():
    with pytest.raises(ValueError, match="prefix_cache_across_versions"):
        EngineConfig(on_refresh="recompute", prefix_cache_across_versions=True)


def test_kv_versions_on_the_wire():
    r = RolloutResult("a", 0, [1, 2], [3, 4], [-0.5, -0.25], [1, 2], "length", kv_versions=[0, 1])
    assert RolloutResult.from_msgpack(r.to_msgpack()).kv_versions == [0, 1]
    bad = r.to_dict() | {"kv_versions": RolloutResult("a", 0, [1], [3, 4], [0, 0], [0, 0], "length",
                                                      kv_versions=[2, 3]).to_dict()["kv_versions"]}
    with pytest.raises(ValueError, match="kv_versions: a token's KV cannot be newer"):
        RolloutResult.from_dict(bad)
    with pytest.raises(ValueError, match="kv_versions"):
        RolloutResult("a", 0, [1], [3, 4], [0, 0], [0, 0], "length", kv_versions=[0])


def test_the_rl_semantics_bench_measures_what_it_says(models):
    """benchmarks/harness/rl_semantics.py on a tiny shape: scores agree with transformers, each prompt's
    prefill is shared by its completions; recompute leaves no token on stale KV and prefills more."""
    from benchmarks.harness.rl_semantics import Shape, refresh, score
    old, _, _ = models
    s = Shape(score_prompts=2, score_n=3, score_prompt=40, score_completion=20, score_batch=2, w2n_prompts=2,
              w2n_n=2, w2n_prompt=16, w2n_new=24, refresh_every=8)

    def make(**o):
        return Engine(model_source=old, device="cpu", num_pages=128, **o)
    sc = score(old, make, s)
    assert sc["sequences"] == 6 and sc["scored_tokens"] == 120 and sc["max_abs_dev"] < 1e-4
    # each prompt's first 2 pages (32 of its 40 tokens) prefilled once, not once per completion
    assert sc["prefilled_tokens"] == 2 * 60 + 4 * (60 - 32)
    weights = {k: v.clone() for k, v in old.state_dict().items()}
    cont, rec = refresh(make, weights, s, "continue"), refresh(make, weights, s, "recompute")
    assert cont["refreshes"] == rec["refreshes"] == 2 and cont["tokens"] == rec["tokens"] == 96
    assert cont["stale_kv_tokens"] > 0 and rec["stale_kv_tokens"] == 0
    assert rec["refresh_recomputes"] == 8 and rec["prefilled_tokens"] > cont["prefilled_tokens"]
