"""Paged attention: the batch metadata and the torch reference that every backend must reproduce.

KV cache layout (one tensor per layer): [num_pages, 2, num_kv_heads, page_size, head_dim], index 0 = K,
1 = V. A slot is page_id * page_size + offset_in_page.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    """Describes one forward step over a ragged batch of B sequences and T query tokens.

    Query tokens of sequence b are rows qo_indptr[b]:qo_indptr[b+1] and are its LAST q_len positions;
    a query at absolute position p attends KV positions <= p. kv_lens counts this step's tokens, which
    are written to the cache before attention reads it.
    """

    is_prefill: bool
    slot_mapping: torch.Tensor  # int64 [T]
    positions: torch.Tensor  # int64 [T]
    qo_indptr: torch.Tensor  # int32 [B+1]
    kv_indptr: torch.Tensor  # int32 [B+1]
    kv_indices: torch.Tensor  # int32 [nnz] page ids, in order
    kv_last_page_len: torch.Tensor  # int32 [B], 1..page_size
    kv_lens: torch.Tensor  # int32 [B]
    block_tables: torch.Tensor  # int32 [B, max_pages], rows padded with 0
    max_q_len: int
    max_kv_len: int

    @property
    def num_seqs(self) -> int:
        return self.kv_lens.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.slot_mapping.shape[0]


def write_kv(kv_layer: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store this step's K/V [T, Hk, D] at their slots, in place."""
    page_size = kv_layer.shape[3]
    page = slot_mapping // page_size
    offset = slot_mapping % page_size
    # Advanced indices split by a slice put the token dim first: the target view is [T, Hk, D].
    kv_layer[page, 0, :, offset] = k.to(kv_layer.dtype)
    kv_layer[page, 1, :, offset] = v.to(kv_layer.dtype)


