"""Mixture-of-experts on the cuda backend: ops/moe_experts.py's semantics with no host round trip, so a decode step with
MoE layers runs inside a CUDA graph.

route: the router product (cuBLAS, or the gemv kernel for one row), then one kernel (csrc/moe.cu): float32
softmax, top-k, renormalisation, and the routing record written at the rows' KV slots.

experts, two ways, by the number of (token, slot) rows:
- up to GEMV_ROWS rows (decode at small batches, where most rows have an expert to themselves): each row streams
  its own expert's weights through the gemv kernel (gate/up and SiLU·mul in one launch, then down), and the
  combine kernel sums each token's k rows.
- more: the permutation kernel counts the rows per expert, writes the offsets and gathers the rows in expert
  order (a stable order, as the reference's sort); the gate/up and down products are torch._grouped_mm over the
  stacked weights (CUTLASS on Hopper); the SiLU·mul kernel between them; the combine kernel un-permutes and sums
  in slot order. Both ways round the products, SiLU and mix as the reference does; only the products' summation
  order differs from its per-expert cuBLAS calls.

Batch-invariant mode takes the grouped way at every size, in calls of at most INVARIANT_ROWS_PER_EXPERT rows per
expert on average: torch picks one CUTLASS tile configuration for all such calls (its "small" one), whose
products compute each row alone, so a token's bits never depend on its batch mates (tests/gpu/test_moe_gpu.py).
"""
from __future__ import annotations

import torch

# Rows of a step up to which the per-row gemv beats the grouped products: WM on the H200 (qwen3-30b-a3b's layer,
# eager, µs): 8 rows 50 vs 107, 64 rows 180 vs 255, 128 rows 334 vs 346, 256 rows 635 vs 433.
GEMV_ROWS = 128
INVARIANT_ROWS_PER_EXPERT = 128  # torch's grouped mm keeps one tile shape while rows / experts <= 128
MAX_EXPERTS = 512  # the routing kernel's warp holds 16 logits per lane (csrc/kernels.h kMoeMaxExperts)
MAX_TOP_K = 16
_HALF = (torch.bfloat16, torch.float16)


def grouped_mm_blocker(device: torch.device | str | None) -> str | None:
    """Why torch._grouped_mm cannot run the experts on `device`, or None."""
    if not hasattr(torch, "_grouped_mm"):
        return f"this torch ({torch.__version__}) has no torch._grouped_mm (2.8 or newer has it)"
    device = torch.device(device if device is not None else "cpu")
    if device.type != "cuda" or not torch.cuda.is_available():
        return f"torch._grouped_mm needs a CUDA GPU, not {device}"
    major, minor = torch.cuda.get_device_capability(device)
    if major < 9:
        return f"torch._grouped_mm runs CUTLASS on Hopper or newer GPUs (compute capability 9.0+), this one is {major}.{minor}"
    return None


def shape_blocker(hidden: int, inter: int, num_experts: int, top_k: int) -> str | None:
    """Why the kernels cannot take an MoE layer of these sizes, or None."""
    if hidden % 8 or inter % 8:
        return f"hidden size {hidden} and expert intermediate size {inter} must be multiples of 8 (16-byte rows)"
    if num_experts > MAX_EXPERTS:
        return f"{num_experts} experts (the routing kernel takes at most {MAX_EXPERTS})"
    if top_k > MAX_TOP_K:
        return f"top-k {top_k} (the kernels take at most {MAX_TOP_K})"
    return None


def graph_blocker(dtype: torch.dtype, device: torch.device | str) -> str | None:
    """Why a decode step with MoE layers of `dtype` cannot be captured on `device` (None: it can)."""
    if dtype != torch.bfloat16:
        return f"the grouped expert products (torch._grouped_mm) take bfloat16, the model is {dtype}"
    return grouped_mm_blocker(device)


def invariant_blocker(hidden: int, inter: int, num_experts: int, top_k: int, dtype: torch.dtype | None,
                      device: torch.device | str | None) -> str | None:
    """Why batch-invariant mode cannot run an MoE model of these sizes on the cuda backend (None: it can)."""
    if dtype is not None and dtype != torch.bfloat16:
        return f"dtype {str(dtype).removeprefix('torch.')} (the grouped expert products take bfloat16)"
    return shape_blocker(hidden, inter, num_experts, top_k) or grouped_mm_blocker(device)


