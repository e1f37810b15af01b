"""DecoderLM: Llama / Mistral / Qwen2 / Qwen3 / Qwen3-MoE / Mixtral decoder over the ops interface and a paged
KV cache (the MoE block: model/moe.py).

Module and parameter names mirror HF transformers' *ForCausalLM, so `hf_model.state_dict()` maps 1:1.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from rollout_service.model.moe import SparseMoeBlock
from rollout_service.model.registry import ArchFlags, MoeSpec, arch_flags, moe_spec
from rollout_service.ops.attention import AttentionMetadata
from rollout_service.ops.backend import Ops, select_ops
from rollout_service.ops.fp8 import Fp8Rows
from rollout_service.ops.rope import build_cos_sin_cache, rope_head_dim


def fuse_linears(linears: list[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight (and bias) for several projections of the same input: one GEMM instead of several.

    Each module's Parameter becomes a view into the fused tensor, so HF-named parameters, the state dict and
    in-place weight refreshes (param.copy_) keep working and update the fused weight too. Called on an empty
    model, before loading: the fused tensors are left uninitialised (copying garbage cost 0.5 s per load).
    """
    def fused(parts: list[torch.Tensor]) -> torch.Tensor:
        first = parts[0]
        return torch.empty((sum(p.shape[0] for p in parts), *first.shape[1:]), dtype=first.dtype, device=first.device)

    weight = fused([m.weight for m in linears])
    bias = fused([m.bias for m in linears]) if linears[0].bias is not None else None
    row = 0
    for m in linears:
        rows = m.weight.shape[0]
        m.weight = nn.Parameter(weight[row:row + rows], requires_grad=False)
        if bias is not None:
            m.bias = nn.Parameter(bias[row:row + rows], requires_grad=False)
        row += rows
    return weight, bias


def project(ops: Ops, x: torch.Tensor | Fp8Rows, weight: torch.Tensor, bias: torch.Tensor | None,
            scale: torch.Tensor | None) -> torch.Tensor:
    """x @ weight.T (+ bias): an FP8 product when the weight was quantized (`scale`: its per-channel scales;
    x may then come quantized already, from the norm or SiLU·mul before it)."""
    return ops.linear(x, weight, bias) if scale is None else ops.fp8_linear(x, weight, scale, bias)


class Linear(nn.Linear):
    """nn.Linear without its initialiser: a DecoderLM is built on the meta device and its weights loaded after,
    and an initialiser's first run on the meta device imports torch's Python meta kernels (~1 s of CPU in every
    process that builds an engine: each rollout worker and its restarts)."""

    def reset_parameters(self) -> None:
        pass


class Embedding(nn.Embedding):
    """nn.Embedding without its initialiser (see Linear)."""

    def reset_parameters(self) -> None:
        pass


