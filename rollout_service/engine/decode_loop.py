"""The engine's two step loops, chosen by EngineConfig.overlap_decode.

The plain loop runs what the scheduler picks and records its tokens before it returns. The overlapped loop
leaves a decode step in flight: the next call launches the following decode step on the device-side sampled
ids, and only then reads and records the first step's tokens, so the host's work hides behind the GPU's. A
sequence that turns out to have finished wasted one step's row; nothing else changes (the same tokens,
log-probs and random draws). A step whose sampling needs the tokens so far on the host (penalties) is recorded
at once in either loop, and so is one that speculation (speculation.py) may turn into a verify step.

Owns: the step in flight. May call: the scheduler (what runs next), the model runner, the sampler, the token
recorder (what a step's tokens do), the speculator (a decode batch as a verify step) and the counters; it
reads the policy version a step ran under.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from rollout_service.engine.model_runner import ModelRunner
from rollout_service.engine.recorder import TokenRecorder
from rollout_service.engine.sampler import Sampler, SamplerOutput, needs_history
from rollout_service.engine.scheduler import Batch, Scheduler
from rollout_service.engine.sequence import Sequence, SeqStatus
from rollout_service.engine.speculation import Speculator
from rollout_service.engine.transfers import copy_to_host, to_device


@dataclass
class Launched:
    """A decode step whose sampled tokens are still on the device."""

    seqs: list[Sequence]
    out: SamplerOutput          # on the device: feeds the next step
    host: SamplerOutput         # the same, copied to the host right behind the sampler (CUDA: pinned, async)
    copied: torch.cuda.Event | None  # that copy's CUDA event (None on CPU)
    version: int
    can_chain: bool  # the next step may run before these tokens are read


class DecodeLoop:
    def __init__(self, overlap: bool, scheduler: Scheduler, runner: ModelRunner, sampler: Sampler,
                 recorder: TokenRecorder, counters: Any, version: Callable[[], int],
                 speculator: Speculator | None = None):
        self.overlap, self.scheduler, self.runner, self.sampler = overlap, scheduler, runner, sampler
        self.recorder, self.counters, self.version = recorder, counters, version
        self.speculator = speculator
        self.in_flight: Launched | None = None

    def step(self) -> bool:
        """One step; what finishes goes to the outbox. False when there was nothing to run."""
        if self.speculator is not None:
            self.speculator.rates.start_step()
        return self._step_overlapped() if self.overlap else self._step_plain()

    def _step_plain(self) -> bool:
        batch = self.scheduler.schedule()
        if batch is None:
            return False
        launched = self._run_scheduled(batch)
        if launched is not None:
            self._record(launched)
        return True

    def _step_overlapped(self) -> bool:
        prev, self.in_flight = self.in_flight, None
        if prev is not None:
            # launch the next decode step first, then read and record prev's tokens while it runs
            nxt = self._schedule_ahead(prev) if prev.can_chain else None
            if nxt is not None:
                batch, rows = nxt
                ids = prev.out.token_ids if rows is None else prev.out.token_ids[rows]
                self.in_flight = self._launch(batch, ids)
                self.counters.overlapped_steps += 1
                self._record(prev)
                return True
            self._record(prev)  # then this call runs the step that schedule picks, as always
        batch = self.scheduler.schedule()
        if batch is None:
            return prev is not None
        launched = self._run_scheduled(batch)
        if launched is not None:
            if launched.can_chain:
                self.in_flight = launched
            else:
                self._record(launched)
        return True

    def _run_scheduled(self, batch: Batch) -> Launched | None:
        """Run a scheduled batch: a prefill or a verify step is recorded here; a decode step is returned
        launched."""
        if not batch.is_prefill:
            if self.speculator is not None and self.speculator.try_verify(batch, self.version):
                return None
            return self._launch(batch)
        prefilled = self.runner.prefill(batch)
        self.counters.steps += 1
        self.recorder.after_prefill(batch, prefilled, self.version())
        return None

    def _launch(self, batch: Batch, input_ids: torch.Tensor | None = None) -> Launched:
        """Queue a decode step's forward and sampling on the device (input_ids: one token ahead)."""
        ahead = int(input_ids is not None)
        logits = self.runner.decode(batch, input_ids)
        self.counters.steps += 1
        draft_top = self.speculator.draft_top(batch.seqs) if self.speculator is not None else 0
        out = self.sampler(logits, batch.seqs, ahead=ahead, draft_top=draft_top)
        host, copied = copy_to_host(out)
        can_chain = self.overlap and not any(needs_history(s.sampling) for s in batch.seqs)
        if self.speculator is not None:
            self.speculator.note_decode(len(batch.seqs))
            # a step that may verify needs these tokens recorded first
            can_chain = can_chain and not self.speculator.may_verify(batch.seqs)
        return Launched(batch.seqs, out, host, copied, self.version(), can_chain)

    def _schedule_ahead(self, prev: Launched) -> tuple[Batch, torch.Tensor | None] | None:
        """The decode step after prev, for prev's sequences that cannot finish by length at prev's token
        (and were not aborted): the batch and the rows of prev's output that feed it (None: all)."""
        if prev.version != self.version():
            return None
        reaches = self.recorder.stops.reaches_length
        # Every running sequence is one of prev's: only a prefill adds to them, and none ran since prev.
        keep = [i for i, s in enumerate(prev.seqs)
                if s.status is SeqStatus.RUNNING and not reaches(s, s.num_output_tokens + 1)]
        batch = self.scheduler.schedule_ahead([prev.seqs[i] for i in keep])
        if batch is None:
            return None
        rows = None if len(keep) == len(prev.seqs) else to_device(keep, prev.out.token_ids.device)
        return batch, rows

    def _record(self, launched: Launched) -> None:
        """Read a decode step's tokens and record them (sequences finished or aborted meanwhile skip theirs)."""
        for seq in launched.seqs:
            seq.num_computed = seq.num_tokens  # the step's query token now has its KV
        if launched.copied is not None:
            launched.copied.synchronize()  # this step's copy only, not the step launched after it
        indices = [s.num_output_tokens for s in launched.seqs]  # the output index each row's token takes
        self.recorder.record(launched.seqs, launched.host, launched.version)
        if self.speculator is not None:
            self.speculator.observe(launched.seqs, indices, launched.host)

    def record_in_flight(self) -> None:
        """Record the step in flight now (before an abort, a weight swap or a sleep)."""
        if self.in_flight is not None:
            prev, self.in_flight = self.in_flight, None
            self._record(prev)


    def drop_in_flight(self) -> None:
        """Forget the step in flight: its tokens are drawn again from recomputed KV (fault isolation)."""
        self.in_flight = None
