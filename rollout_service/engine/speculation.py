"""Exact speculative decoding: a decode step that takes several tokens per sequence, each the one plain
decoding would have sampled.

The sampler's token at a position is a function of that position's logits and counters alone (Gumbel-max with
noise keyed by seed, sample and step: sampler.py). So a draft d1..dk (drafter.py) is checked in one forward
over [last token, d1..dk] through the ragged prefill path: row j gives the logits plain decoding would see after
d1..dj, the sampler draws row j's token with history and step counter as if d1..dj had been sampled, and the
tokens are kept while each equals the next draft token, up to and including the first that differs (or the
token after dk). There is no accept/reject randomness: the tokens are exactly plain decoding's, and in
batch-invariant mode (the verify logits bitwise the decode logits) so are the log-probs. Stops, max_tokens and
overflow are checked token by token as a decode step would; KV written for rejected positions is past the
sequence's computed length, and the pages that held only those are given back.

Speculation pays only while a decode step is memory-bound: `StepRates` keeps the measured tokens per second
of decode and verify steps per batch-size bucket and picks the better (trying the other now and then);
batches over speculative_max_batch never speculate.

Owns: the drafter, the per-sequence draft lengths, the step rates. May call: the model runner (the verify
forward), the sampler, the token recorder (its tokens), the KV blocks (a draft's pages) and the counters.
"""
from __future__ import annotations

import time
from typing import Any, Callable

import torch

from rollout_service.engine.drafter import DIST_TOP, Drafter
from rollout_service.engine.kv_cache import BlockManager, pages_for
from rollout_service.engine.model_runner import ModelRunner
from rollout_service.engine.recorder import TokenRecorder
from rollout_service.engine.sampler import Sampler, needs_history
from rollout_service.engine.scheduler import Batch
from rollout_service.engine.sequence import Sequence, SeqStatus

PROBE_EVERY = 32     # where verify steps were slower, one is tried again once every this many steps of the bucket
DRY_STEPS = 8        # after a step where no sequence had a draft, decode this many steps before asking again
                     # (where decode steps run ahead of their tokens: the engine passes dry_steps)
RATE_WEIGHT = 0.25   # weight of the newest measurement in a bucket's rate (an EMA)


class _Position:
    """What the sampler reads of a sequence, as it would be after `drafted` more tokens."""

    __slots__ = ("prompt_token_ids", "output_token_ids", "num_output_tokens", "sampling", "seed", "sample_index")

    def __init__(self, seq: Sequence, drafted: list[int]):
        self.prompt_token_ids = seq.prompt_token_ids
        # penalties read the whole history; nothing else reads the tokens, so only they pay for a copy
        history = bool(drafted) and needs_history(seq.sampling)
        self.output_token_ids = seq.output_token_ids + drafted if history else seq.output_token_ids
        self.num_output_tokens = seq.num_output_tokens + len(drafted)
        self.sampling, self.seed, self.sample_index = seq.sampling, seq.seed, seq.sample_index

    def __repr__(self) -> str:
        return f"position {self.num_output_tokens} of sample {self.sample_index}"


