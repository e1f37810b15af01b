"""Scoring given completions (RolloutRequest.completion): teacher-forced log-probs by prefill, against
transformers' forward on the same weights and tokens, and bitwise against the rollout's own log-probs in
batch-invariant mode."""
import numpy as np
import pytest
import torch
from tiny_models import tiny_hf_model

from rollout_service import RolloutRequest, SamplingParams
from rollout_service.engine.engine import Engine


@pytest.fixture(scope="module")
def llama():
    return tiny_hf_model("llama", seed=4)


def engine(model, **opts) -> Engine:
    opts.setdefault("num_pages", 128)
    return Engine(model_source=model, device="cpu", **opts)


def seqs(k: int, seed: int = 0, vocab: int = 256) -> list[tuple[list[int], list[int]]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(k):
        p, c = torch.randint(2, 30, (2,), generator=g).tolist()
        out.append((torch.randint(0, vocab, (p,), generator=g).tolist(),
                    torch.randint(0, vocab, (c,), generator=g).tolist()))
    return out


def score(eng: Engine, pairs, sampling=None, **req) -> list:
    sampling = sampling or SamplingParams(temperature=1.0)
    for i, (p, c) in enumerate(pairs):
        eng.add_request(RolloutRequest(prompt=p, completion=c, sampling=sampling, request_id=f"s{i}", **req))
    return sorted(eng.run_until_done(), key=lambda r: int(r.request_id[1:]))


@torch.no_grad()
def hf_logprobs(model, prompt, completion, temperature=1.0) -> torch.Tensor:
    logits = model(torch.tensor([prompt + completion])).logits[0].double() / temperature
    lp = torch.log_softmax(logits, -1)[len(prompt) - 1:-1]
    return lp, lp.gather(1, torch.tensor(completion)[:, None])[:, 0]


@pytest.mark.parametrize("temperature,mode", [(1.0, "processed"), (0.0, "processed"), (0.7, "scaled")])
def test_scores_match_transformers_forward(llama, temperature, mode):
    pairs = seqs(6, seed=1)
    got = score(engine(llama), pairs, SamplingParams(temperature=temperature, logprobs_mode=mode, logprobs=3))
    for (p, c), r in zip(pairs, got):
        full, ref = hf_logprobs(llama, p, c, temperature or 1.0)
        assert r.finish_reason == "scored" and r.prompt_token_ids == p and r.token_ids == c
        assert r.token_versions == [0] * len(c) and r.kv_versions == [0] * len(c)
        np.testing.assert_allclose(r.logprobs, ref.numpy(), atol=1e-4, rtol=0)
        best = full.topk(3, dim=1)
        for row, top, ids in zip(r.top_logprobs, best.values, best.indices):
            assert list(row) == ids.tolist()
            np.testing.assert_allclose(list(row.values()), top.numpy(), atol=1e-4)


def test_top_k_truncation_scores_dropped_tokens_minus_inf(llama):
    p, c = seqs(1, seed=2)[0]
    (r,) = score(engine(llama), [(p, c)], SamplingParams(temperature=1.0, top_k=1))
    full, _ = hf_logprobs(llama, p, c)
    best = full.argmax(dim=1).tolist()
    for tok, want, lp in zip(c, best, r.logprobs):
        assert lp == (0.0 if tok == want else -np.inf)
    # flagged, not failed: the result stays "scored" and its error names the tokens outside
    outside = [i for i, (tok, want) in enumerate(zip(c, best)) if tok != want]
    assert outside and r.finish_reason == "scored"
    assert r.error.startswith(f"completion token(s) {outside[:8]}") and "top_k=1" in r.error, r.error
    (plain,) = score(engine(llama), [(p, c)], SamplingParams(temperature=1.0))
    assert plain.error is None and np.isfinite(plain.logprobs).all()


def test_chunked_prefill_and_preemption_give_the_same_scores(llama):
    pairs = seqs(5, seed=3)
    whole = score(engine(llama), pairs)
    chunked = score(engine(llama, max_num_batched_tokens=7, page_size=8), pairs)
    for a, b in zip(whole, chunked):
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5, rtol=0)
    eng = engine(llama, max_num_batched_tokens=7, page_size=8)
    for i, (p, c) in enumerate(pairs):
        eng.add_request(RolloutRequest(prompt=p, completion=c, request_id=f"s{i}"))
    eng.step(), eng.step()
    eng.sleep(1)  # frees every page: the chunks scored so far are computed again after wake
    eng.wake_up()
    again = sorted(eng.run_until_done(), key=lambda r: int(r.request_id[1:]))
    for a, b in zip(whole, again):
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5, rtol=0)
        assert len(b.logprobs) == len(b.token_ids)


