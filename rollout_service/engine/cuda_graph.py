"""Decode-step CUDA graphs, one per padded batch bucket, sharing one memory pool.

Every per-step input lives in a fixed device buffer that the graphs were captured on; `run` copies the
step's tensors in (device to device, no host sync), points padding rows at the reserved scratch page 0
(the KV pool never hands it out, so their K/V writes land nowhere that matters), replays, and returns the
first B rows of the captured output. Sampling stays outside the graph.
"""
from __future__ import annotations

import logging

import torch
from torch import nn

from rollout_service.ops.attention import AttentionMetadata

logger = logging.getLogger(__name__)

SCRATCH_PAGE = 0


def batch_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to max_batch (which is always included)."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    buckets = [b for b in (1, 2, 4) if b < max_batch] + list(range(8, max_batch, 8))
    return buckets + [max_batch]


class CudaGraphRunner:
    def __init__(
        self, model: nn.Module, kv_caches: list[torch.Tensor], max_batch: int, max_pages_per_seq: int,
        page_size: int, device: torch.device | str, dtype: torch.dtype,
    ) -> None:
        if max_pages_per_seq < 1 or page_size < 1:
            raise ValueError(f"max_pages_per_seq ({max_pages_per_seq}) and page_size ({page_size}) must be >= 1")
        self.model = model
        self.kv_caches = kv_caches
        self.max_batch = max_batch
        self.max_pages = max_pages_per_seq
        self.page_size = page_size
        self.device = torch.device(device)
        self.dtype = dtype
        self.buckets = batch_buckets(max_batch)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.metas: dict[int, AttentionMetadata] = {}
        self.disabled = False
        self._alloc_buffers()

    def _alloc_buffers(self) -> None:
        n, p = self.max_batch, self.max_pages
        i32 = dict(dtype=torch.int32, device=self.device)
        i64 = dict(dtype=torch.int64, device=self.device)
        self.input_ids = torch.zeros(n, **i64)
        self.positions = torch.zeros(n, **i64)
        self.slot_mapping = torch.zeros(n, **i64)
        self.qo_indptr = torch.arange(n + 1, **i32)  # decode: one query per sequence, fixed forever
        self.kv_indptr = torch.zeros(n + 1, **i32)
        self.kv_indices = torch.zeros(n * p, **i32)
        self.kv_last_page_len = torch.ones(n, **i32)
        self.kv_lens = torch.ones(n, **i32)
        self.block_tables = torch.zeros(n, p, **i32)
        self._steps = torch.arange(1, n + 1, **i32)

    def _meta(self, bs: int) -> AttentionMetadata:
        return AttentionMetadata(
            is_prefill=False,
            slot_mapping=self.slot_mapping[:bs],
            positions=self.positions[:bs],
            qo_indptr=self.qo_indptr[: bs + 1],
            kv_indptr=self.kv_indptr[: bs + 1],
            kv_indices=self.kv_indices[: bs * self.max_pages],
            kv_last_page_len=self.kv_last_page_len[:bs],
            kv_lens=self.kv_lens[:bs],
            block_tables=self.block_tables[:bs],
            max_q_len=1,
            max_kv_len=self.max_pages * self.page_size,  # a fixed bound: it sizes the split-KV grid
        )

    def _point_rows_at_scratch(self, start: int, stop: int, nnz_dev: torch.Tensor | int) -> None:
        """Rows start:stop become 1-token sequences on the scratch page (graph padding)."""
        if stop <= start:
            return
        self.input_ids[start:stop] = 0
        self.positions[start:stop] = 0
        self.slot_mapping[start:stop] = SCRATCH_PAGE * self.page_size
        self.kv_last_page_len[start:stop] = 1
        self.kv_lens[start:stop] = 1
        self.block_tables[start:stop] = SCRATCH_PAGE
        # Padding row j owns one page, the scratch page, right after the real pages.
        self.kv_indptr[start + 1 : stop + 1] = self._steps[: stop - start] + nnz_dev

    @torch.no_grad()
    def capture(self) -> None:
        """Capture every bucket, largest first so smaller graphs reuse the pool; on failure run eager."""
        try:
            pool = None
            self.kv_indptr.zero_()
            self.kv_indices.fill_(SCRATCH_PAGE)
            self._point_rows_at_scratch(0, self.max_batch, 0)
            for bs in reversed(self.buckets):
                meta = self._meta(bs)
                args = (self.input_ids[:bs], self.positions[:bs], self.kv_caches, meta)
                stream = torch.cuda.Stream(self.device)
                stream.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(stream):  # warm-up: lazy inits and allocator growth happen outside capture
                    for _ in range(2):
                        self.model(*args)
                torch.cuda.current_stream(self.device).wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    out = self.model(*args)
                pool = graph.pool()
                self.graphs[bs], self.outputs[bs], self.metas[bs] = graph, out, meta
            torch.cuda.synchronize(self.device)
            logger.info("captured decode CUDA graphs for batch sizes %s", self.buckets)
        except Exception as exc:  # a graph is an optimisation: fall back to eager, loudly
            logger.warning("CUDA graph capture failed, decoding eagerly: %s", exc)
            self.graphs.clear()
            self.outputs.clear()
            self.disabled = True

    def can_run(self, batch_size: int) -> bool:
        return not self.disabled and bool(self.graphs) and 1 <= batch_size <= self.max_batch

    def _bucket(self, batch_size: int) -> int:
        return next(b for b in self.buckets if b >= batch_size)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Replay the decode forward for B sequences; returns hidden [B, H] (a view into the graph output)."""
        batch = input_ids.shape[0]
        if not self.can_run(batch):
            raise ValueError(f"no captured graph for batch size {batch} (max {self.max_batch}, disabled={self.disabled})")
        if meta.is_prefill or meta.block_tables.shape[1] > self.max_pages:
            raise ValueError(
                f"graph decode needs a decode step with <= {self.max_pages} pages per sequence, got "
                f"is_prefill={meta.is_prefill}, {meta.block_tables.shape[1]} pages"
            )
        bs = self._bucket(batch)
        nnz = meta.kv_indices.shape[0]
        self.input_ids[:batch].copy_(input_ids, non_blocking=True)
        self.positions[:batch].copy_(positions, non_blocking=True)
        self.slot_mapping[:batch].copy_(meta.slot_mapping, non_blocking=True)
        self.kv_indptr[: batch + 1].copy_(meta.kv_indptr, non_blocking=True)
        self.kv_indices[:nnz].copy_(meta.kv_indices, non_blocking=True)
        self.kv_last_page_len[:batch].copy_(meta.kv_last_page_len, non_blocking=True)
        self.kv_lens[:batch].copy_(meta.kv_lens, non_blocking=True)
        pages = meta.block_tables.shape[1]
        self.block_tables[:batch, :pages].copy_(meta.block_tables, non_blocking=True)
        self.block_tables[:batch, pages:] = SCRATCH_PAGE
        if bs > batch:
            # Padding pages go after the real ones; nnz + (bs - batch) <= bs * max_pages always holds.
            self.kv_indices[nnz : nnz + bs - batch] = SCRATCH_PAGE
            self._point_rows_at_scratch(batch, bs, meta.kv_indptr[batch:])
        self.graphs[bs].replay()
        return self.outputs[bs][:batch]
