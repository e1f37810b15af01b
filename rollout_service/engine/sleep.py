"""Sleep and wake: hand an engine's device memory to a colocated learner, then take it back.

Level 1 parks the weights in pinned host memory (allocated on the first sleep, reused by every later one);
level 2 drops them, so the next refresh must bring every weight before the engine can wake. At both levels
the KV cache and the CUDA graphs (which hold pointers into the weights and the cache) are freed, and
rebuilt on wake. Parameters keep their identity throughout: only their storages are emptied and refilled
(`UntypedStorage.resize_`), so the fused q/k/v and gate/up views and tied embeddings stay intact.

On a CPU engine the weights already live in host memory: level 1 keeps them where they are.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

RESIDENT, PARKED, DROPPED = "resident", "parked", "dropped"


def _bytes_view(storage: torch.UntypedStorage, nbytes: int) -> torch.Tensor:
    t = torch.empty(0, dtype=torch.uint8, device=storage.device)
    return t.set_(storage, 0, (nbytes,))


class WeightParking:
    """Where the weights are while the engine sleeps: resident, parked on the host, or dropped."""

    def __init__(self, model: nn.Module, device: torch.device):
        self.device = device
        storages = {}
        for p in model.parameters():  # tied and fused parameters share one storage: count it once
            s = p.untyped_storage()
            storages.setdefault(s.data_ptr(), s)
        self.storages = list(storages.values())
        self.sizes = [s.nbytes() for s in self.storages]
        self.host: list[torch.Tensor] | None = None
        self.state = RESIDENT

    @property
    def nbytes(self) -> int:
        return sum(self.sizes)

    def device_bytes(self) -> int:
        return sum(s.nbytes() for s in self.storages)

    def park(self, keep: bool) -> None:
        """Free the weights' device memory, keeping a host copy when `keep`."""
        if self.state != RESIDENT:
            if self.state == PARKED and not keep:
                self.state = DROPPED
            return
        if keep and self.device.type == "cpu":
            return  # already host memory
        if keep:
            if self.host is None:
                self.host = [torch.empty(n, dtype=torch.uint8, pin_memory=True) for n in self.sizes]
            for s, n, h in zip(self.storages, self.sizes, self.host):
                h.copy_(_bytes_view(s, n), non_blocking=True)
            torch.cuda.synchronize(self.device)
        for s in self.storages:
            s.resize_(0)
        self.state = PARKED if keep else DROPPED

    def restore(self) -> None:
        """Back on the device with the parked values (ValueError when they were dropped)."""
        if self.state == DROPPED:
            raise ValueError("the weights were dropped by sleep(level=2): push every weight with "
                             "update_weights before wake_up")
        if self.state == PARKED:
            self.reallocate()
            for s, n, h in zip(self.storages, self.sizes, self.host):
                _bytes_view(s, n).copy_(h, non_blocking=True)
            torch.cuda.synchronize(self.device)
        self.state = RESIDENT

    def reallocate(self) -> None:
        """Device memory for every weight again, contents undefined (a full refresh is about to fill it)."""
        for s, n in zip(self.storages, self.sizes):
            if s.nbytes() != n:
                s.resize_(n)
        self.state = RESIDENT


class Sleeper:
    """An engine's sleep state and the memory it moves: weights (parked), KV cache, CUDA graphs.
    The engine calls it under its lock, between two steps."""

    def __init__(self, model: nn.Module, kv: Any, runner: Any, scheduler: Any, device: torch.device):
        self.parking = WeightParking(model, device)
        self.kv, self.runner, self.scheduler, self.device = kv, runner, scheduler, device
        self.level = 0

    def sleep(self, level: int) -> None:
        if level not in (1, 2):
            raise ValueError(f"sleep: level={level!r} must be 1 (weights kept in host memory) or 2 (dropped)")
        self.scheduler.preempt_all()
        self.runner.drop_graphs()
        if not self.level:
            self.kv.release()
        self.parking.park(keep=level == 1)
        self.level = max(self.level, level)
        self._empty_cache()

    def wake(self) -> None:
        if not self.level:
            return
        self.parking.restore()
        try:
            self.kv.reallocate()
        except torch.OutOfMemoryError:
            self.kv.release()
            self._empty_cache()
            free = torch.cuda.mem_get_info(self.device)[0] / 2**30
            raise RuntimeError(f"wake_up: no room for the KV cache ({self.kv.capacity_bytes() / 2**30:.1f} GiB wanted, "
                               f"{free:.1f} GiB free); free the learner's memory first") from None
        self.runner.capture_graphs()
        self.level = 0

    def before_refresh(self, partial: bool) -> None:
        """Weights back on the device before a refresh writes them: a full refresh only needs the memory,
        a partial one the parked values too (impossible after level 2)."""
        state = self.parking.state
        if state == RESIDENT:
            return
        if partial and state == DROPPED:
            raise ValueError("update_weights: partial=True while asleep at level 2 would leave the other "
                             "weights undefined; send every weight")
        self.parking.restore() if partial else self.parking.reallocate()

    def device_memory(self) -> int:
        """Device memory the engine holds: the allocator's reserve on a GPU, weight + KV storages on a CPU."""
        if self.device.type == "cuda":
            return int(torch.cuda.memory_reserved(self.device))
        return self.parking.device_bytes() + self.kv.nbytes

    def _empty_cache(self) -> None:
        if self.device.type == "cuda":
            clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
            if clear is not None:  # cuBLAS workspaces (one per stream used) live in the allocator too
                clear()
            torch.cuda.empty_cache()


_nvml_ready: bool | None = None


def process_gpu_bytes() -> int | None:
    """GPU memory this process holds as the driver counts it (CUDA context included), from NVML; None
    where NVML is not installed or cannot list processes."""
    global _nvml_ready
    if _nvml_ready is False:
        return None
    try:
        import os

        import pynvml
        if _nvml_ready is None:
            pynvml.nvmlInit()  # once per process: an init per call would cost each stats() call ~0.1 s
            _nvml_ready = True
        total = 0
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            total += sum(p.usedGpuMemory or 0 for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
                         if p.pid == os.getpid())
        return total
    except Exception:  # no NVML here, or it cannot see processes (some sandboxes)
        _nvml_ready = False
        return None
