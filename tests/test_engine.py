"""Engine behaviour on tiny random models: HF parity per architecture, sharing, preemption, seeds, refresh,
bad input. Every reference is HF transformers on the same weights."""
import pytest
import torch
from tiny_models import tiny_hf_model

from rollout_service import RolloutClient, RolloutRequest, SamplingParams
from rollout_service.engine.engine import Engine

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@torch.no_grad()
def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    """HF forward + argmax, n times, never stopping (the engine's ignore_eos): HF generate would either stop
    at eos or, with min_new_tokens, forbid it. Tiny models: a full forward per token is cheap."""
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def prompts(k: int, seed: int = 0, lo: int = 3, hi: int = 40, vocab: int = 256) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi, (k,), generator=g).tolist()
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lens]


@pytest.fixture(scope="module")
def llama():
    return tiny_hf_model("llama")


def client(model, **opts) -> RolloutClient:
    opts.setdefault("num_pages", 256)
    return RolloutClient.local(model, **opts)


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
def test_greedy_matches_hf_per_architecture(arch):
    model = tiny_hf_model(arch, seed=1)
    ps = prompts(5, seed=2)
    got = client(model).generate(ps, GREEDY)
    for p, r in zip(ps, got):
        assert r.token_ids == hf_greedy(model, p, GREEDY.max_tokens), f"{arch}: prompt of {len(p)} tokens differs"
        assert r.finish_reason == "length" and r.prompt_token_ids == p


def test_logprobs_match_hf_forward(llama):
    ps = prompts(4, seed=3)
    got = client(llama).generate(ps, SamplingParams(temperature=1.0, max_tokens=10, seed=5, logprobs_mode="raw"))
    diffs = []
    for p, r in zip(ps, got):
        ids = torch.tensor([p + r.token_ids])
        with torch.no_grad():
            lp = torch.log_softmax(llama(ids).logits[0].float(), -1)
        ref = lp[len(p) - 1:-1].gather(1, torch.tensor(r.token_ids)[:, None])[:, 0]
        diffs.append((ref - torch.from_numpy(r.logprobs)).abs())
    assert torch.cat(diffs).mean() <= 1e-5


def test_chunked_prefill_and_ragged_batch_match(llama):
    ps = prompts(6, seed=4, lo=20, hi=120)
    small_budget = client(llama, max_num_batched_tokens=32).generate(ps, GREEDY)
    for p, r in zip(ps, small_budget):
        assert r.token_ids == hf_greedy(llama, p, GREEDY.max_tokens)


def test_prompt_sharing_prefills_once_and_matches_n1(llama):
    c = client(llama)
    ps = prompts(3, seed=5, lo=17, hi=40)
    sp = SamplingParams(n=8, temperature=1.0, max_tokens=10, seed=100, ignore_eos=True)
    before = c.engine.counters.prompt_prefills
    shared = c.generate(ps, sp)
    assert c.engine.counters.prompt_prefills - before == len(ps)  # one prefill per prompt, not n
    assert [r.sample_index for r in shared] == list(range(8)) * len(ps)  # prompt-major
    assert all(len({r.request_id for r in shared[8 * i:8 * i + 8]}) == 1 for i in range(len(ps)))
    for i, p in enumerate(ps):
        samples = shared[8 * i:8 * i + 8]
        assert len({tuple(r.token_ids) for r in samples}) > 1, "the 8 samples should differ"
        for k, r in enumerate(samples):
            alone = c.generate([p], SamplingParams(n=1, temperature=1.0, max_tokens=10, seed=100 + k,
                                                   ignore_eos=True))[0]
            assert r.token_ids == alone.token_ids and r.sample_index == k
    assert c.engine.kv.blocks.num_used == 0  # every shared page returned


def test_seeded_request_independent_of_batch(llama):
    c = client(llama)
    target = RolloutRequest(prompt=[5, 6, 7, 8], sampling=SamplingParams(temperature=0.9, top_p=0.95, top_k=50,
                                                                          max_tokens=16, seed=1234, ignore_eos=True))
    alone = c.generate([target])[0]
    others = [RolloutRequest(prompt=p, sampling=SamplingParams(temperature=1.3, max_tokens=8 + i, seed=i,
                                                               repetition_penalty=1.2))
              for i, p in enumerate(prompts(15, seed=6))]
    mixed = c.generate(others[:7] + [RolloutRequest(prompt=target.prompt, sampling=target.sampling)] + others[7:])
    assert mixed[7].token_ids == alone.token_ids
    # float32 CPU GEMMs block differently for different batch sizes (and CPUs): the last bits of a log-prob may
    # move (1.1e-5 seen on an AMD EPYC host), a wrong temperature or token would move it by far more
    assert mixed[7].logprobs.tolist() == pytest.approx(alone.logprobs.tolist(), abs=1e-4)


