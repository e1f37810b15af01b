"""JIT build and load of the csrc kernels through torch.utils.cpp_extension (ninja + pybind11).

The build directory is keyed by a hash of the csrc sources, the torch/CUDA versions and the target GPU,
so an edit to any kernel rebuilds, and a second process (or `rollout-service build-kernels`) reuses it.
"""
from __future__ import annotations

import functools
import hashlib
import logging
import os
from pathlib import Path
from types import ModuleType

import torch

from rollout_service.config import cache_dir

logger = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parents[2] / "csrc"
CACHE_ENV = "ROLLOUT_KERNELS_CACHE"
_SOURCE_SUFFIXES = (".cu", ".cuh", ".h", ".cpp")


def _sources(csrc: Path) -> list[Path]:
    """The compiled sources: every csrc/*.cu plus the one binding file."""
    sources = sorted(csrc.glob("*.cu")) + [csrc / "bindings.cpp"]
    missing = [str(p) for p in sources if not p.is_file()]
    if missing or len(sources) < 2:
        raise RuntimeError(f"kernel sources missing under {csrc}: {missing or 'no .cu files'}")
    return sources


def _arch_flags(device: int | None = None) -> list[str]:
    """-gencode for the GPU we run on: sm_90a on Hopper (the 'a' unlocks wgmma/setmaxnreg), else native."""
    major, minor = torch.cuda.get_device_capability(device)
    arch = f"{major}{minor}"
    if arch == "90":
        arch = "90a"
    return [f"-gencode=arch=compute_{arch},code=sm_{arch}"]


def _build_key(arch_flags: list[str], csrc: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(p for p in csrc.iterdir() if p.suffix in _SOURCE_SUFFIXES):
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    digest.update(f"{torch.__version__}|{torch.version.cuda}|{' '.join(arch_flags)}".encode())
    return digest.hexdigest()[:16]


def cache_root() -> Path:
    """$ROLLOUT_KERNELS_CACHE, else the service's cache folder (config.cache_dir: $ROLLOUT_SERVICE_CACHE, ...)
    / kernels: the CUDA build and the CPU kernels' (ops/cpu_ext.py)."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    return cache_dir() / "kernels"


class CudaUnavailable(RuntimeError):
    """No CUDA build of torch or no visible CUDA device: a fact about the machine, which the command line
    reports in one line (a compiler failure, by contrast, keeps its traceback and the compiler's output)."""


def _why_no_cuda() -> str:
    if torch.version.cuda is None:
        return f"this torch ({torch.__version__}) is a CPU build"
    return f"no CUDA device is visible (torch {torch.__version__}, CUDA {torch.version.cuda})"


def build_kernels(verbose: bool = False, csrc: Path = CSRC) -> ModuleType:
    """Compile (or reuse the cached build of) the kernels for the current GPU and import the module.
    csrc: the source folder (another one only to time a modified copy of it)."""
    if not torch.cuda.is_available():
        raise CudaUnavailable(f"building the CUDA kernels needs a CUDA device and a CUDA build of torch: "
                              f"{_why_no_cuda()}")
    from torch.utils.cpp_extension import load

    arch_flags = _arch_flags()
    key = _build_key(arch_flags, csrc)
    build_dir = cache_root() / key
    build_dir.mkdir(parents=True, exist_ok=True)
    logger.info("loading rollout_service kernels from %s", build_dir)
    return load(
        name=f"rollout_kernels_{key}",
        sources=[str(p) for p in _sources(csrc)],
        extra_include_paths=[str(csrc)],
        extra_cflags=["-O3"],
        # No --use_fast_math: softmax uses ex2.approx explicitly where it is safe; the rest stays IEEE.
        extra_cuda_cflags=["-O3", "-lineinfo", "--expt-relaxed-constexpr", *arch_flags],
        build_directory=str(build_dir),
        verbose=verbose,
    )


@functools.cache
def _load_once() -> ModuleType | BaseException:
    try:
        return build_kernels()
    except Exception as exc:  # remembered: a failed build is not retried on every call
        return exc


def load_kernels() -> ModuleType:
    """The compiled kernel module, built once per process; a failed build raises (RuntimeError) every call."""
    result = _load_once()
    if isinstance(result, BaseException):
        raise RuntimeError(f"rollout_service CUDA kernels failed to build/load: {result}") from result
    return result
