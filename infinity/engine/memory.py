"""glibc's mmap threshold: whether freed large blocks go back to the OS (peak RSS measures what is alive) or stay
in the heap for the next tensor (no page faults; the heap keeps its high-water mark).

[Note: glibc's mmap threshold]
glibc serves a large malloc with its own mmap and unmaps it on free, but
only above M_MMAP_THRESHOLD, and by default that threshold rises to the size
of each large block freed (up to 32 MiB). After the first gathered parameter
is freed, every later one of that size comes from the heap, and the heap
keeps what it has: RSS then stays at the high-water mark of all the
gathered parameters and gradient buffers ever alive, not of those alive now,
and fragmentation adds to it. Fixing the threshold at 64 KiB (the default of
`infinity.mmap_threshold`) keeps the engine's memory ceiling honest, and
construction under zero_init always uses it.

It has a price. Every tensor above 64 KiB, the model's own activations
included, is then a fresh mapping whose pages fault in (the kernel zeroes
each) on first touch, and is unmapped at free. On the 2-core reference VM the
bf16 `infinity bench train` step spends a fifth to a third of its time there: with
the threshold at 32 MiB the NVMe step took 0.75 s instead of 0.95 s (best of
3 rounds; 21 % less), and the all-RAM step 0.56 s instead of 0.82 s (32 %
less), for about 100 MiB more peak RSS (bench/RESULTS.md, "Where the rest
of the bf16 step goes"). The same 32 MiB
doubled what the training steps of `memory_run` (parity.py) held above their
baseline (69 to 143 MiB: the heap's fragmentation), and took the
construction tests well past their bound, which is why it is an opt-in for
the training steps only. Blocks above the threshold are mapped either way,
so at billions of parameters, where gathered weights and gradients are
tens of MiB and more, the cost of the larger threshold is bounded by the
blocks smaller than it.

Setting the threshold turns off glibc's own adjustment of it and of the trim
threshold (how much free memory at the top of the heap is kept rather than
given back), so both are set: the trim threshold at twice the mmap one, as
glibc's adjustment would. Without that, a block freed at the top of the heap
went back to the OS whenever the trim threshold happened to be low (it
depends on what the imports freed first), and its pages faulted in again.
The setting is process-wide: zero_init sets 64 KiB and puts back what was
there when its block ends; initialize() sets 64 KiB, then its config's.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import warnings

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
CONSTRUCTION = 1 << 16
"""The threshold while zero_init builds a model and initialize() sets it up (and infinity.mmap_threshold's
default)."""
_set: int | None = None  # the threshold this process last set
_warned = False


def mmap_threshold() -> int | None:
    """The threshold this process last set (None: never set, glibc's own)."""
    return _set


def set_mmap_threshold(threshold: int) -> bool:
    """Fix glibc's mmap threshold at `threshold` bytes, and its trim threshold at twice that (see the note). False
    where there is no glibc (said once, when the value asked for is not the default)."""
    global _set, _warned
    if threshold == _set:
        return True
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        ok = bool(libc.mallopt(_M_MMAP_THRESHOLD, threshold)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, 2 * threshold))
    except (OSError, AttributeError):
        ok = False
    if ok:
        _set = threshold
    elif threshold != CONSTRUCTION and not _warned:
        _warned = True
        warnings.warn(f"infinity: infinity.mmap_threshold {threshold} has no effect here: this C library has no "
                      "glibc mallopt(M_MMAP_THRESHOLD)", stacklevel=2)
    return ok
