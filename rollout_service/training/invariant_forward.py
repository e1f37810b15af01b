"""The learner's recompute with the rollout engine's batch-invariant numerics.

`InvariantForward(policy).logprobs(results)` gives, for each rollout result, the log-probs of its tokens under
the policy's current weights, computed with the same operations in the same order as an engine running with
`EngineConfig(batch_invariant=True)` on the same backend: its forward calls the engine's own invariant ops
(ops/invariant.py on the torch backend, ops/invariant_cuda.py's kernels and fixed-shape cuBLAS calls on the cuda
backend) in the engine's order. So while the weights are the ones the engine sampled with, the learner's
log-probs are the rollout's, bit for bit, and the PPO ratio of the first minibatch is exactly 1. Gradients
flow: every op is an autograd function whose forward is the engine's op and whose backward is the plain torch
reference math (the products' explicit formulas; the rest by differentiating a recompute of the reference).

The policy is any HF-named decoder (transformers' Llama / Mistral / Qwen2 / Qwen3 / Qwen3-MoE / Mixtral
*ForCausalLM, or this package's DecoderLM), trained in place: its parameters are read at every call, never
copied. In an MoE layer the experts each token is sent to are the engine's choice: the results' recorded
routing where they carry it (SamplingParams.return_routed_experts and return_prompt_routed_experts: routing
replay), else recomputed the same way; the mixing weights are the router's, recomputed with the engine's
product (the same bits as the engine's while the weights are the same). The gradient flows through the chosen
experts' weights and the router's softmax, not through the choice.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from rollout_service.model.moe import check_moe_backend
from rollout_service.model.registry import arch_flags, moe_spec
from rollout_service.ops import moe_experts, norm
from rollout_service.ops.backend import resolve_backend, select_ops
from rollout_service.ops.rope import apply_rope, build_cos_sin_cache, rope_head_dim
from rollout_service.results.receipts import receipt_of, weights_digest
from rollout_service.training.routing_replay import check_routing, packed_routing
from rollout_service.api.types import RolloutResult

Routing = tuple[torch.Tensor, torch.Tensor]


@dataclass
class Verdict:
    """InvariantForward.verify's answer for one result: ok, or why not. `first_diff`: the first token whose
    recomputed log-prob is not bitwise the result's, `delta` the difference there (recomputed - reported)."""

    ok: bool
    reason: str = ""
    first_diff: int | None = None
    delta: float | None = None  # (expert ids [T, moe_layers, k], replayed rows bool [T])


def reference_self_attention(q, k, v, cos_sin: torch.Tensor, lens: list[int], scale: float) -> torch.Tensor:
    """RoPE then causal attention per sequence with torch's SDPA in float32, in q's dtype: the math the
    backward differentiates (q, k not yet rotated; sequences back to back)."""
    positions = torch.cat([torch.arange(n, device=q.device) for n in lens])
    q, k = apply_rope(q, k, positions, cos_sin)
    outs, start = [], 0
    for n in lens:
        qs, ks, vs = (t[start:start + n].transpose(0, 1).float() for t in (q, k, v))
        o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale,
                                           enable_gqa=qs.shape[0] != ks.shape[0])
        outs.append(o.transpose(0, 1))
        start += n
    return torch.cat(outs).to(q.dtype)


class _Exact(torch.autograd.Function):
    """Forward: fast(*tensors), the engine's op; backward: the gradient of ref(*tensors), the reference math."""

    @staticmethod
    def forward(ctx, fast, ref, *tensors):
        ctx.ref = ref
        ctx.save_for_backward(*tensors)
        return fast(*tensors)

    @staticmethod
    def backward(ctx, *grads):
        inputs = [t.detach().requires_grad_(need) for t, need in zip(ctx.saved_tensors, ctx.needs_input_grad[2:])]
        with torch.enable_grad():
            out = ctx.ref(*inputs)
        pairs = [(o, g) for o, g in zip(out if isinstance(out, tuple) else (out,), grads)
                 if g is not None and o.requires_grad]
        wanted = [t for t in inputs if t.requires_grad]
        got = iter(torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs], allow_unused=True)
                   if wanted and pairs else [None] * len(wanted))
        return (None, None, *[next(got) if t.requires_grad else None for t in inputs])


