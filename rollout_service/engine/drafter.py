"""A model-free drafter: the next tokens of a sequence guessed from text already seen (speculation.py verifies).

RL rollouts repeat themselves: GRPO's n samples of one prompt share much of their text, a sequence repeats
its own prompt and earlier lines (equations, code, tool calls), and the same prompts come back in later epochs.
So the draft follows what came after the sequence's last few tokens (the longest suffix seen, MIN_NGRAM to
MAX_NGRAM tokens) in: its own prompt and output, its siblings' outputs, and earlier rollouts of the same prompt
tokens. Every source of one prompt shares one table (a Corpus), keyed by the prompt's tokens.

What each n-gram remembers is not only which token followed it but the model's distribution there: the
sampler hands over the DIST_TOP likeliest tokens of the distribution it drew each token from (speculation.py
passes them on), and a table adds up those probabilities (the expected counts: sharper than one sample each).
Where no distribution is known (the prompt's own text) the follower counts as 1.

Which follower: greedy decoding takes the likeliest token, so the one with the most mass. Sampling takes
argmax(log p + g) with the sampler's Gumbel draws g, which are known before the step (counter-based noise,
ops/random.py): so the draft takes the token that wins that argmax with its mass standing for p, the one the
sequence's own noise favours. Where the whole context was seen before (siblings before they part) and its last
MAX_NGRAM tokens nowhere else, the mass is the model's distribution there, and the draft is the token the sampler
will draw whenever that token is among the DIST_TOP kept.

A draft only changes speed, never a token (the verify step keeps exactly what plain decoding samples), so
nothing here needs to be right: history is kept across weight refreshes (old rollouts still predict new ones
well) and memory is bounded by dropping whole corpora, least recently used first, past HISTORY_POSITIONS
indexed positions in all.
"""
from __future__ import annotations

import math
from collections import OrderedDict
from typing import Callable

from rollout_service.engine.sequence import Sequence
from rollout_service.ops.random import gumbel_at, row_key

MIN_NGRAM, MAX_NGRAM = 2, 4     # suffix lengths looked up, longest first
HISTORY_POSITIONS = 1 << 15     # positions indexed over every corpus (~1.3 kB each with distributions: ~40 MB)
DIST_TOP = 8                    # tokens of each drawn distribution kept (the sampled one is among 8 ~3/4 of the
                                # time at temperature 1 on the GRPO example; 32 adds little drafting)
MIN_MASS = 0.02                 # of those, the ones at least this likely (rarer ones almost never win)
Noise = Callable[[int, int], float]  # (place in the draft, token id) -> the sampler's Gumbel draw there
Dist = tuple[list[int], list[float]]  # token ids and their log-probs, likeliest first


class Drafter:
    """What the speculator asks of a drafter (the defaults: nothing kept)."""

    def propose(self, seq: Sequence, k: int) -> list[int]:
        """Up to k token ids guessed to follow seq's tokens ([] for no guess)."""
        raise NotImplementedError

    def forget(self, seq: Sequence) -> None:
        """seq finished: drop what is kept for it alone (its text stays as history where there is one)."""

    def observe(self, seq: Sequence, index: int, dist: Dist) -> None:
        """seq's output token `index` was drawn from `dist` (its DIST_TOP likeliest tokens)."""


def kept_mass(dist: Dist) -> list[tuple[int, float]]:
    """dist's tokens at least MIN_MASS likely, with their probabilities."""
    out = []
    for token, logprob in zip(*dist):
        p = math.exp(logprob)
        if p < MIN_MASS:
            break
        out.append((token, p))
    return out


class _Corpus:
    """Every text seen for one prompt: for each n-gram, the mass of each token that could follow it."""

    def __init__(self, min_ngram: int = MIN_NGRAM) -> None:
        self.next: dict[tuple[int, ...], dict[int, float]] = {}
        self.min_ngram = min_ngram
        self.positions = 0
        self.prompt_indexed = False

    def add(self, text: list[int], start: int, end: int, mass: Callable[[int], list[tuple[int, float]] | None]
            = lambda p: None) -> int:
        """Add what follows the n-grams of text ending at positions [start, end): mass(p), the distribution the
        token after p was drawn from, where known; else that token, once."""
        table = self.next
        for p in range(start, end):
            follower = mass(p) or ((text[p + 1], 1.0),)
            for n in range(self.min_ngram, min(MAX_NGRAM, p + 1) + 1):
                masses = table.setdefault(tuple(text[p + 1 - n:p + 1]), {})
                for token, m in follower:
                    masses[token] = masses.get(token, 0.0) + m
        self.positions += max(0, end - start)
        return max(0, end - start)

    def draft(self, text: list[int], k: int, noise: Noise | None = None) -> list[int]:
        """Up to k tokens, each a follower of the longest seen suffix of text + the draft so far: the one with the
        most mass, or with `noise` (a sampled sequence's draws) the one whose log mass + draw is highest."""
        tail, out = text[-MAX_NGRAM:], []
        while len(out) < k:
            masses = None
            for n in range(min(MAX_NGRAM, len(tail)), self.min_ngram - 1, -1):
                masses = self.next.get(tuple(tail[-n:]))
                if masses:
                    break
            if not masses:
                break
            if noise is None:
                tok = max(masses, key=masses.__getitem__)  # ties: the follower seen first
            else:
                at = len(out)
                tok = max(masses, key=lambda t: math.log(masses[t]) + noise(at, t))
            out.append(tok)
            tail = tail[1:] + [tok] if len(tail) == MAX_NGRAM else tail + [tok]
        return out


