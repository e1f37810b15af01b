"""Engine and service configuration: dataclasses that validate themselves and round-trip through YAML."""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

BACKENDS = ("auto", "torch", "cuda")
DTYPES = (None, "float32", "bfloat16", "float16")
ON_REFRESH = ("continue", "abort")


def _fail(cls: str, name: str, value: Any, why: str) -> None:
    raise ValueError(f"{cls}.{name}={value!r}: {why}")


def from_mapping(cls, d: dict, where: str):
    """Build dataclass `cls` from a mapping, naming unknown keys instead of ignoring them."""
    if not isinstance(d, dict):
        raise ValueError(f"{where}: expected a mapping, got {type(d).__name__}")
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(d) - known)
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {unknown}; allowed: {sorted(known)}")
    return cls(**d)


@dataclass
class EngineConfig:
    """One engine on one device. `num_pages=None` sizes the KV pool from `kv_cache_memory_gb` (or, on a
    GPU, from `gpu_memory_utilization` of the free memory)."""

    model: Any = "smollm2-135m"
    backend: str = "auto"
    dtype: str | None = None
    device: str | None = None
    page_size: int = 16
    num_pages: int | None = None
    kv_cache_memory_gb: float = 1.0
    gpu_memory_utilization: float = 0.85
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int | None = None
    enable_cuda_graphs: bool = True
    cuda_graph_max_batch: int = 256
    enable_prefix_caching: bool = False
    seed: int = 0
    on_refresh: str = "continue"

    def __post_init__(self) -> None:
        c = "EngineConfig"
        if self.backend not in BACKENDS:
            _fail(c, "backend", self.backend, f"must be one of {BACKENDS}")
        if self.dtype not in DTYPES:
            _fail(c, "dtype", self.dtype, f"must be one of {DTYPES}")
        if self.device is not None and not str(self.device).startswith(("cpu", "cuda")):
            _fail(c, "device", self.device, "must be 'cpu', 'cuda' or 'cuda:N'")
        if self.page_size not in (8, 16, 32, 64):
            _fail(c, "page_size", self.page_size, "must be one of 8, 16, 32, 64")
        for name in ("max_num_seqs", "max_num_batched_tokens", "cuda_graph_max_batch"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                _fail(c, name, v, "must be an int >= 1")
        if self.num_pages is not None and (not isinstance(self.num_pages, int) or self.num_pages < 2):
            _fail(c, "num_pages", self.num_pages, "must be None or an int >= 2 (page 0 is reserved)")
        if self.max_model_len is not None and (not isinstance(self.max_model_len, int) or self.max_model_len < 2):
            _fail(c, "max_model_len", self.max_model_len, "must be None or an int >= 2")
        if not 0 < self.gpu_memory_utilization <= 0.98:
            _fail(c, "gpu_memory_utilization", self.gpu_memory_utilization, "must be in (0, 0.98]")
        if not self.kv_cache_memory_gb > 0:
            _fail(c, "kv_cache_memory_gb", self.kv_cache_memory_gb, "must be > 0")
        if self.on_refresh not in ON_REFRESH:
            _fail(c, "on_refresh", self.on_refresh, f"must be one of {ON_REFRESH}")

    def to_dict(self) -> dict:
        d = asdict(self)
        if not isinstance(d["model"], str):
            d["model"] = repr(type(self.model).__name__)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "EngineConfig":
        return from_mapping(cls, d, "engine config")
