"""Worker side of a refresh: turn what a transport delivered into (name, tensor) views for the engine.

object store: views of the shared-memory buckets; CUDA IPC: views of the learner's mapped GPU buckets;
broadcast: views of this worker's staging buckets, filled by the group's broadcast. Staging buckets and
IPC mappings are kept between refreshes of the same layout and dropped by `release`.

A delta (delta.py) patches the worker's base: its weights in the engine's dtype, in the dense bucket layout, in
host memory (pinned with CUDA). The base is copied from the engine's own weights on the first delta that finds
none of that version, patched by each delta, and handed to the engine as the refresh's views; a dense refresh
frees it (its weights are then elsewhere). Memory while deltas come: one host copy of the weights. A delta is
decoded and checked in full before the apply (on prepare; for a broadcast, once its bytes are in), so a corrupt
one is refused on every worker before any swaps.
"""
from __future__ import annotations

from typing import Any

import torch

from rollout_service.model.weight_update import current_weights
from rollout_service.weights.buckets import Buckets, Manifest, reuse_or_allocate, views
from rollout_service.weights.cuda_ipc import IpcReader
from rollout_service.weights.delta import NO_BASE, Write, apply, decode
from rollout_service.weights.group import GroupSpec, WeightGroup
from rollout_service.weights.object_store import fetch, fetch_buffers, fetch_pinned
from rollout_service.weights.transport import TRANSPORTS


class WeightReceiver:
    def __init__(self, device: torch.device):
        self.device = device
        self.ipc = IpcReader()
        self.group: WeightGroup | None = None
        self.staging: Buckets | None = None
        self._received: str | None = None  # refresh id whose bytes are in staging (or decoded, for a delta)
        self.base: Buckets | None = None   # the weights of base_version, which a delta patches
        self.base_version: int | None = None
        self._writes: list[Write] | None = None  # the prepared delta's checked writes

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
        engine's `version` and, to copy its base from, its `model` (None: its weights cannot be read now)."""
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
        self._hold_base(manifest, version, model)
        if kind == "broadcast":
            self._stage(payload["group_id"], plan.wire_manifest())
            return
        self._writes = decode(manifest, plan, fetch_buffers(payload["refs"]), dict(self.base.views()))
        self._received = payload["refresh_id"]

    def _hold_base(self, manifest: Manifest, version: int, model: Any) -> None:
        """The base of `version` in `manifest`'s layout, copied from the engine's weights unless already held."""
        if self.base is not None and self.base_version == version and self.base.manifest == manifest:
            return
        if model is None:
            raise ValueError(f"update_weights: {NO_BASE}: this worker's weights are asleep and it keeps no copy of "
                             f"version {version}")
        self.base_version = None
        self.base = reuse_or_allocate(self.base, manifest, "cpu", pin_memory=True)
        slots = dict(self.base.views())
        held = current_weights(model, manifest.entries)
        with torch.no_grad():
            for name, t in held:
                slots[name].copy_(t, non_blocking=True)
        for device in {t.device for _, t in held if t.is_cuda}:
            torch.cuda.synchronize(device)
        self.base_version = version

    def receive(self, payload: dict) -> None:
        """Broadcast only: take every bucket into staging (the engine keeps serving meanwhile); a delta is
        decoded and checked once its bytes are in."""
        if self.group is None or self.staging is None or self.group_id() != payload["group_id"]:
            raise RuntimeError("update_weights: no broadcast was prepared on this worker")
        self._received = None
        self.group.broadcast(self.staging.buffers)  # drops the group on any error
        if payload.get("delta") is not None:
            self._writes = decode(payload["manifest"], payload["delta"], self.staging.buffers,
                                  dict(self.base.views()))
        self._received = payload["refresh_id"]

    def views(self, payload: dict) -> list[tuple[str, torch.Tensor]]:
        manifest: Manifest = payload["manifest"]
        kind = payload["transport"]
        if payload.get("delta") is not None:
            if self._writes is None or self._received != payload["refresh_id"]:
                raise RuntimeError("update_weights: the delta was not prepared on this worker")
            self.base_version = None  # patched from here on: it holds the new version once the engine took it
            apply(self._writes, dict(self.base.views()))
            return self.base.views()
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

    def applied(self, payload: dict, version: int) -> None:
        """The engine took the refresh: a delta's patched base is `version`; after a dense one the base is stale."""
        if payload.get("delta") is not None:
            self.base_version = version
        else:
            self.base, self.base_version = None, None

    def discard(self) -> None:
        self._received, self._writes = None, None

    def release(self) -> None:
        """Drop the staging buckets, the base and the IPC mappings (the learner is about to free its buckets)."""
        self.ipc.release()
        self.staging, self._received, self._writes = None, None, None
        self.base, self.base_version = None, None
