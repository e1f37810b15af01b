"""CPU decode attention that reads the K/V pages in place (csrc/cpu_decode_attention.c), the same attention as
the torch reference (ops/attention.py) with its sums in another order.

The reference copies every row's pages out of the cache each layer and step before its products; here each
(sequence, kv head) streams its own pages. `applies` says where it runs: float32 on the CPU, with the C kernels
built (ops/cpu_ext.py); elsewhere the torch ops keep their torch code.
"""
from __future__ import annotations

import torch

from rollout_service.ops import cpu_ext
from rollout_service.ops.attention import AttentionMetadata


def applies(q: torch.Tensor, kv_layer: torch.Tensor, meta: AttentionMetadata) -> bool:
    return (not meta.is_prefill and q.device.type == "cpu" and q.dtype == torch.float32
            and kv_layer.dtype == torch.float32 and kv_layer.is_contiguous() and cpu_ext.load() is not None)


def decode_attention(q: torch.Tensor, kv_layer: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """[B, Hq, D] attention of each row's one query q [B, Hq, D] over its meta.kv_lens keys."""
    _, _, num_kv_heads, page_size, head_dim = kv_layer.shape
    batch, num_q_heads = q.shape[0], q.shape[1]
    tables, lens = _step_inputs(meta, page_size)
    q = q.contiguous()
    out = torch.empty_like(q)
    failed = cpu_ext.load().rs_paged_decode_attention(
        q.data_ptr(), kv_layer.data_ptr(), tables.data_ptr(), lens.data_ptr(), out.data_ptr(), batch, num_q_heads,
        num_kv_heads, page_size, head_dim, tables.shape[1], scale, torch.get_num_threads())
    if failed:
        raise MemoryError(f"decode attention could not allocate its scores ({batch} rows, up to "
                          f"{meta.max_kv_len} keys)")
    return out


def _step_inputs(meta: AttentionMetadata, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """int32 block tables and lengths, made and checked once per step: the kernel reads pages without bounds
    checks, so a length past its row's table would read outside the cache."""
    key = ("cpu decode inputs", page_size)
    if key not in meta.derived:
        tables = meta.block_tables.to(torch.int32).contiguous()
        lens = meta.kv_lens.to(torch.int32).contiguous()
        if lens.numel() and not (0 < int(lens.min()) and int(lens.max()) <= tables.shape[1] * page_size):
            raise ValueError(f"decode lengths {lens.tolist()} outside 1..{tables.shape[1] * page_size} "
                             f"({tables.shape[1]} pages of {page_size} per row)")
        meta.derived[key] = (tables, lens)
    return meta.derived[key]