def test_preemption_completes_everything_with_same_tokens(llama):
    ps = prompts(12, seed=7, lo=10, hi=30)
    sp = SamplingParams(temperature=0.8, max_tokens=40, seed=3, ignore_eos=True)
    big = client(llama, num_pages=512).generate(ps, sp)
    small = client(llama, num_pages=12, page_size=8)
    tight = small.generate(ps, sp)
    assert small.engine.scheduler.num_preemptions > 0, "the pool was meant to be too small"
    assert [r.token_ids for r in tight] == [r.token_ids for r in big]
    greedy_tight = small.generate(ps, GREEDY)
    assert [r.token_ids for r in greedy_tight] == [hf_greedy(llama, p, GREEDY.max_tokens) for p in ps]
    assert small.engine.kv.blocks.num_used == 0


def test_weight_update_changes_outputs_and_versions(llama):
    c = client(llama)
    ps = prompts(3, seed=8)
    before = c.generate(ps, GREEDY)
    assert all(v == 0 for r in before for v in r.token_versions)
    perturbed = {k: v + 0.05 * torch.randn_like(v) for k, v in llama.state_dict().items()}
    c.update_weights(perturbed, version=1)
    after = c.generate(ps, GREEDY)
    assert [r.token_ids for r in after] != [r.token_ids for r in before]
    assert all(v == 1 for r in after for v in r.token_versions)
    twin = tiny_hf_model("llama")
    twin.load_state_dict(perturbed)
    assert [r.token_ids for r in after] == [hf_greedy(twin, p, GREEDY.max_tokens) for p in ps]


@pytest.mark.parametrize("bad", [
    {"model.layers.0.mlp.up_proj.weight": torch.zeros(3, 3)},
    {"model.layers.99.mlp.up_proj.weight": torch.zeros(128, 64)},
    {"model.norm.weight": torch.ones(64, dtype=torch.int64)},
])
def test_bad_weight_update_raises_and_keeps_old_weights(llama, bad):
    c = client(llama)
    ps = prompts(2, seed=9)
    before = c.generate(ps, GREEDY)
    good_then_bad = {"model.norm.weight": torch.full((64,), 3.0), **bad}
    with pytest.raises(ValueError, match="model\\."):
        c.update_weights(good_then_bad, version=7)
    after = c.generate(ps, GREEDY)
    assert [r.token_ids for r in after] == [r.token_ids for r in before]
    assert c.engine.policy_version == 0


def test_in_flight_sequences_continue_across_refresh(llama):
    eng = Engine(model_source=llama, num_pages=128)
    eng.add_request(RolloutRequest(prompt=[1, 2, 3], sampling=GREEDY, request_id="r"))
    for _ in range(5):
        eng.step()
    eng.update_weights({k: v * 1.01 for k, v in llama.state_dict().items()}, version=3)
    (res,) = eng.run_until_done()
    assert res.token_versions[:5] == [0] * 5 and set(res.token_versions[5:]) == {3}


def test_refresh_with_abort_policy_aborts_in_flight(llama):
    eng = Engine(model_source=llama, num_pages=128, on_refresh="abort")
    eng.add_request(RolloutRequest(prompt=[1, 2, 3], sampling=GREEDY, request_id="r"))
    eng.step()
    eng.update_weights(dict(llama.state_dict()), version=1)
    (res,) = eng.run_until_done()
    assert res.finish_reason == "abort" and len(res.token_ids) == 1


def test_stop_conditions(llama):
    c = client(llama)
    p = [10, 20, 30]
    free = c.generate([p], GREEDY)[0].token_ids
    stop_tok = free[4]
    r = c.generate([p], SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_tok]))[0]
    assert r.token_ids == free[:free.index(stop_tok) + 1] and r.finish_reason == "stop"
    r = c.generate([p], SamplingParams(temperature=0, max_tokens=3))[0]
    assert r.token_ids == free[:3] and r.finish_reason == "length"
    eos = c.engine.eos_ids
    assert eos, "tiny config should still carry an eos id"


