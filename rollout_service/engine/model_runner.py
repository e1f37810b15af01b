"""Turns a scheduled batch into model inputs + paged-attention metadata, runs the forward, returns logits.

Decode batches go through a captured CUDA graph when one fits; everything else runs eagerly. Only the
rows that sample a next token (a sequence's last computed position) reach the LM head.
"""
from __future__ import annotations

import logging

import torch

from rollout_service.engine.kv_cache import KVCache, pages_for
from rollout_service.engine.scheduler import Batch
from rollout_service.ops.attention import AttentionMetadata, make_metadata

log = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, model: torch.nn.Module, kv: KVCache, device: torch.device, max_model_len: int,
                 use_cuda_graphs: bool = False, cuda_graph_max_batch: int = 256):
        self.model = model
        self.kv = kv
        self.device = device
        self.page_size = kv.page_size
        self.max_pages_per_seq = pages_for(max_model_len, kv.page_size)
        self.graphs = None
        if use_cuda_graphs and device.type == "cuda":
            self.graphs = self._capture_graphs(cuda_graph_max_batch)

    def _capture_graphs(self, max_batch: int):
        try:
            from rollout_service.engine.cuda_graph import CudaGraphRunner
            runner = CudaGraphRunner(self.model, self.kv.layers, max_batch, self.max_pages_per_seq, self.page_size,
                                     self.device, self.kv.layers[0].dtype)
            runner.capture()
            return runner
        except Exception as e:  # a failed capture costs speed, never correctness
            log.warning("CUDA graph capture failed, decoding eagerly: %s", e)
            return None

    @torch.inference_mode()
    def run(self, batch: Batch) -> torch.Tensor | None:
        """Forward one step; returns float32 logits for the sequences that complete (None if none do)."""
        input_ids, meta, sample_rows = self._prepare(batch)
        if not batch.is_prefill and self.graphs is not None and self.graphs.can_run(len(batch.seqs)):
            hidden = self.graphs.run(input_ids, meta.positions, meta)
        else:
            hidden = self.model(input_ids, meta.positions, self.kv.layers, meta)
        if not sample_rows:
            return None
        if len(sample_rows) != hidden.shape[0]:
            hidden = hidden[torch.tensor(sample_rows, device=hidden.device)]
        return self.model.compute_logits(hidden)

    def _prepare(self, batch: Batch) -> tuple[torch.Tensor, AttentionMetadata, list[int]]:
        ps = self.page_size
        tokens, page_tables, q_lens, kv_lens, sample_rows = [], [], [], [], []
        for i, seq in enumerate(batch.seqs):
            start = seq.num_computed if batch.is_prefill else seq.num_tokens - 1
            end = start + batch.chunk_lens[i] if batch.is_prefill else seq.num_tokens
            tokens += [seq.token_at(pos) for pos in range(start, end)]
            page_tables.append(seq.pages[:pages_for(end, ps)])
            q_lens.append(end - start)
            kv_lens.append(end)
            if batch.completes[i]:
                sample_rows.append(len(tokens) - 1)
        meta = make_metadata(page_tables, q_lens, kv_lens, ps, batch.is_prefill, self.device)
        return torch.tensor(tokens, dtype=torch.int64, device=self.device), meta, sample_rows
