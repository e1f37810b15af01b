"""Rollout receipts: what lets a learner check that a batch-invariant engine's result is what it computed.

A receipt is sha256 over the weights digest of the policy version that produced the result (weights_digest:
every parameter by name, in sorted order, so a learner holding the same weights under the same names
computes the same digest), that version, the prompt and token ids and the log-prob bytes. An engine with
EngineConfig(batch_invariant=True) sets RolloutResult.receipt on every result produced by one version
(none on a result that spans a refresh, nor on a multi-turn episode's, whose environment tokens no forward
computed). InvariantForward.verify recomputes both the receipt and the log-probs.
"""
from __future__ import annotations

import hashlib
from typing import Iterable

import numpy as np
import torch

from rollout_service.types import RolloutResult

_TAG = b"rollout_service receipt v1\0"


def weights_digest(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
    """sha256 over (name, dtype, shape, bytes) of each tensor, in name order (a tied tensor counted once)."""
    h = hashlib.sha256()
    for name, t in sorted(named_tensors, key=lambda kv: kv[0]):
        t = t.detach()
        h.update(f"{name}\0{str(t.dtype).removeprefix('torch.')}\0{tuple(t.shape)}\0".encode())
        # a copy: exporting a parameter's own storage to numpy would make it non-resizable (engine sleep)
        h.update(t.reshape(-1).view(torch.uint8).to("cpu", copy=True).numpy().tobytes())
    return h.hexdigest()


def receipt(digest: str, version: int, prompt_token_ids: list[int], token_ids: list[int],
            logprobs: np.ndarray) -> str:
    """The receipt of one result's content, produced by the weights of `digest` at policy `version`."""
    h = hashlib.sha256(_TAG)
    h.update(digest.encode())
    h.update(np.int64(version).astype("<i8").tobytes())
    for ids in (prompt_token_ids, token_ids):
        h.update(np.int64(len(ids)).astype("<i8").tobytes())
        h.update(np.asarray(ids, dtype="<i4").tobytes())
    h.update(np.asarray(logprobs, dtype="<f4").tobytes())
    return h.hexdigest()


def receipt_of(result: RolloutResult, digest: str) -> str | None:
    """The receipt `result` should carry given the weights digest of its version (None: spans versions)."""
    versions = set(result.token_versions)
    if len(versions) != 1:
        return None
    return receipt(digest, versions.pop(), result.prompt_token_ids, result.token_ids, result.logprobs)
