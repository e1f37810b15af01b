"""RoPE and the KV cache write in one C pass on the CPU (csrc/cpu_rope_kv.c): the torch ops' bits (ops/rope.py,
ops/attention.write_kv), without their five passes over q and k and the indexed writes."""
from __future__ import annotations

import torch

from rollout_service.ops import cpu_ext


def applies(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos_sin: torch.Tensor, kv_layer: torch.Tensor) -> bool:
    return (all(t.stride(-1) == 1 and t.stride(-2) == t.shape[-1] for t in (q, k, v))
            and cos_sin.is_contiguous() and kv_layer.is_contiguous() and q.shape[-1] % 2 == 0
            and cpu_ext.takes(q, k, v, cos_sin, kv_layer))


def check(positions: torch.Tensor, slot_mapping: torch.Tensor, cos_sin: torch.Tensor, kv_layer: torch.Tensor) -> tuple:
    """(positions, slots) as contiguous int64, once their range is checked: the kernel indexes the rope table and
    the cache without bounds checks."""
    positions, slots = positions.long().contiguous(), slot_mapping.long().contiguous()
    for name, values, limit in (("position", positions, cos_sin.shape[0]),
                                ("KV slot", slots, kv_layer.shape[0] * kv_layer.shape[3])):
        bad = ((values < 0) | (values >= limit)).nonzero()
        if bad.numel():
            raise ValueError(f"token {int(bad[0])}: {name} {int(values[bad[0]])} outside 0..{limit - 1}")
    return positions, slots


def rope_and_write_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                      slots: torch.Tensor, cos_sin: torch.Tensor, kv_layer: torch.Tensor) -> torch.Tensor:
    """The rotated q [T, Hq, D]; k rotated and v stored at their slots of kv_layer. positions and slots from
    check()."""
    tokens, num_q_heads, dim = q.shape
    out = torch.empty(q.shape, dtype=q.dtype)
    cpu_ext.load().rs_rope_write_kv(
        q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), positions.data_ptr(),
        cos_sin.data_ptr(), slots.data_ptr(), kv_layer.data_ptr(), out.data_ptr(), tokens, num_q_heads,
        k.shape[1], kv_layer.shape[3], dim, torch.get_num_threads())
    return out