class RMSNorm(nn.Module):
    """Holds the weight; the computation is the ops backend's."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps


class Attention(nn.Module):
    def __init__(self, config: Any, flags: ArchFlags, ops: Ops):
        super().__init__()
        hidden = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = rope_head_dim(config)
        self.scale = self.head_dim**-0.5
        self.ops = ops
        self.q_proj = Linear(hidden, self.num_heads * self.head_dim, bias=flags.qkv_bias)
        self.k_proj = Linear(hidden, self.num_kv_heads * self.head_dim, bias=flags.qkv_bias)
        self.v_proj = Linear(hidden, self.num_kv_heads * self.head_dim, bias=flags.qkv_bias)
        self.o_proj = Linear(self.num_heads * self.head_dim, hidden, bias=flags.o_bias)
        if flags.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.qk_norm = flags.qk_norm
        self.qkv: tuple[torch.Tensor, torch.Tensor | None] | None = None
        self.qkv_sizes = [self.num_heads * self.head_dim] + [self.num_kv_heads * self.head_dim] * 2
        self.qkv_scale = self.o_scale = None  # per-channel scales once the weights are FP8 (model/quantize.py)

    def fuse(self) -> None:
        self.qkv = fuse_linears([self.q_proj, self.k_proj, self.v_proj])

    def forward(
        self, x: torch.Tensor | Fp8Rows, positions: torch.Tensor, kv_layer: torch.Tensor, meta: AttentionMetadata,
        cos_sin: torch.Tensor,
    ) -> torch.Tensor:
        tokens = x.shape[0]
        if self.qkv is not None:
            q, k, v = project(self.ops, x, *self.qkv, self.qkv_scale).split(self.qkv_sizes, dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.view(tokens, self.num_heads, self.head_dim)
        k = k.view(tokens, self.num_kv_heads, self.head_dim)
        v = v.view(tokens, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q = self.ops.rms_norm(q, self.q_norm.weight, self.q_norm.eps)
            k = self.ops.rms_norm(k, self.k_norm.weight, self.k_norm.eps)
        q = self.ops.rope_and_write_kv(q, k, v, positions, cos_sin, kv_layer, meta.slot_mapping)
        out = self.ops.attention(q, kv_layer, meta, self.scale)
        out = out.reshape(tokens, self.num_heads * self.head_dim)
        return project(self.ops, out, self.o_proj.weight, self.o_proj.bias, self.o_scale)


class MLP(nn.Module):
    def __init__(self, config: Any, flags: ArchFlags, ops: Ops):
        super().__init__()
        self.ops = ops
        hidden, inter = config.hidden_size, config.intermediate_size
        self.gate_proj = Linear(hidden, inter, bias=flags.mlp_bias)
        self.up_proj = Linear(hidden, inter, bias=flags.mlp_bias)
        self.down_proj = Linear(inter, hidden, bias=flags.mlp_bias)
        self.gate_up: tuple[torch.Tensor, torch.Tensor | None] | None = None
        self.gate_up_scale = self.down_scale = None  # per-channel scales once the weights are FP8

    def fuse(self) -> None:
        self.gate_up = fuse_linears([self.gate_proj, self.up_proj])

    def forward(self, x: torch.Tensor | Fp8Rows) -> torch.Tensor:
        if self.gate_up_scale is not None:
            x = self.ops.silu_and_mul_fp8(project(self.ops, x, *self.gate_up, self.gate_up_scale))
        elif self.gate_up is not None:
            x = self.ops.gated_linear(x, *self.gate_up)
        else:
            x = F.silu(self.gate_proj(x)) * self.up_proj(x)
        return project(self.ops, x, self.down_proj.weight, self.down_proj.bias, self.down_scale)


class DecoderLayer(nn.Module):
    def __init__(self, config: Any, flags: ArchFlags, ops: Ops, layer_idx: int = 0, moe: MoeSpec | None = None):
        super().__init__()
        self.ops = ops
        self.self_attn = Attention(config, flags, ops)
        moe_index = moe.moe_index(layer_idx) if moe else None
        if moe_index is None:
            self.mlp: MLP | SparseMoeBlock = MLP(config, flags, ops)
        else:
            self.mlp = SparseMoeBlock(config.hidden_size, moe, moe_index, ops)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor, kv_layer: torch.Tensor,
        meta: AttentionMetadata, cos_sin: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # The residual add of the previous block is fused into this block's first norm.
        x, residual = self._norm(self.input_layernorm, x, residual, self.self_attn.qkv_scale is not None)
        x = self.self_attn(x, positions, kv_layer, meta, cos_sin)
        x, residual = self._norm(self.post_attention_layernorm, x, residual,
                                 getattr(self.mlp, "gate_up_scale", None) is not None)
        if isinstance(self.mlp, SparseMoeBlock):
            return self.mlp(x, meta.slot_mapping), residual
        return self.mlp(x), residual


    def _norm(self, norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor | None,
              quantized: bool) -> tuple[torch.Tensor | Fp8Rows, torch.Tensor]:
        """(norm(x + residual), x + residual), x itself the residual when there is none yet; quantized for an
        FP8 projection next (one kernel on a kernel backend)."""
        if quantized:
            return self.ops.rms_norm_fp8(x, residual, norm.weight, norm.eps)
        if residual is None:
            return self.ops.rms_norm(x, norm.weight, norm.eps), x
        return self.ops.add_rms_norm(x, residual, norm.weight, norm.eps)


class Backbone(nn.Module):
    def __init__(self, config: Any, flags: ArchFlags, ops: Ops, moe: MoeSpec | None):
        super().__init__()
        self.ops = ops
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, flags, ops, i, moe) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
        meta: AttentionMetadata, cos_sin: torch.Tensor,
    ) -> torch.Tensor:
        x, residual = self.embed_tokens(input_ids), None
        for layer, kv_layer in zip(self.layers, kv_caches, strict=True):
            x, residual = layer(x, residual, positions, kv_layer, meta, cos_sin)
        x, _ = self.ops.add_rms_norm(x, residual, self.norm.weight, self.norm.eps)
        return x


class DecoderLM(nn.Module):
    """forward(input_ids [T], positions [T], kv_caches, meta) -> hidden [T, H]; compute_logits -> float32."""

    def __init__(self, config: Any, ops: Ops | None = None, max_positions: int | None = None):
        super().__init__()
        flags = arch_flags(config)
        self.config = config
        self.ops = ops if ops is not None else select_ops("torch")
        self.max_positions = max_positions or config.max_position_embeddings
        self.moe = moe_spec(config)  # None for a dense model
        self.model = Backbone(config, flags, self.ops, self.moe)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_embeddings()
        # Not in the state dict (HF does not save it either); follows .to(dtype) like HF's cos/sin cast.
        self.register_buffer("cos_sin", build_cos_sin_cache(config, self.max_positions), persistent=False)

    @classmethod
    def empty(
        cls, config: Any, dtype: torch.dtype, device: torch.device | str, ops: Ops | None = None,
        max_positions: int | None = None,
    ) -> "DecoderLM":
        """Uninitialised weights allocated straight on `device` in `dtype`, ready to be loaded."""
        with torch.device("meta"):
            model = cls(config, ops, max_positions)
        model = model.to(dtype=dtype).to_empty(device=device)
        model.tie_embeddings()  # moving off the meta device re-creates Parameters, untying them
        model.fuse_projections()
        model.cos_sin = build_cos_sin_cache(config, model.max_positions, dtype, device)
        return model

    @property
    def tied_embeddings(self) -> bool:
        return bool(getattr(self.config, "tie_word_embeddings", False))

    def tie_embeddings(self) -> None:
        if self.tied_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def fuse_projections(self) -> None:
        """Fuse q/k/v and gate/up weights (see fuse_linears); loading then fills the fused tensors."""
        for layer in self.model.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()

    def moe_layers(self) -> list[SparseMoeBlock]:
        """The MoE blocks in layer order: moe_layers()[i].moe_index == i (empty for a dense model)."""
        return [layer.mlp for layer in self.model.layers if isinstance(layer.mlp, SparseMoeBlock)]

    @property
    def num_moe_layers(self) -> int:
        return len(self.moe.sparse_layers) if self.moe else 0

    def cuda_graph_blocker(self) -> str | None:
        """Why decode steps of this model cannot be captured in a CUDA graph, or None if they can."""
        if self.moe is None:
            return None
        weight = self.lm_head.weight
        return self.ops.moe_graph_blocker(weight.dtype, weight.device)

    def kv_cache_spec(self) -> tuple[int, int, int]:
        """(num_layers, num_kv_heads, head_dim) for allocating the paged KV cache."""
        attn = self.model.layers[0].self_attn
        return len(self.model.layers), attn.num_kv_heads, attn.head_dim

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        return self.model(input_ids, positions, kv_caches, meta, self.cos_sin)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits, not rounded to the model dtype first (see Ops.logits)."""
        return self.ops.logits(hidden, self.lm_head.weight)
