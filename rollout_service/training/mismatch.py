"""Logprob mismatch between the rollout engine (behaviour policy) and a learner's recompute.

An RL learner computes importance ratios exp(learner_logprob - rollout_logprob) on the sampled tokens.
They are only as good as the agreement of the two numerics: with the same weights on both sides the
gap should be float noise (<= 1e-4 mean in fp32), and anything larger is off-policy drift the loss must
correct for (see the truncated importance weight in actors/grpo.py). This module recomputes the
learner side with a transformers CausalLM and reports the gap.

Rollouts must be sampled with logprobs_mode "scaled" (or "processed" with no top-k/top-p/min-p and no
penalties) and the learner must recompute at the same temperature, else the two sides measure
different distributions and the report is meaningless.

An episode's result (multi-turn, rollout_service/episodes.py) also holds the environment's tokens, which the
model did not sample (loss_mask 0, log-prob 0.0): only its loss_mask == 1 tokens are compared and counted.

On a mixture-of-experts policy, `routing_replay=True` recomputes with the experts the engine chose
(rollout_service.training.routing_replay; the results must carry routed_experts and prompt_routed_experts), and
a report on results that carry them says how often the routing differed.
"""
from __future__ import annotations

import dataclasses
from contextlib import contextmanager
from typing import Callable, Iterator, Sequence

import numpy as np
import torch

from rollout_service.training.importance import ratio_report
from rollout_service.training.routing_replay import RoutingStats, carries_routing, replay_routing
from rollout_service.api.types import RolloutResult


def model_token_mask(result: RolloutResult) -> np.ndarray:
    """Which of `result.token_ids` the model sampled (bool per token): its loss_mask, or every token of a
    result without one."""
    if result.loss_mask is None:
        return np.ones(len(result.token_ids), dtype=bool)
    return np.asarray(result.loss_mask, dtype=bool).reshape(len(result.token_ids))


def num_model_tokens(results: Sequence[RolloutResult]) -> int:
    return int(sum(model_token_mask(r).sum() for r in results))


