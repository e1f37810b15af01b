"""WeightPusher: the learner's side of a refresh through a Ray rollout service, and the buffers it keeps between
refreshes (the router's side: actors/refresh.py; a worker's: receiver.py).

update_weights: reject non-finite values (unless told otherwise), pick the transport (transport.py), lay the
tensors out in buckets, hand the router the payload (the manifest first: every worker validates it before any
bytes move; the router alone checks the version), and, for a broadcast, send the bytes while the workers
receive them. init_group forms the broadcast group: this process is rank 0. A full push through the object store
or a broadcast goes in the engine's dtype and, once this learner holds the base the workers run, as a delta
(delta_sender.py: when; delta.py: the encoding).
"""
from __future__ import annotations

import time
import uuid
from typing import Any, Sequence

import ray
import torch

from rollout_service.weights.buckets import (DEFAULT_BUCKET_BYTES, Buckets, Manifest, plan, reject_nonfinite,
                                             reuse_or_allocate)
from rollout_service.weights.canary import reject_overflowing
from rollout_service.weights.cuda_ipc import IpcSender, device_uuid
from rollout_service.weights.delta_sender import DeltaSender, PushPace, Wire, delta_dtype
from rollout_service.weights.group import COLLECTIVES, WeightGroup, host_store
from rollout_service.weights.manifest import GroupSpec
from rollout_service.weights.object_store import ObjectStoreSender
from rollout_service.weights.refusals import NO_BASE, REGROUP
from rollout_service.weights.transport import WorkerPlace, choose_transport

GROUP_BACKENDS = ("auto", *COLLECTIVES)
Items = Sequence[tuple[str, torch.Tensor]]


