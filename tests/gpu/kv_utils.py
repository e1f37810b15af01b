"""Helpers for the GPU kernel tests: random paged caches and float64 references."""
from __future__ import annotations

import math

import torch

PAGE = 16
TOL = {torch.bfloat16: 1e-2, torch.float16: 3e-3}  # ||out - ref|| / ||ref|| vs a float64 reference: a few half-precision ulps

requires_cuda = dict(condition=not torch.cuda.is_available(), reason="needs a CUDA device")


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(out).all(), "non-finite values in the kernel output"
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def poison_allocator(nbytes: int) -> None:
    """Fill freed allocator blocks with NaN so an output the kernel forgets to write shows up as NaN."""
    blob = torch.full((nbytes // 4 + 1024,), float("nan"), dtype=torch.float32, device="cuda")
    del blob


def random_paged_cache(
    kv_lens: list[int], num_kv_heads: int, head_dim: int, dtype: torch.dtype, spare_pages: int = 5
) -> tuple[torch.Tensor, list[list[int]]]:
    """A random cache with each sequence on shuffled pages (page 0 unused: the engine's scratch page).
    The unused tail of every last page holds NaN: kernels must never let it into a result."""
    need = [math.ceil(n / PAGE) for n in kv_lens]
    total = sum(need) + spare_pages + 1
    cache = torch.randn(total, 2, num_kv_heads, PAGE, head_dim, dtype=dtype, device="cuda")
    order = (torch.randperm(total - 1) + 1).tolist()
    tables, at = [], 0
    for n, pages in zip(kv_lens, need):
        tables.append(order[at : at + pages])
        at += pages
        tail = n - (pages - 1) * PAGE
        if tail < PAGE:
            cache[tables[-1][-1], :, :, tail:] = float("nan")
    return cache, tables


def gather_kv(cache: torch.Tensor, pages: list[int], kv_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V [kv_len, Hk, D] of one sequence in float64."""
    kv = cache[torch.tensor(pages, device=cache.device)].double()  # [P, 2, Hk, 16, D]
    kv = kv.permute(1, 0, 3, 2, 4).reshape(2, -1, cache.shape[2], cache.shape[4])[:, :kv_len]
    return kv[0], kv[1]


def reference_attention(
    q: torch.Tensor, cache: torch.Tensor, tables: list[list[int]], q_lens: list[int], kv_lens: list[int], scale: float
) -> torch.Tensor:
    """Causal attention in float64; query i of a sequence sits at position kv_len - q_len + i."""
    out = torch.empty(q.shape, dtype=torch.float64, device=q.device)
    group = q.shape[1] // cache.shape[2]
    start = 0
    for pages, q_len, kv_len in zip(tables, q_lens, kv_lens):
        k, v = gather_kv(cache, pages, kv_len)
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # [L, Hq, D]
        qs = q[start : start + q_len].double()
        scores = torch.einsum("qhd,khd->hqk", qs, k) * scale
        pos = torch.arange(kv_len - q_len, kv_len, device=q.device)
        visible = torch.arange(kv_len, device=q.device)[None, :] <= pos[:, None]
        scores = scores.masked_fill(~visible[None], float("-inf"))
        out[start : start + q_len] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
        start += q_len
    return out
