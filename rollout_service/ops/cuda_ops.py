"""The "cuda" Ops: the torch reference Ops with csrc kernels where they apply.

Every method falls back to the torch reference for inputs its kernel does not cover (dtype other than
bf16/fp16, head_dim other than 64/128, page_size other than 16, odd strides), so the backend is always
correct and only sometimes slower. Differences from the reference, both intended and documented:
rope() rotates q and k in place, and add_rms_norm() writes x + residual into `residual` in place.

Every input the extension would reject is caught here first (and sent to the torch reference), because
on the H200 image (torch 2.11, extension built by its /opt/gcc) an exception thrown inside the extension
crashed the process instead of raising; see csrc/NOTES.md. `self.kernels` is therefore an unchecked,
internal API: call it only with inputs these predicates accept.
"""
from __future__ import annotations

import logging

import torch

from rollout_service.ops import attention as attention_ref, cuda_fp8, cuda_moe, fp8
from rollout_service.ops._ext import load_kernels
from rollout_service.ops.torch_ops import TorchOps

logger = logging.getLogger(__name__)

_HALF = (torch.bfloat16, torch.float16)
PAGE_SIZE = 16
HEAD_DIMS = (64, 128)
MAX_DECODE_GROUP = 16
PREFILL_IMPLS = {"auto": 0, "mma_sync": 1}  # csrc/kernels.h PrefillImpl
MAX_ROWS = 65535  # rows of one sampling launch (a grid dimension)


def _aligned(t: torch.Tensor, elements: int = 8) -> bool:
    return t.data_ptr() % (elements * t.element_size()) == 0


def _rows_ok(t: torch.Tensor) -> bool:
    """A 2-D view with contiguous, 16-byte aligned rows (the norm kernels' 16-byte vectors)."""
    return t.dim() == 2 and t.stride(1) == 1 and t.stride(0) % 8 == 0 and _aligned(t)


def _heads_ok(t: torch.Tensor) -> bool:
    return t.dim() == 3 and t.stride(2) == 1 and t.stride(0) % 2 == 0 and t.stride(1) % 2 == 0 and _aligned(t, 2)


