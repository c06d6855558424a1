"""The C heap's freed memory, in one place: glibc's ``malloc_trim`` and ``mallopt`` through ctypes.

PyTorch's CPU tensors come from malloc. glibc keeps freed pages of its heaps resident, so a run that allocates
tensor-sized temporaries between small long-lived objects grows its resident set without using the memory
again. Three callers hand it back or keep it from piling up: the profiler after the statistics of large
attention maps, the streamed executor after each released stage, and quantize (large blocks mapped on their
own). Elsewhere than glibc (musl, macOS, Windows) both calls do nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from typing import Any

_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
_libc: Any = None  # None: not looked up yet; False: no glibc here


def _glibc() -> Any:
    global _libc
    if _libc is None:
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            libc.malloc_trim.argtypes = [ctypes.c_size_t]
            libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
            _libc = libc
        except (OSError, AttributeError):
            _libc = False
    return _libc


def release_freed_memory() -> bool:
    """Return the freed pages of the C heap to the OS (``malloc_trim(0)``); False where there is no glibc."""
    libc = _glibc()
    if libc is False:
        return False
    libc.malloc_trim(0)
    return True


def map_blocks_from(threshold: int) -> bool:
    """Have malloc give every block of at least ``threshold`` bytes its own mapping, returned to the system
    when freed, for the rest of the process (``mallopt(M_MMAP_THRESHOLD, threshold)``); False where there is
    no glibc."""
    libc = _glibc()
    if libc is False:
        return False
    libc.mallopt(_M_MMAP_THRESHOLD, threshold)
    return True
