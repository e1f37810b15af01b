"""A step that raised: the request at fault is found and finishes with its error ("abort", RolloutResult.error);
its batch mates are recomputed and go on.

Owns: nothing between faults. May call: the scheduler (preempt, the waiting queue), the request table (a
request's sequences, finishing them) and the decode loop (steps run alone, the step in flight).
"""
from __future__ import annotations

import logging
from collections import deque

from rollout_service.engine.decode_loop import DecodeLoop
from rollout_service.engine.requests import RequestTable
from rollout_service.engine.scheduler import Scheduler

log = logging.getLogger(__name__)


class FaultIsolation:
    def __init__(self, scheduler: Scheduler, requests: RequestTable, loop: DecodeLoop):
        self.scheduler, self.requests, self.loop = scheduler, requests, loop

    def flush(self) -> None:
        """Record the step in flight now (before an abort, a weight swap or a sleep); a request at fault
        fails alone, as in a step."""
        try:
            self.loop.record_in_flight()
        except Exception as e:
            self.isolate(e)

    def isolate(self, error: Exception) -> None:
        """A step raised `error`. Every sequence it touched is preempted (recomputed later: seeded sampling
        gives the same tokens), then the request at fault is looked for: first one whose sampling params no
        longer pass validation, else each request of the step runs alone until its sequences have one more
        token. One that raises alone finishes with its error ("abort", RolloutResult.error); the others go
        on. A fault only a batch shows leaves no one to blame: they go on, each a token further."""
        self.loop.drop_in_flight()
        touched = self.scheduler.running + [s for s in self.scheduler.waiting if s.pages]
        suspects = list(dict.fromkeys(s.request_id for s in touched))
        if not suspects:
            raise error  # not a request's doing: an engine bug, for the caller to see
        log.warning("engine step failed (%s: %s); isolating the request at fault among %d",
                    type(error).__name__, error, len(suspects))
        self.scheduler.preempt_all()
        invalid = False
        for rid in suspects:
            try:
                self.requests.seqs(rid)[0].sampling.validate()
            except ValueError as e:
                self._fail(rid, e)
                invalid = True
        if not invalid:
            for rid in suspects:
                self._run_alone(rid)

    def _run_alone(self, rid: str) -> None:
        """Run request rid's unfinished sequences by themselves until each has one more token; if that
        raises, rid is at fault and fails. Every sequence is preempted after, as _isolate left them."""
        sched = self.scheduler
        seqs = [s for s in self.requests.seqs(rid) if not s.is_finished]
        goal = {s.seq_id: s.num_output_tokens + 1 for s in seqs}
        others = deque(s for s in sched.waiting if s.request_id != rid)
        sched.waiting = deque(s for s in sched.waiting if s.request_id == rid)
        try:
            while any(not s.is_finished and s.num_output_tokens < goal[s.seq_id] for s in seqs):
                if not self.loop.step():
                    break
            self.loop.record_in_flight()
        except Exception as e:
            self.loop.drop_in_flight()
            self._fail(rid, e)
        finally:
            sched.preempt_all()
            sched.waiting += others

    def _fail(self, rid: str, error: Exception) -> None:
        """Finish every sequence of a request now, with the error."""
        text = f"{type(error).__name__}: {error}"
        log.warning("request %r failed inside an engine step: %s", rid, text)
        for seq in self.requests.seqs(rid):  # none: every sample finished before the error
            if not seq.is_finished:
                self.requests.finish_to_outbox(seq, "abort", text)

