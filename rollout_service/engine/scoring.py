"""Scoring: the teacher-forced log-probs of a given completion (RolloutRequest.completion), by prefill alone.

A scoring sequence holds prompt + completion as its tokens. The logits at position p predict token p + 1, so
the positions [score_from - 1, num_tokens - 1) score the completion; a prefill chunk scores those it covers.
Their hidden states reach the LM head SCORE_ROWS rows at a time (a 1k-token completion would otherwise need
a [1024, vocab] float32 block at once) and the sampler reports each completion token's log-prob under the
sequence's own sampling distribution (Sampler.score). The prefix cache serves the prompt up to the first
scoring position, so the n completions of one prompt prefill it once.

A completion is scored under one policy version: a refresh restarts any sequence part-way through
(`restart_partial`); the result's token_versions say which version it was.
"""
from __future__ import annotations

import torch

from rollout_service.engine.sampler import Sampler
from rollout_service.engine.scheduler import Batch
from rollout_service.engine.sequence import Sequence

SCORE_ROWS = 256


def score_positions(seq: Sequence, start: int, end: int) -> range:
    """The positions in [start, end) whose logits score a completion token (empty for a sampling sequence)."""
    if seq.score_from is None:
        return range(0)
    return range(max(start, seq.score_from - 1), min(end, seq.num_tokens - 1))


@torch.inference_mode()
def record_scores(model: torch.nn.Module, sampler: Sampler, batch: Batch, hidden: torch.Tensor | None) -> int:
    """Score the completion tokens this prefill chunk covered (`hidden`: their rows, in batch order, as the
    runner gathered them); each sequence's scores are written at their token's index, so a chunk recomputed
    after a preemption overwrites what it scored before. Returns how many tokens were scored."""
    owners: list[Sequence] = []
    targets: list[int] = []
    for i, seq in enumerate(batch.seqs):
        for p in score_positions(seq, seq.num_computed, seq.num_computed + batch.chunk_lens[i]):
            owners.append(seq)
            targets.append(seq.prompt_token_ids[p + 1])
    if not owners:
        return 0
    lps, tops = [], []
    for lo in range(0, len(owners), SCORE_ROWS):
        hi = lo + SCORE_ROWS
        out = sampler.score(model.compute_logits(hidden[lo:hi]), owners[lo:hi], targets[lo:hi])
        lps += out.logprobs.tolist()
        if out.top_ids is not None:
            tops += [dict(zip(ids, values)) for ids, values in zip(out.top_ids.tolist(), out.top_logprobs.tolist())]
    row = 0
    for i, seq in enumerate(batch.seqs):
        span = score_positions(seq, seq.num_computed, seq.num_computed + batch.chunk_lens[i])
        if not span:
            continue
        j = span.start - (seq.score_from - 1)
        seq.scores[j:] = lps[row:row + len(span)]
        k = seq.sampling.logprobs
        if k:
            seq.score_top[j:] = [{t: lp for t, lp in list(top.items())[:k] if lp != float("-inf")}
                                 for top in tops[row:row + len(span)]]
        row += len(span)
    return len(owners)


def complete(seq: Sequence, version: int) -> None:
    """A fully scored sequence reads as a result: prompt, then the completion as its tokens with their scores."""
    prompt, completion = seq.prompt_token_ids[:seq.score_from], seq.prompt_token_ids[seq.score_from:]
    seq.prompt_token_ids, seq.output_token_ids = prompt, completion
    seq.output_logprobs, seq.output_top = seq.scores, seq.score_top
    seq.token_versions = [version] * len(completion)
    seq.kv_versions = [seq.kv_version] * len(completion)
    seq.score_from = None


def outside_kept_set(seq: Sequence, shown: int = 8) -> str | None:
    """What a scored result says when some completion tokens fall outside its truncated distribution (top-k,
    top-p, min-p): their log-prob is -inf there, correctly, but a learner's loss cannot take it, so the result
    names them (finish_reason stays "scored"; the log-probs are kept)."""
    outside = [i for i, lp in enumerate(seq.output_logprobs) if lp == float("-inf")]
    if not outside:
        return None
    sp = seq.sampling
    more = f" and {len(outside) - shown} more" if len(outside) > shown else ""
    return (f"completion token(s) {outside[:shown]}{more} are outside the kept set of the sampling distribution "
            f"(top_k={sp.top_k}, top_p={sp.top_p}, min_p={sp.min_p}): their log-prob is -inf; score with "
            f"logprobs_mode='raw' (or without the truncation) for the full distribution's")


def restart_partial(waiting: list[Sequence], release) -> int:
    """Before a refresh: scoring sequences part-way through let go of their KV (`release`), to be scored
    again from the start under the new weights. Returns how many."""
    partial = [s for s in waiting if s.score_from is not None and (s.pages or s.scores)]
    for seq in partial:
        release(seq)
        seq.scores, seq.score_top = [], []
    return len(partial)
