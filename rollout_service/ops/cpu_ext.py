"""Build and load of csrc's C kernels for the CPU (csrc/cpu_*.c): the system C compiler, ctypes, no torch headers.

They build in about a second with `-O3 -march=native -fopenmp -std=gnu11` (GNU C contracts a * b + c into FMAs),
once per machine: the build directory is keyed by the source, the compiler and the CPU (model and flags), so a
home directory shared between machines never loads code built for another CPU. Where no compiler or OpenMP is
found, `load()` returns None and the torch ops run their torch code instead (a log line says why, once).
ROLLOUT_CPU_KERNELS=0 turns them off.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch  # (imported first, it loads torch's libgomp: the kernels' OpenMP is torch's, one thread pool)

from rollout_service.ops._ext import CSRC, cache_root

logger = logging.getLogger(__name__)

ENV = "ROLLOUT_CPU_KERNELS"
SOURCES = ("cpu_attention.c", "cpu_rope_kv.c", "cpu_greedy.c", "cpu_norm.c")
HEADERS = ("cpu_math.h",)


def enabled() -> bool:
    return os.environ.get(ENV, "1") not in ("0", "false", "off")


def takes(*tensors: torch.Tensor) -> bool:
    """Whether the kernels take these tensors: float32 on the CPU, where the kernels build."""
    return all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors) and load() is not None


def _cpu_identity() -> str:
    """The CPU's model and flags (what -march=native compiles for)."""
    try:
        with open("/proc/cpuinfo") as info:
            lines = [line for line in info if line.startswith(("model name", "flags", "Features", "CPU part"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.processor() + platform.machine()


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


def _build(compiler: str) -> Path:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    digest = hashlib.sha256(f"{version}|{_cpu_identity()}".encode())
    for name in SOURCES + HEADERS:
        digest.update((CSRC / name).read_bytes())
    library = cache_root() / "cpu" / digest.hexdigest()[:16] / "rollout_cpu_kernels.so"
    if library.is_file():
        return library
    library.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=library.parent) as tmp:
        partial = Path(tmp) / library.name
        command = [compiler, "-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=gnu11",
                   *(str(CSRC / name) for name in SOURCES), "-o", str(partial)]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} failed:\n{done.stderr.strip()}")
        os.replace(partial, library)  # whole or absent: another process may be building the same key
    return library


@functools.cache
def load() -> ctypes.CDLL | None:
    """The kernels' library, built on first use; None where they are off or do not build here."""
    if not enabled():
        return None
    compiler = _compiler()
    if compiler is None:
        logger.info("no C compiler found: the CPU ops use torch only")
        return None
    try:
        library = ctypes.CDLL(str(_build(compiler)))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        logger.warning("the CPU kernels did not build; the CPU ops use torch only: %s", exc)
        return None
    _declare(library)
    return library


def _declare(library: ctypes.CDLL) -> None:
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    library.rs_paged_attention.argtypes = [ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64, i64, ctypes.c_float,
                                           ctypes.c_int]
    library.rs_paged_attention.restype = ctypes.c_int
    library.rs_rope_write_kv.argtypes = [ptr, i64, ptr, i64, ptr, i64, ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64,
                                         ctypes.c_int]
    library.rs_rope_write_kv.restype = None
    library.rs_argmax_logsumexp.argtypes = [ptr, i64, i64, i64, ptr, ptr, ptr, ctypes.c_int]
    library.rs_argmax_logsumexp.restype = None
    library.rs_add_rms_norm.argtypes = [ptr, ptr, ptr, ctypes.c_float, ptr, ptr, i64, i64, ctypes.c_int]
    library.rs_add_rms_norm.restype = None
