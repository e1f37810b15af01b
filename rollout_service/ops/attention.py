"""Paged attention: the batch metadata and the torch reference that every backend must reproduce.

KV cache layout (one tensor per layer): [num_pages, 2, num_kv_heads, page_size, head_dim], index 0 = K,
1 = V. A slot is page_id * page_size + offset_in_page.
"""
from __future__ import annotations

from dataclasses import dataclass, field

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
    # What the torch reference derives from the fields above once per step and shares across the layers
    # (gather indices, masks); the fields must not change while this object is in use.
    derived: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def num_seqs(self) -> int:
        return self.kv_lens.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.slot_mapping.shape[0]


def write_kv(kv_layer: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor,
             rows: torch.Tensor | None = None) -> None:
    """Store this step's K/V [T, Hk, D] at their slots, in place. rows: kv_rows(kv_layer, slot_mapping), when the
    caller keeps it for every layer of a step (the cache contiguous)."""
    if rows is not None:
        flat = kv_layer.view(-1, kv_layer.shape[4])
        flat[rows[0]] = k.to(kv_layer.dtype)
        flat[rows[1]] = v.to(kv_layer.dtype)
        return
    page_size = kv_layer.shape[3]
    page = slot_mapping // page_size
    offset = slot_mapping % page_size
    # Advanced indices split by a slice put the token dim first: the target view is [T, Hk, D].
    kv_layer[page, 0, :, offset] = k.to(kv_layer.dtype)
    kv_layer[page, 1, :, offset] = v.to(kv_layer.dtype)


