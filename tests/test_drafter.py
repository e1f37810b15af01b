"""The suffix drafter (rollout_service/engine/drafter.py) on token lists whose answer is known: what it learns from
siblings and history, which follower it drafts (the sampler's own noise for sampled sequences), and its bound on
memory. That a draft never changes a token is test_speculative.py's."""
import pytest
import torch

from rollout_service import SamplingParams
from rollout_service.engine.drafter import SuffixDrafter
from rollout_service.engine.sequence import Sequence
from rollout_service.ops.random import gumbel, gumbel_at, row_key


def test_suffix_drafter_learns_from_siblings_and_history():
    d = SuffixDrafter(history_positions=200)
    sp = SamplingParams()
    first = Sequence("a", [1, 2, 3], sp, 0)
    first.output_token_ids = [10, 11, 12, 13, 14, 15]
    assert d.propose(first, 4) == []  # its own text has no repeat yet
    sibling = Sequence("a", [1, 2, 3], sp, 0, sample_index=1)
    sibling.output_token_ids = [99, 11, 12]
    assert d.propose(sibling, 3) == [13, 14, 15]  # what followed "11 12" in its sibling
    d.forget(first)
    d.forget(sibling)
    later = Sequence("b", [1, 2, 3], sp, 0)  # the same prompt in a later epoch: its history is there
    later.output_token_ids = [10, 11]
    assert d.propose(later, 2) == [12, 13]
    # greedy: the most frequent follower wins
    third = Sequence("a", [1, 2, 3], SamplingParams(temperature=0.0), 0, sample_index=2)
    third.output_token_ids = [11, 12, 77, 11, 12, 77, 11, 12]
    assert d.propose(third, 1) == [77]
    # memory stays bounded: other prompts push the oldest corpus out
    for i in range(40):
        s = Sequence(f"x{i}", [200 + i] * 3, sp, 0)
        s.output_token_ids = list(range(20))
        d.propose(s, 2)
        d.forget(s)
    assert d._positions <= 200 and (1, 2, 3) not in d._corpora


def test_a_sampled_sequence_drafts_the_follower_its_own_noise_favours():
    """Two followers seen as often: each sampled sequence drafts the one that wins argmax(log count + g) with the
    Gumbel draws the sampler will add at that step (ops/random.py), so siblings whose draws differ draft
    differently; greedy keeps the follower seen first. Checked against the sampler's own noise tensor."""
    vocab = torch.tensor([13, 77])
    wins = {}
    for sample in range(12):
        d = SuffixDrafter()
        seq = Sequence("a", [1, 2, 3], SamplingParams(temperature=1.0), 7, sample_index=sample)
        seq.output_token_ids = [11, 12, 13, 11, 12, 77, 11, 12]
        key = torch.tensor([row_key(7, sample, seq.num_output_tokens)])
        g = gumbel(key, vocab)[0]
        wins[sample] = d.propose(seq, 1)
        assert wins[sample] == [int(vocab[g.argmax()])]
    assert {tuple(w) for w in wins.values()} == {(13,), (77,)}  # (the draws differ between samples)
    greedy = Sequence("a", [1, 2, 3], SamplingParams(temperature=0.0), 7)
    greedy.output_token_ids = [11, 12, 13, 11, 12, 77, 11, 12]
    assert SuffixDrafter().propose(greedy, 1) == [13]


def test_the_drafters_single_draws_are_the_samplers_noise():
    keys = torch.tensor([row_key(s, i, t) for s, i, t in ((0, 0, 0), (7, 3, 41), (2**40, 1, 9))])
    ids = torch.tensor([0, 1, 13, 49151, 150000])
    g = gumbel(keys, ids)
    for r, key in enumerate(keys.tolist()):
        for c, v in enumerate(ids.tolist()):
            assert gumbel_at(key, v) == pytest.approx(float(g[r, c]), rel=1e-5, abs=1e-5)


