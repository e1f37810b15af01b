"""FP8 products, the reference arithmetic: float8 e4m3 operands with float32 scales, products accumulated in
float32, the result rounded once to the model dtype — what cuBLASLt's FP8 GEMM computes with per-token
activation scales and per-output-channel weight scales. The torch backend runs it as written (so the CPU
tests pin the semantics); a GPU backend computes the same with FP8 tensor cores.

Scaling: each row (a token's activations, a weight's output channel) is divided by amax / 448, which maps its
largest magnitude to e4m3's largest finite value, then rounded to e4m3 (3 mantissa bits: a relative error of
at most 2^-4 per element, more for values near e4m3's subnormals).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 [R, C], float32 scales [R]) of x [R, C]: x[r] ~= q[r] * scale[r]. An all-zero row gets scale 1."""
    amax = x.detach().abs().amax(dim=-1).float()
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    q = (x.detach().float() / scale.unsqueeze(-1)).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return q, scale


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale.unsqueeze(-1)


def linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, K] (model dtype) times an e4m3 weight [N, K] with per-output-channel scales [N]: x is quantized per
    token, the e4m3 products summed in float32 and scaled, plus the bias, rounded once to x's dtype."""
    qx, x_scale = quantize_rows(x)
    y = F.linear(qx.float(), weight.float()) * x_scale.unsqueeze(-1) * weight_scale
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
