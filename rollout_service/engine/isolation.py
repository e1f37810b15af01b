"""A step that raised: the request at fault is found and finishes with its error ("abort", RolloutResult.error);
its batch mates are recomputed and go on. A part of Engine (engine/engine.py).
"""
from __future__ import annotations

import logging
from collections import deque

log = logging.getLogger(__name__)


class FaultIsolation:
    """Engine's fault isolation (a mixin: the state is the engine's)."""

    def _isolate(self, error: Exception) -> None:
        """A step raised `error`. Every sequence it touched is preempted (recomputed later: seeded sampling
        gives the same tokens), then the request at fault is looked for: first one whose sampling params no
        longer pass validation, else each request of the step runs alone until its sequences have one more
        token. One that raises alone finishes with its error ("abort", RolloutResult.error); the others go
        on. A fault only a batch shows leaves no one to blame: they go on, each a token further."""
        self._in_flight = None  # its tokens are drawn again from the recomputed KV
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
                self._requests[rid].seqs[0].sampling.validate()
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
        seqs = [s for s in self._requests[rid].seqs if not s.is_finished]
        goal = {s.seq_id: s.num_output_tokens + 1 for s in seqs}
        others = deque(s for s in sched.waiting if s.request_id != rid)
        sched.waiting = deque(s for s in sched.waiting if s.request_id == rid)
        try:
            while any(not s.is_finished and s.num_output_tokens < goal[s.seq_id] for s in seqs):
                if not self._step():
                    break
            self._record_in_flight()
        except Exception as e:
            self._in_flight = None
            self._fail(rid, e)
        finally:
            sched.preempt_all()
            sched.waiting += others

    def _fail(self, rid: str, error: Exception) -> None:
        """Finish every sequence of a request now, with the error."""
        text = f"{type(error).__name__}: {error}"
        log.warning("request %r failed inside an engine step: %s", rid, text)
        state = self._requests.get(rid)  # None: every sample finished before the error
        for seq in list(state.seqs) if state else []:
            if not seq.is_finished:
                self._outbox += self._finish(seq, "abort", text)

