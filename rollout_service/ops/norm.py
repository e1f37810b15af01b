"""RMSNorm with HF Llama semantics: normalise in float32, cast back, then scale by the weight."""
from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * (x / rms(x)) over the last dim; x may be [..., H] (e.g. per-head [T, heads, D])."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual): the residual add of one block fused with the next norm."""
    new_residual = x + residual
    return rms_norm(new_residual, weight, eps), new_residual
