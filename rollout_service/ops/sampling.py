"""Gumbel-max sampling over a whole vocabulary: the torch reference of the sampling kernel.

token[b] = argmax over vocab ids v of x[b, v] + gumbel(keys[b], v), an exact draw from softmax(x[b])
(rollout_service/ops/random.py makes the noise). torch.argmax's order decides: NaN counts as the
largest value, ties go to the smallest id.
"""
from __future__ import annotations

import torch

from rollout_service.ops.random import gumbel, vocab_ids

_CPU_BLOCK = 1 << 16  # elements per block of the CPU noise loop (~0.5 MiB of int64)


def gumbel_argmax(x: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    batch, vocab = x.shape
    if x.device.type != "cpu":
        return (x + gumbel(keys, vocab_ids(vocab, x.device))).argmax(dim=1)
    # on CPU the ~20 elementwise passes of the hash run much faster on cache-sized column blocks
    width = max(1024, _CPU_BLOCK // max(batch, 1))
    best_value = torch.full((batch,), float("-inf"), device=x.device)
    best_id = torch.zeros(batch, dtype=torch.int64, device=x.device)
    for start in range(0, vocab, width):
        ids = torch.arange(start, min(vocab, start + width), device=x.device)
        value, idx = (x[:, start:start + width] + gumbel(keys, ids)).max(dim=1)
        # strict, NaN-aware: an earlier block keeps ties, and a NaN wins as in argmax
        better = (value > best_value) | (value.isnan() & ~best_value.isnan())
        best_value = torch.where(better, value, best_value)
        best_id = torch.where(better, idx + start, best_id)
    return best_id
