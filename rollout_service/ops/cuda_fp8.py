"""FP8 products on the cuda backend: the e4m3 GEMM of torch._scaled_mm (cuBLASLt / CUTLASS on Hopper) with one
float32 scale per activation row and one per weight channel, the semantics of ops/fp8.py's product; a batch-1
row through our weight-streaming kernel instead (csrc/gemv.cu's gemv_fp8). The
activations arrive quantized by our kernels (csrc/fp8.cu, and fused into the norm and SiLU·mul before the
projections: csrc/norm.cu, csrc/activation.cu).

Which row-scaled FP8 GEMM a torch build has, and whether it adds the bias itself, differs between builds and
GPUs; `probe` finds out once per (dtype, device) with a small product checked against the reference, before
any CUDA graph is captured (the loader calls it: model/quantize.py). Without a fused bias the bias is added
after the product's rounding (one more rounding than the reference, still within FP8's own error).
"""
from __future__ import annotations

import logging

import torch

from rollout_service.ops import fp8

logger = logging.getLogger(__name__)

FUSED_BIAS, SEPARATE_BIAS = "fused bias", "separate bias"
_MODES: dict[tuple[torch.dtype, int], str | None] = {}  # (dtype, device index) -> a mode, None = no such GEMM


def _key(dtype: torch.dtype, device: torch.device) -> tuple[torch.dtype, int]:
    device = torch.device(device)
    return dtype, device.index if device.index is not None else torch.cuda.current_device()


def _scaled_mm(rows: fp8.Fp8Rows, weight: torch.Tensor, weight_scale: torch.Tensor,
               bias: torch.Tensor | None) -> torch.Tensor:
    return torch._scaled_mm(rows.q, weight.t(), scale_a=rows.scale.unsqueeze(1), scale_b=weight_scale.unsqueeze(0),
                            bias=bias, out_dtype=rows.dtype)


def probe(dtype: torch.dtype, device: torch.device) -> str | None:
    """The mode of this (dtype, device)'s row-scaled FP8 GEMM (FUSED_BIAS / SEPARATE_BIAS), or None when there
    is none or it disagrees with the reference; computed once and remembered."""
    key = _key(dtype, device)
    if key in _MODES:
        return _MODES[key]
    gen = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(5, 64, generator=gen).to(dtype=dtype, device=device)
    w, w_scale = fp8.quantize_rows(torch.randn(48, 64, generator=gen).to(dtype=dtype, device=device))
    bias = torch.randn(48, generator=gen).to(dtype=dtype, device=device)
    rows = fp8.Fp8Rows.of(x)
    want = fp8.linear(rows, w, w_scale, bias).float()
    mode, errors = None, []
    for candidate, b in ((FUSED_BIAS, bias), (SEPARATE_BIAS, None)):
        try:
            got = _scaled_mm(rows, w, w_scale, b)
            got = (got + bias if b is None else got).float()
        except (RuntimeError, NotImplementedError) as exc:
            errors.append(f"{candidate}: {exc}".splitlines()[0])
            continue
        if torch.allclose(got, want, rtol=2**-6, atol=1e-3 * float(want.abs().max())):
            mode = candidate
            break
        errors.append(f"{candidate}: differs from the reference by {float((got - want).abs().max()):.3g}")
    if mode is None:
        logger.warning("FP8 products on %s in %s run the reference arithmetic (slow): torch._scaled_mm with row "
                       "scales is unavailable here (%s)", torch.cuda.get_device_name(device),
                       str(dtype).removeprefix("torch."), "; ".join(errors))
    _MODES[key] = mode
    return mode


def product_blocker(rows: fp8.Fp8Rows, weight: torch.Tensor, weight_scale: torch.Tensor,
                    bias: torch.Tensor | None) -> str | None:
    """Why this product cannot take the FP8 GEMM (the reference then computes it), or None."""
    q, scale = rows.q, rows.scale
    if not (q.is_cuda and weight.device == q.device and weight.dtype == fp8.E4M3 and q.dtype == fp8.E4M3):
        return "needs e4m3 CUDA operands on one device"
    if q.dim() != 2 or weight.dim() != 2 or q.shape[1] != weight.shape[1] or not q.is_contiguous():
        return f"shapes x{tuple(q.shape)} w{tuple(weight.shape)}"
    if q.shape[1] % 16 or weight.shape[0] % 16 or not weight.is_contiguous():
        return f"K={q.shape[1]} and N={weight.shape[0]} must be multiples of 16 (contiguous weight)"
    if not (scale.dtype == weight_scale.dtype == torch.float32 and scale.is_contiguous()
            and weight_scale.is_contiguous() and weight_scale.shape == weight.shape[:1]):
        return "needs contiguous float32 scales, one per row and one per channel"
    if bias is not None and (bias.dtype != rows.dtype or bias.shape != weight.shape[:1]):
        return f"bias {bias.dtype} {tuple(bias.shape)}"
    key = _key(rows.dtype, q.device)
    if key not in _MODES and q.is_cuda and torch.cuda.is_current_stream_capturing():
        return "the FP8 GEMM was not probed before graph capture"
    if probe(rows.dtype, q.device) is None:
        return f"no row-scaled FP8 GEMM for {str(rows.dtype).removeprefix('torch.')} on this GPU / torch build"
    return None


def _gemv_ok(rows: fp8.Fp8Rows, weight: torch.Tensor) -> bool:
    """One row: our weight-streaming kernel (csrc/gemv.cu; cuBLAS's FP8 GEMM at M = 1 reads the weight at a
    fraction of the bandwidth). 16-byte aligned rows."""
    return (rows.q.shape[0] == 1 and rows.q.data_ptr() % 16 == 0 and weight.data_ptr() % 16 == 0
            and rows.dtype in (torch.bfloat16, torch.float16) and weight.shape[0] < 2**31)


def product(kernels, rows: fp8.Fp8Rows, weight: torch.Tensor, weight_scale: torch.Tensor,
            bias: torch.Tensor | None) -> torch.Tensor:
    """rows @ weight.T * scales (+ bias), rounded to the model dtype (inputs accepted by product_blocker)."""
    if rows.q.shape[0] == 0:
        return torch.empty(0, weight.shape[0], dtype=rows.dtype, device=rows.q.device)
    if _gemv_ok(rows, weight):
        out = torch.empty(1, weight.shape[0], dtype=rows.dtype, device=rows.q.device)
        kernels.fp8_gemv(out, rows.q, rows.scale, weight, weight_scale, bias)
        return out
    if _MODES[_key(rows.dtype, rows.q.device)] == FUSED_BIAS:
        return _scaled_mm(rows, weight, weight_scale, bias)
    out = _scaled_mm(rows, weight, weight_scale, None)
    return out if bias is None else out.add_(bias)
