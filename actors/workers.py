"""The router's table of rollout workers: each one's actor handle and state (alive, restarted and waiting for
weights, draining before its removal, gone for good and why), its incarnation (a restarted actor gets a new one),
where it runs and the placement-group bundle it holds.

Workers are numbered 0..n-1. `scale` (actors/scaling.py) appends entries, gives a gone worker's entry to its
replacement (a new generation of that index, so the old worker's result loop knows to stop) and drops entries
from the end.
"""
from __future__ import annotations

import asyncio
from typing import Any

from rollout_service.connections.remote_errors import ACTOR_DOWN

STATS_TIMEOUT_S = 2.0  # a worker that does not answer stats() by then is reported without its counters


class WorkerTable:
    def __init__(self, num_workers: int = 0):
        self.handles: list = []
        self.alive: list[bool] = []
        self.gone: list[bool] = []                 # dead for good (no restarts left, its node died, ...)
        self.why_gone: list[str | None] = []
        self.awaiting: list[bool] = []             # restarted, waiting for the learner's weights
        self.draining: list[bool] = []             # being removed: no new requests, its own ones finish
        self.incarnation: list[str | None] = []
        self.killed: list[str | None] = []         # the incarnation the router itself ended
        self.places: list[dict] = []               # node_id, device, weights' dtype, from health()
        self.slots: list[Any] = []                 # its placement-group bundle (actors/slots.py)
        self.generation: list[int] = []            # bumped when the index gets a new worker or is removed
        for _ in range(num_workers):
            self.append()

    def __len__(self) -> int:
        return len(self.alive)

    def append(self) -> int:
        """A new entry for a worker yet to start; its index."""
        for name, v in (("handles", None), ("alive", False), ("gone", False), ("why_gone", None),
                        ("awaiting", False), ("draining", False), ("incarnation", None), ("killed", None),
                        ("places", {}), ("slots", None), ("generation", 0)):
            getattr(self, name).append(dict(v) if isinstance(v, dict) else v)
        return len(self) - 1

    def renew(self, i: int) -> int:
        """Entry i for a new worker (the replacement of a gone one); its generation."""
        self.alive[i] = self.gone[i] = self.awaiting[i] = self.draining[i] = False
        self.why_gone[i] = self.incarnation[i] = self.killed[i] = None
        self.places[i] = {}
        self.generation[i] += 1
        return self.generation[i]

    def truncate(self, n: int) -> None:
        """Forget the entries from n on (removed workers)."""
        for name in ("handles", "alive", "gone", "why_gone", "awaiting", "draining", "incarnation", "killed",
                     "places", "slots", "generation"):
            del getattr(self, name)[n:]

    def current(self, i: int, generation: int) -> bool:
        """Entry i still holds the worker of that generation (not replaced, not removed)."""
        return i < len(self) and self.generation[i] == generation

    def live(self) -> list[int]:
        """Workers new requests may go to."""
        return [i for i, a in enumerate(self.alive) if a and not self.draining[i]]

    def targets(self) -> list[int]:
        """Workers a refresh, a sleep or a pause goes to: those serving (draining ones too: they finish their
        requests on the current weights) and those waiting for weights."""
        return [i for i in range(len(self)) if self.alive[i] or self.awaiting[i]]

    def on_health(self, i: int, h: dict) -> None:
        self.incarnation[i] = h["incarnation"]
        self.places[i] = {"node_id": h.get("node_id"), "device": h.get("device", "cpu"), "gpus": h.get("gpus", []),
                          "weights_dtype": h.get("weights_dtype"), "quantization": h.get("quantization")}

    def mark_down(self, i: int) -> bool:
        """Worker i went down; whether it was up (a death to count)."""
        was_up = self.alive[i] or self.awaiting[i]
        self.alive[i] = self.awaiting[i] = False
        return was_up

    def mark_gone(self, i: int, why: str) -> None:
        self.mark_down(i)
        self.gone[i], self.why_gone[i] = True, why

    async def stats(self, i: int) -> dict:
        """Worker i's counters (the workers read them without waiting for an engine step), or its state alone
        when it is down or does not answer in time."""
        s = {"worker": i, "alive": False, "queued": None, "running": None, "kv_pages_used": None,
             "kv_pages_total": None, "tokens_per_s": None, "policy_version": None}
        if self.alive[i] or self.awaiting[i]:
            try:
                got = await asyncio.wait_for(asyncio.wrap_future(self.handles[i].stats.remote().future()),
                                             STATS_TIMEOUT_S)
                s = {**got, "alive": self.alive[i]}
            except (asyncio.TimeoutError, *ACTOR_DOWN):
                s["alive"] = self.alive[i]
        s.update(awaiting_weights=self.awaiting[i], draining=self.draining[i], gone_reason=self.why_gone[i])
        return s

    async def each(self, targets: list[int], method: str, *args: Any, timeout: float | None = None
                   ) -> list[tuple[int, Any]]:
        """(worker, outcome or exception) of one call on each of `targets`, at once; a call still unanswered after
        `timeout` s gives a Stalled (the call itself is left to the worker)."""
        async def call(i: int) -> Any:
            ref = getattr(self.handles[i], method).remote(*args)
            if timeout is None:
                return await ref
            try:
                return await asyncio.wait_for(asyncio.wrap_future(ref.future()), timeout)
            except asyncio.TimeoutError:
                raise Stalled(f"worker {i} did not answer {method} within {timeout:g} s: it is alive but stalled "
                              "(stopped, or stuck in a call that does not return)") from None
        return list(zip(targets, await asyncio.gather(*(call(i) for i in targets), return_exceptions=True)))


class Stalled(Exception):
    """A worker that did not answer a call within its deadline, though Ray does not report it down."""
