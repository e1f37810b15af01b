"""float32 products on the CPU through oneDNN (torch's mkldnn backend), with weights kept in its packed layout.

`F.linear` on the CPU calls MKL's sgemm, which repacks the weight at every call. oneDNN with the weight packed
once is much faster for an engine's shapes. Measured on a 2-core AMD EPYC (AVX-512, torch 2.13), SmolLM2-135M:
- a decode step's products at 32 rows: 50 ms against MKL's 88 ms (the LM head 9.5 ms against 22.9 ms);
- at 1 row: 22.5 ms against 44 ms;
- a 4096-token prefill's: 4.3 s against 4.7 s.

It is the same product (x @ weight.T + bias, float32 accumulation) summed in another order, as any two GEMM
libraries sum it: the torch reference's semantics are unchanged, only its rounding moves. The packed copy costs
the weight's memory a second time. It is made again whenever the weight changes: a refresh writes in place,
which bumps the tensor's version counter, and re-pointed storage changes its address. Autograd, other dtypes and
inference-tensor weights (no version counter to watch) keep F.linear. A product's bits depend on the row count
only through whole 16-row tiles (ops/invariant.py checks this before it relies on it).
"""
from __future__ import annotations

import os
import weakref
from typing import NamedTuple

import torch
import torch.nn.functional as F

# Two caches keep a oneDNN primitive per product shape, 1024 each by default: ideep's (torch's oneDNN layer) and
# oneDNN's own. A prefill's row count is a new shape nearly every time, and with on_refresh="recompute" every
# refresh prefills every sequence in flight again: resident memory grew ~0.6 MiB a refresh over 400 refreshes
# (issue 45, item 5). With 128 of each it is flat after ~100 (a decode step uses a handful of shapes). Both are
# read at the process's first oneDNN op, so this must run before one; a value the user set is kept.
for _cache_size in ("LRU_CACHE_CAPACITY", "ONEDNN_PRIMITIVE_CACHE_CAPACITY"):
    os.environ.setdefault(_cache_size, "128")

_ONEDNN = (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
           and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))
_PACK_ROWS = 32  # oneDNN's row-count hint for the packed layout: as fast as an exact hint from 1 to 4096 rows


class _Packed(NamedTuple):
    key: tuple                      # the weight's storage address, view and version when packed
    storage: torch.UntypedStorage   # held, so that no other weight can take its address meanwhile
    packed: torch.Tensor            # oneDNN's layout of the weight's rows


_cache: dict[int, dict[tuple[int, int], _Packed]] = {}  # id(weight) -> row range -> its packed copy


def applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """True where linear() takes oneDNN: float32 CPU tensors that need no gradient, the weight not an inference
    tensor."""
    return (_ONEDNN and x.device.type == "cpu" and x.dtype == torch.float32 and weight.dtype == torch.float32
            and x.dim() >= 2 and weight.dim() == 2 and not weight.is_inference()
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias): oneDNN's matmul where applies(), else F.linear."""
    if not applies(x, weight):
        return F.linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, _packed(weight), bias, "none", [], "")


def gated_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """silu(x @ gate.T) * (x @ up.T) for a fused weight [2I, H] (the gate rows, then the up rows), where applies().

    Two products whose epilogues apply the silu and the product, instead of one product and two passes over its
    [T, 2I] output: a 4096-token prefill layer of SmolLM2 72 ms against 100 ms."""
    half = weight.shape[0] // 2
    gate = torch.ops.mkldnn._linear_pointwise(x, _packed(weight, (0, half)), None, "swish", [], "")
    return torch.ops.mkldnn._linear_pointwise.binary(x, gate, _packed(weight, (half, 2 * half)), None, "mul")


def _packed(weight: torch.Tensor, rows: tuple[int, int] | None = None) -> torch.Tensor:
    """The packed copy of weight[rows[0]:rows[1]] (all rows by default), made again when the weight changed."""
    rows = rows or (0, weight.shape[0])
    storage = weight.untyped_storage()
    key = (storage.data_ptr(), weight.storage_offset(), tuple(weight.shape), weight.stride(), weight._version)
    parts = _cache.get(id(weight))
    if parts is None:
        parts = _cache[id(weight)] = {}
        weakref.finalize(weight, _cache.pop, id(weight), None)
    entry = parts.get(rows)
    if entry is not None and entry.key == key:
        return entry.packed
    packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach()[rows[0]:rows[1]].contiguous(), _PACK_ROWS)
    parts[rows] = _Packed(key, storage, packed)
    return packed
