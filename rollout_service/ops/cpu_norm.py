"""RMSNorm, with the residual add before it, in one C pass per row on the CPU (csrc/cpu_norm.c): the torch
reference's arithmetic (ops/norm.py) with the sum of squares in another order."""
from __future__ import annotations

import torch

from rollout_service.ops import cpu_ext


def applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return weight.dim() == 1 and x.shape[-1] == weight.shape[0] and x.numel() > 0 and cpu_ext.takes(x, weight)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(rms_norm(x + residual), x + residual), or (rms_norm(x), None) without a residual; x [..., H]."""
    x, weight = x.contiguous(), weight.contiguous()  # (a per-head norm gets a strided view: copied)
    out = torch.empty_like(x)
    new_residual = None
    if residual is not None:
        residual = residual.contiguous()
        new_residual = torch.empty_like(x)
    cpu_ext.load().rs_add_rms_norm(
        x.data_ptr(), None if residual is None else residual.data_ptr(), weight.data_ptr(), eps, out.data_ptr(),
        None if new_residual is None else new_residual.data_ptr(), x.numel() // x.shape[-1], x.shape[-1],
        torch.get_num_threads())
    return out, new_residual
