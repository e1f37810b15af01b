"""Continuous batching: which sequences run this step, and with how many tokens.

A step is either a prefill (every admissible waiting sequence, ragged, up to the token budget; a prompt
longer than what is left of the budget is chunked) or a decode (one token for every running sequence).
Prefill goes first so new work joins the batch as soon as there are pages for it; a new sequence whose
prefix is in the prefix cache starts with those pages and prefills only the rest. When decode runs out of
pages (cached pages nobody holds are evicted first, by the block manager) the newest running sequence is
preempted: its pages are freed and it is requeued, to be recomputed later. Nothing is ever dropped. Pages
themselves are the block manager's (kv_cache.py): this file only decides what runs.

"Newest" and the waiting order follow EngineConfig.scheduling. "staleness": by the policy version a request
was submitted under, then arrival, so that after a refresh the samples of older versions are admitted and
kept running before newer ones (an episode's later turn or a resubmitted request goes ahead of prompts
submitted under newer weights, and finishes before it grows stale). "fifo": by arrival alone (a preempted
sequence goes back to the front).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from rollout_service.engine.kv_cache import BlockManager, pages_for
from rollout_service.engine.sequence import Sequence, SeqStatus


@dataclass
class Batch:
    is_prefill: bool
    seqs: list[Sequence]
    # prefill only: how many of each sequence's uncomputed tokens run this step
    chunk_lens: list[int] = field(default_factory=list)
    # whether this step computes sequence i up to its last token, so that it samples a next token
    completes: list[bool] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.completes:
            self.completes = [not self.is_prefill or s.num_computed + c == s.num_tokens
                              for s, c in zip(self.seqs, self.chunk_lens or [1] * len(self.seqs))]


def staleness_key(seq: Sequence) -> tuple[int, float, int]:
    return seq.submitted_version, seq.t_arrival, seq.seq_id


class Scheduler:
    def __init__(self, blocks: BlockManager, page_size: int, max_num_seqs: int, max_num_batched_tokens: int,
                 staleness_first: bool = True):
        self.blocks = blocks
        self.staleness_first = staleness_first
        self.page_size = page_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        # called with a sequence whose pages a preemption is about to free (the engine keeps its routing)
        self.on_preempt: Callable[[Sequence], None] = lambda seq: None

    def add(self, seq: Sequence) -> None:
        if self.staleness_first:
            self._insert(seq)
        else:
            self.waiting.append(seq)

    def _insert(self, seq: Sequence) -> None:
        """Into `waiting` in staleness order (scanning from the back: a new arrival is usually the newest)."""
        key, i = staleness_key(seq), len(self.waiting)
        while i and staleness_key(self.waiting[i - 1]) > key:
            i -= 1
        self.waiting.insert(i, seq)

    def _victim(self, pending: deque[Sequence], seq: Sequence) -> Sequence:
        """The running sequence to preempt so that `seq` can grow: the newest of those not yet scheduled."""
        if not pending:
            return seq
        victim = max(pending, key=staleness_key) if self.staleness_first else pending[-1]
        if self.staleness_first and staleness_key(seq) > staleness_key(victim):
            return seq
        pending.remove(victim)
        return victim

    def schedule(self) -> Batch | None:
        return self._schedule_prefill() or self._schedule_decode()

    def _schedule_prefill(self) -> Batch | None:
        budget = self.max_num_batched_tokens
        seqs, chunks = [], []
        reserved = 0  # pages the forks of this batch's finished prompts will take after the step
        num_seqs = len(self.running)
        heads: set[tuple[int, ...]] = set()
        for seq in self.waiting:
            if self._defer(seq, heads):
                continue
            num_seqs += seq.num_samples
            if budget == 0 or (num_seqs > self.max_num_seqs and (seqs or self.running)):
                break
            cached = self.blocks.match_prefix(seq)
            computed = seq.num_computed + len(cached) * self.page_size
            remaining = seq.num_tokens - computed
            chunk = min(remaining, budget)
            need = pages_for(computed + chunk, self.page_size) - len(seq.pages) - len(cached)
            # the n - 1 forks of a finished prompt each copy its partial last page
            forks = seq.num_samples - 1 if chunk == remaining and seq.num_tokens % self.page_size else 0
            # claiming a cached page nobody holds takes it off the evictable list, like an allocation
            if not self.blocks.can_allocate(reserved + need + forks + self.blocks.num_idle(cached)):
                break
            if not seq.pages:
                self.blocks.take_prefix(seq, cached)
            self.blocks.grow(seq, computed + chunk)
            reserved += forks
            seqs.append(seq)
            chunks.append(chunk)
            budget -= chunk
            if chunk < remaining:
                break  # a chunked prompt is always the last of the batch
        return Batch(True, seqs, chunks) if seqs else None

    def _defer(self, seq: Sequence, heads: set[tuple[int, ...]]) -> bool:
        """Whether a new sequence waits a step because a batch-mate is prefilling its first page now: the next
        step takes that prefix from the cache, so prompts sent together that share a system prompt, or the
        completions of one prompt being scored, prefill the shared part once. (The n samples of one request
        share its prompt by forking instead.)"""
        if not self.blocks.enable_cache or seq.pages or seq.num_computed or seq.num_reusable < self.page_size:
            return False
        head = tuple(seq.prompt_token_ids[:self.page_size])
        if head not in heads:
            heads.add(head)
            return False
        return not self.blocks.match_prefix(seq)

    def _schedule_decode(self) -> Batch | None:
        scheduled, pending, ps = [], deque(self.running), self.page_size
        while pending:
            seq = pending.popleft()
            if seq.num_tokens > len(seq.pages) * ps:  # this step's token starts a new page
                while not self.blocks.can_allocate(1):
                    victim = self._victim(pending, seq)
                    self._preempt(victim)
                    if victim is seq:
                        break
                if seq.status == SeqStatus.WAITING:
                    continue
                self.blocks.grow(seq, seq.num_tokens)
            scheduled.append(seq)
        self.running = scheduled
        return Batch(False, list(scheduled)) if scheduled else None  # a copy: finishing edits running

    def schedule_ahead(self, seqs: list[Sequence]) -> Batch | None:
        """A decode step for `seqs` one token ahead of what has been recorded (their last sampled token is
        still on the device), or None: only when no waiting prompt could be admitted and the next pages can
        be had without preempting anyone, so that it is the step `schedule` would pick once the tokens are
        in."""
        if not seqs or (self.waiting and len(seqs) + self.waiting[0].num_samples <= self.max_num_seqs):
            return None  # (a waiting prompt that has no room among max_num_seqs cannot be prefilled anyway)
        short = [s for s in seqs if s.num_tokens + 1 > len(s.pages) * self.page_size]
        if not self.blocks.can_allocate(len(short)):
            return None
        for seq in short:
            self.blocks.grow(seq, seq.num_tokens + 1)
        return Batch(False, list(seqs))

    def preempt_all(self) -> None:
        """Free every sequence's pages (engine sleep): running ones are requeued first, in their order, and
        recomputed when they are scheduled again, like any preempted sequence."""
        for seq in reversed(self.running):
            self._preempt(seq)
        self.running = []
        for seq in self.waiting:
            if seq.pages:  # a prompt part-way through a chunked prefill
                self.on_preempt(seq)
                self.blocks.free(seq)

    def _preempt(self, seq: Sequence) -> None:
        self.on_preempt(seq)
        self.blocks.free(seq)
        seq.status = SeqStatus.WAITING
        if self.staleness_first:
            self._insert(seq)
        else:
            self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def after_prefill(self, batch: Batch, new_running: list[Sequence]) -> None:
        """Cache the prefilled pages; move sequences whose prompt finished (plus their forks) from waiting to
        running."""
        for seq in batch.seqs:
            self.blocks.cache_full_pages(seq)
        done = {s.seq_id for s, c in zip(batch.seqs, batch.completes) if c}
        self.waiting = deque(s for s in self.waiting if s.seq_id not in done)
        for seq in new_running:
            seq.status = SeqStatus.RUNNING
        self.running += new_running

    def finish(self, seq: Sequence) -> None:
        """Release a finished or aborted sequence's pages (cached for later prefixes) and forget it."""
        self.blocks.free(seq)
        seq.status = SeqStatus.FINISHED
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
