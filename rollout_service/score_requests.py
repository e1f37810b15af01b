"""What RolloutClient.score takes, as scoring RolloutRequests (RolloutRequest.completion): RolloutResults
(their prompt and token ids, their metadata) or (prompt, completion token ids) pairs, one or a list."""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from rollout_service.api.types import RolloutRequest, RolloutResult, SamplingParams


def _is_pair(x: Any) -> bool:
    return isinstance(x, tuple) and len(x) == 2 and isinstance(x[1], (list, tuple))


def score_items(sequences: Any) -> list:
    """One RolloutResult or (prompt, completion) tuple, or a list of them, as a list."""
    if isinstance(sequences, RolloutResult) or _is_pair(sequences):
        return [sequences]
    if isinstance(sequences, (str, bytes, dict)) or not isinstance(sequences, Iterable):
        raise ValueError("score: expected a RolloutResult, a (prompt, completion_ids) tuple or a list of them, "
                         f"got {type(sequences).__name__}")
    items = list(sequences)
    if not items:
        raise ValueError("score: the list is empty")
    return items


def score_requests(sequences: Any, sampling: SamplingParams | None, apply_chat_template: bool,
                   metadata: list | None = None) -> list[RolloutRequest]:
    """Checked scoring requests, one per item (ValueError naming the item). A result's prompt is scored as the
    token ids it was generated from (no chat template again) and its metadata comes along; a pair's prompt
    is any prompt (text and chat messages take `apply_chat_template`)."""
    items = score_items(sequences)
    if metadata is not None and (not isinstance(metadata, (list, tuple)) or len(metadata) != len(items)):
        raise ValueError(f"score: metadata must be None or a list with one entry per sequence ({len(items)})")
    if sampling is not None and not isinstance(sampling, SamplingParams):
        raise ValueError(f"score: sampling must be a SamplingParams, got {type(sampling).__name__}")
    sampling = (sampling or SamplingParams()).validated()
    if sampling.n != 1:
        raise ValueError(f"score: sampling.n={sampling.n}; a given completion is scored once (n=1)")
    return [_request(i, item, sampling, apply_chat_template, None if metadata is None else metadata[i])
            for i, item in enumerate(items)]


def _request(i: int, item: Any, sampling: SamplingParams, apply_chat_template: bool, metadata: Any) -> RolloutRequest:
    try:
        if isinstance(item, RolloutResult):
            if not item.token_ids:
                raise ValueError(f"result {item.request_id!r} (sample {item.sample_index}) has no tokens to score")
            return RolloutRequest(prompt=list(item.prompt_token_ids), completion=list(item.token_ids),
                                  sampling=sampling, apply_chat_template=False,
                                  metadata=item.metadata if metadata is None else metadata)
        if not isinstance(item, (tuple, list)) or len(item) != 2:
            raise ValueError(f"expected a RolloutResult or a (prompt, completion_ids) pair, got {type(item).__name__}")
        prompt, completion = item
        return RolloutRequest(prompt=prompt, completion=list(completion) if isinstance(completion, tuple)
                              else completion, sampling=sampling, apply_chat_template=apply_chat_template,
                              metadata=metadata)
    except ValueError as e:
        raise ValueError(f"score: sequence {i}: {e}") from None
