"""WD's learner (delta_bench.py): real GRPO updates between the refreshes it measures.

One step: rollouts of the worker -> rewards -> group advantages -> GRPO loss (ppo_clip_loss with the TIS cap,
zero-advantage samples left out, tokens averaged over the batch, as actors/grpo.py train_on) -> one optimizer step
on the bench model itself (trained in place):
- the embedded SmolLM2: the GRPO example (scripts/grpo_demo.py with cluster_configs/grpo-local.yaml): its
  arithmetic task (chat prompts, its reward), learning rate, clip, TIS cap, gradient clipping, micro-batch, fp32
  weights with AdamW;
- the random-weight models: W6's learner (rl_step.py): token-id prompts, the parity reward, its learning rate,
  AdamW through fp32 master weights (rollout_service/training/precision.py) where those fit beside the worker and
  the sender's base on the GPU; where they do not (llama3-8b on 80 GB: 20 bytes a parameter), the memory-light
  step below (`--shape wd_light=1 / 0` forces it on / off).

The memory-light step (`FreshAdamSR`): the bf16 weights are the only copy. One backward over the batch (gradient
checkpointing) updates each weight once its gradient is complete (a post-accumulate-grad hook; the gradient is
then freed) by AdamW's first step from fresh moments, lr * g / (|g| + eps): every element with a gradient moves by
about lr, no less than Adam's steady steps move it, so no fewer elements change. The update is computed in fp32
and rounded to bf16 stochastically (up or down with probability by distance): an element reaches the next bf16
value with probability |update| / spacing, the rate at which an fp32 master weight's bf16 cast changes under the
same update. No optimizer state and no gradient kept; no gradient clipping (the update does not scale with it).
That rate is a long run's, whose masters lie anywhere between two bf16 values; fp32 masters made from bf16 weights
(qwen2.5-0.5b's) start on them and need half a spacing to change their cast, so their first steps change fewer
elements: on tiny-llama at lr 1e-6, 1.5% at the first step against 3.3% for fp32 weights and for this step.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from benchmarks.harness import rl_step
from benchmarks.harness.models import EMBEDDED, random_prompts

EXAMPLE = Path(__file__).resolve().parents[2] / "cluster_configs" / "grpo-local.yaml"


@dataclass(frozen=True)
class Recipe:
    """What the learner runs: the GRPO example's settings (the embedded model) or W6's (random-weight models)."""
    source: str
    lr: float
    clip_eps: float
    tis_cap: float
    max_grad_norm: float | None
    micro_batch: int
    temperature: float
    task: bool          # the arithmetic task's chat prompts and reward; else token prompts and the parity reward
    seed: int = 0


def recipe(model_name: str) -> Recipe:
    from actors.grpo_config import GRPOConfig

    if model_name == EMBEDDED:
        import yaml
        with open(EXAMPLE) as f:
            g = {**vars(GRPOConfig()), **yaml.safe_load(f)["grpo"]}
        return Recipe(f"the GRPO example (scripts/grpo_demo.py, {EXAMPLE.parent.name}/{EXAMPLE.name})",
                      float(g["lr"]), float(g["clip_eps"]), float(g["tis_cap"]), g["max_grad_norm"],
                      int(g["micro_batch"]), float(g["temperature"]), True, int(g["seed"]))
    d = GRPOConfig()
    learner = {**rl_step.LEARNER_DEFAULT, **rl_step.LEARNER.get(model_name, {})}
    return Recipe("W6's learner (benchmarks/harness/rl_step.py)", rl_step.LR, d.clip_eps, d.tis_cap, d.max_grad_norm,
                  int(learner["micro_batch"]), 1.0, False, d.seed)



class Batches:
    """Each step's prompts, sampling and reward: the GRPO example's task, or token prompts and the parity reward."""

    def __init__(self, rc: Recipe, shapes, vocab_size: int):
        self.rc, self.s, self.vocab_size = rc, shapes, vocab_size
        if rc.task:
            from rollout_service.examples import tasks
            train, _ = tasks.split(64)  # the example's held-out split (heldout_size 64), never trained on
            self.sampler = tasks.ProblemSampler(train, seed=rc.seed)

    def next(self, step: int):
        from rollout_service import SamplingParams
        from rollout_service.examples import tasks

        s = self.s
        sampling = SamplingParams(n=s.wd_n, temperature=self.rc.temperature, max_tokens=s.wd_new,
                                  logprobs_mode="scaled", seed=self.rc.seed * 1_000_003 + step,
                                  ignore_eos=not self.rc.task)
        if not self.rc.task:
            prompts = random_prompts(s.wd_prompts, s.wd_prompt, self.vocab_size, seed=100 + step)
            return prompts, sampling, lambda j, r: rl_step.parity_reward(r)
        problems = self.sampler.sample(s.wd_prompts)
        return ([p.messages() for p in problems], sampling,
                lambda j, r: tasks.reward(r.text, problems[j // s.wd_n].answer))


class Learner:
    """GRPO updates of `model` in place: AdamW (rollout_service.training.MasterWeights: on the weights themselves
    when fp32, through fp32 masters otherwise), or with `light` the memory-light step (FreshAdamSR)."""

    def __init__(self, model: torch.nn.Module, rc: Recipe, light: bool, group_size: int):
        from rollout_service.training import MasterWeights

        self.model, self.rc, self.light, self.group_size = model, rc, light, group_size
        self.dtype = next(model.parameters()).dtype
        if light:
            self.optimizer = FreshAdamSR(model, rc.lr, seed=rc.seed)
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        else:
            self.optimizer = MasterWeights(model, "adamw", rc.lr, 0.0)

    def describe(self) -> str:
        if self.light:
            return ("fresh-adam-sr: bf16 weights only, AdamW's first step from fresh moments (lr * g / (|g| + eps)) "
                    "per tensor in the backward, stochastically rounded to bf16; no optimizer state (delta_bench.py)")
        if self.dtype == torch.float32:
            return "AdamW on fp32 weights (weight decay 0)"
        return f"AdamW through fp32 master weights, {str(self.dtype).removeprefix('torch.')} model (weight decay 0)"

    def state(self) -> dict[str, torch.Tensor]:
        """What the GRPO learner pushes (actors/grpo.py push_weights): its state dict."""
        return {k: v.detach() for k, v in self.model.state_dict().items()}

    def cast_state(self, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """A copy of the state in `dtype` (the engine's)."""
        return {k: v.to(dtype, copy=True) for k, v in self.state().items()}

    def step(self, results, rewards: list[float]) -> dict:
        """One GRPO update (actors/grpo.py train_on's loss: zero-advantage samples left out, tokens averaged over
        the batch); returns its figures."""
        from actors.learner import group_advantages
        from rollout_service.training.loss import ppo_clip_loss
        from rollout_service.training.mismatch import token_logprobs

        rc = self.rc
        t0 = time.perf_counter()
        adv = group_advantages(rewards, self.group_size)
        live = [i for i, a in enumerate(adv) if a != 0.0 and len(results[i].token_ids)]
        n_tokens = max(1, sum(len(r.token_ids) for r in results))
        out = {"trained_samples": len(live), "loss": 0.0, "grad_norm": None}
        if not live:  # every group tied: no update (the GRPO learner takes no step either)
            out["learner_s"] = round(time.perf_counter() - t0, 3)
            return out
        self.model.train()
        try:
            self.optimizer.zero_grad()
            chunk_size = len(live) if self.light else rc.micro_batch  # light: one backward, one update per weight
            for j in range(0, len(live), chunk_size):
                chunk = live[j:j + chunk_size]
                lps = token_logprobs(self.model, [results[i] for i in chunk], rc.temperature)
                loss = sum(ppo_clip_loss(lp, torch.as_tensor(np.array(results[i].logprobs), device=lp.device),
                                         float(adv[i]), rc.clip_eps, rc.tis_cap)
                           for i, lp in zip(chunk, lps)) / n_tokens
                loss.backward()
                if not self.light:
                    self.optimizer.accumulate()
                out["loss"] += loss.item()
            if not self.light:
                out["grad_norm"] = round(self.optimizer.step(rc.max_grad_norm), 5)
        finally:
            self.model.eval()
        out["loss"] = round(out["loss"], 6)
        out["learner_s"] = round(time.perf_counter() - t0, 3)
        return out

    def close(self) -> None:
        """Free the optimizer's state and hooks (the model keeps its trained weights)."""
        if self.light:
            self.optimizer.close()
            self.model.gradient_checkpointing_disable()
        else:
            self.optimizer.zero_grad()
        self.optimizer = None


class FreshAdamSR:
    """The memory-light step (module docstring): each weight updated in the backward once its gradient is complete,
    by lr * g / (|g| + eps) in fp32, rounded to bf16 stochastically; the gradient is freed at once. Weights of
    another dtype are rounded to nearest."""

    CHUNK = 1 << 24  # elements updated at a time: bounds the fp32 temporaries (an 8B model's embedding is 525M)

    def __init__(self, model: torch.nn.Module, lr: float, eps: float = 1e-8, seed: int = 0):
        self.lr, self.eps = lr, eps
        params = [p for p in model.parameters() if p.requires_grad]
        self.gen = torch.Generator(device=params[0].device).manual_seed(seed)
        self.hooks = [p.register_post_accumulate_grad_hook(self._update) for p in params]
        self.total = sum(p.numel() for p in params)
        self.changed = torch.zeros((), dtype=torch.int64, device=params[0].device)  # since zero_grad (one step)

    def zero_grad(self) -> None:
        """Before a step's backward (the gradients themselves are freed as they are used)."""
        self.changed.zero_()

    def changed_share(self) -> float:
        return round(int(self.changed) / max(1, self.total), 6)

    @torch.no_grad()
    def _update(self, p: torch.Tensor) -> None:
        w, g = p.data.view(-1), p.grad.reshape(-1)
        for a in range(0, w.numel(), self.CHUNK):
            old, grad = w[a:a + self.CHUNK], g[a:a + self.CHUNK].float()
            new = old.float() - self.lr * grad / (grad.abs() + self.eps)
            new = stochastic_bf16(new, self.gen) if w.dtype == torch.bfloat16 else new.to(w.dtype)
            self.changed += (new != old).sum()  # (on the device: no sync per chunk)
            old.copy_(new)
        p.grad = None

    def close(self) -> None:
        for h in self.hooks:
            h.remove()
        self.hooks = []


def stochastic_bf16(x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """fp32 `x` rounded to bf16 up or down (in magnitude) with probability by distance: a random 16-bit number added
    to the bits bf16 drops, then dropped (finite values; the sign bit is left alone)."""
    noise = torch.randint(0, 1 << 16, x.shape, generator=gen, device=x.device, dtype=torch.int32)
    return ((x.view(torch.int32) + noise) & -65536).view(torch.float32).to(torch.bfloat16)
