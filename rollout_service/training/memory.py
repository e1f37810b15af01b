"""Memory figures of a learner, and the error it raises when a step runs out of memory.

An out-of-memory in a colocated learner must say so with the numbers a user needs to fix it (what the
learner held, what was free, what the rollout engine kept while asleep), not surface as a hang or a bare
CUDA error deep in a backward pass.
"""
from __future__ import annotations

import resource

import torch


class LearnerOutOfMemory(RuntimeError):
    """A learner step ran out of memory; `figures` holds the memory figures at the time (bytes)."""

    def __init__(self, message: str, figures: dict):
        super().__init__(message)
        self.figures = figures

    def __reduce__(self):  # raised inside a Ray actor: it must unpickle in the caller with its figures
        return type(self), (str(self), self.figures)


def is_out_of_memory(exc: BaseException) -> bool:
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    # the CPU allocator raises a plain RuntimeError
    return isinstance(exc, RuntimeError) and "DefaultCPUAllocator: can't allocate memory" in str(exc)


def memory_figures(device: torch.device | str) -> dict:
    """Bytes: on a GPU, what this process's allocator holds (allocated, reserved, peak) and the device's
    free and total memory; on a CPU, this process's resident set and its peak."""
    device = torch.device(device)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return {"device": str(device), "allocated": torch.cuda.memory_allocated(device),
                "reserved": torch.cuda.memory_reserved(device), "peak_allocated": torch.cuda.max_memory_allocated(device),
                "device_free": free, "device_total": total}
    return {"device": "cpu", "rss": _rss_bytes(), "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def describe(figures: dict) -> str:
    gib = {k: v / 2**30 for k, v in figures.items() if isinstance(v, int)}
    if figures.get("device", "cpu") == "cpu":
        return f"learner RSS {gib['rss']:.2f} GiB (peak {gib['peak_rss']:.2f} GiB)"
    return (f"learner allocated {gib['allocated']:.2f} GiB, reserved {gib['reserved']:.2f} GiB, peak "
            f"{gib['peak_allocated']:.2f} GiB; {figures['device']} free {gib['device_free']:.2f} of "
            f"{gib['device_total']:.2f} GiB")


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            import os
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
