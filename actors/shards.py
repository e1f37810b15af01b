"""Several routers (ServiceConfig.routers > 1): the first one's view of the others.

Each router owns a share of the workers and of the requests (a client sends a request to the router its session
or prompt hashes to: rollout_service/connections/request_shards.py), with its own ledger, dispatch, recovery and
leases, so exactly-once, prefix affinity and staleness hold per router as they do for one. The first router
coordinates what concerns every worker: a refresh (each router prepares its workers, and only when all have does
any apply: every worker or none, across routers too), sleep, pause, scale; and it answers info, stats and digests
for the whole service, its workers numbered first, then the second router's, and so on.
"""
from __future__ import annotations

import asyncio
from typing import Any

import ray

from rollout_service.connections.remote_errors import error_text

BROADCAST_REFUSED = ("transport 'broadcast' needs one router (the weight group spans every worker): this service "
                     "runs {n} routers; use the object store or CUDA IPC (transport='auto' picks them)")
SUMMED = ("in_flight", "streams", "duplicates_dropped", "resubmitted", "stale_regenerated", "stale_pinned",
          "refresh_held_s", "worker_deaths", "streams_expired", "sleep_expired", "quarantined", "handed_back",
          "payloads_lost", "polls", "polled_results", "requests")
ROUTER_SUMMARY = ("num_workers", "requests", "in_flight", "policy_version", "paused", "asleep", "error")
JOINED = ("alive", "awaiting_weights", "gone", "gone_reasons", "draining", "loads")


def share(total: int, k: int, n: int) -> int:
    """Router k's share of `total` things split over `n` routers (the first ones take the remainder)."""
    return total // n + (k < total % n)


class Shards:
    def __init__(self, first: Any, others: list):
        """`first`: this process's Router; `others`: the other routers' actor handles, in order."""
        self.first, self.others = first, list(others)

    @property
    def count(self) -> int:
        return 1 + len(self.others)

    async def each(self, method: str, *args: Any) -> list[Any]:
        """`method` on every router, this one first, at once; an exception is returned, not raised."""
        async def here() -> Any:
            out = getattr(self.first, method)(*args)
            return await out if asyncio.iscoroutine(out) else out
        calls = [here()] + [getattr(r, method).remote(*args) for r in self.others]
        return list(await asyncio.gather(*calls, return_exceptions=True))

    @staticmethod
    def errors(outcomes: list[Any]) -> str | None:
        """The routers' error messages (None or a string each; an exception is the router failing), joined."""
        msgs = [(f"router {k}: " if k else "") + (error_text(o) if isinstance(o, BaseException) else o)
                for k, o in enumerate(outcomes) if o is not None]
        return "; ".join(msgs) or None

    # -- a refresh: every router prepares, then every router applies --------------------------------
    async def update(self, payload: dict, version: int, partial: bool) -> str | None:
        began = await self.each("refresh_begin", payload, version, partial)
        if any(o is not None for o in began):
            await asyncio.gather(*[self._cancel(k) for k, o in enumerate(began) if o is None])
            return self.errors(began)
        return self.errors(await self.each("refresh_finish"))

    async def _cancel(self, k: int) -> None:
        if k == 0:
            await self.first.refresh_cancel()
        else:
            try:
                await self.others[k - 1].refresh_cancel.remote()
            except Exception:  # a router gone with its workers: nothing of theirs to drop
                pass

    # -- what spans the service ----------------------------------------------------------------------
    async def scale(self, num_workers: Any, drain_s: float, timeout_s: float | None) -> str | None:
        if not isinstance(num_workers, int) or isinstance(num_workers, bool) or num_workers < self.count:
            return f"scale: num_workers={num_workers!r} must be an int >= {self.count} (one worker per router at least)"
        outcomes = await asyncio.gather(
            self.first.scale_here(share(num_workers, 0, self.count), drain_s, timeout_s),
            *[r.scale_here.remote(share(num_workers, k + 1, self.count), drain_s, timeout_s)
              for k, r in enumerate(self.others)], return_exceptions=True)
        return self.errors(list(outcomes))

    def where(self, sizes: list[int], i: int) -> tuple[int, int] | None:
        """(router, its own index) of the service's worker i, given each router's number of workers."""
        for k, n in enumerate(sizes):
            if i < n:
                return k, i
            i -= n
        return None

    async def info(self) -> dict:
        parts = [p if isinstance(p, dict) else {"error": error_text(p)} for p in await self.each("info_here")]
        out = dict(parts[0])
        for p in parts[1:]:
            if "error" in p:
                continue
            for key in SUMMED:
                out[key] = out.get(key, 0) + p.get(key, 0)
            for key in JOINED:
                out[key] = list(out.get(key, [])) + list(p.get(key, []))
            out["num_workers"] += p["num_workers"]
            out["routing"] = {k: v + p["routing"].get(k, 0) if isinstance(v, int) else v
                              for k, v in out["routing"].items()}
        out["routers"] = [{key: p.get(key) for key in ROUTER_SUMMARY} for p in parts]
        return out

    async def joined(self, method: str) -> list:
        """Per worker of the whole service: the routers' per-worker lists (stats, digests), one after another."""
        return [x for part in await self.parts(method) for x in part]

    async def parts(self, method: str) -> list:
        """Each router's answer to `method`, in order (a router failing raises)."""
        out = await self.each(method)
        for k, part in enumerate(out):
            if isinstance(part, BaseException):
                raise RuntimeError(f"router {k} failed: {error_text(part)}")
        return out

    async def weight_targets(self) -> list[dict]:
        """The workers a refresh goes to, numbered across the routers."""
        out, offset = [], 0
        for n, targets in await self.parts("weight_targets_here"):
            out += [{**t, "index": offset + t["index"]} for t in targets]
            offset += n
        return out

    async def shutdown(self) -> None:
        await asyncio.gather(*[r.shutdown.remote() for r in self.others], return_exceptions=True)
        for r in self.others:
            try:
                ray.kill(r)
            except Exception:
                pass
