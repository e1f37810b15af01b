"""The router's side of a weight refresh: every worker or none, applied between two engine steps.

Every transport follows one protocol (the learner's side is RolloutClient.update_weights):
1. prepare, on every worker that will serve: the manifest (names, shapes, dtypes; no data) is checked
   against the model and the transport made ready (IPC handles opened, staging allocated). One refusal
   and every worker discards: nothing has changed anywhere.
2. broadcast only: the workers take the bytes into staging while they keep generating, as the learner
   sends them. A failure anywhere (a dead member, a dead learner) fails the refresh everywhere.
3. apply: each worker swaps between two steps and records the version.
One refresh at a time: a second one while one is in flight is refused. The last refresh's payload is kept
(object-store refs, IPC handles) so a restarted worker loads it before it serves; after a broadcast only
the learner has the bytes, so a restarted worker waits for the learner to form the group again.
"""
from __future__ import annotations

import asyncio
import time
from typing import Any

from rollout_service.weights.sender import REGROUP


class RefreshCoordinator:
    def __init__(self, router: Any):
        self.router = router
        self.version = 0
        self.latest: dict | None = None    # what a restarted worker loads (None: nothing that it can load alone)
        self.group: dict | None = None     # {"id": str, "members": {worker index: incarnation}}
        self._busy_since: float | None = None
        self._pending: dict | None = None  # a broadcast between begin and finish

    # -- helpers ----------------------------------------------------------------------------------
    def targets(self) -> list[int]:
        """Workers a refresh goes to: those serving and those waiting for weights to serve again."""
        r = self.router
        return [i for i in range(len(r.workers)) if r._alive[i] or r._awaiting[i]]

    def _start(self, version: Any, resend: bool = False, stale_after: float = 300.0) -> str | None:
        if not isinstance(version, int) or isinstance(version, bool) or \
                version < self.version or (version == self.version and not resend):
            return f"update_weights: version={version!r} must be an int > the current version {self.version}"
        if self._busy_since is not None and time.monotonic() - self._busy_since < stale_after:
            return "update_weights: another refresh is in flight; wait for it to finish"
        if not self.targets():
            return "update_weights: no rollout worker is alive"
        self._busy_since = time.monotonic()
        return None

    def _done(self) -> None:
        self._busy_since, self._pending = None, None

    async def _each(self, targets: list[int], method: str, *args: Any) -> list[tuple[int, Any]]:
        calls = [getattr(self.router.workers[i], method).remote(*args) for i in targets]
        return list(zip(targets, await asyncio.gather(*calls, return_exceptions=True)))

    async def _prepare(self, targets: list[int], payload: dict, partial: bool) -> str | None:
        from actors.router import error_text, is_down
        for i, out in await self._each(targets, "weights_prepare", payload, partial):
            if isinstance(out, BaseException) and not is_down(out):  # a dead one catches up when it restarts
                await self._each(targets, "weights_discard")
                return f"worker {i} rejected the refresh: {error_text(out)}"
        return None

    async def _apply(self, targets: list[int], payload: dict, version: int, partial: bool) -> str | None:
        from actors.router import error_text, is_down
        errors = []
        for i, out in await self._each(targets, "weights_apply", payload, version, partial):
            if isinstance(out, BaseException):
                if not is_down(out):
                    errors.append(f"worker {i} failed to apply the refresh: {error_text(out)}")
            elif self.router._awaiting[i]:  # a restarted worker that waited for these weights
                await self.router.back_in_service(i)
        self.version = version
        return "; ".join(errors) or None

    # -- object store and CUDA IPC: one call --------------------------------------------------------
    async def update(self, payload: dict, version: int, partial: bool = False) -> str | None:
        err = self._start(version)
        if err:
            return err
        try:
            targets = self.targets()
            err = await self._prepare(targets, payload, partial)
            if err:
                return err
            err = await self._apply(targets, payload, version, partial)
            self.latest = None if partial else dict(payload, partial=False)
            return err
        finally:
            self._done()

    # -- broadcast: begin, then finish while the learner sends --------------------------------------
    async def broadcast_begin(self, payload: dict, version: int, partial: bool, resend: bool,
                              timeout_s: float) -> str | None:
        err = self._start(version, resend, stale_after=timeout_s)
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
        self._pending = {"payload": payload, "version": version, "partial": partial, "targets": targets}
        return None

    async def broadcast_finish(self) -> str | None:
        from actors.router import error_text
        p = self._pending
        if p is None:
            return "update_weights: no broadcast was begun (or it was given up after the group timeout)"
        try:
            targets, payload = p["targets"], p["payload"]
            failed = [(i, out) for i, out in await self._each(targets, "weights_receive", payload)
                      if isinstance(out, BaseException)]
            if failed:
                await self._each(targets, "weights_discard")
                self.group = None  # a member failed: the group is formed again before the next broadcast
                i, out = failed[0]
                return f"update_weights: the broadcast failed on worker {i} ({error_text(out)}); every worker " \
                       f"keeps version {self.version}"
            err = await self._apply(targets, payload, p["version"], p["partial"])
            self.latest = None  # only the learner holds these bytes
            return err
        finally:
            self._done()

    # -- the weight group -------------------------------------------------------------------------
    def _group_current(self, targets: list[int]) -> bool:
        inc = self.router._incarnation
        return self.group is not None and sorted(self.group["members"]) == targets and \
            all(self.group["members"][i] == inc[i] for i in targets)

    async def form_group(self, spec: Any, members: list[int]) -> str | None:
        """Workers join as ranks 1..N in `members` order while the learner joins as rank 0."""
        from actors.router import error_text
        if members != self.targets():
            return "init_weight_group: the set of live workers changed meanwhile; call it again"
        await self._each(members, "leave_weight_group")
        self.group = None
        calls = [self.router.workers[i].join_weight_group.remote(spec, rank + 1) for rank, i in enumerate(members)]
        for i, out in zip(members, await asyncio.gather(*calls, return_exceptions=True)):
            if isinstance(out, BaseException):
                return f"init_weight_group: worker {i} could not join: {error_text(out)}"
        self.group = {"id": spec.group_id, "members": {i: self.router._incarnation[i] for i in members}}
        return None

    # -- faults and memory ------------------------------------------------------------------------
    async def bring_up_to_date(self, i: int) -> bool:
        """Give a restarted worker the current weights. False: it must wait for the learner's next push."""
        if self.version == 0:
            return True  # never refreshed: the checkpoint it loaded is current
        if self.latest is None:
            return False
        w = self.router.workers[i]
        try:
            await w.weights_prepare.remote(self.latest, False)
            await w.weights_apply.remote(self.latest, self.version, False)
        except Exception as e:  # e.g. the learner that held the IPC buffers is gone
            from actors.router import error_text
            self.router._log(f"worker {i} could not load the latest weights ({error_text(e)}); "
                             "it waits for the next refresh")
            return False
        return True

    async def release(self) -> None:
        """The learner frees its buffers: workers drop their mappings and staging first."""
        self.latest = None
        await self._each(self.targets(), "release_weight_buffers")
