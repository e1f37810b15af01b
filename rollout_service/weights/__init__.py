"""Weight refresh: how a learner's state dict reaches every rollout worker.

One bucket layout (buckets.py) under three transports: the Ray object store (object_store.py), CUDA IPC
when learner and workers share a node (cuda_ipc.py), and a broadcast over a torch.distributed group of
the learner and the workers (group.py). Which one `auto` picks is decided in transport.py. Nothing is imported
here: the router reads only refusals.py and must not pay for torch.
"""
