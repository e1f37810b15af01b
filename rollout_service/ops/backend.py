"""The one place an ops backend is chosen: "torch" (reference, any device) or "cuda" (csrc kernels)."""
from __future__ import annotations

import logging

import torch

from rollout_service.config import OPS_BACKENDS
from rollout_service.ops.interface import Ops
from rollout_service.ops.cpu_ops import CpuOps

logger = logging.getLogger(__name__)


def select_ops(backend: str, exact_prefill_attention: bool = False, batch_invariant: bool = False) -> Ops:
    """The Ops object for a concrete backend name. exact_prefill_attention: the CUDA prefill kernel keeps P
    to float32 precision in P·V (slower) instead of rounding it to the model dtype as flash attention does;
    the torch reference is exact either way. batch_invariant: the backend's batch-invariant ops (a token's
    numbers never depend on its batch mates): ops/invariant.py (torch) or ops/invariant_cuda.py (cuda)."""
    if batch_invariant and backend == "torch":
        from rollout_service.ops.invariant import InvariantOps

        return InvariantOps()
    if backend == "torch":
        return CpuOps()  # the reference, with the CPU's own paths for CPU tensors (ops/cpu_ops.py)
    if backend == "cuda":
        try:
            from rollout_service.ops.cuda_ops import CudaOps
        except ImportError as exc:
            raise ValueError(f"backend 'cuda' is unavailable: cannot import rollout_service.ops.cuda_ops ({exc})") from exc
        if batch_invariant:
            from rollout_service.ops.invariant_cuda import CudaInvariantOps

            return CudaInvariantOps()
        return CudaOps(exact_prefill_attention)
    raise ValueError(f"unknown ops backend {backend!r}; choose one of {OPS_BACKENDS} (or 'auto' via resolve_backend)")


def resolve_backend(backend: str, device: torch.device | str) -> str:
    """Turn "auto" into "cuda" when the device is a GPU and the kernels load, else "torch"; check the rest."""
    device_type = torch.device(device).type
    if backend == "auto":
        if device_type != "cuda" or not torch.cuda.is_available():
            return "torch"
        try:
            select_ops("cuda")
        except (ValueError, RuntimeError, OSError) as exc:  # a failed kernel build must not stop the service
            logger.warning("CUDA kernels unavailable, falling back to the torch backend: %s", exc)
            return "torch"
        return "cuda"
    if backend not in OPS_BACKENDS:
        raise ValueError(f"unknown ops backend {backend!r}; choose one of {OPS_BACKENDS} or 'auto'")
    if backend == "cuda" and device_type != "cuda":
        raise ValueError(f"backend 'cuda' needs a CUDA device, got device {str(device)!r}")
    return backend
