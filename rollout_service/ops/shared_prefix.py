"""Decode attention that reads a shared prompt's pages once for all the samples that share them (torch, CPU).

The n samples of a prompt share its full pages (engine/kv_cache.py). The torch reference's decode attention
copies every row's pages, so a prompt's K/V is read n times per layer and step. On the CPU those reads are
most of attention's time. Here the rows that start with the same pages form a group:
- the group's common full pages are gathered once, and all of its rows' queries multiply them in one product;
- each row's remaining pages are gathered per row, as before;
- one softmax runs over each row's prefix and own scores side by side, so the result is the same attention
  with the sums in another order.

`plan` finds the groups on the host (a CPU step's tables are host memory) and returns None when no two rows
share a page: the torch ops then run the reference (ops/attention.py) unchanged.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from rollout_service.ops.attention import AttentionMetadata, tile_index


class Plan(NamedTuple):
    prefix_tiles: torch.Tensor   # [2, G, Hk, C] tile ids of each group's common pages (padding: page 0)
    prefix_mask: torch.Tensor    # [G, 1, 1, C * ps] 0 or -inf: padding pages masked
    suffix_tiles: torch.Tensor   # [2, B, Hk, S] tile ids of each row's own pages (padding: page 0)
    suffix_mask: torch.Tensor    # [B, 1, 1, S * ps] 0 or -inf: keys at or past the row's length masked
    group_of: torch.Tensor       # [B] each row's group
    slot_of: torch.Tensor        # [B] each row's place in its group
    rows: int                    # the most rows in a group
    in_order: bool               # groups of `rows` rows each, one after another (as the engine forks them)
    prefix_zero_from: int        # keys from here on are padding in some group (their K/V zeroed)
    suffix_zero_from: int        # keys from here on are past some row's length


def step_plan(meta: AttentionMetadata, num_kv_heads: int, page_size: int) -> Plan | None:
    """plan() of a decode step, made once for all its layers."""
    key = ("shared prefix", num_kv_heads, page_size)
    if key not in meta.derived:
        meta.derived[key] = plan(meta.block_tables, meta.kv_lens, num_kv_heads, page_size)
    return meta.derived[key]


def plan(tables: torch.Tensor, lens: torch.Tensor, num_kv_heads: int, page_size: int) -> Plan | None:
    """Groups of rows with common leading pages, or None if no two rows share one."""
    t, n = tables.numpy().astype(np.int64), lens.numpy().astype(np.int64)
    full = n // page_size  # pages every position of which is written (a shared page always is)
    groups: dict[int, list[int]] = {}
    for row, first in enumerate(t[:, 0].tolist()):
        groups.setdefault(first if full[row] else -1 - row, []).append(row)
    if all(len(rows) == 1 for rows in groups.values()):
        return None
    members = list(groups.values())
    common = [_common_pages(t[rows], int(full[rows].min())) for rows in members]
    group_of, slot_of = np.empty(len(n), np.int64), np.empty(len(n), np.int64)
    for g, rows in enumerate(members):
        group_of[rows], slot_of[rows] = g, np.arange(len(rows))
    c, own = max(common), -(-n // page_size) - np.array(common)[group_of]
    prefix_pages = np.zeros((len(members), max(c, 1)), np.int64)
    for g, rows in enumerate(members):
        prefix_pages[g, :common[g]] = t[rows[0], :common[g]]
    suffix_pages = np.zeros((len(n), max(int(own.max()), 1)), np.int64)
    for row in range(len(n)):
        start = common[group_of[row]]
        suffix_pages[row, :own[row]] = t[row, start:start + own[row]]
    prefix_keys = np.arange(prefix_pages.shape[1] * page_size)
    suffix_keys = np.arange(suffix_pages.shape[1] * page_size)
    prefix_valid = prefix_keys[None, :] < np.array(common)[:, None] * page_size
    suffix_valid = suffix_keys[None, :] < (n - np.array(common)[group_of] * page_size)[:, None]
    most = max(len(rows) for rows in members)
    rows = np.arange(len(n))
    in_order = len(n) % most == 0 and bool((group_of == rows // most).all() and (slot_of == rows % most).all())
    return Plan(tile_index(torch.from_numpy(prefix_pages), num_kv_heads), _additive(prefix_valid),
                tile_index(torch.from_numpy(suffix_pages), num_kv_heads),
                _additive(suffix_valid), torch.from_numpy(group_of), torch.from_numpy(slot_of), most, in_order,
                int(prefix_valid.sum(axis=1).min()), int(suffix_valid.sum(axis=1).min()))


def _common_pages(rows: np.ndarray, limit: int) -> int:
    """How many leading pages all `rows` share, at most `limit`."""
    same = (rows[:, :limit] == rows[:1, :limit]).all(axis=0)
    return int(limit if same.all() else same.argmin())


def _additive(valid: np.ndarray) -> torch.Tensor:
    mask = torch.zeros(valid.shape, dtype=torch.float32)
    mask.masked_fill_(torch.from_numpy(~valid), float("-inf"))
    return mask[:, None, None, :]


def attention(q: torch.Tensor, kv_layer: torch.Tensor, p: Plan, scale: float,
              compute_dtype: torch.dtype) -> torch.Tensor:
    """[B, Hq, D] decode attention of q [B, Hq, D] by the plan's groups; K and V in compute_dtype."""
    _, _, heads, page_size, dim = kv_layer.shape
    batch, num_q = q.shape[0], q.shape[1]
    group = num_q // heads
    tiles = kv_layer.view(-1, page_size * dim)
    pre = _gather(tiles, p.prefix_tiles, p.prefix_mask, p.prefix_zero_from, compute_dtype, dim)  # [2, G, Hk, Lp, D]
    own = _gather(tiles, p.suffix_tiles, p.suffix_mask, p.suffix_zero_from, compute_dtype, dim)  # [2, B, Hk, Ls, D]
    qh = q.to(compute_dtype).view(batch, heads, group, dim)
    s_pre = torch.matmul(_by_group(qh, p), pre[0].transpose(-1, -2)) * scale  # [G, Hk, rows * group, Lp]
    s_pre = _by_row(s_pre, p) + p.prefix_mask[p.group_of]  # [B, Hk, group, Lp]
    s_own = torch.matmul(qh, own[0].transpose(-1, -2)) * scale + p.suffix_mask  # [B, Hk, group, Ls]
    probs = torch.softmax(torch.cat([s_pre, s_own], dim=-1), dim=-1)
    p_pre, p_own = probs.split([s_pre.shape[-1], s_own.shape[-1]], dim=-1)
    out = _by_row(torch.matmul(_by_group(p_pre, p), pre[1]), p) + torch.matmul(p_own, own[1])
    return out.reshape(batch, num_q, dim).to(q.dtype)


