"""Hardware ceilings measured in the same run: memory copy bandwidth and matmul rate.

GPU: 2 GiB device-to-device copy and an 8192^3 bf16 matmul (benchmarks/README.md). CPU: a large tensor copy and
an fp32 matmul. The floor of every workload is computed from these two numbers.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass

import torch


@dataclass
class Ceilings:
    device: str
    copy_bytes: int          # bytes of the copied tensor (read once + written once per copy)
    bandwidth_Bps: float     # (read + written) bytes / second, fastest of the timed copies
    matmul_n: int
    matmul_dtype: str
    matmul_flops: float      # FLOP/s, fastest of the timed matmuls
    read_Bps: float = 0.0    # CPU only: a read-only pass (sum); a CPU copy also reads the destination
                             # lines before writing them, so copy bandwidth understates what reads get

    @property
    def stream_Bps(self) -> float:
        """Bandwidth the floors use: the better of copy and read-only."""
        return max(self.bandwidth_Bps, self.read_Bps)

    def to_dict(self) -> dict:
        return {**asdict(self), "stream_Bps": self.stream_Bps}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_fn(fn, device: torch.device, iters: int, warmup: int = 1, best: bool = False) -> float:
    """Median (or best) wall seconds of fn(); synchronised so GPU work is inside the timed span."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return min(times) if best else statistics.median(times)


def measure_bandwidth(device: torch.device, nbytes: int, iters: int) -> float:
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    # A ceiling is the best the hardware showed, not a typical value: take the fastest copy.
    seconds = time_fn(lambda: dst.copy_(src), device, iters, best=True)
    del src, dst
    return 2 * nbytes / seconds


def measure_read(device: torch.device, nbytes: int, iters: int) -> float:
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    seconds = time_fn(lambda: src.sum(), device, iters, best=True)
    del src
    return nbytes / seconds


def measure_matmul(device: torch.device, n: int, dtype: torch.dtype, iters: int) -> float:
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    seconds = time_fn(lambda: a @ b, device, iters, best=True)
    return 2 * n**3 / seconds


def measure_ceilings(device: torch.device, quick: bool = False) -> Ceilings:
    if device.type == "cuda":
        nbytes, n, dtype, iters = 2 << 30, 8192, torch.bfloat16, 10
        if quick:
            nbytes, n, iters = 256 << 20, 4096, 3
    else:
        # Large enough to leave the caches, small enough for a shared machine.
        nbytes, n, dtype, iters = 256 << 20, 2048, torch.float32, 8
        if quick:
            nbytes, n, iters = 32 << 20, 256, 2
    bw = measure_bandwidth(device, nbytes, iters)
    flops = measure_matmul(device, n, dtype, iters)
    read = 0.0
    if device.type == "cuda":
        torch.cuda.empty_cache()
    else:
        read = measure_read(device, nbytes, iters)
    return Ceilings(str(device), nbytes, bw, n, str(dtype).replace("torch.", ""), flops, read)


def decode_step_floor(weight_bytes: float, kv_bytes: float, params: float, batch: int,
                      ceil: Ceilings) -> float:
    """Seconds for one decode step at the hardware limit: every touched byte read once, or every
    multiply-add done at peak, whichever takes longer. Weights are read once per step (they're
    shared by the batch); each sequence reads its own KV."""
    # Copy bandwidth counts read + write; a read-only stream moves the same bytes per second.
    return max((weight_bytes + kv_bytes) / ceil.stream_Bps, 2 * params * batch / ceil.matmul_flops)


def prefill_floor(weight_bytes: float, params: float, tokens: int, ceil: Ceilings) -> float:
    """Seconds to prefill `tokens` prompt tokens: weight read or 2*params FLOPs per token."""
    return max(weight_bytes / ceil.stream_Bps, 2 * params * tokens / ceil.matmul_flops)
