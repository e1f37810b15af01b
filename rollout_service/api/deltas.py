"""TokenDelta: the new tokens of a sample still running, handed out before its result to a request that streams
them (RolloutRequest.stream_tokens)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TokenDelta:
    """New tokens of a sample still running, for a request with `stream_tokens`: its output tokens
    [start, start + len(token_ids)), with their log-probs, policy versions and (SamplingParams.logprobs) top
    alternatives. The sample's RolloutResult, which comes after its last delta, is what counts: a delta is
    a preview. `attempt` counts the service's dispatches of the request (0 first): a request generated again
    (its worker died, or its tokens went stale) starts again at 0 with the next attempt, and its tokens may
    differ from those an earlier attempt showed."""

    request_id: str
    sample_index: int
    start: int
    token_ids: list[int]
    logprobs: list[float]
    token_versions: list[int]
    top_logprobs: list[dict[int, float]] | None = None
    attempt: int = 0
