"""The placement groups a service holds, and which of their bundles hold a worker.

The workers a service starts with share one placement group, one bundle each, laid out by the config's
strategy (STRICT_SPREAD: a node each, PACK: as few nodes as can hold them). Each later `scale` that needs more
bundles than the service has free reserves one more group, in the same strategy, for the workers it adds: a
group is ready whole or not at all, so a scale the cluster cannot place fails within `placement.timeout_s` and
leaves nothing reserved. (One group per worker would free each bundle with its worker, but no strategy could
then spread or pack workers across groups.)

Ray frees a group's resources only with the whole group: a removed worker's bundle stays the service's, and
the next scale fills it first, until the last worker of its group goes and the group with it. A bundle whose
node died is placed again by Ray on a node that can take it, when one joins; a worker started in it waits for
that.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group

from rollout_service.connections.capacity import resources_text
from rollout_service.config import ServiceConfig


@dataclass(frozen=True, eq=False)
class Slot:
    group: Any   # ray.util.placement_group.PlacementGroup
    bundle: int


@dataclass(eq=False)
class _Group:
    pg: Any
    slots: list[Slot]
    held: set[int] = field(default_factory=set)  # bundles that hold a worker


class Slots:
    def __init__(self) -> None:
        self._groups: list[_Group] = []

    async def reserve(self, config: ServiceConfig, k: int, bundle: dict, timeout: float) -> list[Slot]:
        """A new group of k bundles in the config's strategy, once Ray has placed all of it; ValueError
        (nothing left reserved) when it cannot within `timeout` seconds."""
        strategy = config.placement.strategy
        pg = placement_group([dict(bundle) for _ in range(k)], strategy=strategy,
                             name=f"{config.name}-workers-{len(self._groups)}")
        try:
            await asyncio.wait_for(asyncio.wrap_future(pg.ready().future()), timeout)
        except asyncio.TimeoutError:
            remove_placement_group(pg)
            raise ValueError(f"cannot place {k} rollout worker(s) of {resources_text(bundle)} with strategy "
                             f"{strategy} within {timeout:g}s: the Ray cluster has "
                             f"{resources_text(ray.available_resources())} free of "
                             f"{resources_text(ray.cluster_resources())}") from None
        group = _Group(pg, [Slot(pg, b) for b in range(k)])
        self._groups.append(group)
        return list(group.slots)

    def free(self) -> list[Slot]:
        """Bundles the service holds that no worker uses, oldest group first."""
        return [s for g in self._groups for s in g.slots if s.bundle not in g.held]

    def hold(self, slot: Slot) -> None:
        self._group(slot).held.add(slot.bundle)

    def release(self, slot: Slot) -> None:
        """Its worker is gone: the bundle is free, and the group goes (its resources with it) once none is held."""
        g = self._group(slot)
        g.held.discard(slot.bundle)
        if not g.held:
            self._remove(g)

    def drop_unheld(self) -> None:
        """Remove the groups none of whose bundles holds a worker (a failed start's)."""
        for g in [g for g in self._groups if not g.held]:
            self._remove(g)

    def release_all(self) -> None:
        for g in list(self._groups):
            self._remove(g)

    def _remove(self, g: _Group) -> None:
        self._groups.remove(g)
        try:
            remove_placement_group(g.pg)
        except Exception:  # Ray gone (shutdown): nothing left to free
            pass

    def _group(self, slot: Slot) -> _Group:
        return next(g for g in self._groups if g.pg == slot.group)
