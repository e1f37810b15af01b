"""Counter-based randomness for sampling: a splitmix64 hash of (seed, sample_index, step, vocab id).

Why counter-based: a sequence's random draw at a step is a pure function of its own counters, so its
tokens do not depend on which other sequences share the batch, on the batch order, on preemption and
recompute, or on the device (the same integer ops give the same bits on CPU and CUDA). No generator
state is carried anywhere.

Construction:
  row key  k = mix((mix(seed + sample_index + G) ^ step) + G)                  -- exact, in Python ints
(sample k of a request seeded s draws the stream of seed s + k: an n = 8 request reproduces eight n = 1
requests seeded s, s + 1, ..., s + 7)
  element  h[v] = mix(k + (v + 1) * G)   for vocab id v                      -- torch int64, per [B, V]
where mix is the splitmix64 finaliser and G = 0x9E3779B97F4A7C15 (h[v] is element v of the splitmix64
stream seeded with k). Torch has no uint64, so the tensor version keeps the 64 bits in int64: + and *
wrap mod 2**64 (two's complement, as on every torch backend), and every right shift is masked so the
arithmetic (sign-extending) shift acts as a logical one. `splitmix64_int` is the exact reference;
tests check the tensor version against it bit for bit.

Uniforms: the top 32 bits of h give w = (h32 + 0.5) / 2**32 in float32, clamped to [2**-33, 1 - 2**-24],
so w is never 0 or 1. The Gumbel draw is g = -log(-log1p(-w)), i.e. -log(-log(u)) with u = 1 - w: the
winner of a Gumbel-max is decided by u near 1, and writing it through w keeps 32 bits of resolution
exactly there (a token 1e-9 as likely as the top one can still be drawn).
"""
from __future__ import annotations

import math
import struct

import torch

MASK64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15
_C1 = 0xBF58476D1CE4E5B9
_C2 = 0x94D049BB133111EB


def _signed(x: int) -> int:
    """The int64 with the same 64 bits as the unsigned x."""
    return x - (1 << 64) if x >= 1 << 63 else x


def splitmix64_int(z: int) -> int:
    """splitmix64 finaliser on a Python int (exact uint64 reference)."""
    z &= MASK64
    z = ((z ^ (z >> 30)) * _C1) & MASK64
    z = ((z ^ (z >> 27)) * _C2) & MASK64
    return z ^ (z >> 31)


def row_key(seed: int, sample_index: int, step: int) -> int:
    """64-bit key (as a signed int64 value) of one sequence's draw at one step."""
    k = splitmix64_int(seed + sample_index + GOLDEN)
    k = splitmix64_int((k ^ step) + GOLDEN)
    return _signed(k)


def _xor_shift_(z: torch.Tensor, tmp: torch.Tensor, s: int) -> None:
    """z ^= z >>> s (logical shift on the int64 bits), in place."""
    torch.bitwise_right_shift(z, s, out=tmp)
    tmp.bitwise_and_((1 << (64 - s)) - 1)
    z.bitwise_xor_(tmp)


def splitmix64_(z: torch.Tensor) -> torch.Tensor:
    """splitmix64 finaliser on an int64 tensor, in place (bits as uint64)."""
    tmp = torch.empty_like(z)
    _xor_shift_(z, tmp, 30)
    z.mul_(_signed(_C1))
    _xor_shift_(z, tmp, 27)
    z.mul_(_signed(_C2))
    _xor_shift_(z, tmp, 31)
    return z


def random_bits(keys: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """int64 [B, N]: element (b, j) is splitmix64(keys[b] + (ids[j] + 1) * GOLDEN).

    ids: vocab ids, int64 [N] (the same for every row) or [B, N] (per row, e.g. top-k candidates).
    """
    offsets = (ids.to(torch.int64) + 1).mul_(_signed(GOLDEN))
    return splitmix64_(keys.to(torch.int64).unsqueeze(1) + offsets)


def vocab_ids(vocab_size: int, device: torch.device | str = "cpu") -> torch.Tensor:
    return torch.arange(vocab_size, dtype=torch.int64, device=device)


def uniforms(keys: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """float32 [B, N] uniforms in (0, 1) from the top 32 bits of the hash (see module docstring)."""
    bits = random_bits(keys, ids)
    hi = bits.bitwise_right_shift_(32).bitwise_and_(0xFFFFFFFF)
    w = hi.to(torch.float32).add_(0.5).mul_(2.0 ** -32)
    return w.clamp_(max=1.0 - 2.0 ** -24)


def gumbel(keys: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """float32 [B, N] standard Gumbel noise, -log(-log(1 - w)) with w = uniforms(keys, ids)."""
    w = uniforms(keys, ids)
    return w.neg_().log1p_().neg_().log_().neg_()


def gumbel_at(key: int, vocab_id: int) -> float:
    """One element of gumbel(): the draw of `vocab_id` in the row keyed `key` (row_key's). w is rounded to float32
    as uniforms() rounds it (which matters for w near 1), the logs taken in float64 (gumbel's float32 logs agree
    to their precision). For the few draws a drafter looks at ahead of a step, not a whole row."""
    h = splitmix64_int(key + (vocab_id + 1) * GOLDEN)
    w = min(_float32(_float32(float(h >> 32)) + 0.5) * 2.0 ** -32, 1.0 - 2.0 ** -24)
    return -math.log(-math.log1p(-w))


def _float32(x: float) -> float:
    """x rounded to the nearest float32, as a torch float32 op rounds its result."""
    return struct.unpack("f", struct.pack("f", x))[0]
