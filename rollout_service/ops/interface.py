"""Ops: what the model, the engine and the sampler may ask of an ops backend, and nothing else.

Implementations, chosen in one place (ops/backend.py select_ops): TorchOps (ops/torch_ops.py: the reference
semantics in plain torch, on any device), CpuOps (ops/cpu_ops.py: the reference with the CPU's C kernels and
oneDNN products; the "torch" backend), CudaOps (ops/cuda_ops.py: the csrc kernels, falling back to the reference outside what they cover), and the
batch-invariant pair InvariantOps / CudaInvariantOps (ops/invariant.py, ops/invariant_cuda.py). Every backend
computes the reference's function; where its rounding may differ is said in its module. tests/test_ops.py checks
that each one provides every method below.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

if TYPE_CHECKING:
    from rollout_service.ops.attention import AttentionMetadata
    from rollout_service.ops.fp8 import Fp8Rows


@runtime_checkable
class Ops(Protocol):
    name: str  # "torch", "cuda", "torch-invariant" or "cuda-invariant": the backend's name in stats

    # ---- norms and activations -----------------------------------------------------------------------
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm of the last dimension, rounded as HF's Llama norm rounds."""

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(rms_norm(x + residual), x + residual): a block's residual add fused with the next norm."""

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of a fused [T, 2I] gate_up projection (gate half first)."""

    # ---- products -------------------------------------------------------------------------------------
    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x @ weight.T (+ bias), float32 accumulation rounded once to the dtype."""

    def gated_linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """silu_and_mul(linear(x, weight, bias)) for a fused gate_up weight [2I, H]."""

    def logits(self, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """float32 logits hidden @ weight.T, never rounded to the model dtype."""

    # ---- FP8 (ops/fp8.py) ------------------------------------------------------------------------------
    def fp8_quantize(self, x: torch.Tensor) -> Fp8Rows:
        """Rows quantized to e4m3 with one float32 scale each."""

    def rms_norm_fp8(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                     eps: float) -> tuple[Fp8Rows, torch.Tensor]:
        """add_rms_norm's output quantized per row (x alone without a residual), and the residual."""

    def silu_and_mul_fp8(self, gate_up: torch.Tensor) -> Fp8Rows:
        """silu_and_mul quantized per row (the FP8 down projection's input)."""

    def fp8_linear(self, x: torch.Tensor | Fp8Rows, weight: torch.Tensor, weight_scale: torch.Tensor,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
        """x @ weight.T with an e4m3 weight and per-channel scales; x quantized per row unless it already is."""

    # ---- positions, KV cache and attention --------------------------------------------------------------
    def rope(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
             cos_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotary embedding of q [T, Hq, D] and k [T, Hk, D] at `positions`."""

    def write_kv(self, kv_layer: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Store k and v into the paged cache at their slots."""

    def rope_and_write_kv(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                          cos_sin: torch.Tensor, kv_layer: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
        """rope(q, k), then write_kv(k, v); returns the rotated q."""

    def attention(self, q: torch.Tensor, kv_layer: torch.Tensor, meta: AttentionMetadata,
                  scale: float) -> torch.Tensor:
        """Causal attention of q over the paged KV that `meta` describes (prefill or decode)."""

    # ---- mixture of experts (ops/moe_experts.py) -----------------------------------------------------------------
    def moe_route(self, x: torch.Tensor, weight: torch.Tensor, top_k: int, renormalize: bool,
                  record: torch.Tensor | None = None,
                  slots: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(expert ids [T, k], mixing weights [T, k]) in transformers' order of softmax, top-k, renormalisation;
        the ids also written to `record` at `slots` (routing replay's store) when given."""

    def moe_experts(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                    down: torch.Tensor) -> torch.Tensor:
        """The weighted sum of each token's experts' MLPs (stacked gate_up [E, 2I, H] and down [E, H, I])."""

    def moe_graph_blocker(self, dtype: torch.dtype, device: torch.device) -> str | None:
        """Why MoE decode steps cannot be captured in a CUDA graph on this backend, or None."""

    # ---- sampling (engine/sampler.py) -----------------------------------------------------------------------
    def gumbel_argmax(self, x: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """int64 [B]: a draw from softmax(x[b]) by counter-based Gumbel noise keyed by keys[b]."""

    def argmax_logsumexp(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(tokens, values, log-sum-exp) of each row: the greedy step and its normaliser."""

    def logsumexp(self, x: torch.Tensor) -> torch.Tensor:
        """[B] log-sum-exp of each row (the sampler's normaliser)."""