def test_abort_returns_partial_results(llama):
    eng = Engine(model_source=llama, num_pages=128)
    eng.add_request(RolloutRequest(prompt=[1, 2, 3], sampling=SamplingParams(n=3, max_tokens=50, ignore_eos=True),
                                   request_id="a"))
    eng.add_request(RolloutRequest(prompt=[4, 5], sampling=GREEDY, request_id="b"))
    eng.step()
    eng.step()
    aborted = eng.abort(["a"])
    assert sorted(r.sample_index for r in aborted) == [0, 1, 2]
    assert all(r.finish_reason == "abort" and len(r.token_ids) == 2 for r in aborted)
    rest = eng.run_until_done()
    assert [r.request_id for r in rest] == ["b"] and len(rest[0].token_ids) == GREEDY.max_tokens


def test_abort_before_prefill_reports_every_sample(llama):
    eng = Engine(model_source=llama, num_pages=128)
    eng.add_request(RolloutRequest(prompt=[1, 2], sampling=SamplingParams(n=4), request_id="x"))
    res = eng.abort(["x"])
    assert sorted(r.sample_index for r in res) == [0, 1, 2, 3] and all(not r.token_ids for r in res)
    assert not eng.has_unfinished()


def test_bad_requests_rejected_without_disturbing_others(llama):
    c = client(llama, max_model_len=64)
    good = prompts(3, seed=10)
    expected = c.generate(good, GREEDY)
    for bad in ([1] * 64, [300], [0, -1]):
        with pytest.raises(ValueError, match="prompt|token"):
            c.generate([good[0], bad], GREEDY)  # nothing from this call is queued
    assert not c.engine.has_unfinished()
    assert [r.token_ids for r in c.generate(good, GREEDY)] == [r.token_ids for r in expected]
    with pytest.raises(ValueError, match="text"):
        c.generate(["words need a tokenizer"], GREEDY)


def test_unknown_model_and_bad_config():
    with pytest.raises(ValueError, match="no-such-model"):
        RolloutClient.local("no-such-model")
    with pytest.raises(ValueError, match="backend"):
        RolloutClient.local("smollm2-135m", backend="tpu")
    with pytest.raises(ValueError, match="num_pages"):
        RolloutClient.local("smollm2-135m", num_pages=1)


def test_top_logprobs_and_modes(llama):
    c = client(llama)
    sp = SamplingParams(temperature=0.7, top_k=5, max_tokens=6, seed=1, logprobs=3, logprobs_mode="processed")
    r = c.generate([[3, 4, 5]], sp)[0]
    assert len(r.top_logprobs) == 6 and all(len(d) == 3 for d in r.top_logprobs)
    for tok, lp, top in zip(r.token_ids, r.logprobs, r.top_logprobs):
        assert max(top.values()) >= lp - 1e-6
        if tok in top:
            assert top[tok] == pytest.approx(float(lp), abs=1e-5)
    raw = c.generate([[3, 4, 5]], SamplingParams(temperature=0.7, top_k=5, max_tokens=6, seed=1, logprobs_mode="raw"))
    assert raw[0].token_ids == r.token_ids  # the mode changes what is reported, never what is sampled
    assert all(a <= b + 1e-6 for a, b in zip(raw[0].logprobs, r.logprobs))



def _batch(llama, poison=None, after_steps: int = 0, **opts) -> tuple[Engine, dict[str, list]]:
    """Three seeded requests (one with n=3) in one batch; `poison(seq)`, after `after_steps` steps, spoils the
    middle one's sequence through the engine's own object (out of validation's reach). Returns the engine
    and each request's results by sample index. On the CPU: on a GPU these faults (an index out of range)
    are device-side asserts, which end the process's CUDA context; validation keeps them from a step."""
    eng = Engine(model_source=llama, num_pages=128, device="cpu", **opts)
    sp = SamplingParams(temperature=1.0, max_tokens=12, seed=11, ignore_eos=True)
    reqs = [RolloutRequest([4, 5, 6, 7], sp, request_id="a"), RolloutRequest([8, 9, 10], sp, request_id="bad"),
            RolloutRequest([1, 2, 3, 4, 5], SamplingParams(n=3, temperature=0.8, max_tokens=9, seed=3),
                           request_id="c")]
    seqs = {r.request_id: eng.prepare(r) for r in reqs}
    for r in reqs:
        eng.add_request(r, seqs[r.request_id])
    results = [r for _ in range(after_steps) for r in eng.step()]
    if poison is not None:
        poison(seqs["bad"])
    results += eng.run_until_done()
    by_id: dict[str, list] = {}
    for r in sorted(results, key=lambda r: r.sample_index):
        by_id.setdefault(r.request_id, []).append(r)
    return eng, by_id


