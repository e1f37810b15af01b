"""Worker side of a refresh: turn what a transport delivered into (name, tensor) views for the engine.

object store: views of the shared-memory buckets; CUDA IPC: views of the learner's mapped GPU buckets;
broadcast: views of this worker's staging buckets, filled by the group's broadcast. Staging buckets and
IPC mappings are kept between refreshes of the same layout and dropped by `release`.
"""
from __future__ import annotations

import torch

from rollout_service.weights.buckets import Buckets, Manifest, reuse_or_allocate, views
from rollout_service.weights.cuda_ipc import IpcReader
from rollout_service.weights.group import GroupSpec, WeightGroup
from rollout_service.weights.object_store import fetch, fetch_pinned
from rollout_service.weights.transport import TRANSPORTS


class WeightReceiver:
    def __init__(self, device: torch.device):
        self.device = device
        self.ipc = IpcReader()
        self.group: WeightGroup | None = None
        self.staging: Buckets | None = None
        self._received: str | None = None  # refresh id whose bytes are in staging

    # -- group membership -------------------------------------------------------------------------
    def join(self, spec: GroupSpec, rank: int) -> None:
        self.leave()
        self.group = WeightGroup(spec, rank, self.device if self.device.type == "cuda" else None)

    def leave(self) -> None:
        if self.group is not None:
            self.group.close()
        self.group = None

    def group_id(self) -> str | None:
        return None if self.group is None or self.group.broken else self.group.spec.group_id

    # -- a refresh --------------------------------------------------------------------------------
    def prepare(self, payload: dict) -> None:
        """Get ready to take a refresh's bytes (validation of the manifest is the engine's)."""
        kind = payload["transport"]
        self._received = None
        if kind == "object_store" and self.device.type == "cuda":
            # the slow part (shared memory -> pinned) now, while the engine generates; the swap is DMA
            self.staging = fetch_pinned(payload["manifest"], payload["refs"], self.staging)
            self._received = payload["refresh_id"]
        elif kind == "cuda_ipc":
            self.ipc.open(payload, self.device)
        elif kind == "broadcast":
            if self.group_id() != payload["group_id"]:
                raise ValueError("update_weights: this worker is not in the current weight group")
            self.staging = reuse_or_allocate(self.staging, payload["manifest"], self.group.device, pin_memory=True)

    def receive(self, payload: dict) -> None:
        """Broadcast only: take every bucket into staging (the engine keeps serving meanwhile)."""
        if self.group is None or self.staging is None or self.group_id() != payload["group_id"]:
            raise RuntimeError("update_weights: no broadcast was prepared on this worker")
        self._received = None
        self.group.broadcast(self.staging.buffers)  # drops the group on any error
        self._received = payload["refresh_id"]

    def views(self, payload: dict) -> list[tuple[str, torch.Tensor]]:
        manifest: Manifest = payload["manifest"]
        kind = payload["transport"]
        if kind == "object_store":
            if self._received == payload["refresh_id"]:
                return list(views(manifest, self.staging.buffers))
            return fetch(manifest, payload["refs"])
        if kind == "cuda_ipc":
            return self.ipc.views(manifest, payload, self.device)
        if kind == "broadcast":
            if self._received != payload["refresh_id"]:
                raise RuntimeError("update_weights: the broadcast's bytes were not all received")
            return list(views(manifest, self.staging.buffers))
        raise ValueError(f"update_weights: unknown transport {kind!r}; choose one of {TRANSPORTS[1:]}")

    def discard(self) -> None:
        self._received = None

    def release(self) -> None:
        """Drop the staging buckets and the IPC mappings (the learner is about to free its buckets)."""
        self.ipc.release()
        self.staging, self._received = None, None
