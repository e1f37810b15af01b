"""Freed host memory back to the OS after a weight refresh.

A refresh's validation makes large short-lived host tensors (the canary's products, dtype casts, the copies a
transport hands over), freed from whichever thread made them. glibc keeps freed memory in that thread's malloc
arena for reuse, and with generation running on the engine's thread at the same time, the next refresh rarely
fits the holes: a worker's resident memory grew ~1.3-2.3 MiB per refresh, never given back (issue 45, item 5).
malloc_trim returns the free pages of every arena; it costs a few milliseconds per refresh.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import sys
from functools import lru_cache


@lru_cache(maxsize=1)
def _malloc_trim():
    """libc's malloc_trim, or None off glibc (macOS, musl): there is nothing to do then."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


def release_freed_memory() -> bool:
    """Give the free pages of every malloc arena back to the OS; whether anything was released."""
    trim = _malloc_trim()
    return bool(trim(0)) if trim is not None else False
