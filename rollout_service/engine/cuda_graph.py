"""Decode-step CUDA graphs, one per padded batch bucket, sharing one memory pool.

The graphs are captured on the fixed device views of a DecodeInputs, so a step is: fill + upload the
inputs (one copy, padded to the bucket), replay, read the first B rows of the captured output. The
captured forward ends at the logits; sampling stays outside the graph.
"""
from __future__ import annotations

import logging
import threading
from typing import Callable

import torch

from rollout_service.engine.decode_inputs import SCRATCH_PAGE, DecodeInputs
from rollout_service.ops.attention import AttentionMetadata

logger = logging.getLogger(__name__)

DecodeForward = Callable[[torch.Tensor, AttentionMetadata], torch.Tensor]

# One side stream per device for every warm-up and capture in the process, and one capture at a time on it:
# cuBLAS keeps a workspace (32 MiB on Hopper) per stream it has seen until the process ends, so a stream per
# capture would leave one behind for every engine built (and per bucket, ~35 of them per engine).
_capture_lock = threading.Lock()
_capture_streams: dict[int, torch.cuda.Stream] = {}


def _capture_stream(device: torch.device) -> torch.cuda.Stream:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _capture_streams:
        _capture_streams[index] = torch.cuda.Stream(index)
    return _capture_streams[index]


def batch_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to max_batch (which is always included)."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    buckets = [b for b in (1, 2, 4) if b < max_batch] + list(range(8, max_batch, 8))
    return buckets + [max_batch]


class CudaGraphRunner:
    def __init__(self, forward: DecodeForward, inputs: DecodeInputs, max_batch: int) -> None:
        """forward(input_ids [B], meta) -> output [B, ...] is what each graph captures."""
        if not 1 <= max_batch <= inputs.max_batch:
            raise ValueError(f"max_batch {max_batch} must be in 1..{inputs.max_batch} (the inputs' rows)")
        self.forward = forward
        self.inputs = inputs
        self.max_batch = max_batch
        self.buckets = batch_buckets(max_batch)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.disabled = False

    @torch.inference_mode()
    def capture(self, warm_every_bucket: bool = True) -> None:
        """Capture every bucket, largest first so smaller graphs reuse the pool; on failure run eager.
        A recapture (after sleep) warms up the largest bucket only: every kernel and shape has run before,
        so only the freed workspaces need to come back outside a capture."""
        with _capture_lock:
            self._capture_all(warm_every_bucket)

    def _capture_all(self, warm_every_bucket: bool) -> None:
        try:
            pool = None
            device = self.inputs.device
            stream = _capture_stream(device)
            for bs in reversed(self.buckets):
                # every row a 1-token sequence on the scratch page: capture writes K/V nowhere that matters
                self.inputs.fill([[SCRATCH_PAGE]], [0], [1], rows=bs)
                self.inputs.upload()
                input_ids, meta = self.inputs.batch(bs, full_tables=True)
                stream.wait_stream(torch.cuda.current_stream(device))
                with torch.cuda.stream(stream):  # warm-up: lazy inits and allocator growth happen outside capture
                    for _ in range(2 if warm_every_bucket else int(bs == self.max_batch)):
                        self.forward(input_ids, meta)
                torch.cuda.current_stream(device).wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    out = self.forward(input_ids, meta)
                pool = graph.pool()
                self.graphs[bs], self.outputs[bs] = graph, out
            torch.cuda.synchronize(device)
            logger.info("captured decode CUDA graphs for batch sizes %s", self.buckets)
        except Exception as exc:  # a graph is an optimisation: fall back to eager, loudly
            logger.warning("CUDA graph capture failed, decoding eagerly: %s", exc)
            self.graphs.clear()
            self.outputs.clear()
            self.disabled = True

    def can_run(self, batch_size: int) -> bool:
        return not self.disabled and bool(self.graphs) and 1 <= batch_size <= self.max_batch

    def bucket(self, batch_size: int) -> int:
        """The captured batch size a batch of batch_size runs in (fill the inputs with this many rows)."""
        if not self.can_run(batch_size):
            raise ValueError(f"no captured graph for batch size {batch_size} "
                             f"(max {self.max_batch}, disabled={self.disabled})")
        return next(b for b in self.buckets if b >= batch_size)

    def run(self, batch_size: int) -> torch.Tensor:
        """Replay on the uploaded inputs (filled with bucket(batch_size) rows); the first batch_size output rows."""
        bs = self.bucket(batch_size)
        if self.inputs.rows != bs:
            raise ValueError(f"the inputs hold {self.inputs.rows} rows; batch size {batch_size} runs in {bs}")
        self.graphs[bs].replay()
        return self.outputs[bs][:batch_size]
