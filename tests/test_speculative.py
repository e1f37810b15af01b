"""Exact speculative decoding (EngineConfig.speculative): a verify step keeps exactly the tokens plain decoding
samples, so with speculation on the results are plain decoding's, whatever the drafts: the suffix drafter's,
an oracle's that are always right (every step verifies long drafts), or drafts that are always wrong. Checked
through forks, penalties, top-p, stops inside a draft, preemption, the prefix cache, refreshes, aborts, episodes
and mixture-of-experts routing; bitwise in batch-invariant mode."""
import numpy as np
import pytest
from test_overlap import prompt, step_by_hand
from tiny_models import tiny_hf_model

from rollout_service import RolloutRequest, SamplingParams
from rollout_service.api.types import EpisodeParams
from rollout_service.config import EngineConfig, ServiceConfig
from rollout_service.engine.drafter import Drafter
from rollout_service.engine.engine import Engine
from rollout_service.engine.sequence import Sequence
from rollout_service.engine.speculation import DRY_STEPS, PROBE_EVERY, StepRates


@pytest.fixture(scope="module")
def llama():
    return tiny_hf_model("llama")


MIXED = [  # (request id, prompt, sampling, the step() call at which it arrives)
    ("greedy", prompt(1, 9), SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=2), 0),
    ("forks", prompt(2, 21), SamplingParams(temperature=0.9, top_k=20, max_tokens=15, n=3, seed=4), 0),
    ("nucleus", prompt(3, 5), SamplingParams(temperature=1.0, top_p=0.9, min_p=0.02, max_tokens=30, seed=7), 0),
    ("late", prompt(4, 17), SamplingParams(temperature=0.7, max_tokens=12, seed=1, ignore_eos=True), 3),
    ("penalised", prompt(5, 8), SamplingParams(temperature=0.8, repetition_penalty=1.3, frequency_penalty=0.5,
                                               max_tokens=10, seed=2), 4),
    ("stops", prompt(6, 6), SamplingParams(temperature=1.0, max_tokens=40, seed=3, stop_token_ids=[7, 9, 11]), 0),
    ("short", prompt(7, 4), SamplingParams(temperature=0, max_tokens=1), 5),
]


class Oracle(Drafter):
    """Drafts the tokens a run without speculation sampled (every draft token right), or always wrong ones."""

    def __init__(self, results, wrong: bool = False):
        self.tokens = {(r.request_id, r.sample_index): r.token_ids for r in results}
        self.wrong = wrong

    def propose(self, seq: Sequence, k: int) -> list[int]:
        truth = self.tokens.get((seq.request_id, seq.sample_index), [])
        n = seq.num_output_tokens
        # past the end too (a draft may run beyond the stop): the stop must still end it where it ends
        draft = (truth[n:n + k] + [5] * k)[:k]
        return [(t + 1) % 256 for t in draft] if self.wrong else draft

    def forget(self, seq: Sequence) -> None:
        pass


def drive(model, requests=MIXED, events=None, drafter=None, **opts):
    """Step an engine by hand (test_overlap.step_by_hand), with speculation on when `drafter` or opts ask for it:
    every step with a draft verifies it."""
    spec = drafter is not None or opts.get("speculative") is not None
    opts = {"num_pages": 256, "page_size": 8, **opts, "speculative": "suffix" if spec else None}
    eng = Engine(model_source=model, **opts)
    if spec:
        eng.speculator.rates.always = True
        if drafter is not None:
            eng.speculator.drafter = drafter
    return eng, step_by_hand(eng, requests, events, _no_pages_past_the_tokens)


