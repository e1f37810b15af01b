"""What a step's output does to its sequences: each running sequence gets its sampled token, log-prob and
versions, then the stop rules decide whether it is done; after a prompt's prefill its sibling samples are forked
and a scored completion is finished.

Owns: the stop rules. May call: the request table (finish, add samples), the scheduler (after a prefill), the
KV blocks (fork), the sampler (a prefill's logits) and the counters.
"""
from __future__ import annotations

import math
import time
from typing import Any

import torch

from rollout_service.engine.kv_cache import BlockManager
from rollout_service.engine.model_runner import Prefilled
from rollout_service.engine.overflow import overflow_error
from rollout_service.engine.requests import RequestTable
from rollout_service.engine.sampler import Sampler, SamplerOutput
from rollout_service.engine.scheduler import Batch, Scheduler
from rollout_service.engine.scoring import complete, outside_kept_set, record_scores
from rollout_service.engine.sequence import Sequence, SeqStatus
from rollout_service.prompts import PromptProcessor


class StopRules:
    """When a sequence is done: EOS / stop token ids, stop strings, max_tokens and max_model_len."""

    def __init__(self, eos_ids: set[int], prompts: PromptProcessor, max_model_len: int):
        self.eos_ids, self.prompts, self.max_model_len = eos_ids, prompts, max_model_len

    def reaches_length(self, seq: Sequence, outputs: int) -> bool:
        """Whether seq is done by max_tokens / max_model_len once it has `outputs` output tokens."""
        return outputs >= seq.sampling.max_tokens or outputs + len(seq.prompt_token_ids) >= self.max_model_len

    def reason(self, seq: Sequence, tok: int) -> str | None:
        sp = seq.sampling
        if (not sp.ignore_eos and tok in self.eos_ids) or (sp.stop_token_ids and tok in sp.stop_token_ids):
            return "stop"
        if sp.stop:
            text = self.prompts.decode(seq.output_token_ids)
            hits = [i for i in (text.find(s) for s in sp.stop) if i >= 0]
            if hits:
                seq.stop_text_end = min(hits)
                return "stop"
        if self.reaches_length(seq, len(seq.output_token_ids)):
            return "length"
        return None


class TokenRecorder:
    def __init__(self, model: torch.nn.Module, sampler: Sampler, scheduler: Scheduler, blocks: BlockManager,
                 requests: RequestTable, counters: Any, stops: StopRules):
        self.model, self.sampler, self.scheduler, self.blocks = model, sampler, scheduler, blocks
        self.requests, self.counters, self.stops = requests, counters, stops

    def record(self, seqs: list[Sequence], out: SamplerOutput, version: int) -> None:
        """Record one sampled token per running sequence, then check for stops (finished ones go to the
        outbox). `out` is on the host for a decode step (copied behind its sampler); a prefill step's is
        read here: its one sync."""
        token_ids, logprobs = out.token_ids.tolist(), out.logprobs.tolist()
        top_ids = out.top_ids.tolist() if out.top_ids is not None else None
        top_lps = out.top_logprobs.tolist() if out.top_logprobs is not None else None
        recorded = 0
        for i, seq in enumerate(seqs):
            if seq.status is not SeqStatus.RUNNING:
                continue  # finished (or aborted) while this step ran
            recorded += 1
            top = (top_ids[i], top_lps[i]) if top_ids is not None else None
            self._take(seq, token_ids[i], logprobs[i], top, version)
        self.note_recorded(recorded)

    def record_run(self, seq: Sequence, token_ids: list[int], logprobs: list[float],
                   tops: list[tuple[list[int], list[float]] | None], version: int) -> int:
        """Record consecutive tokens of one running sequence (a verify step's), each as a decode step would, up
        to the one that finishes it; their KV but the last's is computed. Returns how many were recorded."""
        for i, tok in enumerate(token_ids):
            seq.num_computed = seq.num_tokens
            if not self._take(seq, tok, logprobs[i], tops[i], version):
                return i + 1
        return len(token_ids)

    def note_recorded(self, recorded: int) -> None:
        self.counters.generated_tokens += recorded
        self.counters.recent.append((time.time(), recorded))

    def _take(self, seq: Sequence, tok: int, logprob: float, top_row: tuple[list[int], list[float]] | None,
              version: int) -> bool:
        """Append one sampled token and apply the stop rules; False when that finished the sequence."""
        k = seq.sampling.logprobs
        # alternatives outside a truncated distribution (-inf) are not alternatives
        top = ({t: lp for t, lp in zip(top_row[0][:k], top_row[1][:k]) if lp != float("-inf")}
               if k and top_row is not None else None)
        seq.append(tok, logprob, version, top)
        if not math.isfinite(logprob):  # the forward overflowed: what follows would be garbage
            error = overflow_error([logprob], offset=seq.num_output_tokens - 1)
            self.requests.finish_to_outbox(seq, "abort", error)
            return False
        reason = self.stops.reason(seq, tok)
        if reason:
            self.requests.finish_to_outbox(seq, reason)
            return False
        return True

    def after_prefill(self, batch: Batch, prefilled: Prefilled, version: int) -> None:
        """A prefill chunk ran: prompts it completed fork their samples and draw their first tokens; scored
        completions it completed finish."""
        c = self.counters
        c.prefill_steps += 1
        c.prefilled_tokens += sum(batch.chunk_lens)
        c.scored_tokens += record_scores(self.model, self.sampler, batch, prefilled.score_hidden)
        to_sample, rows, row, scored = [], [], 0, []
        for i, seq in enumerate(batch.seqs):
            seq.num_computed += batch.chunk_lens[i]
            if not batch.completes[i]:
                continue
            if seq.score_from is not None:
                scored.append(seq)
                continue
            if seq.num_output_tokens:
                c.recomputes += 1
            else:
                c.prompt_prefills += 1
            group = [seq] + self._fork(seq)
            to_sample += group
            rows += [row] * len(group)  # the samples of one prompt draw from its logits row
            row += 1
        self.scheduler.after_prefill(batch, to_sample)
        for seq in scored:
            self._finish_scored(seq, version)
        if not to_sample:
            return
        logits = prefilled.logits
        if len(rows) != logits.shape[0]:
            logits = logits[torch.tensor(rows, device=logits.device)]
        self.record(to_sample, self.sampler(logits, to_sample), version)

    def _finish_scored(self, seq: Sequence, version: int) -> None:
        complete(seq, version)
        self.counters.scored_sequences += 1
        error = overflow_error(seq.output_logprobs, scoring=True)
        self.requests.finish_to_outbox(seq, "abort" if error else "scored", error or outside_kept_set(seq))

    def _fork(self, seq: Sequence) -> list[Sequence]:
        """The n - 1 sibling samples of a prefilled prompt, sharing its pages (kv_cache.BlockManager.fork)."""
        n, seq.num_samples = seq.num_samples, 1
        children = []
        for k in range(1, n):
            child = seq.fork(seq.sample_index + k)
            self.blocks.fork(seq, child)
            children.append(child)
        self.requests.add_samples(seq.request_id, children)
        return children