def _layer_blocker(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                   down: torch.Tensor) -> str | None:
    if not (x.is_cuda and x.dtype in _HALF and x.dim() == 2 and x.stride(1) == 1):
        return f"x {x.dtype} {tuple(x.shape)} on {x.device}"
    if gate_up.dtype != x.dtype or down.dtype != x.dtype or not (gate_up.is_contiguous() and down.is_contiguous()):
        return "the stacked expert weights must be contiguous and of x's dtype"
    if ids.dtype != torch.int32 or ids.dim() != 2 or weights.shape != ids.shape:
        return f"ids {ids.dtype} {tuple(ids.shape)} / weights {tuple(weights.shape)}"
    if x.data_ptr() % 16 or x.stride(0) % 8:
        return "x rows must be 16-byte aligned"
    return shape_blocker(x.shape[1], down.shape[2], gate_up.shape[0], ids.shape[1])


def experts_blocker(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                    down: torch.Tensor, grouped_only: bool = False) -> str | None:
    """Why experts() cannot take these inputs (the caller falls back to the reference), or None."""
    why = _layer_blocker(x, ids, weights, gate_up, down)
    if why is None and (grouped_only or ids.numel() > GEMV_ROWS):
        why = graph_blocker(x.dtype, x.device)
    return why


def route_blocker(x: torch.Tensor, weight: torch.Tensor, top_k: int) -> str | None:
    if not (x.is_cuda and x.dtype in _HALF and weight.dtype == x.dtype and x.dim() == 2):
        return f"x {x.dtype} {tuple(x.shape)} on {x.device}, router {weight.dtype}"
    if weight.shape[0] > MAX_EXPERTS or not 1 <= top_k <= min(MAX_TOP_K, weight.shape[0]):
        return f"{weight.shape[0]} experts, top-k {top_k}"
    return None


def experts(kernels, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
            down: torch.Tensor) -> torch.Tensor:
    """[T, H]: each token's k experts mixed by its weights (module docstring: gemv rows or grouped products)."""
    if ids.shape[0] == 0:
        return x.new_empty(0, x.shape[1])
    weights = weights.contiguous()
    if ids.numel() <= GEMV_ROWS:
        return gemv_experts(kernels, x, ids, weights, gate_up, down)
    return grouped_experts(kernels, x, ids, weights, gate_up, down)


def gemv_experts(kernels, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                 down: torch.Tensor) -> torch.Tensor:
    """experts() through the gemv rows (each (token, slot) row streams its own expert), whatever the number of
    rows (at most 65535)."""
    act = kernels.moe_gemv(x, gate_up, ids, True)
    return kernels.moe_combine(kernels.moe_gemv(act, down, ids, False), None, weights)


def grouped_experts(kernels, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                    down: torch.Tensor) -> torch.Tensor:
    """experts() through the permutation and torch._grouped_mm, whatever the number of rows."""
    grouped, offsets, position = kernels.moe_permute(x, ids, gate_up.shape[0])
    gate_up_rows = torch._grouped_mm(grouped, gate_up.transpose(1, 2), offs=offsets)
    act = gate_up_rows.new_empty(gate_up_rows.shape[0], gate_up_rows.shape[1] // 2)
    kernels.silu_and_mul(act, gate_up_rows)
    out_rows = torch._grouped_mm(act, down.transpose(1, 2), offs=offsets)
    return kernels.moe_combine(out_rows, position, weights)


def invariant_experts(kernels, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                      down: torch.Tensor) -> torch.Tensor:
    """experts() with a token's bits independent of its batch: the grouped way, in token chunks small enough that
    torch keeps one kernel configuration for every call (module docstring)."""
    if ids.shape[0] == 0:
        return x.new_empty(0, x.shape[1])
    weights = weights.contiguous()
    chunk = max(1, INVARIANT_ROWS_PER_EXPERT * gate_up.shape[0] // ids.shape[1])
    outs = [grouped_experts(kernels, x[i:i + chunk], ids[i:i + chunk], weights[i:i + chunk], gate_up, down)
            for i in range(0, ids.shape[0], chunk)]
    return outs[0] if len(outs) == 1 else torch.cat(outs)
