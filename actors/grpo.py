"""GRPO learner: samples groups from the rollout service, learns from their relative rewards, pushes weights.

One step: G samples per prompt (behaviour log-probs included) -> rewards -> group-normalised advantages
-> PPO-clip loss with the rollout log-probs as the old policy -> one AdamW update -> new weights pushed to
every rollout worker as policy version `step`. Works over any RolloutClient (in-process or Ray);
`GRPOActor` is the same class as a Ray actor that attaches to a named service.

Colocated with the rollout workers on one GPU (a service started with `colocate: true`, the learner placed
with `client.colocated_options(i)`), a step puts the workers to sleep before the learner's forward/backward
and wakes them after the refresh: rollout -> reward -> sleep -> learner -> refresh -> wake. Each step's row
holds the seconds of every phase (rollout_training.StepClock), the learner's memory, and the fidelity of
the step's rollouts (the learner's recompute of their log-probs), which is also reported to the service.
On a GPU the learner trains in bf16 through fp32 master weights (rollout_service/training/precision.py).

Loss per sampled token t of a sample with advantage A (ratio r = exp(learner - rollout log-prob)):
    surrogate = min(r * A, clip(r, 1 - eps, 1 + eps) * A)
    loss      = -surrogate * min(1, C / r)          (C = tis_cap; the factor is a constant, no grad)
The surrogate's gradient carries r as its importance weight; the truncation caps that weight at C
(truncated importance sampling), so tokens the engine sampled where the learner's numerics or a stale
policy disagree sharply cannot blow up the update. Tokens are averaged over the whole batch.

Multi-turn episodes (rollout_service/episodes.py): give the learner `env_fn(problem) -> Environment` and each
problem becomes a group of G episodes (GRPOConfig.max_turns, max_total_tokens, stop), rewarded by default with
the environment's final reward. The loss, the token counts and the fidelity report then cover only the tokens
the model sampled (loss_mask == 1), never the environment's or the chat template's.

Bitwise mode (GRPOConfig.bitwise, against an engine with EngineConfig.batch_invariant): the learner recomputes
the log-probs with the engine's batch-invariant numerics (rollout_service.training.InvariantForward) instead
of the transformers forward, so while its weights are the ones the engine sampled with, the PPO ratio is
exactly 1 on every token (each row's ratio_first_minibatch_max_abs_dev is 0.0). That needs the policy in the
engine's dtype on the engine's kind of device; the learner checks both, and batch_invariant, in every
worker's stats at construction.

Routing replay (GRPOConfig.routing_replay, mixture-of-experts policies): the rollouts return the experts every
MoE layer chose (prompt included) and the learner's forward, and its backward, use them
(rollout_service.training.replay_routing; in bitwise mode InvariantForward takes them itself). Each row's
mismatch is then measured with replay, and routing_differing_share says on how many sampled tokens the policy's
own router, in that forward, would have picked at least one other expert.
"""
from __future__ import annotations

import logging
import time
from contextlib import nullcontext
from dataclasses import asdict
from typing import Any, Callable, ContextManager, Sequence

import numpy as np
import ray
import torch

from actors.grpo_config import GRPOConfig
from actors.learner import group_advantages, load_policy
from rollout_service.examples import tasks
from rollout_service.training.mismatch import (fp32_reference_report, learner_logprobs, logprob_mismatch, model_token_mask,
                                     num_model_tokens, token_logprobs)
from rollout_service.connections.ray_cluster import actor_env
from rollout_service.model.registry import moe_spec
from rollout_service.training import (InvariantForward, LearnerOutOfMemory, MasterWeights, RoutingStats, StepClock,
                                      memory_figures, replay_routing)
from rollout_service.training.engine_match import check_bitwise_engine, engine_numerics
from rollout_service.training.loss import corrected_pg_loss, ppo_clip_loss, ratio_deviation
from rollout_service.training.memory import describe, is_out_of_memory
from rollout_service.api.types import EpisodeParams, RolloutRequest, RolloutResult, SamplingParams

log = logging.getLogger(__name__)


