"""The learner's recompute with the rollout engine's batch-invariant numerics.

`InvariantForward(policy).logprobs(results)` gives, for each rollout result, the log-probs of its tokens under
the policy's current weights, computed with the same operations in the same order as an engine running with
`EngineConfig(batch_invariant=True)`: the fused q/k/v and gate/up products on fixed row tiles, attention in
fixed key blocks, the float32 LM head, the reference norms, RoPE and SiLU. So while the weights are the ones
the engine sampled with, the learner's log-probs are the rollout's, bit for bit, and the PPO ratio of the
first minibatch is exactly 1. Gradients flow: the products and attention are autograd functions whose
backward is the plain torch reference math (ops/invariant.py).

The policy is any HF-named decoder (transformers' Llama / Mistral / Qwen2 / Qwen3 *ForCausalLM, or this
package's DecoderLM), trained in place: its parameters are read at every call, never copied.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from rollout_service.model.registry import arch_flags
from rollout_service.ops import invariant, norm
from rollout_service.ops.rope import apply_rope, build_cos_sin_cache, rope_head_dim
from rollout_service.types import RolloutResult


def _padded_per_sequence(x: torch.Tensor, lens: list[int]) -> torch.Tensor:
    """x [T, H, D] (sequences back to back) as float32 [B, H, max(lens), D], zero past each length."""
    out = x.new_zeros(len(lens), x.shape[1], max(lens), x.shape[2], dtype=torch.float32)
    start = 0
    for b, n in enumerate(lens):
        out[b, :, :n] = x[start:start + n].transpose(0, 1).float()
        start += n
    return out


def _reference_self_attention(q, k, v, lens: list[int], scale: float) -> torch.Tensor:
    """Causal attention per sequence with torch's SDPA in float32: the math the backward differentiates."""
    outs, start = [], 0
    for n in lens:
        qs, ks, vs = (t[start:start + n].transpose(0, 1).float() for t in (q, k, v))
        o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale,
                                           enable_gqa=qs.shape[0] != ks.shape[0])
        outs.append(o.transpose(0, 1))
        start += n
    return torch.cat(outs)


class _SelfAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, lens, scale):
        ctx.save_for_backward(q, k, v)
        ctx.lens, ctx.scale = lens, scale
        keys, values = _padded_per_sequence(k, lens), _padded_per_sequence(v, lens)
        return invariant.block_attention_forward(q, keys, values, lens, lens, scale)

    @staticmethod
    def backward(ctx, grad):
        q, k, v = (t.detach().requires_grad_() for t in ctx.saved_tensors)
        with torch.enable_grad():
            ref = _reference_self_attention(q, k, v, ctx.lens, ctx.scale)
            dq, dk, dv = torch.autograd.grad(ref, (q, k, v), grad)
        return dq, dk, dv, None, None


