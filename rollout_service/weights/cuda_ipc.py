"""CUDA IPC transport: learner and workers on one node, the weights never leave the GPUs.

Learner side: the tensors are copied (device to device) into a few GPU buckets that live for as long as
the learner keeps them (reused by every refresh of the same layout), and each bucket is shared once by a
CUDA IPC handle (torch's CUDA tensor reduction: a handle + offset, no tensor data is pickled). Worker side:
the handles are opened once per bucket allocation and cached, and every refresh copies from the mapped
buckets straight into the engine's parameters, device to device. A worker on another GPU of the node reads
over NVLink/PCIe (peer access) when its process can see the learner's GPU; one that cannot (Ray's default:
a GPU worker sees its own GPU only) is refused (transport.py ipc_refusal, and here again on the worker).

The learner synchronises its copies before it hands the handles out, and every worker synchronises its
reads before its refresh call returns, so the learner may refill the buckets as soon as update_weights
returns.
"""
from __future__ import annotations

import uuid
from typing import Any, Sequence

import torch

from rollout_service.weights.buckets import Buckets, Manifest, views

_DEVICE_ARG = 6  # index of the device in torch's rebuild_cuda_tensor arguments


def device_uuid(device: torch.device) -> str:
    return str(torch.cuda.get_device_properties(device).uuid)


def visible_gpus() -> list[str]:
    """UUIDs of the GPUs this process can see (none without CUDA): a worker reports them so the learner knows
    whether CUDA IPC from its GPU can reach it."""
    if not torch.cuda.is_available():
        return []
    return [device_uuid(torch.device("cuda", i)) for i in range(torch.cuda.device_count())]


class IpcSender:
    """Learner side: GPU buckets on the tensors' device and their IPC handles."""

    def __init__(self) -> None:
        self.buckets: Buckets | None = None
        self.buffers_id: str | None = None
        self._handles: list[Any] = []

    def share(self, manifest: Manifest, items: Sequence[tuple[str, torch.Tensor]]) -> dict:
        """Fill the buckets and return the picklable handles of them (the payload workers open)."""
        from torch.multiprocessing.reductions import reduce_tensor

        devices = {t.device for _, t in items}
        if len(devices) != 1 or next(iter(devices)).type != "cuda":
            where = ", ".join(sorted(str(d) for d in devices))
            raise ValueError(f"update_weights: transport 'cuda_ipc' needs every tensor on one CUDA device "
                             f"(got {where})")
        device = next(iter(devices))
        if self.buckets is None or not self.buckets.fits(manifest, device):
            self.release()
            self.buckets = Buckets(manifest, device)
            self.buffers_id = uuid.uuid4().hex
            self._handles = [reduce_tensor(b) for b in self.buckets.buffers]
        self.buckets.fill(items)
        return {"buffers_id": self.buffers_id, "handles": self._handles, "device_uuid": device_uuid(device)}

    def release(self) -> None:
        """Free the buckets (workers must have dropped their mappings first: IpcReader.release)."""
        self.buckets, self.buffers_id, self._handles = None, None, []
        if torch.cuda.is_available():
            torch.cuda.ipc_collect()
            torch.cuda.empty_cache()


class IpcReader:
    """Worker side: opened buckets, cached by the learner's allocation id."""

    def __init__(self) -> None:
        self._open: dict[str, list[torch.Tensor]] = {}

    def open(self, payload: dict, device: torch.device) -> list[torch.Tensor]:
        if device.type != "cuda":
            raise ValueError(f"update_weights: transport 'cuda_ipc' needs a GPU worker; this one runs on {device}")
        key = payload["buffers_id"]
        if key not in self._open:
            self.release()  # a new allocation replaces the old one
            local = _local_index(payload["device_uuid"], device)
            self._open[key] = [_rebuild(h, local) for h in payload["handles"]]
        return self._open[key]

    def views(self, manifest: Manifest, payload: dict, device: torch.device) -> list[tuple[str, torch.Tensor]]:
        return list(views(manifest, self.open(payload, device)))

    def release(self) -> None:
        self._open.clear()
        if torch.cuda.is_available():
            torch.cuda.ipc_collect()


def _local_index(uuid_str: str, device: torch.device) -> int:
    """This process's index of the learner's GPU. A process that cannot see it is refused: rebuilding the
    handle under another index would claim the memory lives on that GPU (the learner checks this first, from
    what the workers reported; this is the worker's own check)."""
    seen = visible_gpus()
    if uuid_str in seen:
        return seen.index(uuid_str)
    raise ValueError(f"update_weights: transport 'cuda_ipc': the learner's GPU {uuid_str} is not visible to this "
                     f"worker on {device} (it sees {', '.join(seen)}); use transport 'broadcast' or 'object_store'")


def _rebuild(handle: Any, device_index: int) -> torch.Tensor:
    fn, args = handle
    args = list(args)
    args[_DEVICE_ARG] = device_index  # the learner's index of its GPU means nothing in this process
    with torch.cuda.device(device_index):
        return fn(*args)