def exact(fast: Callable, ref: Callable, *tensors: torch.Tensor):
    """fast(*tensors), with the gradient of ref(*tensors) when one is wanted."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return _Exact.apply(fast, ref, *tensors)
    return fast(*tensors)


class _Linear(torch.autograd.Function):
    """Forward: the engine's product; backward the reference's: dx = dy W, dW = dy^T x, db = sum dy."""

    @staticmethod
    def forward(ctx, ops, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return ops.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        g = grad.reshape(-1, grad.shape[-1])
        dx = (g @ weight).view(x.shape) if ctx.needs_input_grad[1] else None
        dw = g.t() @ x.reshape(-1, x.shape[-1]) if ctx.needs_input_grad[2] else None
        db = g.sum(0) if ctx.has_bias and ctx.needs_input_grad[3] else None
        return None, dx, dw, db


def _cat(*tensors: torch.Tensor | None) -> torch.Tensor | None:
    return None if tensors[0] is None else torch.cat(tensors)


class InvariantForward:
    """A differentiable forward of `policy` with the batch-invariant engine's numerics (module docstring).

    backend: the engine's ("torch" or "cuda"; "auto" as the engine resolves it on the policy's device)."""

    def __init__(self, policy: nn.Module, backend: str = "auto"):
        self.policy = policy
        self.config = policy.config
        self.flags = arch_flags(self.config)
        self.head_dim = rope_head_dim(self.config)
        self.eps = self.config.rms_norm_eps
        self.backend = resolve_backend(backend, next(policy.parameters()).device)
        self.moe = moe_spec(self.config)
        param = next(policy.parameters())
        check_moe_backend(self.moe, self.config, self.backend, True, param.dtype, param.device)
        self.ops = select_ops(self.backend, batch_invariant=True)
        self._cos_sin: torch.Tensor | None = None

    def _rope_table(self, like: torch.Tensor) -> torch.Tensor:
        # the engine's table: same builder, dtype and device (rows do not depend on the table's length)
        if self._cos_sin is None or self._cos_sin.dtype != like.dtype or self._cos_sin.device != like.device:
            self._cos_sin = build_cos_sin_cache(self.config, self.config.max_position_embeddings, like.dtype,
                                                like.device)
        return self._cos_sin

    # ---- the engine's ops, differentiable ------------------------------------------------------------

    def _linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias)):
            return _Linear.apply(self.ops, x, weight, bias)
        return self.ops.linear(x, weight, bias)

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return exact(lambda x, w: self.ops.rms_norm(x, w, self.eps), lambda x, w: norm.rms_norm(x, w, self.eps),
                     x, weight)

    def _add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor,
                      weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # the CUDA kernel writes x + residual into residual: give it a copy, the input is saved for backward
        return exact(lambda x, r, w: self.ops.add_rms_norm(x, r.clone(), w, self.eps),
                     lambda x, r, w: norm.add_rms_norm(x, r, w, self.eps), x, residual, weight)

    def _silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        def ref(gu):
            gate, up = gu.chunk(2, dim=-1)
            return F.silu(gate) * up
        return exact(self.ops.silu_and_mul, ref, gate_up)

    # ---- the forward -------------------------------------------------------------------------------

    def hidden(self, input_ids: torch.Tensor, lens: list[int], routing: Routing | None = None) -> torch.Tensor:
        """Final-norm hidden states [T, H] of sequences laid back to back (lens), as DecoderLM computes them;
        routing: recorded experts for the replayed rows, MoE layer by MoE layer (packed_routing)."""
        backbone = self.policy.model
        x, residual = backbone.embed_tokens(input_ids), None
        cos_sin = self._rope_table(x)
        moe_layer = 0
        for layer in backbone.layers:
            if residual is None:
                residual, x = x, self._rms_norm(x, layer.input_layernorm.weight)
            else:
                x, residual = self._add_rms_norm(x, residual, layer.input_layernorm.weight)
            x = self._attention(layer.self_attn, x, lens, cos_sin)
            x, residual = self._add_rms_norm(x, residual, layer.post_attention_layernorm.weight)
            if hasattr(layer.mlp, "experts"):
                x = self._moe(layer.mlp, x, None if routing is None else (routing[0][:, moe_layer], routing[1]))
                moe_layer += 1
            else:
                x = self._mlp(layer.mlp, x)
        x, _ = self._add_rms_norm(x, residual, backbone.norm.weight)
        return x

    def _mlp(self, mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:
        gate_up = self._linear(x, _cat(mlp.gate_proj.weight, mlp.up_proj.weight),
                               _cat(mlp.gate_proj.bias, mlp.up_proj.bias))
        return self._linear(self._silu_and_mul(gate_up), mlp.down_proj.weight, mlp.down_proj.bias)

    def _moe(self, block: nn.Module, x: torch.Tensor, recorded: Routing | None = None) -> torch.Tensor:
        """The engine's routing (ids and weights: the recorded ids on replayed rows, the weights the router's
        at them), then its experts; the backward differentiates the plain torch math of both with the experts
        held at the engine's choice."""
        router, gate_up, down = block.gate.weight, block.experts.gate_up_proj, block.experts.down_proj
        top_k, renormalize = self.moe.top_k, self.moe.renormalize
        with torch.no_grad():
            ids, chosen = self.ops.moe_route(x.detach(), router.detach(), top_k, renormalize)
            if recorded is not None:
                ids = torch.where(recorded[1].to(x.device)[:, None], recorded[0].to(ids.device, ids.dtype), ids)
                chosen = moe_experts.route_weights(x.detach(), router.detach(), ids, renormalize,
                                           product=lambda a, w: self.ops.linear(a, w))
        weights = exact(lambda x, r: chosen.clone(), lambda x, r: moe_experts.route_weights(x, r, ids, renormalize),
                        x, router)
        return exact(lambda x, w, gu, d: self.ops.moe_experts(x, ids, w, gu, d),
                     lambda x, w, gu, d: moe_experts.experts(x, ids, w, gu, d), x, weights, gate_up, down)

    def _attention(self, attn: nn.Module, x: torch.Tensor, lens: list[int], cos_sin: torch.Tensor) -> torch.Tensor:
        cfg, d, tokens = self.config, self.head_dim, x.shape[0]
        hq, hk = cfg.num_attention_heads, cfg.num_key_value_heads
        qkv = self._linear(x, _cat(attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight),
                           _cat(attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias))
        q, k, v = qkv.split([hq * d, hk * d, hk * d], dim=-1)
        q, k, v = q.reshape(tokens, hq, d), k.reshape(tokens, hk, d), v.reshape(tokens, hk, d)
        if self.flags.qk_norm:
            q = self._rms_norm(q, attn.q_norm.weight)
            k = self._rms_norm(k, attn.k_norm.weight)
        scale = d**-0.5
        out = exact(lambda q, k, v: self.ops.causal_self_attention(q, k, v, cos_sin, lens, scale),
                    lambda q, k, v: reference_self_attention(q, k, v, cos_sin, lens, scale), q, k, v)
        return self._linear(out.reshape(tokens, hq * d), attn.o_proj.weight, attn.o_proj.bias)

    def _recorded_routing(self, results: Sequence[RolloutResult]) -> Routing | None:
        if self.moe is None:
            return None
        layers = len(self.moe.sparse_layers)
        check_routing(results, layers, self.moe.top_k, self.moe.num_experts, required=False)
        return packed_routing(results, layers, self.moe.top_k)

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
        hidden = self.hidden(ids, lens, self._recorded_routing(results))
        rows, start = [], 0  # the hidden state before each sampled token
        for r, n in zip(results, lens):
            first = start + len(r.prompt_token_ids) - 1
            rows.append(torch.arange(first, first + len(r.token_ids), device=device))
            start += n
        logits = exact(self.ops.logits, lambda h, w: F.linear(h.float(), w.float()),
                       hidden[torch.cat(rows)], self.policy.lm_head.weight)
        if temperature != 1.0:  # the sampler divides by a float32 temperature, and only when it is not 1
            logits = logits / torch.tensor(temperature, dtype=torch.float32, device=device)
        targets = torch.tensor([t for r in results for t in r.token_ids], dtype=torch.long, device=device)
        lse = exact(self.ops.logsumexp, lambda x: x.logsumexp(dim=1), logits)
        token_logprobs = logits.gather(1, targets[:, None])[:, 0] - lse
        return list(token_logprobs.split([len(r.token_ids) for r in results]))

    @torch.no_grad()
    def verify(self, results: Sequence[RolloutResult], temperature: float = 1.0,
               digest: str | None = None, key: str | bytes | None = None) -> list[Verdict]:
        """Check batch-invariant rollouts against the policy's current weights (those of the results' version):
        each result must be well formed, its receipt what its content and these weights give
        (rollout_service/results/receipts.py; `key`: the service's EngineConfig.receipt_key, when it has one), and its
        log-probs bitwise this forward's. `digest`: the weights digest to expect (default: the policy's own, by
        parameter name). One Verdict per result, in order."""
        digest = digest or weights_digest(self.policy.named_parameters())
        out = []
        for r in results:
            problem = malformed(r)
            if problem:
                out.append(Verdict(False, f"malformed result: {problem}"))
                continue
            if r.receipt is None:
                out.append(Verdict(False, "no receipt (not from a batch-invariant engine, an episode, or "
                                          "spans a refresh)"))
                continue
            (mine,) = self.logprobs([r], temperature)
            got = mine.float().cpu().numpy()
            differs = (got.view("<i4") != r.logprobs.astype("<f4").view("<i4")).nonzero()[0]
            if len(differs):
                i = int(differs[0])
                out.append(Verdict(False, f"log-prob of token {i} differs", i, float(got[i] - r.logprobs[i])))
            elif receipt_of(r, digest, key) != r.receipt:
                out.append(Verdict(False, "the receipt does not match the result and these weights (other "
                                          "weights, another version, a changed field, or another key)"))
            else:
                out.append(Verdict(True))
        return out


def malformed(r: RolloutResult) -> str | None:
    """What is wrong with a result's fields (the checks of its constructor, re-run: a field may have been edited
    in place since), or None."""
    try:
        dataclasses.replace(r)
    except (ValueError, TypeError) as e:
        return str(e)
    for name in ("token_versions", "kv_versions"):
        values = getattr(r, name) or []
        if any(not isinstance(v, (int, np.integer)) or v < 0 for v in values):
            return f"RolloutResult.{name}: must be ints >= 0"
    return None