class GRPOLearner:
    """policy: a transformers CausalLM or a source for `load_policy`; client: a RolloutClient, or the name
    of a running Ray service to attach to. reward_fn(result) -> float (default: the arithmetic task's
    reward of result.text against result.metadata["answer"]; for episodes the environment's reward, 0 when
    there is none); prompt_fn(problem) -> prompt (default: problem.messages(), the chat prompt).
    env_fn(problem) -> Environment: roll out multi-turn episodes instead of single completions."""

    def __init__(self, policy: Any, client: Any, config: GRPOConfig | dict | None = None,
                 reward_fn: Callable[[RolloutResult], float] | None = None,
                 prompt_fn: Callable[[Any], Any] | None = None, version: int | None = None,
                 namespace: str = "rollout_service", num_threads: int | None = None,
                 env_fn: Callable[[Any], Any] | None = None):
        if num_threads:
            torch.set_num_threads(num_threads)
        self.config = c = GRPOConfig(**config) if isinstance(config, dict) else (config or GRPOConfig())
        torch.manual_seed(c.seed)
        self.device = c.torch_device()
        self.policy = load_policy(policy, getattr(torch, c.dtype), self.device, c.seed).train()
        if c.gradient_checkpointing:
            self.policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if isinstance(client, str):
            from rollout_service.client import RolloutClient
            client = RolloutClient.connect(client, namespace=namespace)
        self.client = client
        self.invariant = None
        if c.bitwise:  # the workers' ops backend (torch or cuda) is the learner's too
            workers = engine_numerics(client)
            backends = {w["backend"] for w in workers if w["backend"] is not None}
            self.invariant = InvariantForward(self.policy, backends.pop() if len(backends) == 1 else "auto")
            check_bitwise_engine(workers, next(self.policy.parameters()).dtype, self.device, self.invariant.backend)
        if c.routing_replay and moe_spec(self.policy.config) is None:
            raise ValueError(f"GRPOConfig.routing_replay: the policy ({self.policy.config.model_type}) has no "
                             "mixture-of-experts layers")
        self.env_fn = env_fn
        default_reward = _episode_reward if env_fn else (lambda r: tasks.reward(r.text, r.metadata["answer"]))
        self.reward_fn = reward_fn or default_reward
        self.prompt_fn = prompt_fn or (lambda p: p.messages())
        self.version = _service_version(client) if version is None else version
        self.colocated = bool(client.info().get("colocate")) if c.colocate == "auto" else c.colocate
        self._pending: dict | None = None
        self.precision = MasterWeights(self.policy, c.optimizer, c.lr, c.weight_decay)
        self.optimizer = self.precision.optimizer
        if c.memory_limit_gb and self.device.type == "cuda":
            total = torch.cuda.get_device_properties(self.device).total_memory
            index = self.device.index if self.device.index is not None else torch.cuda.current_device()
            torch.cuda.set_per_process_memory_fraction(min(1.0, c.memory_limit_gb * 2**30 / total), index)

    # -- rollouts --------------------------------------------------------------------------------
    def submit(self, problems: Sequence[Any]) -> dict:
        """Dispatch G samples per problem now (each prompt with its own seed); collect() gathers them.
        Submitting the next batch before an update lets the workers generate while the learner trains."""
        c = self.config
        reqs = []
        for i, p in enumerate(problems):
            seed = (c.seed * 1_000_003 + self.version * 10_007 + i * c.group_size) % 2**62
            sampling = SamplingParams(n=c.group_size, temperature=c.temperature, max_tokens=c.max_tokens,
                                      logprobs_mode="scaled", seed=seed, ignore_eos=c.ignore_eos, stop=c.stop,
                                      return_routed_experts=c.routing_replay,
                                      return_prompt_routed_experts=c.routing_replay)
            metadata = getattr(p, "to_metadata", lambda: None)()
            if self.env_fn is None:
                reqs.append(RolloutRequest(prompt=self.prompt_fn(p), sampling=sampling, metadata=metadata))
            else:
                episode = EpisodeParams(self.env_fn(p), c.max_turns, c.max_total_tokens)
                reqs.append(RolloutRequest(prompt=None, sampling=sampling, metadata=metadata, episode=episode))
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
    def recompute(self, results: Sequence[RolloutResult]) -> list[torch.Tensor]:
        """The log-probs of the results' tokens under the learner's current weights (with grad in grad mode):
        the batch-invariant engine's numerics in bitwise mode, else the transformers forward's; with the
        rollouts' experts under routing_replay."""
        with self._routing(results):
            return self._logprobs(results)

    def _logprobs(self, results: Sequence[RolloutResult]) -> list[torch.Tensor]:
        if self.invariant is not None:  # it takes the results' recorded routing itself
            return self.invariant.logprobs(results, self.config.temperature)
        return token_logprobs(self.policy, results, self.config.temperature)

    def _routing(self, results: Sequence[RolloutResult]) -> ContextManager[RoutingStats | None]:
        if self.config.routing_replay and self.invariant is None:
            return replay_routing(self.policy, results)
        return nullcontext()

    def train_on(self, results: Sequence[RolloutResult], rewards: Sequence[float]) -> dict:
        """One GRPO update on a prompt-major batch; returns loss, grad norm, mismatch report, counts. Only the
        tokens the model sampled count (an episode's loss_mask == 1). ratio_first_minibatch_max_abs_dev: max
        |ratio - 1| over the first micro-batch's tokens (None without one), before this update: 0.0 in bitwise
        mode while the engine sampled with the learner's weights."""
        c = self.config
        start = time.perf_counter()
        adv = group_advantages(rewards, c.group_size)
        sampled = [model_token_mask(r) for r in results]
        # Zero-advantage samples (groups where every reward tied) add nothing to the gradient: skip them.
        live = [i for i, a in enumerate(adv) if a != 0.0 and sampled[i].any()]
        n_tokens = max(1, sum(int(m.sum()) for m in sampled))
        self.precision.zero_grad()
        loss_total, learner_lp, first, routing = 0.0, {}, (None, 0), RoutingStats()
        for j in range(0, len(live), c.micro_batch):
            chunk = live[j:j + c.micro_batch]
            # the replay spans the backward: gradient checkpointing runs the routers again there
            with self._routing([results[i] for i in chunk]) as counted:
                lps = self._logprobs([results[i] for i in chunk])
                if counted is not None:  # now: a checkpointed backward would count its recompute too
                    routing.add(counted)
                old = [torch.as_tensor(np.array(results[i].logprobs), device=lp.device) for i, lp in zip(chunk, lps)]
                keep = [torch.as_tensor(sampled[i], device=lp.device) for i, lp in zip(chunk, lps)]
                if j == 0:
                    first = ratio_deviation(lps, old, keep)
                loss = sum(self._token_loss(lp[k], o[k], float(adv[i]))
                           for i, lp, o, k in zip(chunk, lps, old, keep)) / n_tokens
                loss.backward()
            self.precision.accumulate()
            loss_total += loss.item()
            learner_lp.update({i: lp.detach().float() for i, lp in zip(chunk, lps)})
        grad_norm = self.precision.step(c.max_grad_norm) if live else 0.0
        measured = sorted(learner_lp)
        mismatch = logprob_mismatch([results[i] for i in measured], [learner_lp[i] for i in measured],
                                    ratio_cap=c.correction_cap)
        if c.rollout_correction:
            mismatch["rollout_correction"] = c.rollout_correction
        if c.routing_replay and self.invariant is None:
            mismatch.update(routing_replay=1, routing_differing_share=routing.share)
        return {"loss": loss_total, "grad_norm": grad_norm, "trained_samples": len(live),
                "mismatch": mismatch, "ratio_first_minibatch_max_abs_dev": first[0],
                "ratio_first_minibatch_tokens": first[1], "learner_s": time.perf_counter() - start}

    def _token_loss(self, lp: torch.Tensor, rollout: torch.Tensor, advantage: float) -> torch.Tensor:
        """One sample's summed loss. With rollout_correction, PPO's ratio is taken against the learner's own
        recompute (this step's weights are the ones the engine sampled with), and each token is weighed by the
        learner's and the engine's probability ratio (training/importance.py): the engine's numerics, not a
        policy change, are what that ratio measures. Otherwise PPO against the rollout log-probs, truncated at
        tis_cap."""
        c = self.config
        if not c.rollout_correction:
            return ppo_clip_loss(lp, rollout, advantage, c.clip_eps, c.tis_cap)
        return corrected_pg_loss(lp, rollout, advantage, c.clip_eps, c.rollout_correction, c.correction_cap)

    def push_weights(self) -> int:
        """Send the weights to every rollout worker as the next policy version (= number of updates)."""
        self.version += 1
        self.client.update_weights({k: v.detach() for k, v in self.policy.state_dict().items()}, self.version)
        return self.version

    def step(self, problems: Sequence[Any], full_mismatch: bool = False,
             prefetch: Sequence[Any] | None = None, fp32_reference: int = 0) -> dict:
        """Rollout -> reward -> [sleep] -> update -> push -> [wake]. Returns the step's figures (JSON-ready).

        The step's mismatch covers the samples the learner trained on (it recomputes those anyway, before
        the update: the learner's view of the same weights); full_mismatch=True also recomputes every
        sample before the update (one extra no-grad pass). fp32_reference=k compares the first k samples'
        rollout and learner log-probs with an fp32 forward of the same weights (two more no-grad passes).
        prefetch: the next step's problems, submitted before this update (one-step off-policy: their
        early tokens come from this step's policy, so the next step sees staleness 1)."""
        pending = self._pending
        if pending is not None and pending["problems"] != list(problems):
            raise ValueError("step(problems) differs from the problems prefetched by the previous step")
        clock = StepClock()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        pending = pending or self.submit(problems)
        with clock.phase("rollout"):
            results, _ = self.collect(pending)
        self._pending = self.submit(prefetch) if prefetch is not None else None
        with clock.phase("reward"):
            rewards = [float(self.reward_fn(r)) for r in results]
        if self.colocated:
            with clock.phase("sleep"):
                self.client.sleep(self.config.sleep_level)
        engine_asleep = self._engine_memory() if self.colocated else None
        stats, extra = self._learn(clock, results, rewards, full_mismatch, fp32_reference)
        with clock.phase("refresh"):
            self._report_fidelity(pending["version"], stats["mismatch"])
            self.push_weights()
        if self.colocated:
            with clock.phase("wake"):
                self.client.wake_up()
        return self._row(pending, results, rewards, stats, clock, engine_asleep, extra)

    def _learn(self, clock: StepClock, results, rewards, full_mismatch: bool, fp32_reference: int) -> tuple:
        """The learner phase; an out-of-memory wakes the workers (they serve the last version) and is raised
        as LearnerOutOfMemory with the memory figures."""
        extra: dict = {}
        failure = None
        try:
            with clock.phase("learner"):
                if fp32_reference:
                    extra["fidelity_vs_fp32"] = fp32_reference_report(
                        self.policy, results[:fp32_reference], self.config.temperature, self.config.micro_batch)
                if full_mismatch:
                    extra["full"] = logprob_mismatch(results, learner_logprobs(
                        self.policy, results, micro_batch=self.config.micro_batch, recompute=self.recompute))
                extra["receipts"] = self.verify_receipts(results)
                stats = self.train_on(results, rewards)
                extra["learner_memory"] = memory_figures(self.device)
                self._release_cached_memory()  # the engine wakes into what the learner held as cache
            return stats, extra
        except BaseException as e:
            failure = (e, memory_figures(self.device) if is_out_of_memory(e) else None)
        # out of the except block: the traceback's frames (activations) are gone before memory is released
        self.precision.zero_grad()
        self._release_cached_memory()
        if self.colocated:
            self.client.wake_up()
        e, figures = failure
        if figures is None:
            raise e
        engine = self._engine_memory()
        raise LearnerOutOfMemory(
            f"GRPO step {self.version + 1}: the learner ran out of memory in its forward/backward "
            f"({describe(figures)}; the rollout workers, asleep, held {engine['device_memory_bytes'] / 2**30:.2f} GiB). "
            f"The workers were woken and serve policy version {self.version}. Lower micro_batch, set "
            f"gradient_checkpointing, or use optimizer='adafactor'.", {**figures, "engine": engine}) from None

    def verify_receipts(self, results: Sequence[RolloutResult]) -> dict | None:
        """Bitwise mode: check up to config.verify_receipts of the results sampled by the weights the learner
        holds now (one version: self.version) with InvariantForward.verify; the others cannot be, and count
        as skipped. None outside bitwise mode."""
        if self.invariant is None:
            return None
        mine = [r for r in results if r.receipt is not None and set(r.token_versions) == {self.version}]
        picked = mine[:self.config.verify_receipts]
        verdicts = self.invariant.verify(picked, self.config.temperature, key=self.config.receipt_key) if picked else []
        failed = [(r, v) for r, v in zip(picked, verdicts) if not v.ok]
        for r, v in failed[:3]:
            log.warning("receipt of %s#%d failed verification: %s", r.request_id, r.sample_index, v.reason)
        return {"verified": len(verdicts) - len(failed), "failed": len(failed), "skipped": len(results) - len(picked)}

    def _release_cached_memory(self) -> None:
        if self.device.type == "cuda":
            import gc
            gc.collect()
            torch.cuda.empty_cache()

    def _engine_memory(self) -> dict:
        stats = self.client.stats()
        total = lambda key: sum(s.get(key) or 0 for s in stats)  # noqa: E731
        return {"device_memory_bytes": total("device_memory_bytes"), "process_gpu_bytes": total("process_gpu_bytes")}

    def _report_fidelity(self, version: int, mismatch: dict) -> None:
        """The service keeps every refresh's fidelity: how the learner's recompute of the rollouts of policy
        `version` compares with the log-probs the workers returned."""
        keys = ("mean_abs", "max_abs", "kl", "ratio_mean", "ratio_max", "ratio_outside_share", "ratio_cap",
                "n_tokens", "n_sequences", "routing_replay", "routing_differing_share", "rollout_correction")
        report = {k: mismatch[k] for k in keys if k in mismatch}
        self.client.report_fidelity(version, {**report, "step": self.version + 1})

    def _row(self, pending: dict, results, rewards, stats: dict, clock: StepClock, engine_asleep,
             extra: dict) -> dict:
        oldest = min((min(r.token_versions) for r in results if r.token_versions), default=self.version - 1)
        gen_tokens = num_model_tokens(results)
        span = max(r.timings.get("finished", 0) for r in results) - min(r.timings.get("queued", 0) for r in results)
        phases = clock.row()
        full = extra.get("full")
        mm = stats["mismatch"]
        return {
            "step": self.version, "policy_version_submitted": pending["version"], "policy_version_oldest": oldest,
            "reward_mean": float(np.mean(rewards)),
            "correct_rate": float(np.mean([r >= 1.0 for r in rewards])),
            "format_rate": float(np.mean([r > 0 for r in rewards])),
            "loss": stats["loss"], "grad_norm": stats["grad_norm"], "trained_samples": stats["trained_samples"],
            "mismatch_mean": mm["mean_abs"], "mismatch_max": mm["max_abs"], "mismatch_tokens": mm["n_tokens"],
            "kl_rollout_learner": mm["kl"], "ratio_max": mm["ratio_max"],
            "ratio_first_minibatch_max_abs_dev": stats["ratio_first_minibatch_max_abs_dev"],
            "ratio_first_minibatch_tokens": stats["ratio_first_minibatch_tokens"],
            "learner_bitwise": self.config.bitwise, "receipts": extra.get("receipts"), "routing_replay": self.config.routing_replay,
            "routing_differing_share": mm.get("routing_differing_share"),
            "staleness": (self.version - 1) - oldest,
            "rollout_tokens": gen_tokens, "rollout_span_s": span,
            "rollout_tokens_per_s": gen_tokens / span if span > 0 else None,
            "rollout_wait_tokens_per_s": gen_tokens / phases["rollout_s"] if phases["rollout_s"] > 0 else None,
            "learner_s": stats["learner_s"], "push_s": phases["refresh_s"],
            "mean_completion_tokens": gen_tokens / max(1, len(results)),
            **phases, "colocated": self.colocated,
            "learner_device": str(self.device), "learner_dtype": self.config.dtype,
            "optimizer": self.config.optimizer, "learner_memory": extra.get("learner_memory"),
            "optimizer_state_bytes": self.precision.nbytes(), "engine_memory_asleep": engine_asleep,
            **({"fidelity_vs_fp32": extra["fidelity_vs_fp32"]} if "fidelity_vs_fp32" in extra else {}),
            **({"mismatch_full_mean": full["mean_abs"], "mismatch_full_max": full["max_abs"],
                "mismatch_full_tokens": full["n_tokens"]} if full else {}),
        }

    def state(self) -> dict:
        return {"version": self.version, "config": asdict(self.config)}


def _episode_reward(result: RolloutResult) -> float:
    """An episode's reward: the environment's last one (0 for an episode that ended before any)."""
    return 0.0 if result.reward is None else float(result.reward)


def _service_version(client: Any) -> int:
    """The policy version the service serves now, so pushed versions keep increasing after a restart."""
    return int(client.info()["policy_version"])


GRPOActor = ray.remote(runtime_env=actor_env())(GRPOLearner)  # (at the normal CPU priority, as the service's actors)