def _no_pages_past_the_tokens(eng) -> None:
    """A draft's pages past the tokens kept are given back (checked where no step is in flight)."""
    if not eng.config.overlap_decode:
        ps = eng.config.page_size
        assert all(len(s.pages) <= -(-s.num_tokens // ps) for s in eng.scheduler.running)


def rounding_bound(lp, terms: int = 128) -> np.ndarray:
    """How far two float32 computations of a log-prob may differ when a verify step groups a product's rows
    differently from a decode step (another BLAS blocking): a sum of `terms` products (the model's widest
    reduction; 128 for the tiny models) rounds by up to terms * 2^-24 of its magnitude, |log-prob| or 1."""
    return terms * 2.0 ** -24 * np.maximum(1.0, np.abs(np.asarray(lp, np.float64)))


def assert_same(a, b, bitwise: bool = False, terms: int = 128):
    assert [(r.request_id, r.sample_index) for r in a] == [(r.request_id, r.sample_index) for r in b]
    for x, y in zip(a, b):
        where = f"{x.request_id}#{x.sample_index}"
        assert x.token_ids == y.token_ids, where
        assert (x.finish_reason, x.text, x.token_versions, x.kv_versions) == \
               (y.finish_reason, y.text, y.token_versions, y.kv_versions), where
        if bitwise:
            assert np.asarray(x.logprobs, np.float32).tobytes() == np.asarray(y.logprobs, np.float32).tobytes(), where
        else:
            diff = np.abs(np.asarray(x.logprobs, np.float64) - np.asarray(y.logprobs, np.float64))
            assert np.all(diff <= rounding_bound(x.logprobs, terms)), (where, float(diff.max()))
        assert (x.top_logprobs is None) == (y.top_logprobs is None), where
        for tx, ty in zip(x.top_logprobs or [], y.top_logprobs or []):
            assert tx.keys() == ty.keys(), where


@pytest.mark.parametrize("overlap", [False, True])
def test_any_drafts_give_plain_decodings_tokens(llama, overlap):
    _, plain = drive(llama, overlap_decode=overlap)
    for name, drafter in (("right", Oracle(plain)), ("wrong", Oracle(plain, wrong=True)), ("suffix", None)):
        eng, spec = drive(llama, drafter=drafter, overlap_decode=overlap, speculative="suffix")
        assert_same(plain, spec)
        s = eng.stats()["speculative"]
        assert s["verify_steps"] > 0 and s["proposed"] > 0, name
        if name == "right":  # drafts past a stop are cut there, so not every proposed token is taken
            assert s["tokens_per_draft"] > 3 and eng.stats()["steps"] < 20, s
        if name == "wrong":
            assert s["accepted"] == 0 and s["tokens_per_draft"] == 1.0


def test_batch_invariant_logprobs_are_bitwise_plain_decodings(llama):
    _, plain = drive(llama, batch_invariant=True, page_size=8)
    eng, spec = drive(llama, drafter=Oracle(plain), batch_invariant=True, page_size=8)
    assert eng.stats()["speculative"]["accepted"] > 50
    assert_same(plain, spec, bitwise=True)
    assert all(r.receipt is not None for r in spec)


def test_stop_strings_inside_a_draft(smollm2):
    model, tok = smollm2
    text = "Count: one, two, three, four, five, six, seven, eight, nine, ten."
    ids = tok(text)["input_ids"]
    sp = SamplingParams(temperature=0, max_tokens=24, stop=["four", "nin"])
    reqs = [("s", ids[:4], sp, 0), ("t", ids[:6], SamplingParams(temperature=0, max_tokens=9), 0)]
    _, plain = drive(model, reqs, tokenizer=tok)

    class Copy(Drafter):  # drafts the text itself: the counting continues right past the stop string
        def propose(self, seq, k):
            n = seq.num_tokens
            return ids[n:n + k]

        def forget(self, seq):
            pass
    eng, spec = drive(model, reqs, drafter=Copy(), tokenizer=tok)
    assert_same(plain, spec, terms=model.config.intermediate_size)
    assert eng.stats()["speculative"]["accepted"] > 0


def test_preemption_and_an_abort(llama):
    """Few pages: sequences are preempted and recomputed (a draft never preempts anyone); an abort mid-run keeps
    a prefix of what plain decoding gives."""
    opts = dict(num_pages=14, page_size=8)
    eng0, full = drive(llama, **opts)
    events = {6: lambda eng: eng.abort(["nucleus"])}
    eng, spec = drive(llama, events=events, drafter=Oracle(full), **opts)
    assert eng0.stats()["preemptions"] > 0 and eng.stats()["speculative"]["accepted"] > 0
    cut = next(r for r in spec if r.request_id == "nucleus")
    whole = next(r for r in full if r.request_id == "nucleus")
    assert cut.finish_reason == "abort" and 0 < len(cut.token_ids) < len(whole.token_ids)
    assert cut.token_ids == whole.token_ids[:len(cut.token_ids)]
    assert_same([r for r in full if r is not whole], [r for r in spec if r is not cut])


@pytest.mark.parametrize("on_refresh", ["recompute", "continue"])
def test_a_refresh_between_verify_steps(llama, on_refresh):
    """Greedy requests, a refresh after two steps: the tokens before it are plain decoding's under the old
    weights and (recompute: KV redone under the new weights) the tokens after it plain decoding's under the new
    weights, continuing from those tokens."""
    new = {k: v * 1.05 for k, v in llama.state_dict().items()}
    reqs = [(f"g{i}", prompt(30 + i, 5 + i), SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), 0)
            for i in range(3)]
    _, old_run = drive(llama, reqs)
    eng, spec = drive(llama, reqs, drafter=Oracle(old_run), events={2: lambda e: e.update_weights(new, 1)},
                      on_refresh=on_refresh)
    assert eng.stats()["speculative"]["accepted"] > 0
    fresh = Engine(model_source=llama, num_pages=256)
    fresh.update_weights(new, 1)
    for r, old in zip(spec, old_run):
        before = r.token_versions.count(0)
        assert 0 < before < len(r.token_ids) and r.token_versions == sorted(r.token_versions)
        assert r.token_ids[:before] == old.token_ids[:before]
        if on_refresh == "recompute":
            fresh.add_request(RolloutRequest(prompt=r.prompt_token_ids + r.token_ids[:before], request_id=r.request_id,
                                             sampling=SamplingParams(temperature=0, max_tokens=24 - before,
                                                                     ignore_eos=True)))
            assert fresh.run_until_done()[0].token_ids == r.token_ids[before:]


def test_prefix_cache_hits_are_the_same(llama):
    shared = prompt(11, 24)
    reqs = [(f"r{i}", shared + prompt(20 + i, 3), SamplingParams(temperature=1.0, max_tokens=16, seed=i), i)
            for i in range(4)]
    eng0, plain = drive(llama, reqs, page_size=8)
    eng, spec = drive(llama, reqs, drafter=Oracle(plain), page_size=8)
    assert_same(plain, spec)
    assert eng.stats()["prefix_cache"]["hit_tokens"] == eng0.stats()["prefix_cache"]["hit_tokens"] > 0


class Echo:
    def reset(self, metadata):
        return list(range(30, 52))

    def step(self, text):
        return [7, 8, 9, 10, 11], 0.0, False


def test_episodes_and_moe_routing_are_the_same():
    model = tiny_hf_model("qwen3_moe", seed=5)
    sp = SamplingParams(n=2, temperature=1.0, max_tokens=6, seed=1, ignore_eos=True, return_routed_experts=True,
                        return_prompt_routed_experts=True)

    def run(drafter):
        eng = Engine(model_source=model, num_pages=128, page_size=8, speculative="suffix" if drafter else None)
        if drafter:
            eng.speculator.rates.always, eng.speculator.drafter = True, drafter
        eng.add_request(RolloutRequest(prompt=None, sampling=sp, episode=EpisodeParams(Echo(), max_turns=3)))
        return eng, sorted(eng.run_until_done(), key=lambda r: r.sample_index)

    class Repeat(Drafter):  # an episode's turns repeat the environment's ids: a draft of them is partly right
        def propose(self, seq, k):
            return [7, 8, 9, 10, 11][:k]

        def forget(self, seq):
            pass
    _, plain = run(None)
    eng, spec = run(Repeat())
    assert eng.stats()["speculative"]["verify_steps"] > 0
    for x, y in zip(plain, spec):
        assert (x.token_ids, x.loss_mask, x.finish_reason) == (y.token_ids, y.loss_mask, y.finish_reason)
        assert np.all(np.abs(np.asarray(x.logprobs) - np.asarray(y.logprobs)) <= rounding_bound(x.logprobs))
        assert np.array_equal(x.routed_experts, y.routed_experts)


def test_opt_out_config_and_bad_config(llama, tmp_path):
    reqs = [(rid, p, SamplingParams(**{**sp.to_dict(), "speculative": False}), at) for rid, p, sp, at in MIXED]
    _, plain = drive(llama)
    eng, spec = drive(llama, reqs, drafter=Oracle(plain))
    assert eng.stats()["speculative"]["proposed"] == 0
    assert_same(plain, spec)
    with pytest.raises(ValueError, match="speculative"):
        EngineConfig(speculative="eagle")
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        EngineConfig(speculative="suffix", num_speculative_tokens=0)
    with pytest.raises(ValueError, match="speculative_max_batch"):
        EngineConfig(speculative="suffix", speculative_max_batch=0)
    with pytest.raises(ValueError, match="speculative"):
        SamplingParams(speculative="yes")
    yaml = tmp_path / "svc.yaml"
    yaml.write_text("engine:\n  speculative: suffix\n  num_speculative_tokens: 6\n")
    assert ServiceConfig.from_yaml(str(yaml)).engine.num_speculative_tokens == 6
    yaml.write_text("engine:\n  speculative: medusa\n")
    with pytest.raises(ValueError, match="speculative"):
        ServiceConfig.from_yaml(str(yaml))
    off = Engine(model_source=llama, num_pages=16).stats()["speculative"]
    assert off["enabled"] is False and off["verify_steps"] == 0


def test_step_rates_pick_the_faster_mode_and_probe_the_other():
    r = StepRates()
    assert r.prefer_verify(4)  # nothing measured: verify is tried first
    r.rates[("verify", 4)] = 100.0
    assert not r.prefer_verify(4)  # then decode is measured
    r.rates[("decode", 4)] = 150.0
    r.note("verify", 4, 6)
    picks = []
    for _ in range(3 * PROBE_EVERY):  # decode steps of 3 sequences: 3 falls in the bucket of 4
        picks.append(r.prefer_verify(3))
        r.note("verify" if picks[-1] else "decode", 3, 3)
    assert [i for i, p in enumerate(picks) if p] == [PROBE_EVERY, 2 * PROBE_EVERY + 1]  # once every PROBE_EVERY steps
    r.rates[("decode", 4)] = 50.0
    assert r.prefer_verify(4)


def test_the_embedded_model_on_grpos_prompts(smollm2):
    """Real text: the suffix drafter's drafts (siblings' and the sequence's own text) are partly right, and the
    tokens are plain decoding's, greedy and sampled."""
    from rollout_service.examples import tasks
    model, tok = smollm2
    train, _ = tasks.split()
    reqs = [(f"p{i}", train[i].messages(),
             SamplingParams(n=4, temperature=1.0, max_tokens=32, seed=i), 0) for i in range(1)]
    reqs.append(("greedy", reqs[0][1], SamplingParams(temperature=0, max_tokens=32), 0))
    _, plain = drive(model, reqs, tokenizer=tok)
    eng, spec = drive(model, reqs, tokenizer=tok, speculative="suffix")
    assert_same(plain, spec, terms=model.config.intermediate_size)
    s = eng.stats()["speculative"]
    assert s["accepted"] > 0 and s["tokens_per_verify"] > 1, s


class Never(Drafter):
    """A drafter that never has a draft, counting how often it was asked."""

    def __init__(self):
        self.asked = 0

    def propose(self, seq, k):
        self.asked += 1
        return []

    def forget(self, seq):
        pass


NO_DRAFT_REQUESTS = [(f"r{i}", prompt(40 + i, 6), SamplingParams(temperature=1.0, max_tokens=40, seed=i,
                                                                  ignore_eos=True), 0) for i in range(3)]


def _never_drafting(llama, dry_steps=None):
    eng = Engine(model_source=llama, num_pages=256, page_size=8, speculative="suffix")
    eng.speculator.drafter = Never()
    if dry_steps is not None:
        eng.speculator.dry_steps = dry_steps
    for rid, p, sp, _ in NO_DRAFT_REQUESTS:
        eng.add_request(RolloutRequest(prompt=p, sampling=sp, request_id=rid))
    eng.run_until_done()
    return eng


def test_no_drafts_keep_overlapped_decoding(llama):
    """Where no sequence has a draft, decode steps are still launched ahead of their tokens (the GPU's overlap,
    which is what the CUDA engine's dry steps are for), bar one step in DRY_STEPS that asks the drafter again."""
    off, _ = drive(llama, NO_DRAFT_REQUESTS)
    on = _never_drafting(llama, dry_steps=DRY_STEPS)
    assert on.stats()["speculative"]["verify_steps"] == 0
    assert on.stats()["overlapped_steps"] >= 0.7 * off.stats()["overlapped_steps"] > 0


def test_on_the_cpu_the_drafter_is_asked_at_every_step(llama):
    """A CPU step has run by the time it is "launched", so nothing is lost by recording its tokens before the next:
    the CPU engine asks the drafter at every decode step (on the GPU, one step in DRY_STEPS after a dry one)."""
    eng = _never_drafting(llama)
    assert eng.speculator.dry_steps == 0
    # each of the 3 sequences at each of its 40 steps but its first (the prefill's) and last (no room for a draft)
    assert eng.speculator.drafter.asked == 3 * 38, eng.speculator.drafter.asked


def test_a_verify_step_fits_the_runners_verify_rows(llama, monkeypatch):
    """Past the largest CUDA graph a verify step would run eagerly (~20 graphed steps' time on an H100): the engine
    bounds every verify step by ModelRunner.verify_rows, and the tokens stay plain decoding's."""
    from rollout_service.engine.model_runner import ModelRunner
    _, plain = drive(llama)
    monkeypatch.setattr(ModelRunner, "verify_rows", property(lambda self: 6))
    rows = []
    eng = Engine(model_source=llama, num_pages=256, page_size=8, speculative="suffix")
    eng.speculator.rates.always = True
    eng.speculator.drafter = Oracle(plain)
    verify = eng.runner.verify
    eng.runner.verify = lambda seqs, drafts: rows.append(len(seqs) + sum(map(len, drafts))) or verify(seqs, drafts)
    on = step_by_hand(eng, MIXED, None, _no_pages_past_the_tokens)
    assert rows and max(rows) <= 6 and eng.speculator.max_rows == 6, rows
    assert_same(plain, on)
