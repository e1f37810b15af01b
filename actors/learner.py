"""Learner: the learner side of an RL loop, as a plain class or a Ray actor (`LearnerActor`).

It holds the policy (a transformers CausalLM), asks the rollout service for samples, recomputes the
sampled tokens' log-probs under its current weights (importance ratios against the behaviour
log-probs the service returned), takes clipped policy-gradient steps, and pushes the new weights as
the next policy version. A training loop (e.g. GRPO) is a few lines over these methods; the GRPO loop
of this project is actors/grpo.py.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import ray
import torch

from rollout_service.connections.ray_cluster import actor_env
from rollout_service.training.mismatch import learner_logprobs, logprob_mismatch, token_logprobs
from rollout_service.training.loss import ppo_clip_loss
from rollout_service.api.types import RolloutResult, SamplingParams


def load_policy(model: Any, dtype: torch.dtype | None = None, device: str | torch.device | None = None,
                seed: int = 0) -> torch.nn.Module:
    """A trainable transformers model on `device` in `dtype`, from a HF folder, "smollm2-135m" or a .gguf file
    (through the same cached HF folder the rollout workers load), a transformers config (random weights,
    seeded: a learner whose first refresh brings the workers its weights), or a live module; local files
    only. dtype/device: None keeps a live module's own and loads others in fp32 on the CPU."""
    from transformers import AutoModelForCausalLM, PretrainedConfig

    from rollout_service.model.gguf_cache import pretrained_location
    from rollout_service.model.loader import check_source, gguf_file

    if isinstance(model, torch.nn.Module):
        return model.to(device=device, dtype=dtype) if dtype or device else model
    dtype, device = dtype or torch.float32, device or "cpu"
    if isinstance(model, PretrainedConfig):
        torch.manual_seed(seed)
        with torch.device(device):  # built in place: an 8B model initialised on the CPU takes minutes
            return AutoModelForCausalLM.from_config(model, dtype=dtype)
    check_source(model)  # a hub id is a ValueError here, never a download
    gguf = gguf_file(model)
    path, extra = (model, {}) if gguf is None else pretrained_location(gguf)
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True, **extra).to(device)


def group_advantages(rewards: Sequence[float], group_size: int, eps: float = 1e-6) -> np.ndarray:
    """GRPO advantages: each reward minus its group's mean, over the group's std (groups of n samples
    of one prompt, in prompt-major order)."""
    r = np.asarray(rewards, dtype=np.float64)
    if group_size < 1 or r.size % group_size:
        raise ValueError(f"{r.size} rewards do not split into groups of {group_size}")
    g = r.reshape(-1, group_size)
    return ((g - g.mean(1, keepdims=True)) / (g.std(1, keepdims=True) + eps)).reshape(-1).astype(np.float32)


class Learner:
    def __init__(self, model: Any, service: str = "rollout_service", namespace: str = "rollout_service",
                 lr: float = 1e-5, clip: float = 0.2, seed: int = 0):
        from rollout_service.client import RolloutClient

        torch.manual_seed(seed)
        self.model = load_policy(model).train()
        self.client = RolloutClient.connect(service, namespace=namespace)
        self.version = int(self.client.info()["policy_version"])
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr)
        self.clip = clip

    def rollout(self, prompts: list, sampling: SamplingParams | dict | None = None,
                metadata: list | None = None) -> list[RolloutResult]:
        if isinstance(sampling, dict):
            sampling = SamplingParams.from_dict(sampling)
        return self.client.generate(prompts, sampling, metadata=metadata)

    def token_logprobs(self, results: list[RolloutResult], temperature: float = 1.0) -> list[torch.Tensor]:
        """log p(token_ids[i] | prefix) under the current weights, per result (with grad)."""
        return token_logprobs(self.model, results, temperature)

    def behaviour_gap(self, results: list[RolloutResult], temperature: float = 1.0) -> float:
        """Largest |learner log-prob - behaviour log-prob| over all tokens (0 when on-policy and exact)."""
        return logprob_mismatch(results, learner_logprobs(self.model, results, temperature))["max_abs"]

    def policy_step(self, results: list[RolloutResult], advantages: Sequence[float],
                    temperature: float = 1.0) -> dict:
        """One clipped policy-gradient step (PPO-style ratio to the behaviour policy, token-mean)."""
        if len(advantages) != len(results):
            raise ValueError(f"{len(advantages)} advantages for {len(results)} results")
        self.optimizer.zero_grad()
        losses, ratios = [], []
        for r, lp, a in zip(results, self.token_logprobs(results, temperature), advantages):
            if not len(r.token_ids):
                continue
            old = torch.from_numpy(r.logprobs)
            losses.append(ppo_clip_loss(lp, old, a, self.clip, reduction="mean"))
            ratios.append(torch.exp(lp.detach() - old).mean())
        loss = torch.stack(losses).mean()
        loss.backward()
        self.optimizer.step()
        return {"loss": float(loss), "mean_ratio": float(torch.stack(ratios).mean())}

    def push_weights(self) -> int:
        """Send the current weights to every rollout worker as the next policy version."""
        self.version += 1
        self.client.update_weights({k: v.detach() for k, v in self.model.state_dict().items()}, self.version)
        return self.version

    def service_stats(self) -> list[dict]:
        return self.client.stats()


LearnerActor = ray.remote(runtime_env=actor_env())(Learner)  # (at the normal CPU priority, as the service's actors)
