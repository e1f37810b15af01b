"""A model-free drafter: the next tokens of a sequence guessed from text already seen (speculation.py verifies).

RL rollouts repeat themselves: GRPO's n samples of one prompt share much of their text, a sequence repeats
its own prompt and earlier lines (equations, code, tool calls), and the same prompts come back in later epochs.
So the draft follows what came after the sequence's last few tokens (the longest suffix seen, MIN_NGRAM to
MAX_NGRAM tokens) in: its own prompt and output, its siblings' outputs, and earlier rollouts of the same prompt
tokens. Every source of one prompt shares one table of counts (a Corpus), keyed by the prompt's tokens.

Which follower: greedy decoding takes the likeliest token, so the most frequent one. Sampling takes
argmax(log p + g) with the sampler's Gumbel draws g, which are known before the step (counter-based noise,
ops/random.py): so the draft takes the follower that wins that argmax with its count standing for p, the one the
sequence's own noise favours. Siblings part where their noise differs; this follows the sibling whose draw
this sequence repeats.

A draft only changes speed, never a token (the verify step keeps exactly what plain decoding samples), so
nothing here needs to be right: history is kept across weight refreshes (old rollouts still predict new ones
well) and memory is bounded by dropping whole corpora, least recently used first, past HISTORY_POSITIONS
indexed positions in all.
"""
from __future__ import annotations

import math
from collections import OrderedDict
from typing import Callable, Protocol

from rollout_service.engine.sequence import Sequence
from rollout_service.ops.random import gumbel_at, row_key

MIN_NGRAM, MAX_NGRAM = 2, 4     # suffix lengths looked up, longest first
HISTORY_POSITIONS = 1 << 16     # positions counted over every corpus (3 n-grams each: tens of MB at most)
Noise = Callable[[int, int], float]  # (place in the draft, token id) -> the sampler's Gumbel draw there


class Drafter(Protocol):
    def propose(self, seq: Sequence, k: int) -> list[int]:
        """Up to k token ids guessed to follow seq's tokens ([] for no guess)."""

    def forget(self, seq: Sequence) -> None:
        """seq finished: drop what is kept for it alone (its text stays as history where there is one)."""


class _Corpus:
    """Every text seen for one prompt: for each n-gram, how often each token followed it."""

    def __init__(self) -> None:
        self.next: dict[tuple[int, ...], dict[int, int]] = {}
        self.positions = 0
        self.prompt_indexed = False

    def add(self, text: list[int], start: int, end: int) -> int:
        """Count the tokens that follow the n-grams of text ending at positions [start, end)."""
        table = self.next
        for p in range(start, end):
            follower = text[p + 1]
            for n in range(MIN_NGRAM, min(MAX_NGRAM, p + 1) + 1):
                counts = table.setdefault(tuple(text[p + 1 - n:p + 1]), {})
                counts[follower] = counts.get(follower, 0) + 1
        self.positions += max(0, end - start)
        return max(0, end - start)

    def draft(self, text: list[int], k: int, noise: Noise | None = None) -> list[int]:
        """Up to k tokens, each a follower of the longest seen suffix of text + the draft so far: the most frequent
        one, or with `noise` (a sampled sequence's draws) the one whose log count + draw is highest."""
        tail, out = text[-MAX_NGRAM:], []
        while len(out) < k:
            counts = None
            for n in range(min(MAX_NGRAM, len(tail)), MIN_NGRAM - 1, -1):
                counts = self.next.get(tuple(tail[-n:]))
                if counts:
                    break
            if not counts:
                break
            if noise is None:
                tok = max(counts, key=counts.__getitem__)  # ties: the follower seen first
            else:
                at = len(out)
                tok = max(counts, key=lambda t: math.log(counts[t]) + noise(at, t))
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
    """One live sequence: its text (prompt + output, copied as tokens come), its corpus and its key, and how much
    of the text is indexed."""

    def __init__(self, seq: Sequence, key: tuple[int, ...], corpus: _Corpus, indexed: int):
        self.text = list(seq.prompt_token_ids)
        self.key, self.corpus, self.indexed = key, corpus, indexed


class SuffixDrafter:
    def __init__(self, history_positions: int = HISTORY_POSITIONS) -> None:
        self.history_positions = history_positions
        self._corpora: OrderedDict[tuple[int, ...], _Corpus] = OrderedDict()
        self._tracks: dict[int, _Track] = {}
        self._positions = 0

    def propose(self, seq: Sequence, k: int) -> list[int]:
        track = self._track(seq)
        text = track.text
        outputs = seq.output_token_ids
        if len(text) < seq.num_tokens:
            text += outputs[len(text) - len(seq.prompt_token_ids):]
        # n-grams whose continuation is known: all but the one ending at the last token
        self._positions += track.corpus.add(text, track.indexed, len(text) - 1)
        track.indexed = max(track.indexed, len(text) - 1)
        noise = sampler_noise(seq.seed, seq.sample_index, seq.num_output_tokens) if seq.sampling.temperature else None
        draft = track.corpus.draft(text, k, noise)
        if self._positions > self.history_positions:
            self._shrink()
        return draft

    def forget(self, seq: Sequence) -> None:
        self._tracks.pop(seq.seq_id, None)

    def _track(self, seq: Sequence) -> _Track:
        track = self._tracks.get(seq.seq_id)
        if track is not None:  # (_shrink drops the tracks of the corpora it drops: this one's is live)
            self._corpora.move_to_end(track.key)
            return track
        key = tuple(seq.prompt_token_ids)
        corpus = self._corpora.get(key)
        if corpus is None:  # first sample of this prompt, or its corpus was dropped: index it again
            corpus = self._corpora[key] = _Corpus()
        self._corpora.move_to_end(key)
        prompt_len = len(seq.prompt_token_ids)
        if not corpus.prompt_indexed:  # the prompt's n-grams once per corpus, not once per sample
            self._positions += corpus.add(list(seq.prompt_token_ids), 0, prompt_len - 1)
            corpus.prompt_indexed = True
        track = self._tracks[seq.seq_id] = _Track(seq, key, corpus, max(0, prompt_len - 1))
        return track

    def _shrink(self) -> None:
        """Drop the least recently used corpora until the bound holds (the newest always stays)."""
        while self._positions > self.history_positions and len(self._corpora) > 1:
            _, corpus = self._corpora.popitem(last=False)
            self._positions -= corpus.positions
        if self._positions > self.history_positions:  # one prompt alone past the bound: start it again
            _, corpus = self._corpora.popitem(last=False)
            self._positions -= corpus.positions
        live = set(map(id, self._corpora.values()))
        self._tracks = {sid: t for sid, t in self._tracks.items() if id(t.corpus) in live}
