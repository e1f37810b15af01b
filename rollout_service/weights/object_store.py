"""Object-store transport: any topology, no GPU needed on either side.

Learner side: the tensors are copied into host buckets (pinned when CUDA is present, so a GPU tensor's
copy is a DMA, not a pageable staging copy), reused by every refresh of the same layout, and each bucket
is `ray.put` once, the puts running in parallel threads (each is a memcpy into shared memory). Worker
side: `ray.get` maps the buckets zero-copy from the node's shared memory. A CPU engine copies each view
straight into its parameter. A GPU worker first copies the buckets into pinned host buckets of its own
(parallel memcpy, while the engine keeps generating), so that the swap itself is DMA at the host link's
speed: a host-to-device copy from pageable memory runs at a fraction of it.
"""
from __future__ import annotations

import warnings
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Sequence

import torch

from rollout_service.weights.buckets import Buckets, Manifest, as_bytes, reuse_or_allocate, views


class ObjectStoreSender:
    """Learner side. Keeps its pinned host buckets between refreshes; `release` frees them."""

    def __init__(self) -> None:
        self.buckets: Buckets | None = None

    def publish(self, manifest: Manifest, items: Sequence[tuple[str, torch.Tensor]]) -> list[Any]:
        """Fill the host buckets and put each in the object store, a bucket's put starting as soon as its
        copies are done (GPU tensors: the device-to-host copies of the next buckets run meanwhile).
        Returns one ObjectRef per bucket."""
        import ray

        self.buckets = reuse_or_allocate(self.buckets, manifest, "cpu", pin_memory=True)
        slots = dict(self.buckets.views())
        by_bucket: list[list[tuple[str, torch.Tensor]]] = [[] for _ in manifest.bucket_sizes]
        for e, (name, t) in zip(manifest.entries, items):
            by_bucket[e.bucket].append((name, t))

        def put(array, copied):
            if copied is not None:
                copied.synchronize()
            return ray.put(array)

        with ThreadPoolExecutor(max_workers=4) as pool:  # each put is itself a parallel memcpy
            futures = []
            for bucket, group in zip(self.buckets.buffers, by_bucket):
                for name, t in group:
                    if t.numel():
                        slots[name].copy_(t.detach(), non_blocking=True)
                futures.append(pool.submit(put, bucket.numpy(), _copies_done(group)))
            return [f.result() for f in futures]

    def put(self, buffers: Sequence[torch.Tensor]) -> list[Any]:
        """Put buffers already filled (a delta push's: weights/delta_sender.py), GPU ones through host memory.
        The host buckets of dense pushes are freed: a learner that pushes deltas keeps its base instead."""
        import ray

        self.buckets = None
        with ThreadPoolExecutor(max_workers=4) as pool:
            return list(pool.map(lambda b: ray.put(b.detach().to("cpu").numpy()), buffers))

    def release(self) -> None:
        self.buckets = None


def _copies_done(group: list[tuple[str, torch.Tensor]]) -> Any:
    """An event marking the device-to-host copies just queued for these tensors (None: none were async)."""
    devices = {t.device for _, t in group if t.is_cuda}
    if not devices:
        return None
    if len(devices) > 1:  # tensors of one bucket on several GPUs: rare, wait here
        for d in devices:
            torch.cuda.synchronize(d)
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(devices.pop()))
    return event


def fetch(manifest: Manifest, refs: Sequence[Any]) -> list[tuple[str, torch.Tensor]]:
    """Worker side: zero-copy views of the published buckets (read-only shared memory)."""
    import ray

    return list(views(manifest, ray.get(list(refs))))


def fetch_buffers(refs: Sequence[Any]) -> list[torch.Tensor]:
    """Worker side: the published buckets as flat uint8 tensors (zero-copy, read-only shared memory)."""
    import ray

    return [as_bytes(a) for a in ray.get(list(refs))]


def fetch_pinned(manifest: Manifest, refs: Sequence[Any], staging: Buckets | None) -> Buckets:
    """Worker side, GPU engine: the published buckets copied into pinned host buckets (reused)."""
    import ray

    staging = reuse_or_allocate(staging, manifest, "cpu", pin_memory=True)
    arrays = ray.get(list(refs))
    chunk = 64 << 20
    jobs = [(dst, torch.frombuffer(src, dtype=torch.uint8) if len(src) else dst[:0], o)
            for dst, src in zip(staging.buffers, arrays) for o in range(0, len(src), chunk)]

    def copy(job) -> None:  # torch's copy_ releases the GIL: the chunks copy in parallel
        dst, src, o = job
        dst[o:o + chunk].copy_(src[o:o + chunk])

    with warnings.catch_warnings():  # read-only shared memory; it is only read
        warnings.simplefilter("ignore", UserWarning)
        with ThreadPoolExecutor(max_workers=8) as pool:
            list(pool.map(copy, jobs))
    return staging
