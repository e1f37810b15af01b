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
