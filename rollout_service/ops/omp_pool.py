"""Give back a thread's idle OpenMP workers, so that the thread stepping the engine keeps fast parallel regions.

torch's Linux builds run their parallel CPU ops on libgomp. Every thread that ever ran one keeps its own pool
of workers for life. libgomp lets workers spin between parallel regions only while it manages no more threads
than there are CPUs. Past that, every region wakes its workers through the kernel.

On a 2-core VM that cost about 40 µs per region. SmolLM2's decode step at batch 1 went from 37 to 48 ms, about
its one-thread speed. It happens as soon as a second thread holds a pool: the user's thread that loaded the
model, or a Ray task thread that copied weights in.

`release()` frees the calling thread's pool (OpenMP 5.0's omp_pause_resource_all; libgomp frees only the
caller's). The thread's next parallel op starts a new one, which costs about 0.1 ms. Threads call it before
they wait on the engine, and after they ran engine work off the stepping thread. It is a no-op on other
OpenMP runtimes (LLVM's libomp pauses the whole process, not one thread) and where no libgomp is loaded.
"""
from __future__ import annotations

import ctypes
import functools

import torch  # noqa: F401 - loads libgomp before _libgomp looks for it

_OMP_PAUSE_SOFT = 1


@functools.cache
def _libgomp() -> ctypes.CDLL | None:
    """The libgomp this process has loaded (torch's), found in /proc/self/maps; None if none or not Linux."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libgomp" in line and "/" in line}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            lib = ctypes.CDLL(path)  # the loaded one: dlopen of a loaded path returns its handle
        except OSError:
            continue
        if hasattr(lib, "omp_pause_resource_all"):
            lib.omp_pause_resource_all.argtypes = [ctypes.c_int]
            return lib
    return None


def release() -> bool:
    """Free the calling thread's idle OpenMP workers; True if libgomp did (False: no libgomp, or the thread is
    inside a parallel region)."""
    lib = _libgomp()
    return lib is not None and lib.omp_pause_resource_all(_OMP_PAUSE_SOFT) == 0