def sampler_noise(seed: int, sample_index: int, step: int) -> Noise:
    """The Gumbel draws the sampler will add at each place of a draft that starts at output step `step`
    (sampler.py's keys: seed, sample, step)."""
    keys: dict[int, int] = {}

    def draw(at: int, token: int) -> float:
        key = keys.get(at)
        if key is None:
            key = keys[at] = row_key(int(seed), int(sample_index), step + at)
        return gumbel_at(key, token)
    return draw


class _Track:
    """One live sequence: its text (prompt + output, copied as tokens come), its corpus and its key, how much
    of the text is indexed, and the distributions of its output tokens not indexed yet (by output index)."""

    def __init__(self, seq: Sequence, key: tuple[int, ...], corpus: _Corpus, indexed: int):
        self.text = list(seq.prompt_token_ids)
        self.prompt_len = len(self.text)
        self.key, self.corpus, self.indexed = key, corpus, indexed
        self.dists: dict[int, list[tuple[int, float]]] = {}

    def mass(self, p: int) -> list[tuple[int, float]] | None:
        """The distribution the token after text position p was drawn from, if known."""
        return self.dists.get(p + 1 - self.prompt_len)

    def index(self, corpora: list[_Corpus]) -> int:
        """Add the text not indexed yet to `corpora` (but the last token, whose follower is not known): the count
        of positions added."""
        start, end = self.indexed, len(self.text) - 1
        added = sum(c.add(self.text, start, end, self.mass) for c in corpora)
        for p in range(start, end):
            self.dists.pop(p + 1 - self.prompt_len, None)
        self.indexed = max(start, end)
        return added


class SuffixDrafter(Drafter):
    """shared: where a prompt's own table has no draft, one table of every prompt's text drafts (phrases shared
    across tasks); min_ngram: the shortest suffix looked up (benchmarks compare these)."""

    def __init__(self, history_positions: int = HISTORY_POSITIONS, min_ngram: int = MIN_NGRAM,
                 shared: bool = False) -> None:
        self.history_positions, self.min_ngram = history_positions, min_ngram
        self._corpora: OrderedDict[tuple[int, ...], _Corpus] = OrderedDict()
        self._shared = _Corpus(min_ngram) if shared else None
        self._tracks: dict[int, _Track] = {}
        self._positions = 0

    def propose(self, seq: Sequence, k: int) -> list[int]:
        track = self._track(seq)
        text = track.text
        outputs = seq.output_token_ids
        if len(text) < seq.num_tokens:
            text += outputs[len(text) - len(seq.prompt_token_ids):]
        self._positions += track.index(self._tables(track.corpus))
        noise = sampler_noise(seq.seed, seq.sample_index, seq.num_output_tokens) if seq.sampling.temperature else None
        draft = track.corpus.draft(text, k, noise)
        if not draft and self._shared is not None:
            draft = self._shared.draft(text, k, noise)
        if self._positions > self.history_positions:
            self._shrink()
        return draft

    def forget(self, seq: Sequence) -> None:
        self._tracks.pop(seq.seq_id, None)

    def observe(self, seq: Sequence, index: int, dist: Dist) -> None:
        track = self._tracks.get(seq.seq_id)
        if track is not None and index >= track.indexed + 1 - track.prompt_len:  # (not indexed yet)
            track.dists[index] = kept_mass(dist)

    def _track(self, seq: Sequence) -> _Track:
        track = self._tracks.get(seq.seq_id)
        if track is not None:  # (_shrink drops the tracks of the corpora it drops: this one's is live)
            self._corpora.move_to_end(track.key)
            return track
        key = tuple(seq.prompt_token_ids)
        corpus = self._corpora.get(key)
        if corpus is None:  # first sample of this prompt, or its corpus was dropped: index it again
            corpus = self._corpora[key] = _Corpus(self.min_ngram)
        self._corpora.move_to_end(key)
        prompt_len = len(seq.prompt_token_ids)
        if not corpus.prompt_indexed:  # the prompt's n-grams once per corpus, not once per sample
            self._positions += sum(c.add(list(key), 0, prompt_len - 1) for c in self._tables(corpus))
            corpus.prompt_indexed = True
        track = self._tracks[seq.seq_id] = _Track(seq, key, corpus, max(0, prompt_len - 1))
        return track

    def _tables(self, corpus: _Corpus) -> list[_Corpus]:
        return [corpus] if self._shared is None else [corpus, self._shared]

    def _shrink(self) -> None:
        """Drop the least recently used corpora until the bound holds (the newest always stays); the shared table
        starts again once it holds half the bound."""
        if self._shared is not None and 2 * self._shared.positions > self.history_positions:
            self._positions -= self._shared.positions
            self._shared = _Corpus(self.min_ngram)
        while self._positions > self.history_positions and len(self._corpora) > 1:
            _, corpus = self._corpora.popitem(last=False)
            self._positions -= corpus.positions
        if self._positions > self.history_positions:  # one prompt alone past the bound: start it again
            _, corpus = self._corpora.popitem(last=False)
            self._positions -= corpus.positions
        live = set(map(id, self._corpora.values()))
        self._tracks = {sid: t for sid, t in self._tracks.items() if id(t.corpus) in live}
