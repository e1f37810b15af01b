"""Rollout receipts: what lets a learner check that a batch-invariant engine's result is what it computed.

A receipt is sha256 (HMAC-sha256 with EngineConfig.receipt_key, a secret the service and the learner share)
over the weights digest of the policy version that produced the result (weights_digest: every parameter by
name, in sorted order, so a learner holding the same weights under the same names computes the same digest)
and every field a learner uses: prompt and token ids, log-prob bytes, token and KV versions, finish reason,
text, top log-probs and routed experts. Without a key anyone can recompute a receipt for edited content that
the weights would also produce (a relabelled version, say); with one, only a holder of the key can. An engine
with EngineConfig(batch_invariant=True) sets RolloutResult.receipt on every result produced by one version
(none on a result that spans a refresh, nor on a multi-turn episode's, whose environment tokens no forward
computed). InvariantForward.verify recomputes both the receipt and the log-probs.
"""
from __future__ import annotations

import hashlib
import hmac
from typing import Iterable

import numpy as np
import torch

from rollout_service.api.types import RolloutResult

_TAG = b"rollout_service receipt v2\0"


def weights_digest(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
    """sha256 over (name, dtype, shape, bytes) of each tensor, in name order (a tied tensor counted once)."""
    h = hashlib.sha256()
    for name, t in sorted(named_tensors, key=lambda kv: kv[0]):
        t = t.detach()
        h.update(f"{name}\0{str(t.dtype).removeprefix('torch.')}\0{tuple(t.shape)}\0".encode())
        # a copy: exporting a parameter's own storage to numpy would make it non-resizable (engine sleep)
        h.update(t.reshape(-1).view(torch.uint8).to("cpu", copy=True).numpy().tobytes())
    return h.hexdigest()


def _ints(h, values) -> None:
    h.update(np.int64(-1 if values is None else len(values)).astype("<i8").tobytes())
    if values is not None:
        h.update(np.asarray(values, dtype="<i8").tobytes())


def _text(h, text: str | None) -> None:
    data = b"" if text is None else text.encode("utf-8", "surrogatepass")
    h.update(np.int64(-1 if text is None else len(data)).astype("<i8").tobytes())
    h.update(data)


def _array(h, a: np.ndarray | None) -> None:
    _text(h, None if a is None else f"{a.dtype.str}{a.shape}")
    if a is not None:
        h.update(np.ascontiguousarray(a).tobytes())


def _top(h, top: list[dict[int, float]] | None) -> None:
    """Each position's alternatives in their order (best first), ids and float32 log-prob bytes."""
    _ints(h, None if top is None else [len(d) for d in top])
    for d in top or ():
        _ints(h, list(d.keys()))
        h.update(np.asarray(list(d.values()), dtype="<f4").tobytes())


def _key_bytes(key: str | bytes | None) -> bytes | None:
    if key is None:
        return None
    if isinstance(key, str):
        key = key.encode("utf-8")
    if not isinstance(key, bytes) or not key:
        raise ValueError("receipt key must be a non-empty str or bytes")
    return key


def receipt_of(result: RolloutResult, digest: str, key: str | bytes | None = None) -> str | None:
    """The receipt `result` should carry given the weights digest of its version (None: spans versions);
    keyed (HMAC) when `key` is given."""
    if len(set(result.token_versions)) != 1:
        return None
    key = _key_bytes(key)
    h = hmac.new(key, _TAG, hashlib.sha256) if key else hashlib.sha256(_TAG)
    _text(h, digest)
    for ids in (result.prompt_token_ids, result.token_ids, result.token_versions, result.kv_versions):
        _ints(h, ids)
    h.update(np.asarray(result.logprobs, dtype="<f4").tobytes())
    _text(h, result.finish_reason)
    _text(h, result.text)
    _top(h, result.top_logprobs)
    _array(h, result.routed_experts)
    _array(h, result.prompt_routed_experts)
    return h.hexdigest()
