"""What the router passes on of a refresh, without the bytes: the manifest (where each tensor lies in the buckets,
buckets.py), a delta's plan (how each bucket is sent, delta.py) and the spec of a broadcast's weight group
(group.py).

Plain data and no torch: the router unpickles these on their way to the workers, and a router that imported torch
would pay ~1.5 s of CPU and ~180 MB resident in each process for nothing.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: str          # torch dtype name, e.g. "bfloat16"
    shape: tuple[int, ...]
    bucket: int
    offset: int
    nbytes: int

    def torch_dtype(self) -> "torch.dtype":
        import torch  # here, not at the top: the router unpickles manifests and must not pay for torch

        dtype = getattr(torch, self.dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"update_weights: {self.name!r} has unknown dtype {self.dtype!r}")
        return dtype


@dataclass(frozen=True)
class Manifest:
    """Where each tensor of a refresh lives in the buckets. Equal manifests share one set of buffers."""

    entries: tuple[TensorEntry, ...]
    bucket_sizes: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return sum(self.bucket_sizes)

    def names(self) -> list[str]:
        return [e.name for e in self.entries]


@dataclass(frozen=True)
class SparseTensor:
    """One tensor's changed elements inside a sparse bucket."""
    entry: int      # the tensor's index in manifest.entries
    count: int      # changed elements (width 0: all of them)
    width: int      # bytes per position code: 1 or 2; 0: the tensor whole, no codes
    codes: int      # position codes (count + escapes)
    codes_at: int   # byte offset of the codes in the bucket
    values_at: int  # byte offset of the values: raw (engine dtype), or steps from the base (delta_values.py)
    steps: bool = False
    raws: int = 0   # steps only: the values sent raw after them (escapes)


@dataclass(frozen=True)
class BucketCode:
    nbytes: int                                 # the bucket's bytes as sent
    sparse: tuple[SparseTensor, ...] | None = None  # None: the dense bytes; tensors not listed are unchanged


@dataclass(frozen=True)
class DeltaPlan:
    """What a delta payload adds to the dense manifest: its base version and how each bucket is sent."""
    base_version: int
    buckets: tuple[BucketCode, ...]
    checked: bool = True  # the receiver checks every value (False: the learner pushed with check_finite=False)

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buckets)

    @property
    def all_dense(self) -> bool:
        return all(b.sparse is None for b in self.buckets)

    def wire_manifest(self) -> Manifest:
        """The buckets as sent (no entries): how a receiver sizes the buffers the bytes arrive in."""
        return Manifest((), tuple(b.nbytes for b in self.buckets))


@dataclass(frozen=True)
class GroupSpec:
    """What every member needs to join: picklable, sent to the workers through the router."""

    group_id: str
    host: str
    port: int
    world_size: int
    backend: str
    timeout_s: float