def paged_attention(q: torch.Tensor, kv_layer: torch.Tensor, meta: AttentionMetadata, scale: float,
                    compute_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Causal attention of q [T, Hq, D] over the paged cache; returns [T, Hq, D] in q's dtype.

    Computed in `compute_dtype` (float32; float64 gives the exactly rounded result that diagnostics compare
    the float32 reference and the kernels against)."""
    if meta.is_prefill:
        return _prefill_attention(q, kv_layer, meta, scale, compute_dtype)
    return _decode_attention(q, kv_layer, meta, scale, compute_dtype)


def gather_pages_by_head(kv_layer: torch.Tensor, block_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's pages of K and V as [B, Hk, P * page_size, D] in the cache's dtype. Gathered per (page, head)
    tile, which lands them directly in that order: one copy, no transpose."""
    _, _, num_kv_heads, page_size, head_dim = kv_layer.shape
    batch, max_pages = block_tables.shape
    tiles = kv_layer.view(-1, page_size, head_dim)  # [num_pages * 2 * Hk, ps, D]
    heads = torch.arange(num_kv_heads, device=kv_layer.device)
    k_tile = block_tables.long()[:, None, :] * (2 * num_kv_heads) + heads[None, :, None]  # [B, Hk, P]
    shape = (batch, num_kv_heads, max_pages * page_size, head_dim)
    return tiles[k_tile].view(shape), tiles[k_tile + num_kv_heads].view(shape)


def _decode_attention(
    q: torch.Tensor, kv_layer: torch.Tensor, meta: AttentionMetadata, scale: float, compute_dtype: torch.dtype
) -> torch.Tensor:
    # One query per sequence; no host syncs, so this path can be captured in a CUDA graph. The q heads of a
    # kv head attend as one [group, L] matmul (GQA without repeating K/V).
    batch = meta.block_tables.shape[0]
    num_kv_heads, head_dim = kv_layer.shape[2], kv_layer.shape[4]
    num_q_heads = q.shape[1]
    k, v = (t.to(compute_dtype) for t in gather_pages_by_head(kv_layer, meta.block_tables))
    length = k.shape[2]
    valid = torch.arange(length, device=q.device)[None, :] < meta.kv_lens[:, None]  # [B, L]
    qg = q.to(compute_dtype).view(batch, num_kv_heads, num_q_heads // num_kv_heads, head_dim)
    scores = torch.matmul(qg, k.transpose(-1, -2)).mul_(scale)  # [B, Hk, group, L]
    scores.masked_fill_(~valid[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    # Padded pages and stale page tails may hold anything (even NaN): zero them so 0 * garbage stays 0.
    v.masked_fill_(~valid[:, None, :, None], 0.0)  # v is the gather's own copy
    return torch.matmul(probs, v).reshape(batch, num_q_heads, head_dim).to(q.dtype)


def _prefill_attention(
    q: torch.Tensor, kv_layer: torch.Tensor, meta: AttentionMetadata, scale: float, compute_dtype: torch.dtype
) -> torch.Tensor:
    _, _, num_kv_heads, page_size, head_dim = kv_layer.shape
    num_q_heads = q.shape[1]
    qo_indptr = meta.qo_indptr.tolist()
    kv_indptr = meta.kv_indptr.tolist()
    kv_lens = meta.kv_lens.tolist()
    out = torch.empty_like(q)
    for b, kv_len in enumerate(kv_lens):
        q_start, q_end = qo_indptr[b], qo_indptr[b + 1]
        q_len = q_end - q_start
        if q_len == 0:
            continue
        pages = meta.kv_indices[kv_indptr[b] : kv_indptr[b + 1]].long()
        kv = kv_layer[pages].permute(1, 2, 0, 3, 4).reshape(2, num_kv_heads, -1, head_dim)[:, :, :kv_len]
        kv = kv.to(compute_dtype)
        # The queries are the sequence's last q_len tokens: query i sits at position kv_len - q_len + i.
        q_pos = torch.arange(kv_len - q_len, kv_len, device=q.device)
        causal = torch.arange(kv_len, device=q.device)[None, :] <= q_pos[:, None]
        o = F.scaled_dot_product_attention(
            q[q_start:q_end].transpose(0, 1).to(compute_dtype),
            kv[0],
            kv[1],
            attn_mask=causal,
            scale=scale,
            enable_gqa=num_q_heads != num_kv_heads,
        )
        out[q_start:q_end] = o.transpose(0, 1).to(q.dtype)
    return out


def make_metadata(
    page_tables: list[list[int]],
    q_lens: list[int],
    kv_lens: list[int],
    page_size: int,
    is_prefill: bool | None = None,
    device: torch.device | str = "cpu",
) -> AttentionMetadata:
    """Build metadata from host lists: the engine's model runner, tests and benchmarks all use it.

    page_tables[b] lists sequence b's pages in order; it must cover exactly kv_lens[b] tokens. The queries are
    each sequence's last q_lens[b] tokens. is_prefill defaults to "some sequence has more than one query".
    """
    if not (len(page_tables) == len(q_lens) == len(kv_lens)):
        raise ValueError("page_tables, q_lens and kv_lens must have one entry per sequence")
    slots, positions = [], []
    for b, (pages, q_len, kv_len) in enumerate(zip(page_tables, q_lens, kv_lens)):
        if not 0 <= q_len <= kv_len or len(pages) != -(-kv_len // page_size):
            raise ValueError(f"sequence {b}: q_len {q_len}, kv_len {kv_len} and {len(pages)} pages are inconsistent")
        for pos in range(kv_len - q_len, kv_len):
            positions.append(pos)
            slots.append(pages[pos // page_size] * page_size + pos % page_size)
    if is_prefill is None:
        is_prefill = any(q != 1 for q in q_lens)
    max_pages = max((len(p) for p in page_tables), default=0)

    # Two host-to-device copies per step (one int64, one int32 buffer) instead of one per field.
    wide = _pack([slots, positions], torch.int64, device)
    narrow = _pack([_cumsum(q_lens), _cumsum([len(p) for p in page_tables]),
                    [page for pages in page_tables for page in pages], [(n - 1) % page_size + 1 for n in kv_lens],
                    kv_lens, [page for p in page_tables for page in p + [0] * (max_pages - len(p))]],
                   torch.int32, device)
    return AttentionMetadata(
        is_prefill=is_prefill,
        slot_mapping=wide[0],
        positions=wide[1],
        qo_indptr=narrow[0],
        kv_indptr=narrow[1],
        kv_indices=narrow[2],
        kv_last_page_len=narrow[3],
        kv_lens=narrow[4],
        block_tables=narrow[5].view(-1, max_pages),
        max_q_len=max(q_lens, default=0),
        max_kv_len=max(kv_lens, default=0),
    )


def _pack(fields: list[list[int]], dtype: torch.dtype, device: torch.device | str) -> list[torch.Tensor]:
    flat = torch.tensor([v for f in fields for v in f], dtype=dtype).to(device)
    return list(flat.split([len(f) for f in fields]))


def _cumsum(values: list[int]) -> list[int]:
    out = [0]
    for v in values:
        out.append(out[-1] + v)
    return out
