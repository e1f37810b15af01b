"""Which transport carries a refresh, decided here and nowhere else.

`auto` picks CUDA IPC when the tensors are on one CUDA device that every worker's process can see (the
workers run on GPUs of the learner's node), else a broadcast when a weight group has been formed, else the
object store. An explicit choice that cannot work is refused with the reason, before anything moves.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch


TRANSPORTS = ("auto", "object_store", "cuda_ipc", "broadcast")


@dataclass(frozen=True)
class WorkerPlace:
    index: int
    node_id: str
    device: str  # "cpu" or "cuda:N" as the worker sees it
    gpus: tuple[str, ...] = ()  # UUIDs of every GPU the worker's process can see (Ray shows a worker its own)


def ipc_refusal(items: Sequence[tuple[str, torch.Tensor]], learner_node: str | None, learner_gpu: str | None,
                workers: Sequence[WorkerPlace]) -> str | None:
    """Why CUDA IPC cannot carry these tensors (on the learner's GPU, UUID `learner_gpu`) to these workers, or
    None when it can.

    A worker opens the learner's buckets under its own index of the learner's GPU (cuda_ipc.py). A worker on
    another GPU of the node that cannot see the learner's GPU, which is how Ray starts GPU workers (each one's
    CUDA_VISIBLE_DEVICES names its own GPU), has no such index: the mapping would be made as if the memory
    lived on the worker's GPU. That is refused rather than tried. A worker that does see it (the colocated
    worker on the learner's GPU, or workers started with every GPU of the node visible) reads it by peer
    access."""
    on_cuda = bool(items) and all(t.device.type == "cuda" for _, t in items) and len({t.device for _, t in items}) == 1
    elsewhere = [w for w in workers if w.node_id != learner_node]
    if elsewhere:
        w = elsewhere[0]
        return (f"update_weights: transport 'cuda_ipc' needs the workers on the learner's node ({learner_node}); "
                f"worker {w.index} runs on node {w.node_id}")
    cpu_workers = [w for w in workers if not w.device.startswith("cuda")]
    if cpu_workers:
        return (f"update_weights: transport 'cuda_ipc' needs GPU workers; worker {cpu_workers[0].index} runs on "
                f"{cpu_workers[0].device}")
    if not on_cuda:
        where = sorted({str(t.device) for _, t in items})
        return f"update_weights: transport 'cuda_ipc' needs every tensor on one CUDA device (got {', '.join(where)})"
    blind = [w for w in workers if learner_gpu is None or learner_gpu not in w.gpus]
    if blind:
        w = blind[0]
        return (f"update_weights: transport 'cuda_ipc' needs the learner's GPU ({learner_gpu or 'unknown'}) visible "
                f"to every worker; worker {w.index} runs on another GPU and sees only "
                f"{', '.join(w.gpus) or 'no GPU it reported'}. Use transport 'broadcast' (client.init_weight_group()) "
                "or 'object_store'")
    return None


def choose_transport(requested: str, items: Sequence[tuple[str, torch.Tensor]], learner_node: str | None,
                     workers: Sequence[WorkerPlace], has_group: bool, learner_gpu: str | None = None) -> str:
    """The transport of one refresh. `learner_gpu`: the UUID of the GPU the tensors are on (None off CUDA)."""
    if requested not in TRANSPORTS:
        raise ValueError(f"update_weights: transport={requested!r}; choose one of {TRANSPORTS}")
    if requested == "auto":
        if workers and ipc_refusal(items, learner_node, learner_gpu, workers) is None:
            return "cuda_ipc"
        return "broadcast" if has_group else "object_store"
    if requested == "cuda_ipc":
        why = ipc_refusal(items, learner_node, learner_gpu, workers)
        if why is not None:
            raise ValueError(why)
    if requested == "broadcast" and not has_group:
        raise ValueError("update_weights: transport 'broadcast' needs a weight group: call "
                         "client.init_weight_group() first")
    return requested