def test_the_completions_of_one_prompt_share_its_prefill(llama):
    prompt = list(range(40))
    completions = [[7, 8, 9], [10, 11], [12, 13, 14, 15]]
    eng = engine(llama, page_size=8)
    score(eng, [(prompt, completions[0])])
    before = eng.stats()["prefilled_tokens"]
    got = score(eng, [(prompt, c) for c in completions[1:]])
    # positions 0..38 of the prompt are cached in 4 pages of 8 (32 tokens); each prefills from there
    assert eng.stats()["prefilled_tokens"] - before == sum(40 + len(c) - 32 for c in completions[1:])
    for c, r in zip(completions[1:], got):
        np.testing.assert_allclose(r.logprobs, hf_logprobs(llama, prompt, c)[1].numpy(), atol=1e-4)


def test_scoring_runs_beside_rollouts(llama):
    eng = engine(llama)
    pairs = seqs(3, seed=5)
    eng.add_request(RolloutRequest(prompt=[1, 2, 3], request_id="gen",
                                   sampling=SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)))
    for i, (p, c) in enumerate(pairs):
        eng.add_request(RolloutRequest(prompt=p, completion=c, request_id=f"s{i}"))
    out = {r.request_id: r for r in eng.run_until_done()}
    assert out["gen"].finish_reason == "length" and len(out["gen"].token_ids) == 8
    for i, (p, c) in enumerate(pairs):
        np.testing.assert_allclose(out[f"s{i}"].logprobs, hf_logprobs(llama, p, c)[1].numpy(), atol=1e-4)
    assert eng.stats()["scored_sequences"] == 3


def test_a_refresh_mid_score_scores_the_whole_completion_under_the_new_weights(llama):
    new = tiny_hf_model("llama", seed=9)
    pairs = seqs(3, seed=6)
    eng = engine(llama, max_num_batched_tokens=6, page_size=8)
    for i, (p, c) in enumerate(pairs):
        eng.add_request(RolloutRequest(prompt=p, completion=c, request_id=f"s{i}"))
    eng.step()
    eng.update_weights(new.state_dict(), version=1)
    got = sorted(eng.run_until_done(), key=lambda r: int(r.request_id[1:]))
    for (p, c), r in zip(pairs, got):
        assert r.token_versions == [1] * len(c) and r.kv_versions == [1] * len(c)
        np.testing.assert_allclose(r.logprobs, hf_logprobs(new, p, c)[1].numpy(), atol=1e-4)


@pytest.mark.parametrize("sampling", [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                                      SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, n=3, seed=5),
                                      SamplingParams(temperature=0.8, max_tokens=12, ignore_eos=True, seed=6,
                                                     logprobs=2)])
def test_batch_invariant_score_is_bitwise_the_rollouts_logprobs(llama, sampling):
    eng = engine(llama, batch_invariant=True, page_size=8)
    for i, (p, _) in enumerate(seqs(4, seed=7)):
        eng.add_request(RolloutRequest(prompt=p, sampling=sampling, request_id=f"g{i}"))
    rollouts = eng.run_until_done()
    scored_as = SamplingParams(temperature=sampling.temperature, logprobs=sampling.logprobs)
    for i, r in enumerate(rollouts):
        eng.add_request(RolloutRequest(prompt=r.prompt_token_ids, completion=r.token_ids, sampling=scored_as,
                                       request_id=f"s{i}"))
    scored = {r.request_id: r for r in eng.run_until_done()}
    for i, r in enumerate(rollouts):
        s = scored[f"s{i}"]
        assert s.logprobs.tobytes() == r.logprobs.tobytes(), f"rollout {r.request_id}#{r.sample_index}"
        if sampling.logprobs:
            assert s.top_logprobs == r.top_logprobs


