"""Learner side of a refresh: which transport carries it (decided here, nowhere else) and its buffers.

`auto` picks CUDA IPC when the tensors are on a CUDA device of the node every worker runs on (and the
workers run on GPUs), else a broadcast when a weight group has been formed, else the object store. An
explicit choice that cannot work is refused with the reason, before anything moves.
"""
from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from rollout_service.weights.buckets import DEFAULT_BUCKET_BYTES, Buckets, Manifest, plan, reuse_or_allocate
from rollout_service.weights.cuda_ipc import IpcSender
from rollout_service.weights.group import GroupSpec, WeightGroup
from rollout_service.weights.object_store import ObjectStoreSender

TRANSPORTS = ("auto", "object_store", "cuda_ipc", "broadcast")
REGROUP = "weight group out of date"  # the router's answer when membership changed: the learner forms it again


@dataclass(frozen=True)
class WorkerPlace:
    index: int
    node_id: str
    device: str  # "cpu" or "cuda:N" as the worker sees it


def choose_transport(requested: str, items: Sequence[tuple[str, torch.Tensor]], learner_node: str | None,
                     workers: Sequence[WorkerPlace], has_group: bool) -> str:
    if requested not in TRANSPORTS:
        raise ValueError(f"update_weights: transport={requested!r}; choose one of {TRANSPORTS}")
    on_cuda = all(t.device.type == "cuda" for _, t in items) and len({t.device for _, t in items}) == 1
    elsewhere = [w for w in workers if w.node_id != learner_node]
    cpu_workers = [w for w in workers if not w.device.startswith("cuda")]
    if requested == "auto":
        if on_cuda and workers and not elsewhere and not cpu_workers:
            return "cuda_ipc"
        return "broadcast" if has_group else "object_store"
    if requested == "cuda_ipc":
        if elsewhere:
            w = elsewhere[0]
            raise ValueError(f"update_weights: transport 'cuda_ipc' needs the workers on the learner's node "
                             f"({learner_node}); worker {w.index} runs on node {w.node_id}")
        if cpu_workers:
            raise ValueError(f"update_weights: transport 'cuda_ipc' needs GPU workers; worker "
                             f"{cpu_workers[0].index} runs on {cpu_workers[0].device}")
        if not on_cuda:
            where = sorted({str(t.device) for _, t in items})
            raise ValueError(f"update_weights: transport 'cuda_ipc' needs every tensor on one CUDA device "
                             f"(got {', '.join(where)})")
    if requested == "broadcast" and not has_group:
        raise ValueError("update_weights: transport 'broadcast' needs a weight group: call "
                         "client.init_weight_group() first")
    return requested


@dataclass
class WeightSender:
    """The learner's transports and the buffers they keep between refreshes."""

    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    object_store: ObjectStoreSender = field(default_factory=ObjectStoreSender)
    ipc: IpcSender = field(default_factory=IpcSender)
    group: WeightGroup | None = None
    group_args: dict | None = None       # how the group was formed, to form it again after a fault
    broadcast_buckets: Buckets | None = None
    committed: int | None = None         # version the broadcast buckets hold, once every worker took it

    def plan(self, items: Sequence[tuple[str, torch.Tensor]]) -> Manifest:
        return plan(items, self.bucket_bytes)

    def payload(self, transport: str, manifest: Manifest, items: Sequence[tuple[str, torch.Tensor]]) -> dict:
        """Object store or CUDA IPC: what the workers need to take this refresh (refs or handles, never
        tensor data)."""
        out: dict[str, Any] = {"transport": transport, "manifest": manifest, "refresh_id": uuid.uuid4().hex}
        if transport == "object_store":
            out["refs"] = self.object_store.publish(manifest, items)
        elif transport == "cuda_ipc":
            out.update(self.ipc.share(manifest, items))
        else:
            raise ValueError(f"update_weights: no payload for transport {transport!r}")
        return out

    def fill_broadcast(self, manifest: Manifest, items: Sequence[tuple[str, torch.Tensor]]) -> None:
        self.committed = None  # the buckets are about to hold a version no worker has yet
        self.broadcast_buckets = reuse_or_allocate(self.broadcast_buckets, manifest, self.group_device(),
                                                   pin_memory=True)
        self.broadcast_buckets.fill(items)

    def broadcast_payload(self, manifest: Manifest) -> dict:
        return {"transport": "broadcast", "manifest": manifest, "refresh_id": uuid.uuid4().hex,
                "group_id": self.group.spec.group_id}

    def group_device(self) -> torch.device:
        """Where the broadcast buckets live: the GPU for NCCL, host memory for gloo."""
        if self.group_args and self.group_args["backend"] == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def send(self) -> None:
        """Broadcast the filled buckets to the group (this process is rank 0)."""
        self.group.broadcast(self.broadcast_buckets.buffers)

    def join(self, spec: GroupSpec) -> None:
        self.leave()
        self.group = WeightGroup(spec, 0)

    def leave(self) -> None:
        if self.group is not None:
            self.group.close()
        self.group = None

    def has_group(self) -> bool:
        return self.group is not None

    def release(self) -> None:
        self.object_store.release()
        self.ipc.release()
        self.broadcast_buckets, self.committed = None, None
