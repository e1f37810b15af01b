"""The engine's requests in flight and its outbox: which sequences are whose, how many samples each request still
owes, and the finished results not yet handed out.

Owns: the request table and the outbox. May call: `to_result` (a finished sample becomes a RolloutResult) and
`release` (the scheduler lets a finished sequence go). Every other part of the engine finishes a sequence here,
so a request leaves the table exactly when its last sample is done.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

from rollout_service.api.deltas import TokenDelta
from rollout_service.api.types import RolloutResult
from rollout_service.engine.sequence import Sequence

ToResult = Callable[[Sequence, Any, int, "str | None"], RolloutResult]


@dataclass
class _Request:
    metadata: Any
    seqs: list[Sequence]
    num_pending: int  # samples not yet finished (an unforked prompt stands for all of its samples)
    streamed: dict[int, int] | None = None  # stream_tokens: sample index -> output tokens handed out as deltas


class RequestTable:
    def __init__(self, to_result: ToResult, release: Callable[[Sequence], None]):
        self._to_result = to_result
        self._release = release
        self._requests: dict[str, _Request] = {}
        self._outbox: list[RolloutResult] = []
        self._streaming: set[str] = set()  # requests whose running samples hand out TokenDeltas

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests

    def __len__(self) -> int:
        return len(self._requests)

    def ids(self) -> list[str]:
        return list(self._requests)

    def add(self, seq: Sequence, metadata: Any, stream_tokens: bool = False) -> None:
        self._requests[seq.request_id] = _Request(metadata, [seq], seq.sampling.n, {} if stream_tokens else None)
        if stream_tokens:
            self._streaming.add(seq.request_id)

    def seqs(self, request_id: str) -> list[Sequence]:
        """The request's sequences (a copy; empty once every sample finished)."""
        state = self._requests.get(request_id)
        return list(state.seqs) if state else []

    def add_samples(self, request_id: str, children: list[Sequence]) -> None:
        """The sibling samples forked from the request's prefilled prompt."""
        self._requests[request_id].seqs += children

    def finish(self, seq: Sequence, reason: str, error: str | None = None) -> list[RolloutResult]:
        """Finish one sequence: its results (one per sample it stands for), which the caller hands out."""
        seq.finish_reason, seq.t_finished = reason, time.time()
        state = self._requests[seq.request_id]
        indices = range(seq.sample_index, seq.sample_index + seq.num_samples)
        results = [self._to_result(seq, state.metadata, i, error) for i in indices]  # first: decoding may raise
        self._release(seq)
        state.num_pending -= len(indices)
        if state.num_pending == 0:
            del self._requests[seq.request_id]
            self._streaming.discard(seq.request_id)
        return results

    def deltas(self) -> list[TokenDelta]:
        """The tokens the running samples of streaming requests sampled since the last call. A finished sample
        has none: its result carries them all."""
        out = []
        for rid in self._streaming:
            state = self._requests[rid]
            for seq in state.seqs:
                if seq.num_samples == 1 and not seq.is_finished:
                    out += _delta(seq, state.streamed)
        return out

    def finish_to_outbox(self, seq: Sequence, reason: str, error: str | None = None) -> None:
        self._outbox += self.finish(seq, reason, error)

    def post(self, results: list[RolloutResult]) -> None:
        """Results finished outside a step (episodes that ended at once, an abort on refresh)."""
        self._outbox += results

    def has_output(self) -> bool:
        return bool(self._outbox)

    def take(self) -> list[RolloutResult]:
        out, self._outbox = self._outbox, []
        return out

    def take_through(self, collect: Callable[[list[RolloutResult]], list[RolloutResult]]) -> None:
        """Pass the outbox through `collect` now (the episodes move finished turns on), keeping what it returns."""
        self._outbox = collect(self._outbox)


def _delta(seq: Sequence, streamed: dict[int, int]) -> list[TokenDelta]:
    start, end = streamed.get(seq.sample_index, 0), len(seq.output_token_ids)
    if end <= start:
        return []
    streamed[seq.sample_index] = end
    top = seq.output_top[start:end] if seq.sampling.logprobs else None
    return [TokenDelta(seq.request_id, seq.sample_index, start, seq.output_token_ids[start:end],
                       [float(x) for x in seq.output_logprobs[start:end]], seq.token_versions[start:end], top)]
