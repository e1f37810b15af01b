"""The router's table of rollout workers: each one's actor handle and state (alive, restarted and waiting for
weights, gone for good), its incarnation (a restarted actor gets a new one) and where it runs."""
from __future__ import annotations

import asyncio
from typing import Any

from actors.remote_errors import ACTOR_DOWN

STATS_TIMEOUT_S = 2.0  # a worker that does not answer stats() by then is reported without its counters


class WorkerTable:
    def __init__(self, num_workers: int):
        n = num_workers
        self.handles: list = []
        self.alive = [False] * n
        self.gone = [False] * n                           # dead for good (no restarts left)
        self.awaiting = [False] * n                       # restarted, waiting for the learner's weights
        self.incarnation: list[str | None] = [None] * n
        self.killed: list[str | None] = [None] * n        # the incarnation the router itself ended
        self.places: list[dict] = [{} for _ in range(n)]  # node_id and device, from health()

    def __len__(self) -> int:
        return len(self.alive)

    def live(self) -> list[int]:
        return [i for i, a in enumerate(self.alive) if a]

    def targets(self) -> list[int]:
        """Workers a refresh, a sleep or a pause goes to: those serving and those waiting for weights."""
        return [i for i in range(len(self)) if self.alive[i] or self.awaiting[i]]

    def on_health(self, i: int, h: dict) -> None:
        self.incarnation[i] = h["incarnation"]
        self.places[i] = {"node_id": h.get("node_id"), "device": h.get("device", "cpu")}

    def mark_down(self, i: int) -> bool:
        """Worker i went down; whether it was up (a death to count)."""
        was_up = self.alive[i] or self.awaiting[i]
        self.alive[i] = self.awaiting[i] = False
        return was_up

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
        s["awaiting_weights"] = self.awaiting[i]
        return s

    async def each(self, targets: list[int], method: str, *args: Any) -> list[tuple[int, Any]]:
        """(worker, outcome or exception) of one call on each of `targets`, at once."""
        calls = [getattr(self.handles[i], method).remote(*args) for i in targets]
        return list(zip(targets, await asyncio.gather(*calls, return_exceptions=True)))
