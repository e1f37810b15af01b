"""Weight refresh transports: how a learner's state dict reaches every rollout worker.

Tensors are packed into a few large byte buckets (never one transfer per parameter) plus a small
index of (name, dtype, shape, bucket, offset). The object-store transport puts the packed buckets once
with `ray.put`; every worker on a node then maps the same shared-memory copy and unpacks zero-copy
views, which the engine copies into its parameters. CUDA IPC / NCCL transports can reuse the same
bucket layout: only `publish` / `fetch` change.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Iterable, Iterator, Mapping, Union

import numpy as np
import torch

NamedTensors = Union[Mapping[str, torch.Tensor], Iterable[tuple[str, torch.Tensor]]]
DEFAULT_BUCKET_BYTES = 256 << 20
_ALIGN = 64  # every tensor starts on a 64-byte boundary so views are aligned for any dtype


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: str          # torch dtype name, e.g. "bfloat16"
    shape: tuple[int, ...]
    bucket: int
    offset: int
    nbytes: int


@dataclass
class PackedWeights:
    """A state dict as a few contiguous uint8 buckets + an index; cheap to put in the object store."""

    entries: list[TensorEntry]
    buckets: list[np.ndarray]

    @property
    def nbytes(self) -> int:
        return sum(int(b.nbytes) for b in self.buckets)

    def names(self) -> list[str]:
        return [e.name for e in self.entries]


def named_items(named_tensors: NamedTensors) -> list[tuple[str, torch.Tensor]]:
    """Normalise a dict / iterable of pairs, rejecting anything that is not (str, Tensor)."""
    if isinstance(named_tensors, PackedWeights):
        return list(unpack(named_tensors))
    items = list(named_tensors.items()) if isinstance(named_tensors, Mapping) else None
    if items is None:
        try:
            items = [(n, t) for n, t in named_tensors]
        except (TypeError, ValueError):
            raise ValueError("update_weights: expected a dict or an iterable of (name, tensor) pairs") from None
    for name, t in items:
        if not isinstance(name, str):
            raise ValueError(f"update_weights: parameter name {name!r} is not a string")
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"update_weights: {name!r} is a {type(t).__name__}, not a torch.Tensor")
    if not items:
        raise ValueError("update_weights: no tensors given")
    return items


def _plan(items: list[tuple[str, torch.Tensor]], bucket_bytes: int) -> list[list[int]]:
    """Group tensor indices into buckets of about `bucket_bytes` (a larger tensor gets its own)."""
    groups: list[list[int]] = [[]]
    size = 0
    for i, (_, t) in enumerate(items):
        n = t.numel() * t.element_size()
        if groups[-1] and size + n > bucket_bytes:
            groups.append([])
            size = 0
        groups[-1].append(i)
        size += -(-n // _ALIGN) * _ALIGN
    return groups


def pack(named_tensors: NamedTensors, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> PackedWeights:
    """Copy tensors (any device) into CPU byte buckets. Tied aliases are packed once per name."""
    if bucket_bytes < 1:
        raise ValueError(f"pack: bucket_bytes={bucket_bytes!r} must be >= 1")
    items = named_items(named_tensors)
    entries: list[TensorEntry] = []
    buckets: list[np.ndarray] = []
    for b, group in enumerate(_plan(items, bucket_bytes)):
        offsets, total = [], 0
        for i in group:
            offsets.append(total)
            t = items[i][1]
            total += -(-(t.numel() * t.element_size()) // _ALIGN) * _ALIGN
        buf = np.zeros(max(total, 1), dtype=np.uint8)
        flat = torch.from_numpy(buf)
        for i, off in zip(group, offsets):
            name, t = items[i]
            t = t.detach()
            n = t.numel() * t.element_size()
            if n:
                flat[off:off + n].copy_(t.contiguous().reshape(-1).view(torch.uint8).cpu())
            entries.append(TensorEntry(name, str(t.dtype).removeprefix("torch."), tuple(t.shape), b, off, n))
        buckets.append(buf)
    return PackedWeights(entries, buckets)


def unpack(packed: PackedWeights) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) views into the buckets (no copy; read-only when the buckets come from the
    object store, so consumers must copy, as Engine.update_weights does)."""
    if not isinstance(packed, PackedWeights):
        raise ValueError(f"unpack: expected PackedWeights, got {type(packed).__name__}")
    for e in packed.entries:
        dtype = getattr(torch, e.dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"update_weights: {e.name!r} has unknown dtype {e.dtype!r}")
        raw = packed.buckets[e.bucket][e.offset:e.offset + e.nbytes]
        with warnings.catch_warnings():  # object-store buffers are read-only; we never write to them
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.frombuffer(raw, dtype=torch.uint8) if e.nbytes else torch.empty(0, dtype=torch.uint8)
        yield e.name, flat.view(dtype).reshape(e.shape)


def publish(named_tensors: NamedTensors, bucket_bytes: int = DEFAULT_BUCKET_BYTES):
    """Object-store transport, learner side: pack and `ray.put` once. Returns the ObjectRef."""
    import ray
    return ray.put(pack(named_tensors, bucket_bytes))


def fetch(packed_or_named) -> list[tuple[str, torch.Tensor]]:
    """Object-store transport, worker side: Ray has already resolved the ref to PackedWeights."""
    if isinstance(packed_or_named, PackedWeights):
        return list(unpack(packed_or_named))
    return named_items(packed_or_named)