class StepRates:
    """Tokens per second of decode and verify steps per batch-size bucket, timed from one step's start to the
    next's (a host's own pace included: it is what a caller sees)."""

    def __init__(self) -> None:
        self.rates: dict[tuple[str, int], float] = {}
        self.samples: dict[tuple[str, int], int] = {}
        self.steps: dict[int, int] = {}       # decode and verify steps per bucket
        self.verified: dict[int, int] = {}    # the bucket's step count at its last verify step
        self.total = 0                        # steps of every bucket
        self._pending: tuple[str, int, int] | None = None
        self._t = 0.0
        self.always = False  # verify whenever there is a draft (tests, benchmarks of the verify step itself)

    def start_step(self) -> None:
        now = time.perf_counter()
        if self._pending is not None and now > self._t:
            key, tokens = self._pending[:2], self._pending[2]
            rate = tokens / (now - self._t)
            # a plain mean of the first few, then an EMA: one unlucky first step must not decide for long
            n = self.samples[key] = self.samples.get(key, 0) + 1
            old = self.rates.get(key, rate)
            self.rates[key] = old + max(RATE_WEIGHT, 1 / n) * (rate - old)
        self._pending, self._t = None, now

    def note(self, mode: str, batch: int, tokens: int) -> None:
        """The step that started last was a `mode` step of `batch` sequences that gave `tokens` tokens."""
        bucket = _bucket(batch)
        self._pending = (mode, bucket, tokens)
        self.steps[bucket] = self.steps.get(bucket, 0) + 1
        self.total += 1
        if mode == "verify":
            self.verified[bucket] = self.steps[bucket]

    def prefer_verify(self, batch: int) -> bool:
        """Whether a step of `batch` sequences should verify: where verify steps have been faster, where they
        are not measured yet, and once every PROBE_EVERY steps of the bucket where they have been slower."""
        if self.always:
            return True
        bucket = _bucket(batch)
        verify, decode = self.rates.get(("verify", bucket)), self.rates.get(("decode", bucket))
        if verify is None or decode is None:
            return verify is None  # measure verify first, then decode
        return verify >= decode or self.steps.get(bucket, 0) - self.verified.get(bucket, 0) >= PROBE_EVERY


def _bucket(batch: int) -> int:
    return 1 << max(0, batch - 1).bit_length()


