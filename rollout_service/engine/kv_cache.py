"""Paged KV cache: a pool of ref-counted pages and the per-layer tensors they index.

Layout per layer: [num_pages, 2, num_kv_heads, page_size, head_dim] (0 = K, 1 = V), so one head of one
page is a contiguous page_size x head_dim tile for the kernels. Page 0 is a scratch page that is never
handed out: padded rows of a CUDA-graph batch write their K/V there.
"""
from __future__ import annotations

from collections import deque

import torch


class PagePool:
    """Free list + reference counts. A page shared by k sequences (the prompt of n samples) has count k."""

    def __init__(self, num_pages: int):
        if num_pages < 2:
            raise ValueError(f"num_pages={num_pages}: need at least 2 (page 0 is reserved)")
        self.num_pages = num_pages
        self.refcount = [0] * num_pages
        self.refcount[0] = 1  # scratch page, never freed
        self._free = deque(range(1, num_pages))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_usable(self) -> int:
        return self.num_pages - 1

    @property
    def num_used(self) -> int:
        return self.num_usable - self.num_free

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"PagePool: asked for {n} pages, {len(self._free)} free")
        pages = [self._free.popleft() for _ in range(n)]
        for p in pages:
            self.refcount[p] = 1
        return pages

    def share(self, pages: list[int]) -> None:
        for p in pages:
            assert self.refcount[p] > 0, f"sharing free page {p}"
            self.refcount[p] += 1

    def release(self, pages: list[int]) -> None:
        for p in pages:
            assert p != 0 and self.refcount[p] > 0, f"releasing free or scratch page {p}"
            self.refcount[p] -= 1
            if self.refcount[p] == 0:
                self._free.append(p)


def pages_for(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)


class KVCache:
    """The page pool plus one K/V tensor per layer."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, page_size: int, num_pages: int,
                 dtype: torch.dtype, device: torch.device | str):
        self.page_size = page_size
        self.pool = PagePool(num_pages)
        shape = (num_pages, 2, num_kv_heads, page_size, head_dim)
        self.layers = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @staticmethod
    def bytes_per_page(num_layers: int, num_kv_heads: int, head_dim: int, page_size: int,
                       dtype: torch.dtype) -> int:
        return num_layers * 2 * num_kv_heads * page_size * head_dim * torch.empty((), dtype=dtype).element_size()

    @property
    def nbytes(self) -> int:
        """Bytes held now (0 while released)."""
        return sum(layer.untyped_storage().nbytes() for layer in self.layers)

    def capacity_bytes(self) -> int:
        """Bytes of every page: what the cache holds when allocated."""
        return sum(layer.numel() * layer.element_size() for layer in self.layers)

    def release(self) -> None:
        """Free the cache's memory (sleep); the page pool must hold no sequence's pages."""
        assert self.pool.num_used == 0, "releasing a KV cache that sequences still use"
        for layer in self.layers:
            layer.untyped_storage().resize_(0)

    def reallocate(self) -> None:
        """Memory for every page again (wake); contents undefined, as at start-up."""
        for layer in self.layers:  # layer by layer: a wake that ran out of memory part-way is retried
            want = layer.numel() * layer.element_size()
            if layer.untyped_storage().nbytes() != want:
                layer.untyped_storage().resize_(want)

    def copy_page(self, src: int, dst: int) -> None:
        """Copy-on-write for a forked sample's partial last prompt page."""
        for layer in self.layers:
            layer[dst].copy_(layer[src])