def _mates_unharmed(llama, eng: Engine, got: dict[str, list]) -> None:
    _, clean = _batch(llama)
    for rid in ("a", "c"):
        assert [(r.token_ids, r.finish_reason) for r in got[rid]] == \
            [(r.token_ids, r.finish_reason) for r in clean[rid]]
        assert all(r.error is None for r in got[rid])
        assert [r.logprobs.tolist() for r in got[rid]] == \
            [pytest.approx(r.logprobs.tolist(), abs=1e-4) for r in clean[rid]]  # recomputed: last bits may move
    assert eng.kv.blocks.num_used == 0 and not eng.has_unfinished()
    eng.add_request(RolloutRequest([4, 5, 6, 7], SamplingParams(temperature=0, max_tokens=5), request_id="next"))
    assert len(eng.run_until_done()[0].token_ids) == 5  # the engine still serves


@pytest.mark.parametrize("overlap", [True, False])
def test_step_failure_from_params_only_reachable_past_validation(llama, overlap):
    """top_k = 0 on the engine's own copy of the params (it crashed workers): a decode step raises, the
    request found invalid on a re-check finishes with that error, its batch mates go on unchanged."""
    def poison(seq):
        seq.sampling.top_k = 0
    eng, got = _batch(llama, poison, after_steps=3, overlap_decode=overlap)
    (bad,) = got["bad"]
    assert bad.finish_reason == "abort" and "SamplingParams.top_k=0" in bad.error
    assert 0 < len(bad.token_ids) < 12  # the tokens it had
    _mates_unharmed(llama, eng, got)


def test_step_failure_from_a_bad_state_is_found_by_running_requests_alone(llama):
    """An out-of-vocabulary prompt token in one sequence (its params are fine): the batch's prefill raises in
    the model, each request of the step runs alone until the one that fails is found; the others go on."""
    def poison(seq):
        seq.prompt_token_ids[1] = 10**6
    eng, got = _batch(llama, poison)
    (bad,) = got["bad"]
    assert bad.finish_reason == "abort" and bad.error.startswith("IndexError") and not bad.token_ids
    _mates_unharmed(llama, eng, got)


def test_failure_recording_the_step_in_flight_for_an_abort_fails_only_its_request(llama):
    """abort() records the overlapped step in flight first: a request whose recording raises (stop strings
    spoilt past validation) fails alone there too; the abort and the other requests are unaffected."""
    eng = Engine(model_source=llama, num_pages=128, device="cpu")
    sp = SamplingParams(temperature=1.0, max_tokens=12, seed=11, ignore_eos=True)
    seqs = {rid: eng.prepare(RolloutRequest([4, 5, 6, 7], sp, request_id=rid)) for rid in ("a", "bad", "c")}
    for rid, seq in seqs.items():
        eng.add_request(RolloutRequest([4, 5, 6, 7], sp, request_id=rid), seq)
    for _ in range(3):
        assert eng.step() == []
    assert eng.loop.in_flight is not None
    seqs["bad"].sampling.stop = 5
    aborted = eng.abort(["a"])
    assert [(r.request_id, r.finish_reason, r.error) for r in aborted] == [("a", "abort", None)]
    rest = {r.request_id: r for r in eng.run_until_done()}
    assert rest["bad"].finish_reason == "abort" and "SamplingParams.stop=5" in rest["bad"].error
    alone = Engine(model_source=llama, num_pages=64, device="cpu")
    alone.add_request(RolloutRequest([4, 5, 6, 7], sp, request_id="c"))
    assert rest["c"].error is None and rest["c"].token_ids == alone.run_until_done()[0].token_ids
