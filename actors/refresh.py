"""The router's side of a weight refresh: every worker or none, applied between two engine steps.

Every transport follows one protocol (the learner's side is RolloutClient.update_weights):
1. prepare, on every worker that will serve: the manifest (names, shapes, dtypes; no data) is checked
   against the model and the transport made ready (IPC handles opened, staging allocated). One refusal
   and every worker discards: nothing has changed anywhere.
2. broadcast only: the workers take the bytes into staging while they keep generating, as the learner
   sends them. A failure anywhere (a dead member, a dead learner) fails the refresh everywhere.
3. apply: each worker swaps between two steps and records the version.
One refresh at a time: a second one while one is in flight is refused.

A restarted worker must serve exactly the weights its peers serve. The coordinator keeps a replay log:
the refreshes that rebuild the current weights from the checkpoint (object-store refs, IPC handles), in
order, the newest payload of every weight (an older refresh whose weights were all sent again is dropped,
a full refresh starts the log afresh). A restarted worker replays the log before it serves. When some
current weight exists only with the learner (a broadcast since the last full refresh of another
transport, IPC buckets the learner has refilled, released buffers) there is no log, and a restarted
worker waits for the learner's next FULL refresh; a partial one does not let it serve. After a full
broadcast the learner can resend it (`heal`), which is accepted while nothing has been refreshed since.
A delta (rollout_service/weights/delta.py) patches the weights of its base version: it is refused before any
worker prepares unless the service runs that version, and in the log it keeps every entry before it, until its
deltas outweigh the weights (then there is no log; the learner's next push reaches a restarted worker dense).
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

import ray

from rollout_service.connections.remote_errors import error_text, is_down
from actors.workers import Stalled, WorkerTable
from rollout_service.api.checks import check_policy_version
from rollout_service.weights.refusals import NO_BASE, REGROUP


# A refresh call (prepare, receive, apply, discard) that a worker has not answered in this long fails the refresh
# and restarts the worker: far above any model's copy time, and never the learner's wait forever.
STALL_S = 300.0


@dataclass(frozen=True)
class Logged:
    """An applied refresh that a restarted worker can replay."""
    payload: dict
    version: int
    partial: bool
    names: frozenset[str]


class RefreshCoordinator:
    def __init__(self, workers: WorkerTable, log: Callable[[str], None],
                 back_in_service: Callable[[int], Awaitable[None]], stall_s: float = STALL_S):
        """`back_in_service(i)`: put a restarted worker that waited for the learner's weights back to work."""
        self.workers = workers
        self._log = log
        self._back_in_service = back_in_service
        self.version = 0
        self.replay: list[Logged] | None = []  # None: the current weights cannot be rebuilt without the learner
        self.learner_holds: int | None = None  # version that the learner's last broadcast holds in full
        self.group: dict | None = None         # {"id": str, "members": {worker index: incarnation}}
        self._joining: tuple[str, asyncio.Task] | None = None  # (group id, the workers joining it)
        self._busy_until: float | None = None
        self._pending: dict | None = None      # a refresh prepared, not yet applied (begin .. finish)
        self.stall_s = stall_s                 # a worker's refresh call unanswered this long: it is stalled

    # -- helpers ----------------------------------------------------------------------------------
    def targets(self) -> list[int]:
        """Workers a refresh goes to: those serving and those waiting for weights to serve again."""
        return self.workers.targets()

    @property
    def busy(self) -> bool:
        """A refresh is in flight (one whose learner went silent counts until its group timeout)."""
        return self._busy_until is not None and time.monotonic() < self._busy_until

    async def idle(self) -> None:
        while self.busy:
            await asyncio.sleep(0.05)

    def _start(self, version: Any, resend: bool = False, stale_after: float = 300.0, payload: dict | None = None
               ) -> str | None:
        try:
            check_policy_version(version, self.version, resend)
        except ValueError as e:
            return str(e)
        delta = (payload or {}).get("delta")
        if delta is not None and getattr(delta, "base_version", None) != self.version:  # (the learner pushes dense)
            return (f"update_weights: {NO_BASE}: the service runs version {self.version}, the delta applies to "
                    f"version {getattr(delta, 'base_version', None)}")
        if self.busy:
            return "update_weights: another refresh is in flight; wait for it to finish"
        if not self.targets():
            return "update_weights: no rollout worker is alive"
        self._busy_until = time.monotonic() + stale_after
        return None

    def _done(self) -> None:
        self._busy_until, self._pending = None, None

    async def _each(self, targets: list[int], method: str, *args: Any, timeout: float | None = None
                    ) -> list[tuple[int, Any]]:
        """Every refresh call has a deadline (`stall_s` unless given): a worker that stops answering (stopped, not
        dead) fails the refresh with a Stalled instead of holding it, and the learner, forever."""
        return await self.workers.each(targets, method, *args, timeout=timeout or self.stall_s)

    def _restart(self, i: int, why: str) -> None:
        """Kill worker i; Ray restarts it and the recovery (actors/recovery.py) brings it to the current weights."""
        self._log(why)
        self.workers.killed[i] = self.workers.incarnation[i]
        ray.kill(self.workers.handles[i], no_restart=False)

    async def _abandon(self, outcomes: list[tuple[int, Any]]) -> None:
        """A refresh refused before any swap: the workers that answered drop what they prepared; a stalled one is
        restarted (it would answer nothing, the discard included)."""
        stalled = [i for i, out in outcomes if isinstance(out, Stalled)]
        await self._each([i for i, _ in outcomes if i not in stalled], "weights_discard")
        for i in stalled:
            self._restart(i, f"worker {i} stalled during a refresh (no answer within {self.stall_s:g} s); "
                             f"restarting it, every worker keeps version {self.version}")

    async def _prepare(self, targets: list[int], payload: dict, partial: bool) -> str | None:
        outcomes = await self._each(targets, "weights_prepare", payload, partial)
        refused = [(i, out) for i, out in outcomes if isinstance(out, BaseException) and not is_down(out)]
        if not refused:  # (a dead one catches up when it restarts)
            return None
        await self._abandon(outcomes)
        i, out = next(((i, out) for i, out in refused if isinstance(out, Stalled)), refused[0])
        if isinstance(out, Stalled):
            return f"update_weights: {out}; it is restarted and every worker keeps version {self.version}"
        return f"worker {i} rejected the refresh: {error_text(out)}"

    async def _apply(self, targets: list[int], payload: dict, version: int, partial: bool) -> str | None:
        outcomes = await self._each(targets, "weights_apply", payload, version, partial)
        failed = [(i, out) for i, out in outcomes if isinstance(out, BaseException) and not is_down(out)]
        errors = [f"worker {i} failed to apply the refresh: {error_text(out)}" for i, out in failed]
        if failed and not any(isinstance(out, Stalled) for _, out in failed) and len(failed) == len(outcomes):
            return "; ".join(errors)  # nobody swapped (a check of the values): nothing changed
        self.version = version
        self._record(payload, version, partial)
        for i, _ in failed:  # its peers swapped: restart it, and the replay log brings it to their weights
            self._restart(i, f"worker {i} failed to apply version {version}; restarting it to replay the refreshes")
        for i, out in outcomes:
            if isinstance(out, BaseException):
                continue
            if self.workers.awaiting[i] and not partial:  # a restarted worker that waited for every weight
                await self._back_in_service(i)
        return "; ".join(errors) or None

    def _logs(self, transport: str) -> bool:
        return any(e.payload["transport"] == transport for e in self.replay or [])

    def _record(self, payload: dict, version: int, partial: bool) -> None:
        """Log an applied refresh for the workers that restart later."""
        kind = payload["transport"]
        self.learner_holds = version if kind == "broadcast" and not partial else None
        if kind == "broadcast" or (partial and self.replay is None):
            self.replay = None
            return
        names = frozenset(payload["manifest"].names())
        entry = Logged(dict(payload), version, partial, names)
        if payload.get("delta") is not None:
            self.replay = self._with_delta(entry)
            return
        if partial and any(e.payload.get("delta") is not None for e in self.replay):
            kept = self.replay  # a delta patches what every entry before it left: none may go
        else:
            kept = [e for e in self.replay if not e.names <= names] if partial else []
        self.replay = kept + [entry]

    def _with_delta(self, entry: Logged) -> list[Logged] | None:
        """The log with a delta after every entry it builds on, or None (a restarted worker then waits for the
        next push, which reaches it dense) once its deltas hold more bytes than the weights: the object store
        keeps every logged push's buckets."""
        if self.replay is None:
            return None
        log = self.replay + [entry]
        held = sum(e.payload["delta"].nbytes for e in log if e.payload.get("delta") is not None)
        if held > entry.payload["manifest"].nbytes:
            self._log(f"the replay log's deltas passed the weights' size ({held} bytes); a worker restarted from now "
                      "on waits for the learner's next push")
            return None
        return log

    # -- object store and CUDA IPC: one call --------------------------------------------------------
    async def update(self, payload: dict, version: int, partial: bool = False) -> str | None:
        return await self.begin(payload, version, partial) or await self.finish()

    async def begin(self, payload: dict, version: int, partial: bool = False) -> str | None:
        """Prepare every worker; finish() applies, cancel() drops. Apart only where several routers refresh
        together (actors/shards.py: each prepares before any applies)."""
        err = self._start(version, payload=payload)
        if err:
            return err
        if payload["transport"] == "cuda_ipc" and self._logs("cuda_ipc"):
            self.replay = None  # the learner has refilled (or freed) the IPC buckets the log points to
        targets = self.targets()
        err = await self._prepare(targets, payload, partial)
        if err:
            self._done()
            return err
        self._pending = {"payload": payload, "version": version, "partial": partial, "targets": targets}
        return None

    async def finish(self) -> str | None:
        p = self._pending
        if p is None or p["payload"]["transport"] == "broadcast":
            return "update_weights: no refresh was prepared (or it was given up after its deadline)"
        try:
            return await self._apply(p["targets"], p["payload"], p["version"], p["partial"])
        finally:
            self._done()

    async def cancel(self) -> None:
        """Drop a prepared refresh: another router's workers refused theirs."""
        p = self._pending
        if p is None or p["payload"]["transport"] == "broadcast":
            return
        try:
            await self._abandon([(i, None) for i in p["targets"]])
        finally:
            self._done()

    # -- broadcast: begin, then finish while the learner sends --------------------------------------
    async def broadcast_begin(self, payload: dict, version: int, partial: bool, resend: bool,
                              timeout_s: float) -> str | None:
        if resend and version != self.learner_holds:
            return (f"update_weights: a restarted worker needs every current weight (version {self.version}); the "
                    "learner's last broadcast was partial, or another refresh came after it, so resending it cannot "
                    "restore them: push the full weights with update_weights")
        err = self._start(version, resend, stale_after=timeout_s + self.stall_s, payload=payload)
        if err:
            return err
        targets = self.targets()
        if not self._group_current(targets):
            self._done()
            return REGROUP
        err = await self._prepare(targets, payload, partial)
        if err:
            self._done()
            return err
        self._pending = {"payload": payload, "version": version, "partial": partial, "targets": targets,
                         "timeout_s": timeout_s}
        return None

    async def broadcast_finish(self) -> str | None:
        p = self._pending
        if p is None or p["payload"]["transport"] != "broadcast":
            return "update_weights: no broadcast was begun (or it was given up after the group timeout)"
        try:
            targets, payload = p["targets"], p["payload"]
            # a live member's receive ends within the group's timeout (bytes in, or the error): one silent
            # `stall_s` past it is stalled (its peers, whose receives that stall may have timed out, are not)
            outcomes = await self._each(targets, "weights_receive", payload, timeout=p["timeout_s"] + self.stall_s)
            failed = [(i, out) for i, out in outcomes if isinstance(out, BaseException)]
            if failed:
                await self._abandon(outcomes)
                self.group = None  # a member failed: the group is formed again before the next broadcast
                i, out = next(((i, out) for i, out in failed if isinstance(out, Stalled)), failed[0])
                why = str(out) if isinstance(out, Stalled) else error_text(out)
                return f"update_weights: the broadcast failed on worker {i} ({why}); every worker keeps version " \
                       f"{self.version}"
            return await self._apply(targets, payload, p["version"], p["partial"])
        finally:
            self._done()

    # -- the weight group -------------------------------------------------------------------------
    def _group_current(self, targets: list[int]) -> bool:
        inc = self.workers.incarnation
        return self.group is not None and sorted(self.group["members"]) == targets and \
            all(self.group["members"][i] == inc[i] for i in targets)

    def form_group(self, spec: Any, members: list[int]) -> str | None:
        """A refusal, or None: the workers are joining as ranks 1..N in `members` order, and the learner joins as
        rank 0 once it has this answer (then `joined` says how the workers' joins went). Answering before anyone
        waits on the group is what lets a refused learner hear it at once, however busy the machine."""
        if members != self.targets():
            return "init_weight_group: the set of live workers changed meanwhile; call it again"
        self._joining = (spec.group_id, asyncio.ensure_future(self._join(spec, members)))
        return None

    async def joined(self, group_id: str) -> str | None:
        if self._joining is None or self._joining[0] != group_id:
            return "init_weight_group: another weight group was formed meanwhile; call it again"
        return await self._joining[1]

    async def _join(self, spec: Any, members: list[int]) -> str | None:
        await self._each(members, "leave_weight_group")
        self.group = None
        calls = [self.workers.handles[i].join_weight_group.remote(spec, rank + 1) for rank, i in enumerate(members)]
        for i, out in zip(members, await asyncio.gather(*calls, return_exceptions=True)):
            if isinstance(out, BaseException):
                return f"init_weight_group: worker {i} could not join: {error_text(out)}"
        self.group = {"id": spec.group_id, "members": {i: self.workers.incarnation[i] for i in members}}
        return None

    # -- faults and memory ------------------------------------------------------------------------
    async def bring_up_to_date(self, i: int, has: int) -> int | None:
        """Replay the log on worker i, which runs version `has` (0: a restarted worker, on its checkpoint).
        Returns the version it then runs, or None: it must wait for the learner's next full refresh."""
        if has == self.version:
            return has
        if self.replay is None:
            return None
        w = self.workers.handles[i]
        try:
            for e in [e for e in self.replay if e.version > has]:
                await w.weights_prepare.remote(e.payload, e.partial)
                has = await w.weights_apply.remote(e.payload, e.version, e.partial)
        except Exception as e:
            if is_down(e):
                raise
            # e.g. the learner that owned the object-store copies or the IPC buckets is gone
            self._log(f"worker {i} could not replay the refreshes ({error_text(e)}); it waits for the "
                             "next full refresh")
            self.replay = None
            return None
        return has

    async def release(self) -> None:
        """The learner frees its buffers: workers drop their mappings and staging first."""
        self.replay = None
        await self._each(self.targets(), "release_weight_buffers")