def test_a_drawn_distribution_drafts_tokens_never_sampled_where_the_noise_favours_them():
    """The first sample drew 13 after "11 12" from a distribution that gave 13 and 77 even odds (the sampler's
    DIST_TOP tokens, handed over by observe). A sibling at the same context drafts whichever of the two its own
    draws favour, 77 included, which counting followers alone never proposes; tokens under MIN_MASS are not
    kept; the sampled token alone counts where no distribution was observed."""
    import math

    vocab = torch.tensor([13, 77])
    half = math.log(0.5)
    wins = set()
    for sample in range(1, 13):
        d = SuffixDrafter()
        first = Sequence("a", [1, 2, 3], SamplingParams(temperature=1.0), 7)
        first.output_token_ids = [11, 12]
        d.propose(first, 1)
        first.output_token_ids.append(13)
        d.observe(first, 2, ([13, 77, 5], [half, half, math.log(0.01)]))
        d.propose(first, 1)  # indexes "11 12" -> the distribution of 13
        sibling = Sequence("a", [1, 2, 3], SamplingParams(temperature=1.0), 7, sample_index=sample)
        sibling.output_token_ids = [99, 11, 12]
        g = gumbel(torch.tensor([row_key(7, sample, 3)]), vocab)[0]
        draft = d.propose(sibling, 1)
        assert draft == [int(vocab[g.argmax()])]
        wins.add(draft[0])
        assert 5 not in d._corpora[(1, 2, 3)].next[(11, 12)]
    assert wins == {13, 77}
    counted = SuffixDrafter()
    first = Sequence("a", [1, 2, 3], SamplingParams(temperature=1.0), 7)
    first.output_token_ids = [11, 12, 13]
    counted.propose(first, 1)
    assert counted._corpora[(1, 2, 3)].next[(11, 12)] == {13: 1.0}


def test_the_engine_hands_the_drafter_each_tokens_drawn_distribution():
    """Every output token after the first (the prefill's), whether a decode step or a verify step gave it, reaches
    the drafter with the DIST_TOP likeliest tokens of the distribution it was drawn from: the very alternatives a
    request with logprobs=DIST_TOP gets back (processed log-probs; greedy rows: the model's own)."""
    import numpy as np
    from test_overlap import prompt, step_by_hand
    from tiny_models import tiny_hf_model

    from rollout_service.engine.drafter import DIST_TOP, Drafter
    from rollout_service.engine.engine import Engine

    class HalfRight(Drafter):  # the plain run's next tokens, the last of each draft wrong: verify steps keep some
        def __init__(self, plain):
            self.tokens = {(r.request_id, r.sample_index): r.token_ids for r in plain}
            self.seen = {}

        def propose(self, seq, k):
            n, truth = seq.num_output_tokens, self.tokens[(seq.request_id, seq.sample_index)]
            draft = truth[n:n + k]
            return draft[:-1] + [(draft[-1] + 1) % 256] if len(draft) > 1 else []

        def observe(self, seq, index, dist):
            self.seen[(seq.request_id, seq.sample_index, index)] = dist

    llama = tiny_hf_model("llama")
    requests = [("sampled", prompt(1, 9), SamplingParams(temperature=1.0, n=2, max_tokens=24, seed=3, ignore_eos=True,
                                                         logprobs=DIST_TOP), 0),
                ("greedy", prompt(2, 7), SamplingParams(temperature=0, max_tokens=16, ignore_eos=True,
                                                        logprobs=DIST_TOP), 1)]
    plain = step_by_hand(Engine(model_source=llama, num_pages=64, page_size=8), requests)
    eng = Engine(model_source=llama, num_pages=64, page_size=8, speculative="suffix")
    eng.speculator.rates.always = True
    eng.speculator.drafter = drafter = HalfRight(plain)
    results = step_by_hand(eng, requests)
    assert eng.stats()["speculative"]["accepted"] > 0
    for r in results:
        for i in range(1, len(r.token_ids)):
            ids, lps = drafter.seen[(r.request_id, r.sample_index, i)]
            assert ids == list(r.top_logprobs[i]), (r.request_id, i)
            np.testing.assert_allclose(lps, list(r.top_logprobs[i].values()), atol=1e-5)
    assert len(drafter.seen) == sum(len(r.token_ids) - 1 for r in results)


def test_the_shared_table_drafts_another_prompts_phrases_and_one_token_suffixes():
    """shared=True: a prompt whose own table has no draft takes one from every prompt's text; min_ngram=1 finds a
    follower of the last token alone. Neither is the engine's default."""
    first = Sequence("a", [1, 2, 3], SamplingParams(temperature=0.0), 0)
    first.output_token_ids = [40, 41, 42, 43, 44]
    other = Sequence("b", [9, 9, 9], SamplingParams(temperature=0.0), 0)
    other.output_token_ids = [50, 41, 42]
    alone, wide = SuffixDrafter(), SuffixDrafter(min_ngram=1, shared=True)
    for d in (alone, wide):
        d.propose(first, 1)
    assert alone.propose(other, 2) == [] and wide.propose(other, 2) == [43, 44]
    last = Sequence("c", [7, 7, 7], SamplingParams(temperature=0.0), 0)
    last.output_token_ids = [41, 42, 77, 41]  # "77 41" is new; "41" alone was followed by 42
    assert SuffixDrafter().propose(last, 1) == [] and SuffixDrafter(min_ngram=1).propose(last, 1) == [42]
