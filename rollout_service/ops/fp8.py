"""FP8 products, the reference arithmetic: float8 e4m3 operands with float32 scales, products accumulated in
float32, the result rounded once to the model dtype — what cuBLASLt's FP8 GEMM computes with per-token
activation scales and per-output-channel weight scales. The torch backend runs it as written (so the CPU
tests pin the semantics); a GPU backend computes the same with FP8 tensor cores.

Scaling: each row (a token's activations, a weight's output channel) is divided by amax / 448, which maps its
largest magnitude to e4m3's largest finite value, then rounded to e4m3 (3 mantissa bits: a relative error of
at most 2^-4 per element, more for values near e4m3's subnormals).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 [R, C], float32 scales [R]) of x [R, C]: x[r] ~= q[r] * scale[r]. An all-zero row gets scale 1."""
    amax = x.detach().abs().amax(dim=-1).float()
    # a tensor divisor: torch's CUDA division by a Python scalar multiplies by its reciprocal (not always the
    # IEEE quotient), which would make the reference differ between devices
    scale = torch.where(amax > 0, amax / torch.full_like(amax, E4M3_MAX), torch.ones_like(amax))
    q = (x.detach().float() / scale.unsqueeze(-1)).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return q, scale


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale.unsqueeze(-1)


@dataclass
class Fp8Rows:
    """Activations already quantized for an FP8 product (by a norm or SiLU·mul that ended in the quantization):
    q [T, K] e4m3, scale [T] float32, and the model dtype the product rounds to."""

    q: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype

    @classmethod
    def of(cls, x: torch.Tensor) -> "Fp8Rows":
        return cls(*quantize_rows(x), x.dtype)

    @property
    def shape(self) -> torch.Size:
        return self.q.shape


def linear(x: "torch.Tensor | Fp8Rows", weight: torch.Tensor, weight_scale: torch.Tensor,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, K] (model dtype, or already quantized) times an e4m3 weight [N, K] with per-output-channel scales
    [N]: x is quantized per token, the e4m3 products summed in float32 and scaled, plus the bias, rounded once
    to the model dtype."""
    rows = x if isinstance(x, Fp8Rows) else Fp8Rows.of(x)
    y = F.linear(rows.q.float(), weight.float()) * rows.scale.unsqueeze(-1) * weight_scale
    if bias is not None:
        y = y + bias.float()
    return y.to(rows.dtype)
