"""CPU paged attention that reads the K/V pages in place (csrc/cpu_attention.c): the same attention as the torch
reference (ops/attention.py) with its sums in another order.

The reference copies every decode row's pages out of the cache each layer and step before its products, and a
prefill's K/V once more per GQA group for SDPA. Here every query token is a row of the kernel, which attends the
keys up to its own position in place. `applies` says where it runs: float32 on the CPU, with the C kernels built
(ops/cpu_ext.py); elsewhere the torch ops keep their torch code.
"""
from __future__ import annotations

import torch

from rollout_service.ops import cpu_ext
from rollout_service.ops.attention import AttentionMetadata, make_metadata, write_kv


def applies(q: torch.Tensor, kv_layer: torch.Tensor) -> bool:
    return cpu_ext.takes(q, kv_layer) and kv_layer.is_contiguous()  # (an engine's layers always are)


def attention(q: torch.Tensor, kv_layer: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """[T, Hq, D] causal attention of the step's query tokens q [T, Hq, D] over the paged cache."""
    _, _, num_kv_heads, page_size, head_dim = kv_layer.shape
    tables, lens = _rows(meta, page_size)
    q = q.contiguous()
    out = torch.empty_like(q)
    failed = cpu_ext.load().rs_paged_attention(
        q.data_ptr(), kv_layer.data_ptr(), tables.data_ptr(), lens.data_ptr(), out.data_ptr(), q.shape[0],
        q.shape[1], num_kv_heads, page_size, head_dim, tables.shape[1], scale, torch.get_num_threads())
    if failed:
        raise MemoryError(f"attention could not allocate its scores ({q.shape[0]} rows, up to {int(lens.max())} "
                          f"keys)")
    return out


def causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: list[int], scale: float) -> torch.Tensor:
    """Causal attention of sequences laid back to back (q [T, Hq, D], k and v [T, Hk, D], rotated) through the
    kernel, with its K/V copied into pages of its own: the learner's recompute in batch-invariant mode. A row's
    bits do not depend on the pages its keys sit in (the kernel sums over blocks of keys in key order), so they
    are the bits the engine's row got."""
    page_size, tables, first = 16, [], 0
    for n in lens:
        tables.append(list(range(first, first + -(-n // page_size))))
        first += len(tables[-1])
    meta = make_metadata(tables, lens, lens, page_size)
    cache = torch.empty(first, 2, k.shape[1], page_size, k.shape[2], dtype=k.dtype)  # slots past a length: unread
    write_kv(cache, k, v, meta.slot_mapping)
    return attention(q, cache, meta, scale)


def _rows(meta: AttentionMetadata, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each query token's page table and key count, int32, made and checked once per step: sequence b's queries
    are its last q_len positions, so its query i attends kv_len - q_len + i + 1 keys. The kernel reads pages
    without bounds checks: a count past its sequence's table would read outside the cache."""
    key = ("cpu attention rows", page_size)
    if key not in meta.derived:
        tables, lens = meta.block_tables.to(torch.int32), meta.kv_lens.to(torch.int32)
        if meta.is_prefill:
            q_lens = meta.qo_indptr.diff().long()
            seq = torch.repeat_interleave(torch.arange(q_lens.numel()), q_lens)
            ends = meta.qo_indptr[1:].long()[seq]  # each row's sequence's end row
            tables, lens = tables[seq], (lens[seq] - (ends - torch.arange(seq.numel())) + 1).to(torch.int32)
        capacity = tables.shape[1] * page_size
        bad = ((lens < 1) | (lens > capacity)).nonzero()
        if bad.numel():
            row = int(bad[0])
            raise ValueError(f"attention row {row} would read {int(lens[row])} keys: outside 1..{capacity} "
                             f"({tables.shape[1]} pages of {page_size} per sequence)")
        meta.derived[key] = (tables.contiguous(), lens.contiguous())
    return meta.derived[key]
