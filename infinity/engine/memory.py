"""Make freed large blocks go back to the OS, so that peak RSS measures what is alive.

[Note: glibc's mmap threshold]
glibc serves a large malloc with its own mmap and unmaps it on free, but
only above M_MMAP_THRESHOLD, and by default that threshold rises to the size
of each large block freed (up to 32 MiB). After the first gathered parameter
is freed, every later one of that size comes from the heap, and the heap
keeps what it has: RSS then stays at the high-water mark of all the
gathered parameters and gradient buffers ever alive, not of those alive now.
Fixing the threshold at 64 KiB keeps the engine's memory ceiling honest.
"""

from __future__ import annotations

import ctypes
import ctypes.util

_M_MMAP_THRESHOLD = -3
_done = False


def return_freed_memory_to_os(threshold: int = 1 << 16) -> bool:
    """Pin glibc's mmap threshold (see the note). False where there is no glibc."""
    global _done
    if _done:
        return True
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        _done = bool(libc.mallopt(_M_MMAP_THRESHOLD, threshold))
    except (OSError, AttributeError):
        return False
    return _done