def kv_rows(kv_layer: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
    """int64 [2, T, Hk]: the rows of kv_layer.view(-1, D) where each token's K (0) and V (1) heads go."""
    _, _, num_kv_heads, page_size, _ = kv_layer.shape
    page, offset = slot_mapping // page_size, slot_mapping % page_size
    heads = torch.arange(num_kv_heads, device=slot_mapping.device) * page_size
    k_rows = (page * (2 * num_kv_heads * page_size) + offset)[:, None] + heads[None, :]
    return torch.stack([k_rows, k_rows + num_kv_heads * page_size])


def paged_attention(q: torch.Tensor, kv_layer: torch.Tensor, meta: AttentionMetadata, scale: float,
                    compute_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Causal attention of q [T, Hq, D] over the paged cache; returns [T, Hq, D] in q's dtype.

    Computed in `compute_dtype` (float32; float64 gives the exactly rounded result that diagnostics compare
    the float32 reference and the kernels against)."""
    if meta.is_prefill:
        return _prefill_attention(q, kv_layer, meta, scale, compute_dtype)
    return _decode_attention(q, kv_layer, meta, scale, compute_dtype)


def tile_index(pages: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """int64 [2, R, Hk, P]: for page ids [R, P], the rows of a layer viewed as [num_pages * 2 * Hk, ps * D] that
    hold each page's K (0) and V (1) tile of each head."""
    heads = torch.arange(num_kv_heads, device=pages.device)
    k_tile = pages.long()[:, None, :] * (2 * num_kv_heads) + heads[None, :, None]  # [R, Hk, P]
    return torch.stack([k_tile, k_tile + num_kv_heads])


def gather_pages_by_head(kv_layer: torch.Tensor, block_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's pages of K and V as [B, Hk, P * page_size, D] in the cache's dtype. Gathered per (page, head)
    tile, which lands them directly in that order: one copy (of whole tiles as rows: index_select), no transpose."""
    _, _, num_kv_heads, page_size, head_dim = kv_layer.shape
    batch, max_pages = block_tables.shape
    tiles = kv_layer.view(-1, page_size * head_dim)  # [num_pages * 2 * Hk, ps * D]
    index = tile_index(block_tables, num_kv_heads).view(-1)
    kv = torch.index_select(tiles, 0, index).view(2, batch, num_kv_heads, max_pages * page_size, head_dim)
    return kv[0], kv[1]


def _decode_plan(kv_layer: torch.Tensor, meta: AttentionMetadata, compute_dtype: torch.dtype) -> tuple:
    """(tiles index [2, B, Hk, P], additive mask [B * Hk, 1, L] (0 or -inf), invalid [B, 1, L - start, 1], start):
    made once per step. Keys at or past a row's length (stale page tails, padding pages) are masked; from
    `start` on some row has such keys, and their K and V are zeroed in the gathered copy (they may hold anything,
    even NaN, and 0 * NaN is NaN). start is the shortest length where the host knows it for free (CPU), else 0."""
    key = ("decode", kv_layer.shape, compute_dtype)
    # a CUDA graph computes it itself (a capture reuses the metadata of its warm-up runs)
    capturing = kv_layer.is_cuda and torch.cuda.is_current_stream_capturing()
    plan = None if capturing else meta.derived.get(key)
    if plan is None:
        _, _, num_kv_heads, page_size, _ = kv_layer.shape
        tables = meta.block_tables.long()
        batch, length = tables.shape[0], tables.shape[1] * page_size
        index = tile_index(tables, num_kv_heads)
        key_pos = torch.arange(length, device=tables.device)
        invalid = key_pos[None, :] >= meta.kv_lens[:, None]  # [B, L]
        mask = torch.zeros(batch, 1, length, dtype=compute_dtype, device=tables.device)
        mask.masked_fill_(invalid[:, None, :], float("-inf"))
        start = int(meta.kv_lens.min()) if tables.device.type == "cpu" and batch else 0
        plan = (index, mask.repeat_interleave(num_kv_heads, dim=0), invalid[:, None, start:, None], start)
        if not capturing:
            meta.derived[key] = plan
    return plan


def _decode_attention(
    q: torch.Tensor, kv_layer: torch.Tensor, meta: AttentionMetadata, scale: float, compute_dtype: torch.dtype
) -> torch.Tensor:
    # One query per sequence; no host syncs on a GPU, so this path can be captured in a CUDA graph. The q heads
    # of a kv head attend as one [group, L] product (GQA without repeating K/V). K and V come in one gather.
    batch = meta.block_tables.shape[0]
    _, _, num_kv_heads, page_size, head_dim = kv_layer.shape
    num_q_heads = q.shape[1]
    index, mask, invalid, start = _decode_plan(kv_layer, meta, compute_dtype)
    length = index.shape[3] * page_size
    # whole (page, head) tiles as rows: index_select copies rows, several times faster than tensor indexing; into
    # one buffer per step (each layer's copy is dead once its products are done)
    tiles = kv_layer.view(-1, page_size * head_dim)
    buffer = meta.derived.get(("decode buffer", tiles.dtype))
    if buffer is None or buffer.device != tiles.device or buffer.shape[0] != index.numel():
        buffer = torch.empty(index.numel(), tiles.shape[1], dtype=tiles.dtype, device=tiles.device)
        if not (tiles.is_cuda and torch.cuda.is_current_stream_capturing()):
            meta.derived[("decode buffer", tiles.dtype)] = buffer
    kv = torch.index_select(tiles, 0, index.view(-1), out=buffer).to(compute_dtype)  # [2 * B * Hk * P, ps * D]
    if start < length:  # (on a copy: our buffer, or .to's)
        kv.view(2, batch, num_kv_heads, length, head_dim)[:, :, :, start:].masked_fill_(invalid, 0.0)
    kv = kv.view(2, batch * num_kv_heads, length, head_dim)
    qg = q.to(compute_dtype).view(batch * num_kv_heads, num_q_heads // num_kv_heads, head_dim)
    scores = torch.baddbmm(mask, qg, kv[0].transpose(1, 2), alpha=scale)  # [B * Hk, group, L]
    probs = torch.softmax(scores, dim=-1)
    return torch.bmm(probs, kv[1]).view(batch, num_q_heads, head_dim).to(q.dtype)


def _prefill_attention(
    q: torch.Tensor, kv_layer: torch.Tensor, meta: AttentionMetadata, scale: float, compute_dtype: torch.dtype
) -> torch.Tensor:
    _, _, num_kv_heads, page_size, head_dim = kv_layer.shape
    num_q_heads = q.shape[1]
    lists = meta.derived.get("prefill lists")
    if lists is None:  # host copies once per step, not per layer
        lists = meta.derived["prefill lists"] = (meta.qo_indptr.tolist(), meta.kv_indptr.tolist(),
                                                 meta.kv_lens.tolist())
    qo_indptr, kv_indptr, kv_lens = lists
    batch = len(kv_lens)
    q_len = qo_indptr[1] - qo_indptr[0] if batch else 0
    if batch > 1 and q_len and all(n == kv_lens[0] for n in kv_lens) and all(
            qo_indptr[b + 1] - qo_indptr[b] == q_len for b in range(batch)):
        # every sequence the same shape (as a batch of equal prompts): one SDPA call for all of them
        kv_len = kv_lens[0]
        pages = meta.kv_indices.long().view(batch, -1)
        kv = _pages(kv_layer, pages.view(-1)).view(batch, -1, *kv_layer.shape[1:])
        kv = kv.permute(2, 0, 3, 1, 4, 5).reshape(2, batch, num_kv_heads, -1, head_dim)
        o = _causal_sdpa(q.view(batch, q_len, num_q_heads, head_dim).transpose(1, 2), kv[:, :, :, :kv_len],
                         scale, compute_dtype)
        return o.transpose(1, 2).reshape(q.shape).to(q.dtype)
    out = torch.empty_like(q)
    for b, kv_len in enumerate(kv_lens):
        q_start, q_end = qo_indptr[b], qo_indptr[b + 1]
        if q_end == q_start:
            continue
        pages = meta.kv_indices[kv_indptr[b] : kv_indptr[b + 1]].long()
        kv = _pages(kv_layer, pages).permute(1, 2, 0, 3, 4).reshape(2, num_kv_heads, -1, head_dim)[:, :, :kv_len]
        o = _causal_sdpa(q[q_start:q_end].transpose(0, 1), kv, scale, compute_dtype)
        out[q_start:q_end] = o.transpose(0, 1).to(q.dtype)
    return out


def _pages(kv_layer: torch.Tensor, pages: torch.Tensor) -> torch.Tensor:
    """kv_layer[pages] (pages int64 [N]) by index_select over whole pages as rows (a faster copy)."""
    return torch.index_select(kv_layer.view(kv_layer.shape[0], -1), 0, pages).view(-1, *kv_layer.shape[1:])


def _causal_sdpa(q: torch.Tensor, kv: torch.Tensor, scale: float, compute_dtype: torch.dtype) -> torch.Tensor:
    """Causal attention of q [..., Hq, Lq, D], the last Lq positions of sequences whose K and V are kv
    [2, ..., Hk, L, D]; [..., Hq, Lq, D] in compute_dtype."""
    q_len, kv_len = q.shape[-2], kv.shape[-2]
    group = q.shape[-3] // kv.shape[-3]
    kv = kv.to(compute_dtype)
    if group != 1:
        # GQA by repeated K/V heads (as transformers does on the CPU): SDPA's enable_gqa takes its slow unfused
        # path on the CPU
        kv = kv.repeat_interleave(group, dim=-3)
    causal = None
    if q_len != kv_len:
        # The queries are the sequence's last q_len tokens: query i sits at position kv_len - q_len + i.
        q_pos = torch.arange(kv_len - q_len, kv_len, device=q.device)
        causal = torch.arange(kv_len, device=q.device)[None, :] <= q_pos[:, None]
    return F.scaled_dot_product_attention(q.to(compute_dtype), kv[0], kv[1], attn_mask=causal,
                                          is_causal=causal is None, scale=scale)


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
