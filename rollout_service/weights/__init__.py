"""Weight refresh: how a learner's state dict reaches every rollout worker.

One bucket layout (buckets.py) under three transports: the Ray object store (object_store.py), CUDA IPC
when learner and workers share a node (cuda_ipc.py), and a broadcast over a torch.distributed group of
the learner and the workers (group.py). Which one `auto` picks is decided in transport.py.
"""
from rollout_service.weights.buckets import (DEFAULT_BUCKET_BYTES, Buckets, Manifest, NamedTensors, PackedWeights,
                                             TensorEntry, named_items, pack, plan, reject_nonfinite, unpack, views)

__all__ = ["DEFAULT_BUCKET_BYTES", "Buckets", "Manifest", "NamedTensors", "PackedWeights", "TensorEntry",
           "named_items", "pack", "plan", "reject_nonfinite", "unpack", "views"]
