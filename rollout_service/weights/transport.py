"""Which transport carries a refresh, decided here and nowhere else.

`auto` picks CUDA IPC when the tensors are on a CUDA device of the node every worker runs on (and the
workers run on GPUs), else a broadcast when a weight group has been formed, else the object store. An
explicit choice that cannot work is refused with the reason, before anything moves.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch


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
