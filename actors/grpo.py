"""GRPO learner: samples groups from the rollout service, learns from their relative rewards, pushes weights.

One step: G samples per prompt (behaviour log-probs included) -> rewards -> group-normalised advantages
-> PPO-clip loss with the rollout log-probs as the old policy -> one AdamW update -> new weights pushed to
every rollout worker as policy version `step`. Works over any RolloutClient (in-process or Ray);
`GRPOActor` is the same class as a Ray actor that attaches to a named service.

Loss per sampled token t of a sample with advantage A (ratio r = exp(learner - rollout log-prob)):
    surrogate = min(r * A, clip(r, 1 - eps, 1 + eps) * A)
    loss      = -surrogate * min(1, C / r)          (C = tis_cap; the factor is a constant, no grad)
The surrogate's gradient carries r as its importance weight; the truncation caps that weight at C
(truncated importance sampling), so tokens the engine sampled where the learner's numerics or a stale
policy disagree sharply cannot blow up the update. Tokens are averaged over the whole batch.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Sequence

import numpy as np
import ray
import torch

from actors.learner import group_advantages, load_policy
from rollout_service import tasks
from rollout_service.mismatch import logprob_mismatch, mismatch_report, token_logprobs
from rollout_service.types import RolloutRequest, RolloutResult, SamplingParams


@dataclass
class GRPOConfig:
    group_size: int = 8
    prompts_per_step: int = 8
    lr: float = 2e-5
    clip_eps: float = 0.2
    tis_cap: float = 2.0
    temperature: float = 1.0
    max_tokens: int = 16
    micro_batch: int = 16
    max_grad_norm: float = 1.0
    weight_decay: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("group_size", "prompts_per_step", "max_tokens", "micro_batch"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"GRPOConfig.{name}={v!r}: must be an int >= 1")
        if self.group_size < 2:
            raise ValueError(f"GRPOConfig.group_size={self.group_size}: GRPO needs >= 2 samples per prompt")
        for name in ("lr", "clip_eps", "temperature", "max_grad_norm"):
            if not getattr(self, name) > 0:
                raise ValueError(f"GRPOConfig.{name}={getattr(self, name)!r}: must be > 0")
        if not self.tis_cap >= 1:
            raise ValueError(f"GRPOConfig.tis_cap={self.tis_cap!r}: must be >= 1")


def grpo_token_loss(new_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, advantage: float,
                    clip_eps: float, tis_cap: float) -> torch.Tensor:
    """Summed loss over one sample's tokens (see the module docstring)."""
    ratio = torch.exp(new_logprobs - rollout_logprobs)
    surrogate = torch.minimum(ratio * advantage, torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps) * advantage)
    truncation = torch.clamp(tis_cap / ratio.detach(), max=1.0)
    return -(surrogate * truncation).sum()


