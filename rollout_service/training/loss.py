"""The PPO-clip policy loss against the behaviour policy's log-probs, for every learner of this project."""
from __future__ import annotations

from typing import Sequence

import torch

from rollout_service.training.importance import importance_weights


def ppo_clip_loss(new_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, advantage: float, clip_eps: float,
                  tis_cap: float | None = None, reduction: str = "sum") -> torch.Tensor:
    """One sample's loss over its tokens: -min(r A, clip(r, 1 - eps, 1 + eps) A) per token, r = exp(new - rollout)
    the importance ratio to the behaviour policy. `tis_cap`: each token's term is also weighted by the truncated
    importance weight min(1, tis_cap / r) (no gradient through it), which bounds what a token the learner finds
    far likelier than the rollout did can contribute. `reduction`: "sum" or "mean" over the tokens, or "none"
    (one loss per token)."""
    ratio = torch.exp(new_logprobs - rollout_logprobs)
    losses = -torch.minimum(ratio * advantage, torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps) * advantage)
    if tis_cap is not None:
        losses = losses * torch.clamp(tis_cap / ratio.detach(), max=1.0)
    if reduction == "sum":
        return losses.sum()
    if reduction == "mean":
        return losses.mean()
    if reduction == "none":
        return losses
    raise ValueError(f"ppo_clip_loss: reduction={reduction!r}; choose 'sum', 'mean' or 'none'")


def corrected_pg_loss(new_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, advantage: float, clip_eps: float,
                      correction: str, cap: float) -> torch.Tensor:
    """One sample's summed loss when the learner's weights are the ones the engine sampled with (one update
    per batch): PPO's ratio against the learner's own recompute (so exactly 1 in value), each token weighed by
    the learner's and the engine's probability ratio, truncated ("tis") or masked ("mis") at `cap`
    (training/importance.py). The gradient is sum_t w_t A grad log p(t): what the engine's numerics skewed is
    corrected, not mistaken for a policy change."""
    weights = importance_weights(rollout_logprobs, new_logprobs, correction, cap)
    return (ppo_clip_loss(new_logprobs, new_logprobs.detach(), advantage, clip_eps, reduction="none") * weights).sum()


def ratio_deviation(lps: Sequence[torch.Tensor], old: Sequence[torch.Tensor],
                    keep: Sequence[torch.Tensor]) -> tuple[float | None, int]:
    """(max |ratio - 1|, tokens) over the kept tokens of one micro-batch, the ratio as ppo_clip_loss forms it."""
    with torch.no_grad():
        dev = [(torch.exp(lp[k] - o[k]) - 1).abs() for lp, o, k in zip(lps, old, keep)]
        flat = torch.cat(dev) if dev else torch.zeros(0)
    return (float(flat.max()) if flat.numel() else None), int(flat.numel())
