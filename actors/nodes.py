"""Whether a worker's node is still in the cluster, as Ray's control store (GCS) sees it.

A worker whose node died (its raylet killed, the machine gone) cannot come back by a restart there: Ray
places its bundle again only when a node that can take it joins, which may be never. So the router gives
such a worker up as soon as the GCS declares its node dead (after its health checks of the raylet fail:
health_check_period_ms x health_check_failure_threshold, about 15 s with Ray's defaults) rather than wait
RESTART_TIMEOUT_S for a restart; its requests were already resubmitted when it went down.
"""
from __future__ import annotations

import asyncio

import ray

NODE_CHECK_S = 1.0  # how often a down worker's node is looked up while the router waits for it


async def node_dead(node_id: str | None) -> bool:
    """The GCS lists this node as dead (an unknown or unnamed node is not taken for dead)."""
    if not node_id:
        return False
    nodes = await asyncio.to_thread(ray.nodes)  # a GCS round trip: off the router's event loop
    return any(n.get("NodeID") == node_id and not n.get("Alive", True) for n in nodes)


async def until_node_dead(node_id: str | None) -> None:
    """Returns once the GCS declares `node_id` dead (never, for a node it does not know)."""
    while not await node_dead(node_id):
        await asyncio.sleep(NODE_CHECK_S)
