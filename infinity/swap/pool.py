"""BufferPool: a fixed count x size of aligned (pinned when CUDA is present) host buffers.

It is the hard memory ceiling of the swap service: all of its memory is
reserved once, up front, and nothing is ever allocated past it (its pages
become resident as buffers are first written: `aligned_empty`). A request it
cannot serve waits (back-pressure); a prefetcher uses `try_acquire` so that it
never holds a buffer the critical path is waiting for.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager

import torch

from infinity.errors import PoolExhausted  # noqa: F401 - raised here, defined there
from infinity.io import aligned_empty


class PoolBuffer:
    """One buffer of the pool. `tensor` is a uint8 view of `size` bytes; `view(dtype, numel)` types it."""

    __slots__ = ("index", "tensor", "owner", "_pool")

    def __init__(self, pool: "BufferPool", index: int, tensor: torch.Tensor):
        self._pool = pool
        self.index = index
        self.tensor = tensor
        self.owner: str | None = None  # who borrowed it, for diagnostics

    def view(self, dtype: torch.dtype, numel: int) -> torch.Tensor:
        """The first numel elements of the buffer as `dtype` (no copy)."""
        nbytes = numel * torch.empty(0, dtype=dtype).element_size()
        if nbytes > self.tensor.numel():
            raise ValueError(f"PoolBuffer.view: {numel} x {dtype} needs {nbytes} bytes but pool buffers have "
                             f"{self.tensor.numel()}; raise the buffer size")
        return self.tensor[:nbytes].view(dtype)

    def release(self) -> None:
        self._pool.release(self)

    def __repr__(self) -> str:
        return f"PoolBuffer(#{self.index}, {self.tensor.numel()} B, owner={self.owner!r})"


class BufferPool:
    """`count` buffers of `size` bytes each, carved from one aligned allocation."""

    def __init__(self, count: int, size: int, *, alignment: int = 4096, pin: bool | None = None):
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(f"BufferPool: count must be an int >= 1, got {count!r}")
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"BufferPool: size must be an int >= 1, got {size!r}")
        # Round each buffer up to the alignment so every buffer starts aligned
        # (O_DIRECT needs it) while the pool stays one allocation to pin.
        self.count = count
        self._alignment, self._pin = alignment, pin
        self._carve(size)
        self._buffers = [PoolBuffer(self, i, self._view(i)) for i in range(count)]
        self._free = list(reversed(self._buffers))
        self._cond = threading.Condition()
        self.acquired_total = 0
        self.peak_in_use = 0

    def _carve(self, size: int) -> None:
        self.size = size
        self.stride = -(-size // self._alignment) * self._alignment
        self._memory = aligned_empty(self.stride * self.count, self._alignment, pin=self._pin)

    def _view(self, i: int) -> torch.Tensor:
        return self._memory[i * self.stride:i * self.stride + self.size]

    def shrink(self, size: int) -> None:
        """Make every buffer `size` bytes (no larger than now), in a new allocation; the old one is freed.

        For a pool sized for one phase and then used for a smaller one (the parameter pool holds fp32 shards
        while the model is built and compute-dtype shards after). Every buffer must be free: a held view would
        keep the old memory alive, and its holder would be writing into memory no longer the pool's.
        """
        if isinstance(size, bool) or not isinstance(size, int) or not 1 <= size <= self.size:
            raise ValueError(f"BufferPool.shrink: size must be an int in [1, {self.size}], got {size!r}")
        with self._cond:
            if len(self._free) != self.count:
                holders = ", ".join(sorted(str(b.owner) for b in self._buffers if b.owner is not None))
                raise RuntimeError(f"BufferPool.shrink: {self.count - len(self._free)} buffer(s) are in use "
                                   f"(held by: {holders}); release them first")
            if size == self.size:
                return
            for buf in self._buffers:  # the old allocation is freed before the new one is made
                buf.tensor = torch.empty(0, dtype=torch.uint8)
            self._memory = None
            self._carve(size)
            for i, buf in enumerate(self._buffers):
                buf.tensor = self._view(i)

    def prefault(self) -> None:
        """Make every page of the pool resident (it is mapped lazily, see aligned_empty): for a measurement
        that counts the pool as memory already held, not as growth when a buffer is first written."""
        with self._cond:
            for buf in self._buffers:
                if buf.owner is None:
                    buf.tensor.fill_(0)

    @property
    def nbytes(self) -> int:
        """Host memory the pool holds (its whole budget, allocated up front)."""
        return self._memory.numel()

    @property
    def free_count(self) -> int:
        with self._cond:
            return len(self._free)

    @property
    def in_use(self) -> int:
        with self._cond:
            return self.count - len(self._free)

    def try_acquire(self, owner: str | None = None, *, reserve: int = 0) -> PoolBuffer | None:
        """A free buffer, or None at once if no more than `reserve` are free (what prefetchers use).

        A prefetcher passes reserve=1 so that the critical path, which takes
        one buffer at a time, always finds one: it can never be starved.
        """
        with self._cond:
            return self._take(owner) if len(self._free) > reserve else None

    def acquire(self, owner: str | None = None, timeout: float | None = None) -> PoolBuffer:
        """A free buffer, waiting for one to be released; PoolExhausted after `timeout` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while not self._free:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    holders = ", ".join(sorted({str(b.owner) for b in self._buffers if b.owner is not None}))
                    raise PoolExhausted(f"BufferPool: all {self.count} buffers of {self.size} B are in use after "
                                        f"waiting {timeout} s (held by: {holders}); raise buffer_count or release "
                                        "buffers sooner")
                self._cond.wait(left)
            return self._take(owner)

    def _take(self, owner) -> PoolBuffer:
        buf = self._free.pop()
        buf.owner = owner or "?"
        self.acquired_total += 1
        self.peak_in_use = max(self.peak_in_use, self.count - len(self._free))
        return buf

    def release(self, buf: PoolBuffer) -> None:
        """Give a buffer back. Releasing twice, or a buffer of another pool, is an error."""
        if not isinstance(buf, PoolBuffer) or buf._pool is not self:
            raise ValueError(f"BufferPool.release: {buf!r} does not belong to this pool")
        with self._cond:
            if buf.owner is None:
                raise ValueError(f"BufferPool.release: buffer #{buf.index} was released twice")
            buf.owner = None
            self._free.append(buf)
            self._cond.notify()

    @contextmanager
    def borrow(self, owner: str | None = None, timeout: float | None = None):
        """`with pool.borrow() as buf:` acquire, and release however the block ends."""
        buf = self.acquire(owner, timeout)
        try:
            yield buf
        finally:
            self.release(buf)

    def __repr__(self) -> str:
        return f"BufferPool({self.count} x {self.size} B, {self.in_use} in use, peak {self.peak_in_use})"