class WeightPusher:
    def __init__(self, router: Any, bucket_bytes: int = DEFAULT_BUCKET_BYTES):
        self.router = router
        self.bucket_bytes = bucket_bytes
        self.object_store = ObjectStoreSender()
        self.ipc = IpcSender()
        self.group: WeightGroup | None = None
        self.group_args: dict | None = None         # how the group was formed, to form it again after a fault
        self.broadcast_buckets: Buckets | None = None
        self.committed: int | None = None           # version the broadcast buckets hold, once every worker took it
        self.last_timings: dict[str, float | str] = {}  # seconds of the learner's phases of the last refresh
        self.deltas = DeltaSender()                 # the base of delta pushes (delta_sender.py)
        self.paces: dict[str, PushPace] = {}        # per transport, for delta="auto": delta or dense, the faster
        self.last_push: dict[str, Any] = {}         # the last push: a delta or not, bytes sent, dense bytes

    # -- refresh ----------------------------------------------------------------------------------
    def update_weights(self, items: Items, version: int, transport: str = "auto", partial: bool = False,
                       check_finite: bool = True, delta: Any = "auto") -> str:
        """Push a new policy to every worker (all or none); returns the transport used. `items`: (name, tensor)
        pairs, as the client normalised them. `delta`: delta_sender.py."""
        t0 = time.perf_counter()
        targets = ray.get(self.router.weight_targets.remote())
        places = [WorkerPlace(t["index"], t.get("node_id"), t.get("device", "cpu"), tuple(t.get("gpus") or ()))
                  for t in targets]
        # a group once formed counts even while dropped after a fault: the broadcast forms it again
        kind = choose_transport(transport, items, ray.get_runtime_context().get_node_id(), places,
                                self.group_args is not None, _learner_gpu(items))
        dtype = delta_dtype(delta, kind, partial, targets)
        if check_finite:
            reject_nonfinite(items)
            reject_overflowing(items)
        if dtype is not None:
            want = delta is True or self.paces.setdefault(kind, PushPace()).prefer_delta()
            return self._push_wire(kind, plan(items, self.bucket_bytes, dtype), items, version, t0, check_finite,
                                   want)
        self.deltas.release()
        manifest = self.plan(items)
        t1 = time.perf_counter()
        if kind == "broadcast":
            t2 = time.perf_counter()
            self._broadcast(manifest, version, partial, items=items)
        else:
            payload = self._payload(kind, manifest, items)
            t2 = time.perf_counter()
            err = ray.get(self.router.update_weights.remote(payload, version, partial))
            if err is not None:
                raise ValueError(err)
        t3 = time.perf_counter()
        self.last_timings = {"transport": kind, "check_s": t1 - t0, "pack_s": t2 - t1, "service_s": t3 - t2}
        self.last_push = {"delta": False, "wire_bytes": manifest.nbytes, "dense_bytes": manifest.nbytes}
        return kind

    def _push_wire(self, kind: str, manifest: Manifest, items: Items, version: int, t0: float,
                   checked: bool = True, delta: bool = True) -> str:
        """A full push in the engine's dtype: a delta against the base when `delta` and the learner holds one, else
        dense. A delta that some worker (or the service) cannot take, lacking its base, goes again dense to every
        worker."""
        t1 = time.perf_counter()
        wire = self.deltas.wire(manifest, items, delta=delta, checked=checked)
        t2 = time.perf_counter()
        timed = True
        try:
            self._send_wire(kind, manifest, wire, version)
        except ValueError as e:
            if wire.plan is None or NO_BASE not in str(e):
                raise
            wire, timed = self.deltas.wire(manifest, items, delta=False), False  # (two pushes' time: not timed)
            self._send_wire(kind, manifest, wire, version)
        self.deltas.commit(wire, version, items)
        t3 = time.perf_counter()
        if timed:
            self.paces.setdefault(kind, PushPace()).note(wire.plan is not None, t3 - t1)
        self.last_timings = {"transport": kind, "check_s": t1 - t0, "pack_s": t2 - t1, "service_s": t3 - t2}
        self.last_push = {"delta": wire.plan is not None, "wire_bytes": wire.nbytes, "dense_bytes": manifest.nbytes}
        return kind

    def _send_wire(self, kind: str, manifest: Manifest, wire: Wire, version: int) -> None:
        if kind == "broadcast":
            return self._broadcast(manifest, version, False, wire=wire)
        payload = {"transport": kind, "manifest": manifest, "refresh_id": uuid.uuid4().hex,
                   "refs": self.object_store.put(wire.buffers)}
        if wire.plan is not None:
            payload["delta"] = wire.plan
        err = ray.get(self.router.update_weights.remote(payload, version, False))
        if err is not None:
            raise ValueError(err)

    def _payload(self, transport: str, manifest: Manifest, items: Items) -> dict:
        """Object store or CUDA IPC: what the workers need to take this refresh (refs or handles, never tensor
        data)."""
        out: dict[str, Any] = {"transport": transport, "manifest": manifest, "refresh_id": uuid.uuid4().hex}
        if transport == "object_store":
            out["refs"] = self.object_store.publish(manifest, items)
        else:
            out.update(self.ipc.share(manifest, items))
        return out

    # -- the broadcast's steps (also driven one by one by the fault tests) ------------------------------
    def plan(self, items: Items) -> Manifest:
        return plan(items, self.bucket_bytes)

    def broadcast_payload(self, manifest: Manifest, wire: Wire | None = None) -> dict:
        out = {"transport": "broadcast", "manifest": manifest, "refresh_id": uuid.uuid4().hex,
               "group_id": self.group.spec.group_id}
        if wire is not None and wire.plan is not None:
            out["delta"] = wire.plan
        return out

    def fill_broadcast(self, manifest: Manifest, items: Items) -> None:
        self.committed = None  # the buckets are about to hold a version no worker has yet
        self.broadcast_buckets = reuse_or_allocate(self.broadcast_buckets, manifest, self._group_device(),
                                                   pin_memory=True)
        self.broadcast_buckets.fill(items)

    def fill_wire(self, manifest: Manifest, wire: Wire) -> None:
        """The broadcast buckets, laid out as sent (a delta's: its plan's sizes), filled from a push's buffers."""
        self.committed = None
        layout = manifest if wire.plan is None else wire.plan.wire_manifest()
        self.broadcast_buckets = reuse_or_allocate(self.broadcast_buckets, layout, self._group_device(),
                                                   pin_memory=True)
        for dst, src in zip(self.broadcast_buckets.buffers, wire.buffers):
            dst.copy_(src, non_blocking=True)
        for dev in {self.broadcast_buckets.device} | {b.device for b in wire.buffers}:
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)

    def send(self) -> None:
        """Broadcast the filled buckets to the group (this process is rank 0)."""
        self.group.broadcast(self.broadcast_buckets.buffers)

    def _group_device(self) -> torch.device:
        """Where the broadcast buckets live: the GPU for NCCL, host memory for gloo."""
        if self.group_args and self.group_args["backend"] == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def _broadcast(self, manifest: Manifest, version: int, partial: bool, resend: bool = False,
                   items: Items | None = None, wire: Wire | None = None) -> None:
        """Begin on the router (every worker checks the manifest and the version), fill the buckets with `items`
        or a push's `wire` (neither: resend what they hold), then send them while the workers receive."""
        if self.group is None or self.group.broken:
            self._form_group()
        for attempt in range(2):
            err = ray.get(self.router.broadcast_begin.remote(self.broadcast_payload(manifest, wire), version, partial,
                                                             resend, self.group.spec.timeout_s))
            if err == REGROUP and attempt == 0:  # a worker restarted or died since the group was formed
                self._form_group()
                continue
            if err is not None:
                raise ValueError(err)
            finish = self.router.broadcast_finish.remote()
            sent: BaseException | None = None
            try:
                if items is not None:
                    self.fill_broadcast(manifest, items)
                elif wire is not None:
                    self.fill_wire(manifest, wire)
                self.send()
            except Exception as e:
                sent = e
                self._leave()  # dropping the group makes the workers' receives fail at once
            err = ray.get(finish)
            if err is not None or sent is not None:
                raise RuntimeError(err or f"update_weights: the broadcast failed: {sent}")
            self.committed = version
            return
        raise RuntimeError("update_weights: the weight group could not be formed with the live workers")

    def heal(self) -> bool:
        """A restarted worker waits for weights only the learner has (the last broadcast): form the group again
        and send them. False when this learner holds no such weights."""
        if self.committed is None or self.group_args is None:
            return False
        committed, base = self.committed, self.deltas.full(self.committed)
        if base is not None:  # the last broadcast was pushed through the base (maybe a delta): send it whole
            self.fill_wire(base.manifest, Wire(base.buffers))
            self.committed = committed
        self._form_group()
        self._broadcast(self.broadcast_buckets.manifest, committed, False, resend=True)
        return True

    # -- the weight group -------------------------------------------------------------------------
    def init_group(self, master_address: str | None = None, backend: str = "auto", timeout_s: float = 300.0) -> None:
        if backend not in GROUP_BACKENDS:
            raise ValueError(f"init_weight_group: backend={backend!r}; choose one of {GROUP_BACKENDS}")
        if not isinstance(timeout_s, (int, float)) or timeout_s <= 0:
            raise ValueError(f"init_weight_group: timeout_s={timeout_s!r} must be a number > 0")
        if backend == "auto":
            targets = ray.get(self.router.weight_targets.remote())
            gpus = torch.cuda.is_available() and all(str(t.get("device")).startswith("cuda") for t in targets)
            backend = "nccl" if gpus else "gloo"
        self.group_args = {"master_address": master_address, "backend": backend, "timeout_s": float(timeout_s)}
        try:
            self._form_group()
        except BaseException:
            self.group_args = None  # never formed: pushes go on as without a group
            raise

    def _form_group(self) -> None:
        args = self.group_args
        if args is None:
            raise ValueError("update_weights: transport 'broadcast' needs a weight group: call "
                             "client.init_weight_group() first")
        self._leave()
        host = args["master_address"] or ray.util.get_node_ip_address()
        members = [t["index"] for t in ray.get(self.router.weight_targets.remote())]
        store = host_store(host, 1 + len(members), args["timeout_s"])
        spec = GroupSpec(uuid.uuid4().hex, host, store.port, 1 + len(members), args["backend"], args["timeout_s"])
        err = ray.get(self.router.form_weight_group.remote(spec, members))  # a refusal, before anyone joins
        joined: BaseException | None = None
        if err is None:
            try:
                self.group = WeightGroup(spec, 0, store=store)  # returns once every worker has joined too
            except Exception as e:
                joined = e
            err = ray.get(self.router.weight_group_joined.remote(spec.group_id))
        if err is not None or joined is not None:
            self._leave()
            del store  # its port closes now, not whenever the raised error's frame is freed
            raise RuntimeError(err or f"init_weight_group: the learner could not join: {joined}")

    def _leave(self) -> None:
        if self.group is not None:
            self.group.close()
        self.group = None

    # -- memory -----------------------------------------------------------------------------------
    def release(self) -> None:
        """Workers drop their mappings and staging, then this process frees its buckets."""
        ray.get(self.router.release_weight_buffers.remote())
        self._free()

    def _free(self) -> None:
        self.object_store.release()
        self.ipc.release()
        self.deltas.release()
        self.broadcast_buckets, self.committed = None, None

    def close(self) -> None:
        self._leave()
        self._free()


def _learner_gpu(items: Items) -> str | None:
    """The UUID of the GPU the learner's tensors are on (the first one's; CUDA IPC wants them all on one), or None
    off CUDA: what a worker must see for CUDA IPC to reach it."""
    if not items or items[0][1].device.type != "cuda":
        return None
    return device_uuid(items[0][1].device)