def _by_group(x: torch.Tensor, p: Plan) -> torch.Tensor:
    """Rows [B, Hk, group, N] laid out per group [G, Hk, rows * group, N] (the places of missing rows zero)."""
    batch, heads, group, width = x.shape
    if p.in_order:
        grouped = x.view(-1, p.rows, heads, group, width)
    else:
        grouped = x.new_zeros(p.prefix_tiles.shape[1], p.rows, heads, group, width)
        grouped[p.group_of, p.slot_of] = x
    return grouped.transpose(1, 2).reshape(grouped.shape[0], heads, p.rows * group, width)


def _by_row(x: torch.Tensor, p: Plan) -> torch.Tensor:
    """The inverse of _by_group: [G, Hk, rows * group, N] -> each row's [B, Hk, group, N]."""
    groups, heads, _, width = x.shape
    x = x.view(groups, heads, p.rows, -1, width).transpose(1, 2)
    if p.in_order:
        return x.reshape(-1, heads, x.shape[3], width)
    return x[p.group_of, p.slot_of]


def _gather(tiles: torch.Tensor, index: torch.Tensor, mask: torch.Tensor, zero_from: int, compute_dtype: torch.dtype,
            dim: int) -> torch.Tensor:
    """[2, R, Hk, P * ps, D] K and V of the index's tiles, zero where masked (a padding page or a stale tail
    may hold anything, even NaN, and 0 * NaN is NaN); keys before zero_from are valid in every row."""
    two, rows, heads, _ = index.shape
    kv = torch.index_select(tiles, 0, index.reshape(-1)).to(compute_dtype).view(two, rows, heads, -1, dim)
    if zero_from < kv.shape[3]:
        invalid = mask[:, 0, 0, zero_from:] != 0  # [R, L - zero_from]
        kv[:, :, :, zero_from:].masked_fill_(invalid[None, :, None, :, None], 0.0)
    return kv
