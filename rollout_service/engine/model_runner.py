"""Turns a scheduled batch into model inputs + paged-attention metadata, runs the forward, returns logits.

Decode steps fill one DecodeInputs (one host-to-device copy) and replay a captured CUDA graph when one
fits, else run eagerly on the same inputs. Prefill steps build their metadata with make_metadata. Only
the rows that sample a next token (a sequence's last computed position) reach the LM head; a scoring
sequence's rows come back as hidden states, for engine/scoring.py to take through the LM head in slices.
"""
from __future__ import annotations

import logging
import time
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch

from rollout_service.engine.decode_inputs import DecodeInputs
from rollout_service.engine.kv_cache import KVCache, pages_for
from rollout_service.engine.scheduler import Batch
from rollout_service.engine.scoring import score_positions
from rollout_service.engine.sequence import Sequence
from rollout_service.ops.attention import AttentionMetadata, make_metadata
from rollout_service.ops.cpu_threads import CpuThreads

log = logging.getLogger(__name__)


@dataclass
class Prefilled:
    logits: torch.Tensor | None        # float32 [sequences that complete, V] (None if none do)
    score_hidden: torch.Tensor | None  # [scored positions, H] in batch order (None if none)


class ModelRunner:
    def __init__(self, model: torch.nn.Module, kv: KVCache, device: torch.device, max_model_len: int,
                 max_rows: int, use_cuda_graphs: bool = False, cuda_graph_max_batch: int = 256):
        """max_rows: the most rows a decode step has (a sequence each, or a verify step's row per token)."""
        self.model = model
        self.kv = kv
        self.device = device
        self.page_size = kv.page_size
        self.max_pages_per_seq = pages_for(max_model_len, kv.page_size)
        self.decode_inputs = DecodeInputs(max_rows, self.max_pages_per_seq, self.page_size, device)
        self.graph_max_batch = min(cuda_graph_max_batch, max_rows) if use_cuda_graphs and device.type == "cuda" else 0
        self.graphs = None
        self.capture_s = 0.0  # wall time of the last capture: paid at start-up and on every wake
        # a CPU engine's thread count follows how busy the machine is (ops/cpu_threads.py)
        self.cpu_threads = CpuThreads() if device.type == "cpu" else None
        self.capture_graphs()

    @property
    def verify_rows(self) -> int:
        """The most rows a speculative verify step may have: the largest captured graph's where graphs run (past
        it a verify step runs eagerly: on an H100, SmolLM2's 320-row verify steps at batch 64 cost ~20 graphed
        steps each and halved that batch's speed), else every row a decode step has."""
        return self.graph_max_batch or self.decode_inputs.max_batch

    def threads(self) -> AbstractContextManager[None]:
        """Around one engine step: a CPU engine's thread count for it (ops/cpu_threads.py); nothing on a GPU."""
        return self.cpu_threads.step() if self.cpu_threads is not None else nullcontext()

    def capture_graphs(self) -> None:
        """Capture the decode graphs (at start-up, and on wake: they hold pointers into weights and KV)."""
        if not self.graph_max_batch:
            return
        t0 = time.perf_counter()
        try:
            from rollout_service.engine.cuda_graph import CudaGraphRunner
            runner = CudaGraphRunner(self._decode_logits, self.decode_inputs, self.graph_max_batch)
            runner.capture(warm_every_bucket=not self.capture_s)
            self.graphs = runner
            self.capture_s = time.perf_counter() - t0
        except Exception as e:  # a failed capture costs speed, never correctness
            log.warning("CUDA graph capture failed, decoding eagerly: %s", e)
            self.graphs = None

    def drop_graphs(self) -> None:
        """Free the graphs and their memory pool (sleep)."""
        self.graphs = None

    def _decode_logits(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.model.compute_logits(self.model(input_ids, meta.positions, self.kv.layers, meta))

    @torch.inference_mode()
    def prefill(self, batch: Batch) -> Prefilled:
        """Forward one prefill step: logits of the sequences that complete, hidden states of scored positions."""
        if self.cpu_threads is not None:
            self.cpu_threads.tick()
        input_ids, meta, sample_rows, score_rows = self._prepare_prefill(batch)
        hidden = self.model(input_ids, meta.positions, self.kv.layers, meta)
        logits = self.model.compute_logits(_take(hidden, sample_rows)) if sample_rows else None
        return Prefilled(logits, _take(hidden, score_rows) if score_rows else None)

    @torch.inference_mode()
    def decode(self, batch: Batch, input_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Forward one decode step; float32 logits, one row per sequence.

        input_ids: the step runs one token ahead of what the sequences have recorded, its query ids the
        previous step's sampled ids, still on the device."""
        if batch.is_prefill:
            raise ValueError("ModelRunner.decode: given a prefill batch")
        return self._decode(batch, input_ids)

    @torch.inference_mode()
    def verify(self, seqs: list[Sequence], drafts: list[list[int]]) -> torch.Tensor:
        """Forward each running sequence's last token and its draft (engine/speculation.py): float32 logits,
        len(drafts[b]) + 1 rows per sequence, row j predicting the token after draft[:j]. Each row is a decode
        row of its own (the sequence's pages, its length up to that token): a decode step writes every row's
        K/V before any row attends, so row j sees the draft before it. So a verify step is a decode step of
        more rows, in the same CUDA graphs and with the same arithmetic per row. The sequences' pages cover
        their tokens and drafts."""
        tables, tokens, lengths = [], [], []
        for seq, draft in zip(seqs, drafts):
            n = seq.num_tokens
            tables += [seq.pages] * (len(draft) + 1)
            tokens += [seq.last_token] + draft
            lengths += range(n, n + len(draft) + 1)
        return self._decode_rows(tables, tokens, lengths)

    def _decode(self, batch: Batch, input_ids: torch.Tensor | None) -> torch.Tensor:
        seqs = batch.seqs
        n = len(seqs)
        ahead = input_ids is not None
        if ahead and input_ids.shape != (n,):
            raise ValueError(f"input_ids must have shape ({n},), got {tuple(input_ids.shape)}")
        last = [0] * n if ahead else [s.last_token for s in seqs]  # ahead: the ids follow on the device
        return self._decode_rows([s.pages for s in seqs], last, [s.num_tokens + ahead for s in seqs], input_ids)

    def _decode_rows(self, tables: list[list[int]], tokens: list[int], lengths: list[int],
                     input_ids: torch.Tensor | None = None) -> torch.Tensor:
        """One query per row: row r is the token at position lengths[r] - 1 of a sequence whose KV lives in
        tables[r]. A captured graph runs it when one fits."""
        if self.cpu_threads is not None:
            self.cpu_threads.tick()
        n = len(lengths)
        graph = self.graphs is not None and self.graphs.can_run(n)
        rows = self.graphs.bucket(n) if graph else n
        inputs = self.decode_inputs
        inputs.fill(tables, tokens, lengths, rows)
        inputs.upload()
        if input_ids is not None:
            inputs.set_input_ids(input_ids)
        if graph:
            return self.graphs.run(n)
        return self._decode_logits(*inputs.batch(n))

    def _prepare_prefill(self, batch: Batch) -> tuple[torch.Tensor, AttentionMetadata, list[int], list[int]]:
        ps = self.page_size
        tokens, page_tables, q_lens, kv_lens, sample_rows, score_rows = [], [], [], [], [], []
        for i, seq in enumerate(batch.seqs):
            start, end = seq.num_computed, seq.num_computed + batch.chunk_lens[i]
            offset = len(tokens) - start
            tokens += seq.token_slice(start, end)
            page_tables.append(seq.pages[:pages_for(end, ps)])
            q_lens.append(end - start)
            kv_lens.append(end)
            score_rows += [offset + p for p in score_positions(seq, start, end)]
            if batch.completes[i] and seq.score_from is None:
                sample_rows.append(len(tokens) - 1)
        meta = make_metadata(page_tables, q_lens, kv_lens, ps, True, self.device)
        return torch.tensor(tokens, dtype=torch.int64, device=self.device), meta, sample_rows, score_rows


def _take(hidden: torch.Tensor, rows: list[int]) -> torch.Tensor:
    if len(rows) == hidden.shape[0]:
        return hidden
    return hidden[torch.tensor(rows, device=hidden.device)]
