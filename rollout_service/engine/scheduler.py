"""Continuous batching: which sequences run this step, and with how many tokens.

A step is either a prefill (every admissible waiting sequence, ragged, up to the token budget; a prompt
longer than what is left of the budget is chunked) or a decode (one token for every running sequence).
Prefill goes first so new work joins the batch as soon as there are pages for it. When decode runs out of
pages the newest running sequence is preempted: its pages are freed and it is requeued at the front, to be
recomputed later. Nothing is ever dropped.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from rollout_service.engine.kv_cache import PagePool, pages_for
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


class Scheduler:
    def __init__(self, pool: PagePool, page_size: int, max_num_seqs: int, max_num_batched_tokens: int):
        self.pool = pool
        self.page_size = page_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def schedule(self) -> Batch | None:
        return self._schedule_prefill() or self._schedule_decode()

    def _schedule_prefill(self) -> Batch | None:
        budget = self.max_num_batched_tokens
        seqs, chunks = [], []
        reserved = 0
        num_seqs = len(self.running)
        for seq in self.waiting:
            num_seqs += seq.num_samples
            if budget == 0 or (num_seqs > self.max_num_seqs and (seqs or self.running)):
                break
            remaining = seq.num_tokens - seq.num_computed
            chunk = min(remaining, budget)
            need = pages_for(seq.num_computed + chunk, self.page_size) - len(seq.pages)
            # the n - 1 forks of a finished prompt each copy its partial last page
            forks = seq.num_samples - 1 if chunk == remaining and seq.num_tokens % self.page_size else 0
            if not self.pool.can_allocate(reserved + need + forks):
                break
            reserved += need + forks
            seqs.append(seq)
            chunks.append(chunk)
            budget -= chunk
            if chunk < remaining:
                break  # a chunked prompt is always the last of the batch
        if not seqs:
            return None
        for seq, chunk in zip(seqs, chunks):
            need = pages_for(seq.num_computed + chunk, self.page_size) - len(seq.pages)
            seq.pages += self.pool.allocate(need)
        return Batch(True, seqs, chunks)

    def _schedule_decode(self) -> Batch | None:
        scheduled, pending, ps = [], deque(self.running), self.page_size
        while pending:
            seq = pending.popleft()
            if seq.num_tokens > len(seq.pages) * ps:  # this step's token starts a new page
                while not self.pool.can_allocate(1):
                    self._preempt(pending.pop() if pending else seq)
                    if seq.status == SeqStatus.WAITING:
                        break
                if seq.status == SeqStatus.WAITING:
                    break
                seq.pages += self.pool.allocate(1)
            scheduled.append(seq)
        self.running = scheduled
        return Batch(False, list(scheduled)) if scheduled else None  # a copy: finishing edits running

    def schedule_ahead(self, seqs: list[Sequence]) -> Batch | None:
        """A decode step for `seqs` one token ahead of what has been recorded (their last sampled token is
        still on the device), or None: only when nothing waits for a prefill and the next pages can be had
        without preempting anyone, so that it is the step `schedule` would pick once the tokens are in."""
        if self.waiting or not seqs:
            return None
        short = [s for s in seqs if s.num_tokens + 1 > len(s.pages) * self.page_size]
        if not self.pool.can_allocate(len(short)):
            return None
        for seq in short:
            seq.pages += self.pool.allocate(1)
        return Batch(False, list(seqs))

    def preempt_all(self) -> None:
        """Free every sequence's pages (engine sleep): running ones are requeued first, in their order, and
        recomputed when they are scheduled again, like any preempted sequence."""
        for seq in reversed(self.running):
            self._preempt(seq)
        self.running = []
        for seq in self.waiting:
            if seq.pages:  # a prompt part-way through a chunked prefill
                self.pool.release(seq.pages)
                seq.pages, seq.num_computed = [], 0

    def _preempt(self, seq: Sequence) -> None:
        self.pool.release(seq.pages)
        seq.pages = []
        seq.num_computed = 0
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def after_prefill(self, batch: Batch, new_running: list[Sequence]) -> None:
        """Move sequences whose prompt finished (plus their forks) from waiting to running."""
        done = {s.seq_id for s, c in zip(batch.seqs, batch.completes) if c}
        self.waiting = deque(s for s in self.waiting if s.seq_id not in done)
        for seq in new_running:
            seq.status = SeqStatus.RUNNING
        self.running += new_running

    def finish(self, seq: Sequence) -> None:
        """Release a finished or aborted sequence's pages and forget it."""
        self.pool.release(seq.pages)
        seq.pages = []
        seq.status = SeqStatus.FINISHED
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