class CudaOps(TorchOps):
    name = "cuda"

    def __init__(self, exact_prefill_attention: bool = False) -> None:
        if not torch.cuda.is_available():
            raise ValueError("backend 'cuda' needs a CUDA device and a CUDA build of torch")
        self.kernels = load_kernels()
        self.exact_prefill_attention = exact_prefill_attention
        self._fallbacks: set[str] = set()

    def _fallback(self, op: str, why: str) -> None:
        if op not in self._fallbacks:  # log once per op: fallbacks are correct but slow
            self._fallbacks.add(op)
            logger.warning("cuda ops: %s falls back to the torch reference (%s)", op, why)

    # ---- norms ------------------------------------------------------------------------------------

    def _norm_args(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
        if not (x.is_cuda and x.dtype in _HALF and weight.dtype == x.dtype and x.shape[-1] % 8 == 0):
            return None
        if not (weight.device == x.device and weight.shape == x.shape[-1:] and weight.is_contiguous()
                and _aligned(weight)):
            return None
        rows = x.view(-1, x.shape[-1]) if x.is_contiguous() else x.reshape(-1, x.shape[-1])
        return rows if _rows_ok(rows) else None

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        rows = self._norm_args(x, weight)
        if rows is None:
            self._fallback("rms_norm", f"{x.dtype} {tuple(x.shape)}")
            return super().rms_norm(x, weight, eps)
        out = torch.empty_like(rows)
        self.kernels.rms_norm(out, rows, weight, eps)
        return out.view(x.shape)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        rows = self._norm_args(x, weight)
        ok = (rows is not None and residual.shape == x.shape and residual.dtype == x.dtype
              and residual.device == x.device and residual.is_contiguous())
        if not ok or not _aligned(residual):
            self._fallback("add_rms_norm", f"{x.dtype} {tuple(x.shape)}")
            return super().add_rms_norm(x, residual, weight, eps)
        out = torch.empty_like(rows)
        self.kernels.add_rms_norm(out, rows, residual.view(rows.shape), weight, eps)
        return out.view(x.shape), residual

    @staticmethod
    def _gate_up_ok(gate_up: torch.Tensor) -> bool:
        """A fused [rows, 2 * inter] gate_up projection the SiLU·mul kernels take (inter a multiple of 8)."""
        return (gate_up.is_cuda and gate_up.dtype in _HALF and gate_up.dim() == 2 and gate_up.shape[1] % 16 == 0
                and _rows_ok(gate_up))

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        if not self._gate_up_ok(gate_up):
            self._fallback("silu_and_mul", f"{gate_up.dtype} {tuple(gate_up.shape)}")
            return super().silu_and_mul(gate_up)
        out = gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)
        self.kernels.silu_and_mul(out, gate_up)
        return out

    # ---- linear layers -----------------------------------------------------------------------------

    def _gemv_ok(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
        """One row (a batch-1 decode step) in the gemv kernel; from two rows on cuBLAS is as fast or faster
        (csrc/gemv.cu)."""
        return (
            x.is_cuda and x.dtype in _HALF and weight.dtype == x.dtype and x.dim() == 2
            and x.shape[0] == 1 and x.shape[1] % 8 == 0 and _rows_ok(x)
            and weight.dim() == 2 and weight.shape[1] == x.shape[1] and weight.is_contiguous() and _aligned(weight)
            and weight.shape[0] < 2**31 and weight.device == x.device
            and (bias is None or (bias.dtype == x.dtype and bias.shape == weight.shape[:1] and bias.is_contiguous()
                                  and bias.device == x.device))
        )

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if not self._gemv_ok(x, weight, bias):
            return super().linear(x, weight, bias)
        out = x.new_empty(x.shape[0], weight.shape[0])
        self.kernels.gemv(out, x, weight, bias, False)
        return out

    def gated_linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if not (self._gemv_ok(x, weight, bias) and weight.shape[0] % 2 == 0):
            return super().gated_linear(x, weight, bias)
        out = x.new_empty(x.shape[0], weight.shape[0] // 2)
        self.kernels.gemv(out, x, weight, bias, True)
        return out

    def logits(self, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if not self._gemv_ok(hidden, weight, None):
            return super().logits(hidden, weight)
        out = hidden.new_empty(hidden.shape[0], weight.shape[0], dtype=torch.float32)
        self.kernels.gemv(out, hidden, weight, None, False)
        return out

    # ---- FP8 products (ops/cuda_fp8.py) ------------------------------------------------------------

    def _fp8_out(self, rows: torch.Tensor, cols: int, dtype: torch.dtype) -> fp8.Fp8Rows:
        return fp8.Fp8Rows(rows.new_empty(rows.shape[0], cols, dtype=fp8.E4M3),
                           rows.new_empty(rows.shape[0], dtype=torch.float32), dtype)

    def fp8_quantize(self, x: torch.Tensor) -> fp8.Fp8Rows:
        ok = x.is_cuda and x.dtype in _HALF and x.dim() == 2 and x.shape[1] % 8 == 0 and _rows_ok(x)
        if not ok:
            self._fallback("fp8_quantize", f"{x.dtype} {tuple(x.shape)}")
            return super().fp8_quantize(x)
        out = self._fp8_out(x, x.shape[1], x.dtype)
        self.kernels.fp8_quantize(out.q, out.scale, x)
        return out

    def rms_norm_fp8(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                     eps: float) -> tuple[fp8.Fp8Rows, torch.Tensor]:
        rows = self._norm_args(x, weight)
        ok = rows is not None and x.dim() == 2 and (residual is None or (
            residual.shape == x.shape and residual.dtype == x.dtype and residual.device == x.device
            and residual.is_contiguous() and _aligned(residual)))
        if not ok:
            self._fallback("rms_norm_fp8", f"{x.dtype} {tuple(x.shape)}")
            return super().rms_norm_fp8(x, residual, weight, eps)
        out = self._fp8_out(rows, rows.shape[1], x.dtype)
        self.kernels.rms_norm_fp8(out.q, out.scale, rows, None if residual is None else residual.view(rows.shape),
                                  weight, eps)
        return out, (x if residual is None else residual)

    def silu_and_mul_fp8(self, gate_up: torch.Tensor) -> fp8.Fp8Rows:
        if not self._gate_up_ok(gate_up):
            self._fallback("silu_and_mul_fp8", f"{gate_up.dtype} {tuple(gate_up.shape)}")
            return super().silu_and_mul_fp8(gate_up)
        out = self._fp8_out(gate_up, gate_up.shape[1] // 2, gate_up.dtype)
        self.kernels.silu_and_mul_fp8(out.q, out.scale, gate_up)
        return out

    def fp8_linear(self, x: torch.Tensor | fp8.Fp8Rows, weight: torch.Tensor, weight_scale: torch.Tensor,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
        rows = x if isinstance(x, fp8.Fp8Rows) else self.fp8_quantize(x)
        why = cuda_fp8.product_blocker(rows, weight, weight_scale, bias)
        if why:
            self._fallback("fp8_linear", why)
            return super().fp8_linear(rows, weight, weight_scale, bias)
        return cuda_fp8.product(self.kernels, rows, weight, weight_scale, bias)

    # ---- mixture of experts (ops/cuda_moe.py) ------------------------------------------------------

    def moe_route(self, x: torch.Tensor, weight: torch.Tensor, top_k: int, renormalize: bool,
                  record: torch.Tensor | None = None,
                  slots: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        why = cuda_moe.route_blocker(x, weight, top_k)
        if why:
            self._fallback("moe_route", why)
            return super().moe_route(x, weight, top_k, renormalize, record, slots)
        return self.kernels.moe_route(self.linear(x, weight), top_k, renormalize, record, slots)

    def moe_experts(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                    down: torch.Tensor) -> torch.Tensor:
        why = cuda_moe.experts_blocker(x, ids, weights, gate_up, down)
        if why:
            self._fallback("moe_experts", why)
            return super().moe_experts(x, ids, weights, gate_up, down)
        return cuda_moe.experts(self.kernels, x, ids, weights, gate_up, down)

    def moe_graph_blocker(self, dtype: torch.dtype, device: torch.device) -> str | None:
        return cuda_moe.graph_blocker(dtype, device)

    # ---- rope / kv write ---------------------------------------------------------------------------

    def _rope_ok(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor) -> bool:
        return (
            q.is_cuda and q.dtype in _HALF and k.dtype == q.dtype and _heads_ok(q) and _heads_ok(k)
            and q.shape[0] == k.shape[0] and q.shape[2] == k.shape[2] and q.shape[2] % 2 == 0
            and positions.dtype == torch.int64 and positions.shape == (q.shape[0],) and positions.is_contiguous()
            and cos_sin.dtype in (torch.float32, q.dtype) and cos_sin.dim() == 2 and cos_sin.is_contiguous()
            and cos_sin.shape[1] == q.shape[2]
            and q.device == k.device == positions.device == cos_sin.device
        )

    def _cache_ok(self, kv_layer: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> bool:
        return (
            k.is_cuda and kv_layer.is_contiguous() and kv_layer.dtype == k.dtype == v.dtype and k.dtype in _HALF
            and _heads_ok(k) and _heads_ok(v) and v.shape == k.shape
            and kv_layer.dim() == 5 and kv_layer.shape[1] == 2 and kv_layer.shape[2] == k.shape[1]
            and kv_layer.shape[4] == k.shape[2]
            and slot_mapping.dtype == torch.int64 and slot_mapping.shape == (k.shape[0],)
            and slot_mapping.is_contiguous()
            and k.device == v.device == kv_layer.device == slot_mapping.device
        )

    def rope(
        self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self._rope_ok(q, k, positions, cos_sin):
            self._fallback("rope", f"{q.dtype} q{tuple(q.shape)} cos_sin {cos_sin.dtype}")
            return super().rope(q, k, positions, cos_sin)
        self.kernels.rope(q, k, positions, cos_sin)
        return q, k

    def write_kv(self, kv_layer: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        if not self._cache_ok(kv_layer, k, v, slot_mapping):
            self._fallback("write_kv", f"{k.dtype} k{tuple(k.shape)}")
            return super().write_kv(kv_layer, k, v, slot_mapping)
        self.kernels.write_kv(kv_layer, k, v, slot_mapping)

    def rope_and_write_kv(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
        kv_layer: torch.Tensor, slot_mapping: torch.Tensor,
    ) -> torch.Tensor:
        """rope(q, k) then write_kv(k, v) in one launch; returns the rotated q (k is rotated in place too)."""
        if not (self._rope_ok(q, k, positions, cos_sin) and self._cache_ok(kv_layer, k, v, slot_mapping)):
            q, k = self.rope(q, k, positions, cos_sin)
            self.write_kv(kv_layer, k, v, slot_mapping)
            return q
        self.kernels.rope_write_kv(q, k, v, positions, cos_sin, kv_layer, slot_mapping)
        return q

    # ---- attention ---------------------------------------------------------------------------------

    def _attention_ok(self, q: torch.Tensor, kv_layer: torch.Tensor, meta: attention_ref.AttentionMetadata) -> bool:
        if not (q.is_cuda and q.dtype in _HALF and kv_layer.dtype == q.dtype and _heads_ok(q)):
            return False
        if kv_layer.dim() != 5 or not kv_layer.is_contiguous():
            return False
        _, _, num_kv_heads, page_size, head_dim = kv_layer.shape
        if page_size != PAGE_SIZE or head_dim not in HEAD_DIMS or q.shape[2] != head_dim:
            return False
        if q.shape[1] % num_kv_heads != 0:
            return False
        batch = meta.kv_indptr.shape[0] - 1
        if meta.qo_indptr.shape[0] != batch + 1 or meta.kv_last_page_len.shape[0] != batch:
            return False
        if not meta.is_prefill and (q.shape[1] // num_kv_heads > MAX_DECODE_GROUP or q.shape[0] != batch):
            return False
        return kv_layer.device == q.device and all(
            t.dtype == torch.int32 and t.device == q.device and t.dim() == 1 and t.is_contiguous()
            for t in (meta.qo_indptr, meta.kv_indptr, meta.kv_indices, meta.kv_last_page_len)
        )

    def attention(
        self, q: torch.Tensor, kv_layer: torch.Tensor, meta: attention_ref.AttentionMetadata, scale: float
    ) -> torch.Tensor:
        if not self._attention_ok(q, kv_layer, meta):
            self._fallback("attention", f"{q.dtype} q{tuple(q.shape)} kv{tuple(kv_layer.shape)}")
            return super().attention(q, kv_layer, meta, scale)
        if meta.is_prefill:
            return self.prefill_attention(q, kv_layer, meta, scale)
        return self.decode_attention(q, kv_layer, meta, scale)

    def prefill_attention(
        self, q: torch.Tensor, kv_layer: torch.Tensor, meta: attention_ref.AttentionMetadata, scale: float,
        exact: bool | None = None, impl: str = "auto",
    ) -> torch.Tensor:
        """The prefill kernel. exact: P·V at float32 precision (None = this backend's setting); impl: "auto"
        (wgmma on Hopper, else mma.sync) or "mma_sync" (the sm_80 kernel, to compare)."""
        if impl not in PREFILL_IMPLS:
            raise ValueError(f"impl must be one of {sorted(PREFILL_IMPLS)}, got {impl!r}")
        exact = self.exact_prefill_attention if exact is None else exact
        return self.kernels.prefill_attention(
            q, kv_layer, meta.qo_indptr, meta.kv_indptr, meta.kv_indices, meta.kv_last_page_len,
            meta.max_q_len, scale, bool(exact), PREFILL_IMPLS[impl],
        )

    def decode_attention(
        self, q: torch.Tensor, kv_layer: torch.Tensor, meta: attention_ref.AttentionMetadata, scale: float,
        num_splits: int = 0,
    ) -> torch.Tensor:
        """The decode kernel. num_splits: 0 = chosen from batch, heads, meta.max_kv_len and the SM count;
        n > 0 = n splits; -1 = one warp per (sequence, kv head)."""
        if not isinstance(num_splits, int) or num_splits < -1:
            raise ValueError(f"num_splits must be an int >= -1, got {num_splits!r}")
        return self.kernels.decode_attention(
            q, kv_layer, meta.kv_indptr, meta.kv_indices, meta.kv_last_page_len, scale, meta.max_kv_len, num_splits
        )

    # ---- sampling ---------------------------------------------------------------------------------

    def gumbel_argmax(self, x: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        ok = (x.is_cuda and x.dtype == torch.float32 and x.dim() == 2 and x.stride(1) == 1 and x.shape[1] > 0
              and x.shape[0] <= MAX_ROWS and isinstance(keys, torch.Tensor) and keys.device == x.device
              and keys.dtype == torch.int64 and keys.shape == x.shape[:1] and keys.is_contiguous())
        if not ok:
            self._fallback("gumbel_argmax", "needs float32 CUDA rows with a contiguous vocabulary and int64 keys")
            return super().gumbel_argmax(x, keys)
        return self.kernels.gumbel_argmax(x, keys)

    def argmax_logsumexp(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        ok = (x.is_cuda and x.dtype == torch.float32 and x.dim() == 2 and x.stride(1) == 1 and x.shape[1] > 0
              and x.shape[0] <= MAX_ROWS)
        if not ok:
            self._fallback("argmax_logsumexp", "needs float32 CUDA rows with a contiguous vocabulary")
            return super().argmax_logsumexp(x)
        return self.kernels.argmax_logsumexp(x)
