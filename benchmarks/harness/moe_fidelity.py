"""WMF: how far a transformers learner's recompute is from an MoE rollout, with and without routing replay.

The bench model's LM head is scaled so that next-token distributions are sharp (mean entropy near
TARGET_ENTROPY nats on the prompts, as a trained policy's are; random weights give ~11 nats, where every
log-prob is tiny and any mismatch hides), then restored exactly. The engine samples `seqs` prompts at
temperature 1 with each token's routed experts (prompt included); the learner is the bench model's own
transformers forward in its dtype (mismatch.mismatch_report), once routing by itself and once replaying the
engine's experts (training/routing_replay.py). Reported: the share of sampled tokens whose experts differ in
at least one layer, mean and max |Δ log-prob|, the largest importance ratio and the share outside [0.8, 1.25].
"""
from __future__ import annotations

import torch

from benchmarks.harness.context import BenchContext
from benchmarks.harness.engine_side import open_engine
from benchmarks.harness.models import random_prompts
from benchmarks.harness.report import Cell, Row

TARGET_ENTROPY = 1.5
SEQS, PROMPT, NEW = 64, 128, 128
RATIO_CAP = 1.25


@torch.no_grad()
def sharpening_scale(model: torch.nn.Module, prompts: list[list[int]], target: float) -> tuple[float, float]:
    """(scale of the LM head, the mean entropy it gives): found by bisection on one forward's final hidden
    states, the logits of each scale computed from them."""
    ids = torch.tensor(prompts, device=model.device)
    hidden = model.model(input_ids=ids).last_hidden_state.reshape(-1, model.config.hidden_size)
    logits = (hidden @ model.lm_head.weight.T).float()

    def entropy(scale: float) -> float:
        logp = torch.log_softmax(logits * scale, dim=-1)
        return float(-(logp.exp() * logp).sum(-1).mean())

    lo, hi = 1.0, 1.0
    while entropy(hi) > target and hi < 1e4:
        hi *= 2
    for _ in range(30):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if entropy(mid) > target else (lo, mid)
    return hi, entropy(hi)


def wmf_moe_fidelity(ctx: BenchContext) -> list[Row]:
    bm = ctx.bm
    row = Row(bm.name, "WMF", f"learner recompute vs rollout, mean |Δ log-prob| with routing replay (engine) and "
              f"without (other peer); {SEQS} seqs, prompt {PROMPT}, {NEW} new, temperature 1", "nats", False)
    row.hf_generate = row.hf_generate_batch = row.floor = Cell.na("a fidelity comparison")
    if bm.moe is None:
        row.engine = Cell.na("needs a mixture-of-experts model")
        return [row]
    from rollout_service import SamplingParams

    prompts = random_prompts(SEQS, PROMPT, bm.vocab_size, seed=9)
    head = bm.hf_model.lm_head.weight
    original = head.detach().clone()
    scale, entropy = sharpening_scale(bm.hf_model, prompts[:8], TARGET_ENTROPY)
    row.details.update(lm_head_scale=round(scale, 3), mean_entropy_nats=round(entropy, 3))
    sp = SamplingParams(temperature=1.0, max_tokens=NEW, ignore_eos=True, seed=0, logprobs_mode="scaled",
                        return_routed_experts=True, return_prompt_routed_experts=True)
    try:
        with torch.no_grad():
            head.mul_(scale)
        with open_engine(bm, ctx.backend, SEQS, PROMPT + NEW, ctx.engine_extra) as client:
            results = client.generate(prompts, sampling=sp)
        reports = {replay: _report(bm.hf_model, results, replay) for replay in (False, True)}
    finally:
        with torch.no_grad():
            head.copy_(original)
    for replay, report in reports.items():
        row.details["replay" if replay else "own_routing"] = report
    row.engine = Cell(reports[True]["mean_abs"], "routing replay")
    row.other_peer = Cell(reports[False]["mean_abs"], "learner's own routing")
    return [row]


def _report(model: torch.nn.Module, results: list, replay: bool) -> dict:
    """The mismatch of the learner's recompute (replaying the routing or not) with the importance-ratio band
    [1 / RATIO_CAP, RATIO_CAP], and how often its own routing differs from the engine's."""
    from rollout_service.training.mismatch import learner_logprobs, logprob_mismatch
    from rollout_service.training.routing_replay import RoutingStats

    stats = RoutingStats()
    learner = learner_logprobs(model, results, 1.0, micro_batch=16, routing_replay=replay, routing_stats=stats)
    report = {**logprob_mismatch(results, learner, ratio_cap=RATIO_CAP), **stats.as_dict()}
    return {k: round(v, 6) if isinstance(v, float) else v for k, v in report.items() if k != "versions"}
