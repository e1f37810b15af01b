"""Broadcast transport: one torch.distributed group of the learner (rank 0) and the workers (ranks 1..N).

The group is built straight from a TCP store and a backend object, outside torch's default process group,
so a learner that already trains with its own (FSDP, DDP) is not disturbed and a group can be dropped and
formed again after a fault. The same code runs NCCL between GPUs and gloo on CPUs. The store's server
lives in the learner process; its address is the learner node's IP as Ray reports it.

A member that fails (a send or receive error, a peer that died) drops its group at once: closing it is
what makes the other members' pending receives fail instead of waiting out the timeout. A broken group
is formed again, with the members alive then, before the next broadcast.
"""
from __future__ import annotations

import datetime
from typing import Any, Sequence

import torch

from rollout_service.weights.manifest import GroupSpec

COLLECTIVES = ("nccl", "gloo")  # torch.distributed backends a weight group runs on


def host_store(host: str, world_size: int, timeout_s: float) -> "torch.distributed.TCPStore":
    """The group's store server, on `host` (the address the workers are told), listening on a port the kernel picks
    (`.port` says which) before anyone is told it: a port found free and bound only later could be taken meanwhile
    by any process of the learner's node."""
    import torch.distributed as dist

    return dist.TCPStore(host, 0, world_size, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=timeout_s))


class WeightGroup:
    """This process's membership of a weight group. Rank 0 (the learner) hosts the store (host_store's, `store`)
    and sends."""

    def __init__(self, spec: GroupSpec, rank: int, device: torch.device | None = None, store: Any = None):
        import torch.distributed as dist

        if spec.backend not in COLLECTIVES:
            raise ValueError(f"weight group backend {spec.backend!r}: choose one of {COLLECTIVES}")
        if spec.backend == "nccl" and not (torch.cuda.is_available() and dist.is_nccl_available()):
            raise ValueError("weight group backend 'nccl' needs CUDA and a torch built with NCCL; use 'gloo'")
        self.spec, self.rank = spec, rank
        self.device = torch.device("cuda", torch.cuda.current_device()) if spec.backend == "nccl" else torch.device("cpu")
        if device is not None and spec.backend == "nccl":
            self.device = device
        if (rank == 0) != (store is not None):
            raise ValueError("a weight group's rank 0 hosts its store (host_store()); the other ranks connect to it")
        timeout = datetime.timedelta(seconds=spec.timeout_s)
        self._store = store if store is not None else dist.TCPStore(
            spec.host, spec.port, spec.world_size, is_master=False, timeout=timeout)
        prefixed = dist.PrefixStore(f"weights/{spec.group_id}/", self._store)
        if spec.backend == "gloo":
            self._pg = dist.ProcessGroupGloo(prefixed, rank, spec.world_size, timeout)
        else:
            torch.cuda.set_device(self.device)
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            self._pg = dist.ProcessGroupNCCL(prefixed, rank, spec.world_size, opts)
        self.broken = False

    def broadcast(self, buffers: Sequence[torch.Tensor]) -> None:
        """Rank 0 sends each buffer in turn; every other rank receives into its own. Any error drops the
        group (so the peers stop waiting) and is raised."""
        import torch.distributed as dist

        if self.broken:
            raise RuntimeError("the weight group is broken; it must be formed again")
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        try:
            for buf in buffers:
                self._pg.broadcast([buf], opts).wait()
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        except Exception:
            self.close()
            raise

    def close(self) -> None:
        """Leave the group: a peer still waiting on this member fails at once."""
        self.broken = True
        pg, self._pg = getattr(self, "_pg", None), None
        if pg is not None and self.spec.backend == "nccl":
            try:
                pg.abort()
            except Exception:  # already torn down
                pass
        del pg
        self._store = None
