"""The CPU's Ops: the torch reference (ops/torch_ops.py) with the CPU's own paths where they apply, each computing
the reference's function and falling back to it for every other input (a GPU tensor, a dtype or layout the path
does not take). What each path changes is said in its module:
- products in oneDNN with the weights packed once, gate/up's silu and product in its epilogues (cpu_linear.py);
- RMSNorm with the residual add in one C pass per row (cpu_norm.py);
- RoPE and the KV cache write in one C pass with the torch ops' bits (cpu_rope.py);
- attention reading the K/V pages in place (cpu_attention.py), or, where the C kernels do not build, decode
  attention reading a prompt's shared pages once for all its samples (shared_prefix.py);
- a greedy step's token and normaliser in one C read of the logits (cpu_greedy.py).
It is the "torch" backend on the CPU (ops/backend.py select_ops).
"""
from __future__ import annotations

import torch

from rollout_service.ops import attention, cpu_attention, cpu_greedy, cpu_linear, cpu_norm, cpu_rope, shared_prefix
from rollout_service.ops.torch_ops import TorchOps


class CpuOps(TorchOps):
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if cpu_norm.applies(x, weight):
            return cpu_norm.add_rms_norm(x, None, weight, eps)[0]
        return super().rms_norm(x, weight, eps)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        if cpu_norm.applies(x, weight) and residual.dtype == x.dtype and residual.shape == x.shape:
            return cpu_norm.add_rms_norm(x, residual, weight, eps)
        return super().add_rms_norm(x, residual, weight, eps)

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return cpu_linear.linear(x, weight, bias)  # F.linear wherever oneDNN does not apply

    def gated_linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if bias is None and cpu_linear.applies(x, weight):
            return cpu_linear.gated_linear(x, weight)
        return super().gated_linear(x, weight, bias)

    def logits(self, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if hidden.dtype == torch.float32 and weight.dtype == torch.float32:
            return cpu_linear.linear(hidden, weight)
        return super().logits(hidden, weight)

    def rope_and_write_kv(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                          cos_sin: torch.Tensor, kv_layer: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
        if cpu_rope.applies(q, k, v, cos_sin, kv_layer):
            checked = self._per_step("cpu rope", (positions, slot_mapping), (cos_sin.shape, kv_layer.shape),
                                     lambda: cpu_rope.check(positions, slot_mapping, cos_sin, kv_layer))
            return cpu_rope.rope_and_write_kv(q, k, v, *checked, cos_sin, kv_layer)
        return super().rope_and_write_kv(q, k, v, positions, cos_sin, kv_layer, slot_mapping)

    def attention(self, q: torch.Tensor, kv_layer: torch.Tensor, meta: attention.AttentionMetadata,
                  scale: float) -> torch.Tensor:
        if cpu_attention.applies(q, kv_layer):
            return cpu_attention.attention(q, kv_layer, meta, scale)
        if not meta.is_prefill and kv_layer.device.type == "cpu":
            shared = shared_prefix.step_plan(meta, kv_layer.shape[2], kv_layer.shape[3])
            if shared is not None:
                return shared_prefix.attention(q, kv_layer, shared, scale, torch.float32)
        return super().attention(q, kv_layer, meta, scale)

    def argmax_logsumexp(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if cpu_greedy.applies(x):
            return cpu_greedy.argmax_logsumexp(x)
        return super().argmax_logsumexp(x)