class Speculator:
    def __init__(self, drafter: Drafter, max_draft: int, max_batch: int, max_rows: int, runner: ModelRunner,
                 sampler: Sampler, recorder: TokenRecorder, blocks: BlockManager, counters: Any,
                 max_live: int, dry_steps: int = DRY_STEPS):
        self.drafter, self.max_draft, self.max_batch, self.max_rows = drafter, max_draft, max_batch, max_rows
        self.dry_steps = dry_steps
        self.dist_top = DIST_TOP  # 0: the drafter counts followers alone (benchmarks compare)
        self.runner, self.sampler, self.recorder, self.blocks, self.counters = runner, sampler, recorder, blocks, counters
        self.rates = StepRates()
        self._dry_at: int | None = None           # rates.total when no sequence last had a draft
        self._seen: dict[int, Sequence] = {}      # every sequence the drafter was asked about
        self._accepted: dict[int, float] = {}     # seq_id -> recent accepted tokens per draft
        self._max_live = max_live

    def may_verify(self, seqs: list[Sequence]) -> bool:
        """Whether the next step of these sequences might verify (then it is not launched ahead of their tokens:
        where speculation does not run, overlapped decoding keeps its pace)."""
        return len(seqs) <= self.max_batch and not self._dry() and self.rates.prefer_verify(len(seqs))

    def _dry(self) -> bool:
        return not self.rates.always and self._dry_at is not None and self.rates.total - self._dry_at < self.dry_steps

    def note_decode(self, batch: int) -> None:
        self.rates.note("decode", batch, batch)

    def draft_top(self, seqs: list[Sequence]) -> int:
        """How many of each drawn distribution's likeliest tokens the sampler should hand the drafter for these
        sequences' step (0: none of them will speculate)."""
        return self.dist_top if len(seqs) <= self.max_batch and any(s.sampling.speculative for s in seqs) else 0

    def observe(self, seqs: list[Sequence], indices: list[int], out: Any, rows: list[int] | None = None) -> None:
        """The drafter learns the distribution each sequence's output token indices[i] was drawn from: row
        rows[i] (or i) of a sampler output's draft_ids / draft_logprobs, where recorded."""
        if out.draft_ids is None:
            return
        ids, lps = out.draft_ids.tolist(), out.draft_logprobs.tolist()
        for i, (seq, index) in enumerate(zip(seqs, indices)):
            if index < seq.num_output_tokens:
                r = i if rows is None else rows[i]
                self.drafter.observe(seq, index, (ids[r], lps[r]))

    def try_verify(self, batch: Batch, version: Callable[[], int]) -> bool:
        """Run `batch` (a decode batch) as a verify step when that pays and some sequence has a draft; False:
        nothing ran, decode it."""
        seqs = batch.seqs
        if len(seqs) > self.max_batch or self._dry() or not self.rates.prefer_verify(len(seqs)):
            return False
        drafts = self._drafts(seqs)
        if not any(drafts):
            self._dry_at = self.rates.total
            return False
        self._verify(seqs, drafts, version())
        return True

    def _drafts(self, seqs: list[Sequence]) -> list[list[int]]:
        stops, ps = self.recorder.stops, self.blocks.page_size
        budget = self.max_rows - len(seqs)  # one forward: every sequence's last token plus the drafts
        drafts = []
        if len(self._seen) > 2 * self._max_live:
            self._forget_finished()
        for seq in seqs:
            self._seen[seq.seq_id] = seq
            sp = seq.sampling
            # room for k drafted tokens and the one after them before a length stop
            room = min(sp.max_tokens - seq.num_output_tokens, stops.max_model_len - seq.num_tokens) - 1
            k = min(self._draft_len(seq), room, budget)
            draft = self.drafter.propose(seq, k) if k > 0 and sp.speculative else []
            if draft:
                need = pages_for(seq.num_tokens + len(draft), ps) - len(seq.pages)
                if need > 0 and not self.blocks.can_allocate(need):  # a draft never preempts anyone
                    draft = draft[:len(seq.pages) * ps - seq.num_tokens]
                self.blocks.grow(seq, seq.num_tokens + len(draft))
            budget -= len(draft)
            drafts.append(draft)
        return drafts

    def _draft_len(self, seq: Sequence) -> int:
        """One more than the tokens recently accepted per draft, up to max_draft (a new sequence: max_draft)."""
        seen = self._accepted.get(seq.seq_id)
        return self.max_draft if seen is None else min(self.max_draft, int(seen + 0.5) + 1)

    @torch.inference_mode()
    def _verify(self, seqs: list[Sequence], drafts: list[list[int]], version: int) -> None:
        logits = self.runner.verify(seqs, drafts)
        positions = [_Position(seq, draft[:j]) for seq, draft in zip(seqs, drafts) for j in range(len(draft) + 1)]
        out = self.sampler(logits, positions, draft_top=self.dist_top)
        observed: list[tuple[Sequence, int, int]] = []  # (sequence, output index, row)
        tokens, logprobs = out.token_ids.tolist(), out.logprobs.tolist()
        top_ids = out.top_ids.tolist() if out.top_ids is not None else None
        top_lps = out.top_logprobs.tolist() if out.top_logprobs is not None else None
        c, row, emitted = self.counters, 0, 0
        for seq, draft in zip(seqs, drafts):
            rows = len(draft) + 1
            keep = 1  # the tokens while each equals the draft's next one, up to the first that does not
            while keep < rows and tokens[row + keep - 1] == draft[keep - 1]:
                keep += 1
            span = slice(row, row + keep)
            tops = [None] * keep if top_ids is None else list(zip(top_ids[span], top_lps[span]))
            first = seq.num_output_tokens
            recorded = self.recorder.record_run(seq, tokens[span], logprobs[span], tops, version)
            observed += [(seq, first + j, row + j) for j in range(recorded)]
            emitted += recorded
            if seq.status is SeqStatus.RUNNING:
                self.blocks.trim(seq, seq.num_tokens)
            if draft:
                c.spec_drafts += 1
                c.spec_proposed += len(draft)
                c.spec_accepted += min(keep - 1, recorded)  # (a stop inside the draft ends what counts)
                self._remember(seq, keep - 1)
            row += rows
        if observed:
            seqs_, indices, rows_ = zip(*observed)
            self.observe(list(seqs_), list(indices), out, list(rows_))
        c.steps += 1
        c.spec_verify_steps += 1
        c.spec_tokens += emitted
        self.recorder.note_recorded(emitted)
        self.rates.note("verify", len(seqs), emitted)

    def _remember(self, seq: Sequence, accepted: int) -> None:
        seen = self._accepted.get(seq.seq_id)
        self._accepted[seq.seq_id] = accepted if seen is None else 0.5 * (seen + accepted)

    def _forget_finished(self) -> None:
        for sid, seq in list(self._seen.items()):
            if seq.is_finished:
                del self._seen[sid]
                self._accepted.pop(sid, None)
                self.drafter.forget(seq)
