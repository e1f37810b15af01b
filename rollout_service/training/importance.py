"""Importance weights that correct for the rollout engine's numerics differing from the learner's.

The rollout engine samples with its own numerics (bf16, FP8 products, other kernels), so the probability it
gave a token, mu(a|s), is not exactly what the learner computes for the same policy, pi(a|s): the ratio
r = pi / mu = exp(learner_logprob - rollout_logprob) is not 1 even on-policy. A learner corrects per token:

- "tis" (truncated importance sampling): weight min(r, cap): unbiased up to the cap, bounded variance;
- "mis" (masked importance sampling): weight 1 where 1/cap <= r <= cap, else 0: the tokens whose
  probabilities the two sides disagree on most are dropped rather than down-weighted.

The weights carry no gradient: they scale a token's loss, they are not trained through.
"""
from __future__ import annotations

import numpy as np
import torch

from rollout_service.api.values import is_real

MODES = ("tis", "mis")


def importance_weights(rollout_logprobs: torch.Tensor | np.ndarray, learner_logprobs: torch.Tensor | np.ndarray,
                       mode: str = "tis", cap: float = 2.0) -> torch.Tensor:
    """Per-token weights (float32, the learner's shape and device, no gradient) for tokens whose behaviour
    log-probs the engine returned (`rollout_logprobs`) and the learner recomputed (`learner_logprobs`)."""
    if mode not in MODES:
        raise ValueError(f"importance_weights: mode={mode!r}; choose one of {MODES}")
    if not is_real(cap) or cap <= 1:
        raise ValueError(f"importance_weights: cap={cap!r} must be a finite number > 1")
    learner = torch.as_tensor(learner_logprobs).detach()
    rollout = torch.as_tensor(rollout_logprobs, device=learner.device).detach()
    if rollout.shape != learner.shape:
        raise ValueError(f"importance_weights: {tuple(rollout.shape)} rollout log-probs for "
                         f"{tuple(learner.shape)} learner log-probs")
    ratio = torch.exp(learner.float() - rollout.float())
    if mode == "tis":
        return torch.clamp(ratio, max=cap)
    return ((ratio >= 1.0 / cap) & (ratio <= cap)).float()


def ratio_report(rollout_logprobs: np.ndarray, learner_logprobs: np.ndarray, cap: float = 2.0) -> dict:
    """How far the two sides' probabilities are apart: the ratio's mean and max, and the share of tokens
    outside [1/cap, cap] (which "mis" drops and "tis" truncates above)."""
    ratio = np.exp(np.asarray(learner_logprobs, np.float64) - np.asarray(rollout_logprobs, np.float64))
    if ratio.size == 0:
        return {"ratio_mean": None, "ratio_max": None, "ratio_outside_share": None, "ratio_cap": cap}
    outside = (ratio < 1.0 / cap) | (ratio > cap)
    return {"ratio_mean": float(ratio.mean()), "ratio_max": float(ratio.max()),
            "ratio_outside_share": float(outside.mean()), "ratio_cap": cap}
