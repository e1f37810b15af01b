"""Host <-> device transfers that never wait for the GPU.

With overlapped decode the stream holds the next step's forward while the host prepares and reads. A plain
torch.tensor(list, device="cuda") or .tolist() of a CUDA tensor synchronises with the stream, i.e. waits for
everything queued, which would undo the overlap. Here small host values go through pinned memory with an
asynchronous copy, and a step's outputs are copied out right behind its sampler with an event to wait on.
"""
from __future__ import annotations

from dataclasses import fields, replace
from typing import Any

import torch


def to_device(values: Any, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """torch.tensor(values) on `device`, without a stream synchronisation on CUDA."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def copy_to_host(out: Any) -> tuple[Any, torch.cuda.Event | None]:
    """A dataclass of tensors (or None) copied to pinned host memory behind the work queued so far, and the
    event that marks the copy done (None off CUDA, where `out` itself is returned)."""
    first = next(getattr(out, f.name) for f in fields(out))
    if first.device.type != "cuda":
        return out, None

    def pinned(t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None:
            return None
        return torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)

    host = replace(out, **{f.name: pinned(getattr(out, f.name)) for f in fields(out)})
    copied = torch.cuda.Event()
    copied.record()
    return host, copied