def test_bad_completions_are_refused_by_name(llama):
    eng = engine(llama, max_model_len=64)
    cases = [([], "non-empty list"), ([1, -2], "non-empty list"), ("abc", "non-empty list"),
             ([True], "non-empty list")]
    for completion, words in cases:
        with pytest.raises(ValueError, match=words):
            RolloutRequest(prompt=[1, 2], completion=completion)
    with pytest.raises(ValueError, match="n=1 and no penalties"):
        RolloutRequest(prompt=[1, 2], completion=[3], sampling=SamplingParams(n=2))
    with pytest.raises(ValueError, match="n=1 and no penalties"):
        RolloutRequest(prompt=[1, 2], completion=[3], sampling=SamplingParams(repetition_penalty=1.2))
    with pytest.raises(ValueError, match="out of range"):
        eng.add_request(RolloutRequest(prompt=[1, 2], completion=[3, 256]))
    with pytest.raises(ValueError, match="max_model_len is 64"):
        eng.add_request(RolloutRequest(prompt=[1] * 40, completion=[3] * 25))
    eng.add_request(RolloutRequest(prompt=[1] * 40, completion=[3] * 24, request_id="ok"))  # exactly 64 fits
    (r,) = eng.run_until_done()
    assert r.finish_reason == "scored" and len(r.logprobs) == 24
    back = RolloutRequest.from_msgpack(RolloutRequest(prompt=[1], completion=[2, 3], submitted_version=4).to_msgpack())
    assert back.completion == [2, 3] and back.submitted_version == 4


def test_client_score_takes_results_and_pairs_in_order(llama):
    """RolloutClient.score in-process: results (their metadata along) and (prompt, completion) pairs, one
    result each in their order, against transformers' forward; bad input named, the client still serves."""
    from rollout_service import RolloutClient
    client = RolloutClient.local(llama, backend="torch", dtype="float32", device="cpu", num_pages=128)
    sampling = SamplingParams(temperature=1.0, max_tokens=9, ignore_eos=True, n=2, seed=3)
    rollouts = client.generate([p for p, _ in seqs(3, seed=8)], sampling, metadata=["a", "b", "c"])
    pairs = seqs(2, seed=9)
    got = client.score(rollouts + pairs)
    assert len(got) == len(rollouts) + len(pairs)
    for want, r in zip([(x.prompt_token_ids, x.token_ids) for x in rollouts] + pairs, got):
        assert (r.prompt_token_ids, r.token_ids, r.finish_reason) == (*want, "scored")
        np.testing.assert_allclose(r.logprobs, hf_logprobs(llama, *want)[1].numpy(), atol=1e-4)
        assert set(r.token_versions) == {0}
    assert [r.metadata for r in got[:6]] == ["a", "a", "b", "b", "c", "c"]
    (one,) = client.score(rollouts[0], SamplingParams(temperature=0.5, logprobs=2))
    assert len(one.top_logprobs) == len(rollouts[0].token_ids)
    for bad, words in [([], "empty"), ("text", "expected a RolloutResult"), ([(1, 2, 3)], "sequence 0"),
                       ([([1, 2], [])], "sequence 0: RolloutRequest.completion")]:
        with pytest.raises(ValueError, match=words):
            client.score(bad)
    with pytest.raises(ValueError, match="n=2"):
        client.score(pairs, SamplingParams(n=2))
    with pytest.raises(ValueError, match="metadata"):
        client.score(pairs, metadata=["only one"])
    client.update_weights(llama.state_dict(), version=2)
    assert client.score(pairs[:1])[0].token_versions == [2] * len(pairs[0][1])
    client.close()


def test_client_score_in_batch_invariant_mode_is_bitwise_the_rollouts(llama):
    from rollout_service import RolloutClient
    client = RolloutClient.local(llama, backend="torch", dtype="float32", device="cpu", num_pages=128,
                                 batch_invariant=True, page_size=8)
    sampling = SamplingParams(temperature=0.8, max_tokens=10, ignore_eos=True, n=3, seed=1)
    rollouts = client.generate([p for p, _ in seqs(3, seed=10)], sampling)
    for r, s in zip(rollouts, client.score(rollouts, SamplingParams(temperature=0.8))):
        assert s.logprobs.tobytes() == r.logprobs.tobytes()
    client.close()
