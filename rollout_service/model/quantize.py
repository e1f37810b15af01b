"""FP8 rollouts (EngineConfig.quantization="fp8"): the attention and MLP projections' weights held as float8 e4m3
with one float32 scale per output channel (ops/fp8.py), quantized from the model dtype when the model is
loaded and again whenever a refresh brings new weights (the learner keeps pushing bf16 under HF names).
Embeddings, norms, the MoE router and the LM head stay in the model dtype; so does everything of an MoE
expert for now (refused: the MoE layer has no FP8 path yet).

A quantized weight stays a Parameter under its HF name, a view into its fused projection as before, and carries
its scales as `param.fp8_scale` (a view into the projection's scales), so refresh validation, the apply at a
step boundary (weight_update.apply_named_tensors quantizes what it copies) and weights_digest (which digests
the scales too) see what the engine runs.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from rollout_service.ops import fp8

QUANTIZATIONS = ("fp8",)
FP8_DTYPES = (torch.bfloat16, torch.float16)


def check_quantization(quantization: str | None, dtype: torch.dtype, device: torch.device, num_moe_layers: int,
                       batch_invariant: bool) -> None:
    """ValueError naming what keeps `quantization` from running here."""
    if quantization is None:
        return
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization={quantization!r}: choose one of {QUANTIZATIONS} (or None)")
    if dtype not in FP8_DTYPES:
        raise ValueError(f"quantization='fp8' needs a bfloat16 or float16 model (its products round to that dtype), "
                         f"got {str(dtype).removeprefix('torch.')}: set dtype='bfloat16'")
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        major, minor = torch.cuda.get_device_capability(device)
        raise ValueError(f"quantization='fp8' needs FP8 tensor cores (compute capability 8.9 or newer: Ada, "
                         f"Hopper); this GPU is {major}.{minor}")
    if num_moe_layers:
        raise ValueError("quantization='fp8' on a mixture-of-experts model is not supported yet (its experts have "
                         "no FP8 path); use the model dtype")
    if batch_invariant:
        raise ValueError("quantization='fp8' with batch_invariant: the batch-invariant products are model-dtype "
                         "ones; turn one of them off")
    if device.type == "cuda":
        # Find the GPU's FP8 GEMM now, before any decode step is captured in a CUDA graph (ops/cuda_fp8.py).
        from rollout_service.ops import cuda_fp8
        cuda_fp8.probe(dtype, device)


def quantize_fp8(model: Any) -> None:
    """Quantize every attention and MLP projection of a loaded DecoderLM in place."""
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        attn.qkv, attn.qkv_scale = _quantize([attn.q_proj, attn.k_proj, attn.v_proj], attn.qkv)
        _, attn.o_scale = _quantize([attn.o_proj])
        mlp.gate_up, mlp.gate_up_scale = _quantize([mlp.gate_proj, mlp.up_proj], mlp.gate_up)
        _, mlp.down_scale = _quantize([mlp.down_proj])
    model.quantization = "fp8"


def _quantize(linears: list[nn.Linear], fused: tuple | None = None) -> tuple[tuple, torch.Tensor]:
    """The projection of `linears` (their fused weight, or the one linear's) as an e4m3 weight and its scales;
    each linear's weight becomes a Parameter view of the e4m3 weight with its scales as `fp8_scale`."""
    weight = fused[0] if fused is not None else linears[0].weight.detach()
    q, scale = fp8.quantize_rows(weight)
    row = 0
    for m in linears:
        rows = m.weight.shape[0]
        m.weight = nn.Parameter(q[row:row + rows], requires_grad=False)
        m.weight.fp8_scale = scale[row:row + rows]
        row += rows
    bias = fused[1] if fused is not None else linears[0].bias
    return (q, bias), scale


def copy_quantized(param: torch.Tensor, value: torch.Tensor) -> None:
    """A refresh's model-dtype value into an e4m3 parameter: quantized here, on the parameter's device."""
    q, scale = fp8.quantize_rows(value.to(param.device))
    param.copy_(q)
    param.fp8_scale.copy_(scale)
