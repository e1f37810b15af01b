"""Requests whose user code kills or wedges a rollout worker: quarantined, not resubmitted from worker to worker.

Reward functions and environments run inside a worker's process (rollout_service/user_code.py). Code that
ends the process (os._exit, a crash in a C extension, memory enough for the OOM killer) or never returns takes
the worker down, and a request resubmitted after that would do the same on the next worker, until none is left.
The router must know which request's code was running when a worker died, and afterwards it cannot ask.

So a worker announces each call of user code before making it (`UserCodeWatch.running`): the call goes in the
worker's next poll reply, and waits until the router's following poll confirms it read that reply (at most
ANNOUNCE_WAIT_S; a few milliseconds on one node). A call of os._exit from user code is announced the same way
before the process ends. When a worker goes down, the router (`Quarantine`) knows what was running:
- a request whose code called os._exit is quarantined: its missing samples end "abort" with the error, and it
  never runs again; the requests whose code ran beside it are resubmitted as if nothing had happened;
- a call that runs longer than `user_code_timeout_s` has wedged its worker: the router restarts the worker
  and quarantines that request (only that one);
- any other death (a crash, the OOM killer, a node lost, a kill from outside) cannot be told from an accident:
  the requests whose code was running get a strike and are resubmitted; a second strike quarantines one. A
  request that crashes every worker it lands on costs two deaths; its peers lose nothing.
"""
from __future__ import annotations

import contextlib
import itertools
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Iterator

ANNOUNCE_WAIT_S = 10.0  # a call waits this long at most for the router to confirm it knows of it


class UserCodeWatch:
    """The worker's side: the calls of user code now running, and what the router has confirmed reading.
    Shares the worker's condition variable, on which its poll waits."""

    def __init__(self, cv: threading.Condition):
        self._cv = cv
        self._calls: dict[int, list] = {}  # call -> [request id, what, start, called os._exit]
        self._ids = itertools.count()
        self._thread = threading.local()   # .call: the call this thread is in
        self._changes = 0      # changes to _calls; each reported to the router
        self._reported = 0     # changes in the last poll reply
        self._confirmed = 0    # changes the router has confirmed reading
        self._watched = False  # a router polls this worker (else nobody would confirm: calls do not wait)
        self._closed = False

    @contextlib.contextmanager
    def running(self, request_id: str, what: str) -> Iterator[None]:
        """Around one call of user code for `request_id` (a worker's engine request id)."""
        call = next(self._ids)
        with self._cv:
            self._calls[call] = [request_id, what, time.monotonic(), False]
            self._announce()
        self._thread.call = call
        try:
            yield
        finally:
            self._thread.call = None
            with self._cv:
                del self._calls[call]
                self._changed()  # reported soon, so a death after this call does not blame its request

    def before_exit(self) -> None:
        """os._exit was called: if from user code, the router learns whose before the process ends."""
        call = getattr(self._thread, "call", None)
        with self._cv:
            if call in self._calls:
                self._calls[call][3] = True
                self._announce()

    def _announce(self) -> None:
        """Report a change and wait until the router has read it. Hold the cv."""
        seq = self._changed()
        deadline = time.monotonic() + ANNOUNCE_WAIT_S
        while self._watched and not self._closed and self._confirmed < seq and time.monotonic() < deadline:
            self._cv.wait(deadline - time.monotonic())

    def _changed(self) -> int:
        self._changes += 1
        self._cv.notify_all()
        return self._changes

    @property
    def unreported(self) -> bool:
        """Something changed since the last poll reply (the poll should return now). Hold the cv."""
        return self._changes != self._reported

    def confirm(self, seq: int) -> None:
        """The router has read the reply that reported change `seq`. Hold the cv."""
        self._watched = True
        if seq > self._confirmed:
            self._confirmed = seq
            self._cv.notify_all()

    def report(self) -> dict:
        """For the poll reply: {"seq": changes so far, "calls": [[request id, what, seconds running, called
        os._exit], ...]}. Hold the cv."""
        self._reported = self._changes
        now = time.monotonic()
        return {"seq": self._changes, "calls": [[rid, what, now - t0, exits] for rid, what, t0, exits in
                                                self._calls.values()]}

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()


def announce_exits(watch: UserCodeWatch) -> None:
    """Route this process's os._exit through `watch.before_exit` (user code that ends the process is named
    to the router first; any other caller exits at once, as before)."""
    real_exit = os._exit

    def _exit(code: int) -> None:
        watch.before_exit()
        real_exit(code)

    os._exit = _exit


@dataclass
class _Seen:
    incarnation: str | None = None
    seq: int = 0                                     # the last change read: confirmed in the next poll
    calls: list[list] = field(default_factory=list)  # what the last poll reply said was running
    wedged: set[str] = field(default_factory=set)    # request ids whose call ran past the timeout


@dataclass(frozen=True)
class Suspect:
    request_id: str  # the worker's (engine) request id: the router's job id
    what: str        # the code: "reward module:function", "environment Name.step()", ...
    cause: str | None  # "exit": it called os._exit; "wedged": it ran past the timeout; None: it was running

    def verdict(self, strikes: int) -> str | None:
        """Why its request is quarantined, given the deaths while its code ran (this one included); None:
        resubmit it."""
        if self.cause == "exit":
            happened = "called os._exit, which ended the rollout worker's process"
        elif self.cause == "wedged":
            happened = "did not return within user_code_timeout_s, and the worker was restarted"
        elif strikes >= 2:
            happened = f"was running each time a worker died ({strikes} deaths)"
        else:
            return None
        return (f"quarantined: this request's {self.what} {happened}; it is not run again (reward functions and "
                "environments run inside the rollout worker's process)")


class Quarantine:
    """The router's side: per worker, the user code its last poll reply said was running."""

    def __init__(self) -> None:
        self._seen: dict[int, _Seen] = {}

    def _at(self, i: int) -> _Seen:
        return self._seen.setdefault(i, _Seen())

    def forget(self, i: int) -> None:
        """Worker i was removed (or replaced): what its process ran no longer matters."""
        self._seen.pop(i, None)

    def confirmation(self, i: int, incarnation: str | None) -> tuple[str | None, int]:
        """What worker i's next poll confirms (a restarted worker ignores its predecessor's confirmation)."""
        s = self._at(i)
        return incarnation, s.seq if s.incarnation == incarnation else 0

    def read(self, i: int, incarnation: str, report: dict) -> None:
        s = self._at(i)
        if s.incarnation != incarnation:
            self._seen[i] = s = _Seen(incarnation)
        s.seq, s.calls = report["seq"], report["calls"]

    def overdue(self, i: int, timeout_s: float) -> list[list]:
        """Calls on worker i that have run longer than `timeout_s`; marks their requests to be quarantined
        when the worker goes down (the router restarts it)."""
        s = self._at(i)
        late = [c for c in s.calls if c[2] > timeout_s]
        s.wedged.update(c[0] for c in late)
        return late

    def on_death(self, i: int) -> list[Suspect]:
        """Worker i went down: the requests whose user code it was running (one each), those that caused the
        death only when it is known. Forgets what worker i was running."""
        s, self._seen[i] = self._at(i), _Seen()
        whats = {rid: what for rid, what, _, _ in s.calls}
        exited = {rid for rid, _, _, exits in s.calls if exits}
        if s.wedged or exited:  # the others' code did nothing wrong
            return [Suspect(rid, whats[rid], "exit" if rid in exited else "wedged")
                    for rid in exited | s.wedged if rid in whats]
        return [Suspect(rid, what, None) for rid, what in whats.items()]