def self_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: list[int], scale: float) -> torch.Tensor:
    """Causal attention of sequences laid back to back ([T, H, D] each), the engine's invariant numerics."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        return _SelfAttention.apply(q, k, v, lens, scale)
    return invariant.block_attention_forward(q, _padded_per_sequence(k, lens), _padded_per_sequence(v, lens),
                                             lens, lens, scale)


def _cat(*tensors: torch.Tensor | None) -> torch.Tensor | None:
    return None if tensors[0] is None else torch.cat(tensors)


class InvariantForward:
    """A differentiable forward of `policy` with the batch-invariant engine's numerics (module docstring)."""

    def __init__(self, policy: nn.Module):
        self.policy = policy
        self.config = policy.config
        self.flags = arch_flags(self.config)
        self.head_dim = rope_head_dim(self.config)
        self.eps = self.config.rms_norm_eps
        self._cos_sin: torch.Tensor | None = None

    def _rope_table(self, like: torch.Tensor) -> torch.Tensor:
        # the engine's table: same builder, dtype and device (rows do not depend on the table's length)
        if self._cos_sin is None or self._cos_sin.dtype != like.dtype or self._cos_sin.device != like.device:
            self._cos_sin = build_cos_sin_cache(self.config, self.config.max_position_embeddings, like.dtype,
                                                like.device)
        return self._cos_sin

    def hidden(self, input_ids: torch.Tensor, positions: torch.Tensor, lens: list[int]) -> torch.Tensor:
        """Final-norm hidden states [T, H] of sequences laid back to back (lens), as DecoderLM computes them."""
        backbone = self.policy.model
        x, residual = backbone.embed_tokens(input_ids), None
        cos_sin = self._rope_table(x)
        for layer in backbone.layers:
            if residual is None:
                residual, x = x, norm.rms_norm(x, layer.input_layernorm.weight, self.eps)
            else:
                x, residual = norm.add_rms_norm(x, residual, layer.input_layernorm.weight, self.eps)
            x = self._attention(layer.self_attn, x, positions, lens, cos_sin)
            x, residual = norm.add_rms_norm(x, residual, layer.post_attention_layernorm.weight, self.eps)
            mlp = layer.mlp
            gate_up = invariant.linear(x, _cat(mlp.gate_proj.weight, mlp.up_proj.weight),
                                       _cat(mlp.gate_proj.bias, mlp.up_proj.bias))
            gate, up = gate_up.chunk(2, dim=-1)
            x = invariant.linear(F.silu(gate) * up, mlp.down_proj.weight, mlp.down_proj.bias)
        x, _ = norm.add_rms_norm(x, residual, backbone.norm.weight, self.eps)
        return x

    def _attention(self, attn: nn.Module, x: torch.Tensor, positions: torch.Tensor, lens: list[int],
                   cos_sin: torch.Tensor) -> torch.Tensor:
        cfg, d, tokens = self.config, self.head_dim, x.shape[0]
        hq, hk = cfg.num_attention_heads, cfg.num_key_value_heads
        qkv = invariant.linear(x, _cat(attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight),
                               _cat(attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias))
        q, k, v = qkv.split([hq * d, hk * d, hk * d], dim=-1)
        q, k, v = q.reshape(tokens, hq, d), k.reshape(tokens, hk, d), v.reshape(tokens, hk, d)
        if self.flags.qk_norm:
            q = norm.rms_norm(q, attn.q_norm.weight, self.eps)
            k = norm.rms_norm(k, attn.k_norm.weight, self.eps)
        q, k = apply_rope(q, k, positions, cos_sin)
        out = self_attention(q, k, v, lens, d**-0.5).to(q.dtype)
        return invariant.linear(out.reshape(tokens, hq * d), attn.o_proj.weight, attn.o_proj.bias)

    def logprobs(self, results: Sequence[RolloutResult], temperature: float = 1.0) -> list[torch.Tensor]:
        """log p(token_ids[i] | prompt + earlier tokens) per result (float32), as the engine's sampler reports
        them in "scaled" mode (and "processed" / "raw" without truncation or penalties at temperature 1)."""
        if temperature <= 0:
            raise ValueError(f"temperature={temperature}: logprobs are recomputed at a sampling temperature > 0")
        if not results:
            return []
        device = next(self.policy.parameters()).device
        seqs = [list(r.prompt_token_ids) + list(r.token_ids) for r in results]
        lens = [len(s) for s in seqs]
        ids = torch.tensor([t for s in seqs for t in s], dtype=torch.long, device=device)
        positions = torch.cat([torch.arange(n, device=device) for n in lens])
        hidden = self.hidden(ids, positions, lens)
        rows, start = [], 0  # the hidden state before each sampled token
        for r, n in zip(results, lens):
            first = start + len(r.prompt_token_ids) - 1
            rows.append(torch.arange(first, first + len(r.token_ids), device=device))
            start += n
        logits = invariant.logits(hidden[torch.cat(rows)], self.policy.lm_head.weight)
        if temperature != 1.0:  # the sampler divides by a float32 temperature, and only when it is not 1
            logits = logits / torch.tensor(temperature, dtype=torch.float32, device=device)
        out, at = [], 0
        for r in results:
            x = logits[at:at + len(r.token_ids)]
            target = torch.tensor(r.token_ids, dtype=torch.long, device=device)
            out.append(x.gather(1, target[:, None])[:, 0] - invariant.logsumexp(x))
            at += len(r.token_ids)
        return out
