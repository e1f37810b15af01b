"""Worker side of a refresh: turn what a transport delivered into (name, tensor) views for the engine.

object store: views of the shared-memory buckets; CUDA IPC: views of the learner's mapped GPU buckets;
broadcast: views of this worker's staging buckets, filled by the group's broadcast. Staging buckets and
IPC mappings are kept between refreshes of the same layout and dropped by `release`.

A delta (delta.py) is decoded on the engine's device against the engine's own weights (its base: the version
the engine runs) into checked writes, which the engine then does in place (Engine.patch_weights): only the
changed elements move, and the worker keeps no copy of the weights. A sparse bucket goes to the device as it
arrives (a few MB); a bucket the sender found smaller dense stays in host memory until the apply copies it. A
delta is decoded and checked in full before the apply (on prepare; for a broadcast, once its bytes are in), so a
corrupt one is refused on every worker before any swaps.
"""
from __future__ import annotations

from typing import Any

import torch

from rollout_service.model.weight_update import current_weights
from rollout_service.weights.buckets import Buckets, Manifest, reuse_or_allocate, views
from rollout_service.weights.cuda_ipc import IpcReader
from rollout_service.weights.delta import DeltaPlan, Write, decode
from rollout_service.weights.group import WeightGroup
from rollout_service.weights.manifest import GroupSpec
from rollout_service.weights.object_store import fetch, fetch_buffers, fetch_pinned
from rollout_service.weights.refusals import NO_BASE
from rollout_service.weights.transport import TRANSPORTS


class WeightReceiver:
    def __init__(self, device: torch.device):
        self.device = device
        self.ipc = IpcReader()
        self.group: WeightGroup | None = None
        self.staging: Buckets | None = None
        self._received: str | None = None  # refresh id whose bytes are in staging (or decoded, for a delta)
        self._writes: list[Write] | None = None  # the prepared delta's checked writes
        self._base: dict[str, torch.Tensor] | None = None  # the engine's weights by name, while a delta is decoded

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
    def prepare(self, payload: dict, version: int = 0, model: Any = None) -> None:
        """Get ready to take a refresh's bytes (validation of the manifest is the engine's). A delta needs the
        engine's `version` and its `model`, whose weights it is decoded against (None: they cannot be read now,
        e.g. asleep: the delta is refused as lacking its base, and the learner pushes dense)."""
        kind = payload["transport"]
        self._received, self._writes = None, None
        if payload.get("delta") is not None:
            return self._prepare_delta(payload, version, model)
        if kind == "object_store" and self.device.type == "cuda":
            # the slow part (shared memory -> pinned) now, while the engine generates; the swap is DMA
            self.staging = fetch_pinned(payload["manifest"], payload["refs"], self.staging)
            self._received = payload["refresh_id"]
        elif kind == "cuda_ipc":
            self.ipc.open(payload, self.device)
        elif kind == "broadcast":
            self._stage(payload["group_id"], payload["manifest"])

    def _stage(self, group_id: str, layout: Manifest) -> None:
        if self.group_id() != group_id:
            raise ValueError("update_weights: this worker is not in the current weight group")
        self.staging = reuse_or_allocate(self.staging, layout, self.group.device, pin_memory=True)

    def _prepare_delta(self, payload: dict, version: int, model: Any) -> None:
        plan, manifest, kind = payload["delta"], payload["manifest"], payload["transport"]
        if getattr(plan, "base_version", None) != version:
            raise ValueError(f"update_weights: {NO_BASE}: this worker runs version {version}, the delta applies to "
                             f"version {getattr(plan, 'base_version', None)}")
        if kind not in ("object_store", "broadcast"):
            raise ValueError(f"update_weights: transport {kind!r} carries no deltas")
        if model is None:
            raise ValueError(f"update_weights: {NO_BASE}: this worker's weights are asleep")
        base = dict(current_weights(model, manifest.entries))  # (a ValueError for FP8 or another dtype)
        if kind == "broadcast":
            self._stage(payload["group_id"], plan.wire_manifest())
            self._base = base
            return
        self._writes = decode(manifest, plan, self._on_device(plan, fetch_buffers(payload["refs"])), base)
        self._received = payload["refresh_id"]

    def _on_device(self, plan: DeltaPlan, buffers: list[torch.Tensor]) -> list[torch.Tensor]:
        """The sparse buckets on the engine's device, where they are decoded next to the weights (the dense ones
        are copied into the weights once, at the apply)."""
        if self.device.type != "cuda":
            return buffers
        return [b if code.sparse is None else b.to(self.device) for code, b in zip(plan.buckets, buffers)]

    def receive(self, payload: dict) -> None:
        """Broadcast only: take every bucket into staging (the engine keeps serving meanwhile); a delta is
        decoded and checked once its bytes are in."""
        if self.group is None or self.staging is None or self.group_id() != payload["group_id"]:
            raise RuntimeError("update_weights: no broadcast was prepared on this worker")
        self._received = None
        self.group.broadcast(self.staging.buffers)  # drops the group on any error
        if payload.get("delta") is not None:
            base, self._base = self._base, None
            self._writes = decode(payload["manifest"], payload["delta"], self.staging.buffers, base)
        self._received = payload["refresh_id"]

    def writes(self, payload: dict) -> list[Write]:
        """A delta's checked writes, for Engine.patch_weights."""
        if self._writes is None or self._received != payload["refresh_id"]:
            raise RuntimeError("update_weights: the delta was not prepared on this worker")
        return self._writes

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
        self._received, self._writes, self._base = None, None, None

    def release(self) -> None:
        """Drop the staging buckets and the IPC mappings (the learner is about to free its buckets)."""
        self.ipc.release()
        self.staging = None
        self.discard()
