"""Rollout routing replay (R3) on the learner's side: a transformers mixture-of-experts policy's forward over
rollout results' sequences sends every token to the experts the engine chose (RolloutResult.routed_experts and
prompt_routed_experts), so a router near-tie that falls another way in the learner's numerics no longer swaps a
token's experts between the behaviour policy and the recompute.

The mixing weights stay the policy's own, as R3 has them: its router's softmax over all experts (float32, as
transformers computes it), gathered at the recorded experts and renormalised as the config says (Mixtral
always, Qwen3-MoE with norm_topk_prob). Gradients flow through that softmax to the router's weights at the
recorded experts, and through the recorded experts' weights; not through the choice.

Positions the results record nothing for run on the policy's own routing: each sequence's last token (it
produces no log-prob of a sampled token and, attention being causal, changes none) and the right padding.
The prompt's positions need prompt_routed_experts (SamplingParams.return_prompt_routed_experts=True): their
experts shape the KV every sampled token attends to, so a result without it is refused rather than half
replayed.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Sequence

import numpy as np
import torch
from torch import nn

from rollout_service.model.registry import moe_spec
from rollout_service.api.types import RolloutResult


@dataclass
class RoutingStats:
    """Positions that produced a sampled token (the model's, by loss_mask), and how many of those had at least
    one MoE layer whose router, on its own, would have chosen other experts than the recorded ones (compared
    as sets). Under replay each layer's own choice is taken on the replayed forward's hidden states."""

    tokens: int = 0
    differing: int = 0

    def add(self, other: "RoutingStats") -> None:
        self.tokens += other.tokens
        self.differing += other.differing

    @property
    def share(self) -> float:
        return self.differing / self.tokens if self.tokens else 0.0

    def as_dict(self) -> dict:
        return {"routing_tokens": self.tokens, "routing_differing": self.differing,
                "routing_differing_share": self.share}


def moe_routers(policy: nn.Module) -> list[nn.Module]:
    """The router (TopKRouter) of every sparse layer of a transformers Qwen3-MoE / Mixtral policy, in order."""
    spec = moe_spec(policy.config)
    blocks = [layer.mlp for layer in policy.model.layers if hasattr(layer.mlp, "experts")]
    if spec is None or not blocks:
        raise ValueError(f"routing replay: the policy ({policy.config.model_type}) has no mixture-of-experts layers")
    if len(blocks) != len(spec.sparse_layers) or not all(hasattr(b.gate, "top_k") for b in blocks):
        raise ValueError("routing replay needs a transformers Qwen3-MoE or Mixtral policy (sparse blocks whose "
                         "`gate` is a TopKRouter)")
    return [b.gate for b in blocks]


def carries_routing(result: RolloutResult) -> bool:
    """Whether a result holds its routing, prompt included (what a replay needs)."""
    return result.routed_experts is not None and result.prompt_routed_experts is not None


def check_routing(results: Sequence[RolloutResult], layers: int, top_k: int, num_experts: int,
                  required: bool = True) -> None:
    """ValueError naming the result whose recorded routing does not fit the policy (or, if `required`, is
    missing)."""
    for i, r in enumerate(results):
        if not required and not carries_routing(r):
            continue
        for name in ("routed_experts", "prompt_routed_experts"):
            ids = getattr(r, name)
            if ids is None:
                raise ValueError(f"routing replay: result {i} has no {name}: sample with SamplingParams("
                                 "return_routed_experts=True, return_prompt_routed_experts=True)")
            if ids.shape[1:] != (layers, top_k):
                raise ValueError(f"routing replay: result {i}'s {name} has shape {ids.shape}; the policy has "
                                 f"{layers} MoE layers of top-{top_k}")
            if ids.size and int(ids.max()) >= num_experts:
                raise ValueError(f"routing replay: result {i}'s {name} holds expert {int(ids.max())}; the policy "
                                 f"has {num_experts}")


def _ids_dtype(results: Sequence[RolloutResult]) -> np.dtype:
    # the recorded width (uint8 or uint16), kept: [tokens, layers, k] of int64 would be 8x the memory. torch
    # has few uint16 ops, so those travel as int32.
    wide = any(r.routed_experts.dtype == np.uint16 for r in results if carries_routing(r))
    return np.dtype(np.int32 if wide else np.uint8)


def packed_routing(results: Sequence[RolloutResult], layers: int,
                   top_k: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(ids [T, layers, k], replayed bool [T]) for the results' sequences back to back (prompt + tokens each;
    InvariantForward's layout), a result without routing replaying nothing; None if none carries it."""
    if not any(carries_routing(r) for r in results):
        return None
    parts, flags, dtype = [], [], _ids_dtype(results)
    for r in results:
        n = len(r.prompt_token_ids) + len(r.token_ids)
        known = np.concatenate([r.prompt_routed_experts, r.routed_experts]) if carries_routing(r) else None
        rows = np.zeros((n, layers, top_k), dtype=dtype)
        rows[:n - 1] = known if known is not None else 0  # the last token's own position produced nothing
        parts.append(rows)
        flags.append(np.arange(n) < (n - 1 if known is not None else 0))
    return torch.from_numpy(np.concatenate(parts)), torch.from_numpy(np.concatenate(flags))


def recorded_layout(results: Sequence[RolloutResult], layers: int, top_k: int) -> tuple[torch.Tensor, ...]:
    """(ids [B * W, layers, k], replayed bool [B * W], counted bool [B * W]) in token_logprobs' layout: result
    b's prompt + tokens at row b, right-padded to the longest W. `counted`: the positions that produced a
    model-sampled token."""
    width = max(len(r.prompt_token_ids) + len(r.token_ids) for r in results)
    ids = np.zeros((len(results), width, layers, top_k), dtype=_ids_dtype(results))
    replayed = np.zeros((len(results), width), dtype=bool)
    counted = np.zeros((len(results), width), dtype=bool)
    for b, r in enumerate(results):
        prompt, n = len(r.prompt_token_ids) - 1, len(r.token_ids)
        ids[b, :prompt + n] = np.concatenate([r.prompt_routed_experts, r.routed_experts])
        replayed[b, :prompt + n] = True
        counted[b, prompt:prompt + n] = True if r.loss_mask is None else np.asarray(r.loss_mask, dtype=bool)
    flat = (len(results) * width,)
    return (torch.from_numpy(ids).view(*flat, layers, top_k), torch.from_numpy(replayed).view(flat),
            torch.from_numpy(counted).view(flat))


@contextmanager
def replay_routing(policy: nn.Module, results: Sequence[RolloutResult], replay: bool = True) -> Iterator[RoutingStats]:
    """Within the block, every forward of `policy` must be over `results`' sequences in token_logprobs' layout
    (rollout_service.training.mismatch), and routes each recorded position to the recorded experts (module docstring).
    Yields the RoutingStats of those forwards. replay=False leaves the policy's own routing in place and only
    counts where it differs from the recorded one. The hooks stay for the whole block: a backward that
    recomputes the layers (gradient checkpointing) inside it replays them too, and counts its forward again."""
    routers = moe_routers(policy)
    spec = moe_spec(policy.config)
    check_routing(results, len(routers), spec.top_k, spec.num_experts)
    ids, replayed, counted = recorded_layout(results, len(routers), spec.top_k)
    stats = RoutingStats()
    differs: list[torch.Tensor] = []  # this forward's positions whose routing differed so far, on the device

    def hook(layer: int, module: nn.Module, args, out):
        if not (isinstance(out, tuple) and len(out) == 3):
            raise ValueError("routing replay: a router returned something other than (logits, weights, ids)")
        logits, weights, own = out
        if own.shape[0] != ids.shape[0]:
            raise ValueError(f"routing replay: the forward has {own.shape[0]} rows; the replayed results' layout "
                             f"(token_logprobs': right-padded, in order) has {ids.shape[0]}")
        recorded = ids[:, layer].to(own.device).long()
        differs.append((own.sort(-1).values != recorded.sort(-1).values).any(-1))
        if layer == len(routers) - 1:  # the forward's last MoE layer: its count is complete (one host sync)
            stats.tokens += int(counted.sum())
            stats.differing += int((torch.stack(differs).any(0) & counted.to(own.device)).sum())
            differs.clear()
        if not replay:
            return out
        chosen = torch.where(replayed.to(own.device)[:, None], recorded, own)
        mixed = torch.softmax(logits.float(), dim=-1).gather(1, chosen)
        if spec.renormalize:
            mixed = mixed / mixed.sum(dim=-1, keepdim=True)
        return logits, mixed.to(weights.dtype), chosen.to(own.dtype)

    handles = [r.register_forward_hook(lambda m, a, o, layer=i: hook(layer, m, a, o)) for i, r in enumerate(routers)]
    try:
        yield stats
    finally:
        for h in handles:
            h.remove()