def token_logprobs(model: torch.nn.Module, results: Sequence[RolloutResult], temperature: float = 1.0,
                   weights: dict[str, torch.Tensor] | None = None, routing_replay: bool = False) -> list[torch.Tensor]:
    """log p(token_ids[i] | prompt + earlier tokens) per result, in one right-padded forward.

    Gradients flow when grad mode is on (a learner's loss); right padding keeps every real token's
    positions and causal context identical to an unpadded forward. Only the positions from the shortest
    prompt on get logits (`logits_to_keep`): the prompt's vocabulary-wide logits were most of the memory.
    `weights`: parameters to run instead of the model's own (torch.func.functional_call), e.g. its weights
    upcast to fp32, for an fp32 reference forward without a second model. `routing_replay`: every MoE layer
    takes the results' recorded experts (training/routing_replay.py; with gradient checkpointing, keep the
    replay_routing block open over the backward instead)."""
    if temperature <= 0:
        raise ValueError(f"temperature={temperature}: logprobs are recomputed at a sampling temperature > 0")
    if not results:
        return []
    device = next(model.parameters()).device
    seqs = [list(r.prompt_token_ids) + list(r.token_ids) for r in results]
    width = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros(len(seqs), width, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = torch.tensor(s)
        mask[i, :len(s)] = 1
    first = min(len(r.prompt_token_ids) for r in results) - 1  # the first position whose logits are used
    kwargs = dict(input_ids=ids.to(device), attention_mask=mask.to(device), use_cache=False,
                  logits_to_keep=width - first)
    with _routing(model, results, routing_replay, None):
        if weights is None:
            logits = model(**kwargs).logits
        else:
            logits = torch.func.functional_call(model, weights, args=(), kwargs=kwargs, strict=False)
            logits = logits.logits
    out = []
    for i, r in enumerate(results):
        start, n = len(r.prompt_token_ids) - 1 - first, len(r.token_ids)
        rows = logits[i, start:start + n]
        rows = rows.to(torch.promote_types(rows.dtype, torch.float32))  # bf16 up to fp32; a float64 check stays so
        if temperature != 1.0:
            rows = rows / temperature
        target = torch.tensor(r.token_ids, dtype=torch.long, device=device)
        out.append(rows.gather(1, target[:, None])[:, 0] - torch.logsumexp(rows, dim=-1))
    return out


def learner_logprobs(model: torch.nn.Module, results: Sequence[RolloutResult], temperature: float = 1.0,
                     micro_batch: int = 16, recompute: Callable[[Sequence[RolloutResult]], list] | None = None,
                     routing_replay: bool = False, routing_stats: RoutingStats | None = None) -> list[np.ndarray]:
    """The learner's float32 log-probs of every result's sampled tokens (no grad, in micro-batches).
    recompute(results): the learner's forward (default: token_logprobs of `model` at `temperature`).
    routing_replay: the forward replays the results' recorded experts. routing_stats: counts, over these
    forwards, the sampled tokens whose routing by the policy's routers differs from the recorded one."""
    if micro_batch < 1:
        raise ValueError(f"micro_batch={micro_batch} must be >= 1")
    recompute = recompute or (lambda chunk: token_logprobs(model, chunk, temperature))
    out: list[np.ndarray] = []
    with torch.no_grad():
        for i in range(0, len(results), micro_batch):
            chunk = results[i:i + micro_batch]
            with _routing(model, chunk, routing_replay, routing_stats):
                out += [t.cpu().numpy().astype(np.float32) for t in recompute(chunk)]
    return out


@contextmanager
def _routing(model: torch.nn.Module, results: Sequence[RolloutResult], replay: bool,
             stats: RoutingStats | None) -> Iterator[None]:
    """The replay (or only the count) of the results' routing over a forward, when either is wanted."""
    if not (replay or stats is not None) or not results:
        yield
        return
    with replay_routing(model, results, replay) as counted:
        yield
    if stats is not None:
        stats.add(counted)




def logprob_mismatch(results: Sequence[RolloutResult], learner: Sequence[np.ndarray | torch.Tensor],
                     ratio_cap: float = 2.0) -> dict:
    """Compare rollout (behaviour) log-probs with a learner's, token by token (the model's tokens only:
    model_token_mask).

    Returns mean_abs / max_abs |learner - rollout|, mean_signed (learner - rollout), n_tokens,
    n_sequences, kl (k3 estimate of KL(rollout || learner) on the sampled tokens, >= 0), the mean
    and max importance ratio exp(learner - rollout) and the share of tokens whose ratio is outside
    [1/ratio_cap, ratio_cap] (training/importance.py: what masked IS drops), and the rollout policy versions
    seen."""
    if len(results) != len(learner):
        raise ValueError(f"{len(learner)} learner log-prob arrays for {len(results)} results")
    rollout, mine, versions = [], [], set()
    for i, (r, lp) in enumerate(zip(results, learner)):
        lp = lp.detach().cpu().numpy() if isinstance(lp, torch.Tensor) else np.asarray(lp)
        if lp.shape != (len(r.token_ids),):
            raise ValueError(f"result {i}: {lp.shape[0] if lp.ndim else 0} learner log-probs for "
                             f"{len(r.token_ids)} sampled tokens")
        sampled = model_token_mask(r)
        rollout.append(np.asarray(r.logprobs, dtype=np.float64)[sampled])
        mine.append(lp.astype(np.float64)[sampled])
        versions.update(np.asarray(r.token_versions, dtype=np.int64)[sampled].tolist())
    b = np.concatenate(rollout) if rollout else np.zeros(0)
    a = np.concatenate(mine) if mine else np.zeros(0)
    if not np.all(np.isfinite(b)):
        raise ValueError("rollout log-probs hold -inf/nan: sample with logprobs_mode='scaled' to compare")
    if b.size == 0:
        return {"mean_abs": 0.0, "max_abs": 0.0, "mean_signed": 0.0, "kl": 0.0, "ratio_mean": 1.0,
                "ratio_max": 1.0, "ratio_outside_share": 0.0, "ratio_cap": ratio_cap, "n_tokens": 0,
                "n_sequences": len(results), "versions": sorted(versions)}
    diff = a - b
    log_ratio = -diff  # log(rollout / learner) per token, for the k3 estimator
    return {
        "mean_abs": float(np.abs(diff).mean()),
        "max_abs": float(np.abs(diff).max()),
        "mean_signed": float(diff.mean()),
        "kl": float(np.mean(np.exp(-log_ratio) - 1 + log_ratio)),
        **ratio_report(b, a, ratio_cap),
        "n_tokens": int(b.size),
        "n_sequences": len(results),
        "versions": sorted(int(v) for v in versions),
    }


def mismatch_report(model: torch.nn.Module, results: Sequence[RolloutResult], temperature: float = 1.0,
                    micro_batch: int = 16, routing_replay: bool = False) -> dict:
    """Recompute with `model` and compare: the one call a learner makes on a batch of results. With results that
    carry their routing, also routing_replay (1 or 0) and RoutingStats.as_dict(): without replay, the share
    of sampled tokens the policy routes differently from the engine at one MoE layer or more."""
    stats = RoutingStats() if results and all(map(carries_routing, results)) else None
    report = logprob_mismatch(results, learner_logprobs(model, results, temperature, micro_batch,
                                                        routing_replay=routing_replay, routing_stats=stats))
    if stats is not None:
        report.update(routing_replay=int(routing_replay), **stats.as_dict())  # 0/1: a fidelity report's numbers
    return report


def fp32_reference_report(model: torch.nn.Module, results: Sequence[RolloutResult], temperature: float = 1.0,
                          micro_batch: int = 8) -> dict:
    """How far the rollout's log-probs and the learner's own are from an fp32 forward of the same weights.

    A bf16 engine cannot match a bf16 learner bitwise; what matters is that it is no further from the exact
    values than the learner's own numerics are. The fp32 forward runs the model's weights upcast (a
    transient fp32 copy of them) through the model itself (torch.func.functional_call). Returns
    {"rollout_vs_fp32": report, "learner_vs_fp32": report, "ratio": the rollout's mean |error| over the
    learner's}."""
    weights = {n: p.detach().float() for n, p in model.named_parameters()}
    fp32, mine = [], []
    with torch.no_grad():
        for i in range(0, len(results), micro_batch):
            chunk = results[i:i + micro_batch]
            fp32 += [t.float().cpu().numpy() for t in token_logprobs(model, chunk, temperature, weights)]
            mine += [t.float().cpu().numpy() for t in token_logprobs(model, chunk, temperature)]
    del weights
    rollout = logprob_mismatch(results, fp32)
    learner = logprob_mismatch([dataclasses.replace(r, logprobs=m) for r, m in zip(results, mine)], fp32)
    ratio = rollout["mean_abs"] / learner["mean_abs"] if learner["mean_abs"] > 0 else None
    return {"rollout_vs_fp32": rollout, "learner_vs_fp32": learner, "ratio": ratio}
