"""A refresh's canary: each new weight applied to a fixed input, refused when its output could overflow.

A finite weight can still make the forward non-finite (one element at 3e38 multiplies any activation into inf,
and every later token is NaN). A whole-model canary forward would need the old weights kept beside the new ones
(or, asleep, would have none to run with), so the canary runs per tensor, on the sender's side of every
transport and again in-process: a linear map (any tensor of 2+ dimensions, read as rows over its last dimension)
times a fixed unit-RMS input, a vector (norm weights, biases) by its largest element, an embedding row by its
largest element too. Each output must stay within LIMIT. Why that suffices for bf16 / fp32 engines: every
block's input is RMS-normalised, so a block's output is bounded by the product of its few maps' gains (each <=
LIMIT on a unit-RMS input, a norm weight <= LIMIT): at most LIMIT^4 = 1e24 per block, 1e26 summed over a hundred
layers, far below float32's and bf16's 3.4e38. Trained models' maps give O(1) to O(100) here. An fp16 engine
(max 65504) can still overflow below LIMIT: there a result whose log-probs are non-finite carries an error
(engine/engine.py).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

LIMIT = 1e6


def _probe(n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A fixed unit-RMS input of n elements: +-1 in a pattern no weight layout lines up with."""
    i = torch.arange(n, device=device)
    return torch.where((i * 7 + i // 5) % 3 == 0, -1.0, 1.0).to(dtype)


_MATMUL_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def _largest_output(t: torch.Tensor) -> float:
    t = t.detach()
    if t.dtype not in _MATMUL_DTYPES:  # float8 and the like have no matmul: their values in float32
        t = t.float()
    if t.dim() < 2:
        return float(t.abs().max())
    # in the tensor's own dtype (no float32 copy of a large weight): an overflow shows as inf
    return float(torch.matmul(t, _probe(t.shape[-1], t.dtype, t.device)).abs().max())


def reject_overflowing(items: Sequence[tuple[str, torch.Tensor]]) -> None:
    """ValueError naming the first weight whose output on the fixed input exceeds LIMIT (or is not finite).
    Call after the finiteness check."""
    for name, t in items:
        if not t.is_floating_point() or not t.numel():
            continue
        largest = _largest_output(t)
        if not largest <= LIMIT:  # NaN compares false too
            raise ValueError(f"update_weights: weight {name!r} would overflow the forward: on a fixed unit-RMS "
                             f"input it gives outputs up to {largest:.3g} (limit {LIMIT:.0e}; a trained model's "
                             "weights give O(1) to O(100)); nothing was changed (pass check_finite=False to send "
                             "it anyway)")