class GRPOLearner:
    """policy: a transformers CausalLM or a source for `load_policy`; client: a RolloutClient, or the name
    of a running Ray service to attach to. reward_fn(result) -> float (default: the arithmetic task's
    reward of result.text against result.metadata["answer"]); prompt_fn(problem) -> prompt (default:
    problem.messages(), the chat prompt)."""

    def __init__(self, policy: Any, client: Any, config: GRPOConfig | dict | None = None,
                 reward_fn: Callable[[RolloutResult], float] | None = None,
                 prompt_fn: Callable[[Any], Any] | None = None, version: int | None = None,
                 namespace: str = "rollout_service", num_threads: int | None = None):
        if num_threads:
            torch.set_num_threads(num_threads)
        self.config = GRPOConfig(**config) if isinstance(config, dict) else (config or GRPOConfig())
        torch.manual_seed(self.config.seed)
        self.policy = load_policy(policy).train()
        if isinstance(client, str):
            from rollout_service.client import RolloutClient
            client = RolloutClient.connect(client, namespace=namespace)
        self.client = client
        self.reward_fn = reward_fn or (lambda r: tasks.reward(r.text, r.metadata["answer"]))
        self.prompt_fn = prompt_fn or (lambda p: p.messages())
        self.version = _service_version(client) if version is None else version
        self._pending: dict | None = None
        self.optimizer = torch.optim.AdamW(self.policy.parameters(), lr=self.config.lr,
                                           weight_decay=self.config.weight_decay)

    # -- rollouts --------------------------------------------------------------------------------
    def submit(self, problems: Sequence[Any]) -> dict:
        """Dispatch G samples per problem now (each prompt with its own seed); collect() gathers them.
        Submitting the next batch before an update lets the workers generate while the learner trains."""
        c = self.config
        reqs = []
        for i, p in enumerate(problems):
            seed = (c.seed * 1_000_003 + self.version * 10_007 + i * c.group_size) % 2**62
            sampling = SamplingParams(n=c.group_size, temperature=c.temperature, max_tokens=c.max_tokens,
                                      logprobs_mode="scaled", seed=seed)
            reqs.append(RolloutRequest(prompt=self.prompt_fn(p), sampling=sampling,
                                       metadata=getattr(p, "to_metadata", lambda: None)()))
        return {"problems": list(problems), "order": {r.request_id: i for i, r in enumerate(reqs)},
                "stream": self.client.stream(reqs), "version": self.version}

    def collect(self, pending: dict) -> tuple[list[RolloutResult], float]:
        """(prompt-major results, seconds spent waiting for them)."""
        start = time.perf_counter()
        results = sorted(pending["stream"], key=lambda r: (pending["order"][r.request_id], r.sample_index))
        return results, time.perf_counter() - start

    def rollout(self, problems: Sequence[Any]) -> tuple[list[RolloutResult], float]:
        return self.collect(self.submit(problems))

    def evaluate(self, problems: Sequence[tasks.Problem], max_tokens: int | None = None) -> dict:
        """Greedy accuracy and well-formed rate on `problems` with the service's current weights."""
        sp = SamplingParams(n=1, temperature=0.0, max_tokens=max_tokens or self.config.max_tokens)
        results = self.client.generate([self.prompt_fn(p) for p in problems], sp)
        correct = [tasks.is_correct(r.text, p.answer) for r, p in zip(results, problems)]
        formed = [tasks.parse_answer(r.text) is not None for r in results]
        return {"accuracy": float(np.mean(correct)), "format_rate": float(np.mean(formed)),
                "samples": [r.text for r in results[:4]]}

    # -- learning --------------------------------------------------------------------------------
    def train_on(self, results: Sequence[RolloutResult], rewards: Sequence[float]) -> dict:
        """One GRPO update on a prompt-major batch; returns loss, grad norm, mismatch report, counts."""
        c = self.config
        start = time.perf_counter()
        adv = group_advantages(rewards, c.group_size)
        # Zero-advantage samples (groups where every reward tied) add nothing to the gradient: skip them.
        live = [i for i, a in enumerate(adv) if a != 0.0 and len(results[i].token_ids)]
        n_tokens = max(1, sum(len(r.token_ids) for r in results))
        self.optimizer.zero_grad(set_to_none=True)
        loss_total, learner_lp = 0.0, {}
        for j in range(0, len(live), c.micro_batch):
            chunk = live[j:j + c.micro_batch]
            lps = token_logprobs(self.policy, [results[i] for i in chunk], c.temperature)
            old = [torch.as_tensor(np.array(results[i].logprobs), device=lp.device) for i, lp in zip(chunk, lps)]
            loss = sum(grpo_token_loss(lp, o, float(adv[i]), c.clip_eps, c.tis_cap)
                       for i, lp, o in zip(chunk, lps, old)) / n_tokens
            loss.backward()
            loss_total += loss.item()
            learner_lp.update({i: lp.detach() for i, lp in zip(chunk, lps)})
        grad_norm = 0.0
        if live:
            grad_norm = float(torch.nn.utils.clip_grad_norm_(self.policy.parameters(), c.max_grad_norm))
            self.optimizer.step()
        measured = sorted(learner_lp)
        mismatch = logprob_mismatch([results[i] for i in measured], [learner_lp[i] for i in measured])
        return {"loss": loss_total, "grad_norm": grad_norm, "trained_samples": len(live),
                "mismatch": mismatch, "learner_s": time.perf_counter() - start}

    def push_weights(self) -> int:
        """Send the weights to every rollout worker as the next policy version (= number of updates)."""
        self.version += 1
        self.client.update_weights({k: v.detach() for k, v in self.policy.state_dict().items()}, self.version)
        return self.version

    def step(self, problems: Sequence[Any], full_mismatch: bool = False,
             prefetch: Sequence[Any] | None = None) -> dict:
        """Rollout -> reward -> update -> push. Returns the step's figures (JSON-ready).

        The step's mismatch covers the samples the learner trained on (it recomputes those anyway);
        full_mismatch=True also recomputes every sample before the update (one extra no-grad pass).
        prefetch: the next step's problems, submitted before this update (one-step off-policy: their
        early tokens come from this step's policy, so the next step sees staleness 1)."""
        pending = self._pending
        if pending is not None and pending["problems"] != list(problems):
            raise ValueError("step(problems) differs from the problems prefetched by the previous step")
        pending = pending or self.submit(problems)
        results, rollout_s = self.collect(pending)
        self._pending = self.submit(prefetch) if prefetch is not None else None
        rewards = [float(self.reward_fn(r)) for r in results]
        full = mismatch_report(self.policy, results, self.config.temperature, self.config.micro_batch) \
            if full_mismatch else None
        stats = self.train_on(results, rewards)
        push_start = time.perf_counter()
        self.push_weights()
        oldest = min((min(r.token_versions) for r in results if r.token_versions), default=self.version - 1)
        gen_tokens = sum(len(r.token_ids) for r in results)
        span = max(r.timings.get("finished", 0) for r in results) - min(r.timings.get("queued", 0) for r in results)
        return {
            "step": self.version, "policy_version_submitted": pending["version"], "policy_version_oldest": oldest,
            "reward_mean": float(np.mean(rewards)),
            "correct_rate": float(np.mean([r >= 1.0 for r in rewards])),
            "format_rate": float(np.mean([r > 0 for r in rewards])),
            "loss": stats["loss"], "grad_norm": stats["grad_norm"], "trained_samples": stats["trained_samples"],
            "mismatch_mean": stats["mismatch"]["mean_abs"], "mismatch_max": stats["mismatch"]["max_abs"],
            "mismatch_tokens": stats["mismatch"]["n_tokens"], "kl_rollout_learner": stats["mismatch"]["kl"],
            "staleness": (self.version - 1) - oldest,
            "rollout_tokens": gen_tokens, "rollout_wait_s": rollout_s, "rollout_span_s": span,
            "rollout_tokens_per_s": gen_tokens / span if span > 0 else None,
            "learner_s": stats["learner_s"], "push_s": time.perf_counter() - push_start,
            "mean_completion_tokens": gen_tokens / max(1, len(results)),
            **({"mismatch_full_mean": full["mean_abs"], "mismatch_full_max": full["max_abs"],
                "mismatch_full_tokens": full["n_tokens"]} if full else {}),
        }

    def state(self) -> dict:
        return {"version": self.version, "config": asdict(self.config)}


def _service_version(client: Any) -> int:
    """The policy version the service serves now, so pushed versions keep increasing after a restart."""
    return int(client.info()["policy_version"])


GRPOActor = ray.remote(GRPOLearner)
