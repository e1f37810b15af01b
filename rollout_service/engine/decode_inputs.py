"""A decode step's model inputs in one flat buffer: filled on the host with numpy, sent in one copy.

A decode step needs eight small arrays (ids, positions, slots, CSR page lists, block tables). Building
each as its own tensor costs a host-to-device copy and several launches apiece, which at batch 1 is most
of a step. Here they live at fixed offsets of one pinned host buffer and one device buffer: `fill` writes
the host side, `upload` sends the used prefix in one asynchronous copy. The device views never move, so
the CUDA graphs are captured on them directly and a replay needs no copies of its own.

Rows past the real batch (graph padding) become 1-token sequences on the scratch page 0, which the page
pool never hands out: their K/V writes land nowhere that matters.
"""
from __future__ import annotations

from itertools import chain

import numpy as np
import torch

from rollout_service.ops.attention import AttentionMetadata

SCRATCH_PAGE = 0


class DecodeInputs:
    def __init__(self, max_batch: int, max_pages: int, page_size: int, device: torch.device | str):
        if max_batch < 1 or max_pages < 1 or page_size < 1:
            raise ValueError(f"max_batch ({max_batch}), max_pages ({max_pages}) and page_size ({page_size}) "
                             "must be >= 1")
        self.max_batch, self.max_pages, self.page_size = max_batch, max_pages, page_size
        self.device = torch.device(device)
        r, p = max_batch, max_pages
        # (name, dtype, length) in buffer order; kv_indices last, so the used bytes are one prefix.
        fields = [("input_ids", torch.int64, r), ("positions", torch.int64, r), ("slot_mapping", torch.int64, r),
                  ("qo_indptr", torch.int32, r + 1), ("kv_indptr", torch.int32, r + 1),
                  ("kv_last_page_len", torch.int32, r), ("kv_lens", torch.int32, r),
                  ("block_tables", torch.int32, r * p), ("kv_indices", torch.int32, r * p)]
        offsets, nbytes = {}, 0
        for name, dtype, n in fields:
            nbytes = -(-nbytes // 8) * 8  # keep every field 8-byte aligned
            offsets[name] = (nbytes, dtype, n)
            nbytes += n * dtype.itemsize
        pinned = self.device.type == "cuda"
        self._host = torch.zeros(nbytes, dtype=torch.uint8, pin_memory=pinned)
        self._dev = torch.zeros(nbytes, dtype=torch.uint8, device=self.device) if pinned else self._host
        self.h = {name: self._host[o:o + n * dt.itemsize].view(dt).numpy() for name, (o, dt, n) in offsets.items()}
        self.d = {name: self._dev[o:o + n * dt.itemsize].view(dt) for name, (o, dt, n) in offsets.items()}
        self._kv_indices_offset = offsets["kv_indices"][0]
        self.h["qo_indptr"][:] = np.arange(r + 1)  # one query per sequence, fixed forever
        self._copied = torch.cuda.Event() if pinned else None
        self._rows = self._real = self._nnz = self._widest = 0

    def fill(self, page_tables: list[list[int]], last_tokens: list[int], lengths: list[int], rows: int) -> None:
        """Sequence b has lengths[b] tokens (the last, last_tokens[b], is this step's query) whose KV lives in
        page_tables[b] (at least enough pages for them). Rows len(lengths):rows are scratch padding."""
        n = len(lengths)
        if not 1 <= n <= rows <= self.max_batch:
            raise ValueError(f"decode batch of {n} sequences in {rows} rows; at most {self.max_batch} rows")
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's copy has read the host buffer
        ps, h = self.page_size, self.h
        lens = np.fromiter(lengths, dtype=np.int64, count=n)
        counts = (lens - 1) // ps + 1
        widest = int(counts.max())
        if widest > self.max_pages:
            raise ValueError(f"a sequence of {int(lens.max())} tokens needs more than {self.max_pages} pages")
        tables = [t if len(t) == c else t[:c] for t, c in zip(page_tables, counts.tolist())]
        nnz = int(counts.sum())
        pad = rows - n
        indptr = h["kv_indptr"]
        indptr[0] = 0
        np.cumsum(counts, out=indptr[1:n + 1])
        indptr[n + 1:rows + 1] = nnz + np.arange(1, pad + 1)  # one scratch page per padding row
        pages = h["kv_indices"]
        pages[:nnz] = np.fromiter(chain.from_iterable(tables), dtype=np.int32, count=nnz)
        pages[nnz:nnz + pad] = SCRATCH_PAGE
        offset = (lens - 1) % ps
        h["input_ids"][:n] = last_tokens
        h["positions"][:n] = lens - 1
        h["slot_mapping"][:n] = pages[indptr[1:n + 1] - 1].astype(np.int64) * ps + offset
        h["kv_lens"][:n] = lens
        h["kv_last_page_len"][:n] = offset + 1
        for name, value in (("input_ids", 0), ("positions", 0), ("slot_mapping", SCRATCH_PAGE * ps),
                            ("kv_lens", 1), ("kv_last_page_len", 1)):
            h[name][n:rows] = value
        tables2d = h["block_tables"].reshape(self.max_batch, self.max_pages)
        # clear this fill's extent and the last one's: then nothing outside the current extent is stale
        tables2d[:max(rows, self._rows), :max(widest, self._widest)] = SCRATCH_PAGE
        row_of = np.repeat(np.arange(n), counts)
        tables2d[row_of, np.arange(nnz) - np.repeat(indptr[:n], counts)] = pages[:nnz]
        self._rows, self._real, self._nnz, self._widest = rows, n, nnz, widest

    def set_input_ids(self, token_ids: torch.Tensor) -> None:
        """Overwrite the first len(token_ids) ids on the device, after `upload` (in stream order): a step
        fed the previous step's sampled ids without their trip through the host."""
        self.d["input_ids"][:token_ids.shape[0]].copy_(token_ids)

    @property
    def rows(self) -> int:
        """Rows of the last fill (real sequences + padding)."""
        return self._rows

    def upload(self) -> None:
        """Send what fill wrote to the device (asynchronously, in stream order)."""
        if self._copied is None:
            return
        used = self._kv_indices_offset + (self._nnz + self._rows - self._real) * 4
        self._dev[:used].copy_(self._host[:used], non_blocking=True)
        self._copied.record()

    def batch(self, rows: int, full_tables: bool = False) -> tuple[torch.Tensor, AttentionMetadata]:
        """(input_ids, metadata) views of the first `rows` rows. full_tables: block tables max_pages wide and
        max_kv_len at its bound (fixed shapes for graph capture); else as wide as the last fill needs."""
        d, p = self.d, self.max_pages
        width = p if full_tables else max(1, self._widest)
        meta = AttentionMetadata(
            is_prefill=False,
            slot_mapping=d["slot_mapping"][:rows],
            positions=d["positions"][:rows],
            qo_indptr=d["qo_indptr"][:rows + 1],
            kv_indptr=d["kv_indptr"][:rows + 1],
            kv_indices=d["kv_indices"][:rows * p] if full_tables else d["kv_indices"][:self._nnz + rows - self._real],
            kv_last_page_len=d["kv_last_page_len"][:rows],
            kv_lens=d["kv_lens"][:rows],
            block_tables=d["block_tables"].view(self.max_batch, p)[:rows, :width],
            max_q_len=1,
            # a fixed bound, in eager and graph runs alike: it sizes the split-KV grid, and the same split
            # count keeps a graph replay bit-identical to the eager step
            max_kv_len=p * self.page_size,
        )
        return d["input_ids"][:rows], meta
