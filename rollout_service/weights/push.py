"""The learner's side of a refresh through a Ray rollout service (the router's side: actors/refresh.py).

update_weights: check the tensors (finite, unless told otherwise) and the version, pick the transport
(sender.choose_transport), lay the tensors out in buckets, hand the router the payload (manifest first:
every worker validates it before any bytes move), and, for a broadcast, send the bytes while the workers
receive them. init_weight_group forms the broadcast group: this process is rank 0.
"""
from __future__ import annotations

import time
import uuid
from typing import Any

import ray
import torch

from rollout_service.checks import check_policy_version
from rollout_service.weights.buckets import Manifest, NamedTensors, named_items, reject_nonfinite
from rollout_service.weights.group import COLLECTIVES, GroupSpec, free_port
from rollout_service.weights.sender import REGROUP, WeightSender, WorkerPlace, choose_transport

GROUP_BACKENDS = ("auto", *COLLECTIVES)


class WeightPusher:
    def __init__(self, router: Any):
        self.router = router
        self.sender = WeightSender()
        self.last_timings: dict[str, float | str] = {}  # seconds of the learner's phases of the last refresh

    # -- refresh ----------------------------------------------------------------------------------
    def update_weights(self, named_tensors: NamedTensors, version: int, transport: str = "auto",
                       partial: bool = False, check_finite: bool = True) -> str:
        """Push a new policy to every worker (all or none); returns the transport used."""
        t0 = time.perf_counter()
        items = named_items(named_tensors)
        targets = ray.get(self.router.weight_targets.remote())
        check_policy_version(version, ray.get(self.router.info.remote())["policy_version"])
        places = [WorkerPlace(t["index"], t.get("node_id"), t.get("device", "cpu")) for t in targets]
        kind = choose_transport(transport, items, ray.get_runtime_context().get_node_id(), places,
                                self.sender.has_group())
        if check_finite:
            reject_nonfinite(items)
        manifest = self.sender.plan(items)
        t1 = time.perf_counter()
        if kind == "broadcast":
            self.sender.fill_broadcast(manifest, items)
            t2 = time.perf_counter()
            self._broadcast(manifest, version, partial)
        else:
            payload = self.sender.payload(kind, manifest, items)
            t2 = time.perf_counter()
            err = ray.get(self.router.update_weights.remote(payload, version, partial))
            if err is not None:
                raise ValueError(err)
        t3 = time.perf_counter()
        self.last_timings = {"transport": kind, "check_s": t1 - t0, "pack_s": t2 - t1, "service_s": t3 - t2}
        return kind

    def _broadcast(self, manifest: Manifest, version: int, partial: bool, resend: bool = False) -> None:
        if self.sender.group is None or self.sender.group.broken:
            self._form_group()
        for attempt in range(2):
            payload = self.sender.broadcast_payload(manifest)
            err = ray.get(self.router.broadcast_begin.remote(payload, version, partial, resend,
                                                             self.sender.group.spec.timeout_s))
            if err == REGROUP and attempt == 0:  # a worker restarted or died since the group was formed
                self._form_group()
                continue
            if err is not None:
                raise ValueError(err)
            finish = self.router.broadcast_finish.remote()
            sent: BaseException | None = None
            try:
                self.sender.send()
            except Exception as e:
                sent = e
                self.sender.leave()  # dropping the group makes the workers' receives fail at once
            err = ray.get(finish)
            if err is not None or sent is not None:
                raise RuntimeError(err or f"update_weights: the broadcast failed: {sent}")
            self.sender.committed = version
            return
        raise RuntimeError("update_weights: the weight group could not be formed with the live workers")

    def heal(self) -> bool:
        """A restarted worker waits for weights only the learner has (the last broadcast): form the group
        again and send them. False when this learner holds no such weights."""
        if self.sender.committed is None or self.sender.group_args is None:
            return False
        self._form_group()
        self._broadcast(self.sender.broadcast_buckets.manifest, self.sender.committed, False, resend=True)
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
        self.sender.group_args = {"master_address": master_address, "backend": backend, "timeout_s": float(timeout_s)}
        self._form_group()

    def _form_group(self) -> None:
        args = self.sender.group_args
        if args is None:
            raise ValueError("update_weights: transport 'broadcast' needs a weight group: call "
                             "client.init_weight_group() first")
        self.sender.leave()
        host = args["master_address"] or ray.util.get_node_ip_address()
        members = [t["index"] for t in ray.get(self.router.weight_targets.remote())]
        spec = GroupSpec(uuid.uuid4().hex, host, free_port(), 1 + len(members), args["backend"], args["timeout_s"])
        formed = self.router.form_weight_group.remote(spec, members)
        done, _ = ray.wait([formed], timeout=0.5)  # a refusal (membership changed) comes back at once
        err = ray.get(formed) if done else None
        joined: BaseException | None = None
        if err is None:
            try:
                self.sender.join(spec)  # returns once every worker has joined too
            except Exception as e:
                joined = e
            err = ray.get(formed)
        if err is not None or joined is not None:
            self.sender.leave()
            raise RuntimeError(err or f"init_weight_group: the learner could not join: {joined}")

    # -- memory -----------------------------------------------------------------------------------
    def release(self) -> None:
        """Workers drop their mappings and staging, then this process frees its buckets."""
        ray.get(self.router.release_weight_buffers.remote())
        self.sender.release()

    def close(self) -> None:
        self.sender.leave()
        self.sender.release()
