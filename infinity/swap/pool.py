"""BufferPool: count x size bytes of aligned (pinned when CUDA is present) host memory, lent as buffers.

It is the hard memory ceiling of the swap service: all of its memory is
reserved once, up front, and nothing is ever allocated past it (its pages
become resident as buffers are first written: `aligned_empty`). A request it
cannot serve waits (back-pressure); a prefetcher uses `try_acquire` so that it
never holds a buffer the critical path is waiting for.
"""

from __future__ import annotations

import bisect
import threading
import time
from contextlib import contextmanager

import torch

from infinity.errors import PoolExhausted  # noqa: F401 - raised here, defined there
from infinity.io import aligned_empty


class PoolBuffer:
    """One buffer lent by the pool. `tensor` is a uint8 view of its bytes; `view(dtype, numel)` types it."""

    __slots__ = ("index", "tensor", "owner", "_pool", "_start", "_span")

    def __init__(self, pool: "BufferPool", index: int, tensor: torch.Tensor, start: int, span: int):
        self._pool = pool
        self.index = index
        self.tensor = tensor
        self.owner: str | None = None  # who borrowed it, for diagnostics
        self._start, self._span = start, span  # the pool's bytes [start, start + span) it holds

    def view(self, dtype: torch.dtype, numel: int) -> torch.Tensor:
        """The first numel elements of the buffer as `dtype` (no copy)."""
        nbytes = numel * torch.empty(0, dtype=dtype).element_size()
        if nbytes > self.tensor.numel():
            raise ValueError(f"PoolBuffer.view: {numel} x {dtype} needs {nbytes} bytes but this pool buffer has "
                             f"{self.tensor.numel()}; raise the buffer size, or acquire it with nbytes")
        return self.tensor[:nbytes].view(dtype)

    def release(self) -> None:
        self._pool.release(self)

    def __repr__(self) -> str:
        return f"PoolBuffer(#{self.index}, {self.tensor.numel()} B, owner={self.owner!r})"


# [Note: a pool of full-size slots lends smaller buffers]
# The pool is `count` slots of `size` bytes, in one allocation. In a `sized` pool a buffer is a full slot
# unless its taker asks for fewer bytes (`nbytes`): then it is just those bytes (rounded up to the alignment),
# cut from the free space best-fit, and freed space merges with its neighbours. The parameter pool needs this: its slot is
# the largest shard (at gpt-125m the tied embedding, 38.6M parameters, 77 MB in bf16), and with one shard per
# slot its 5 slots held 5 shards of any size, so prefetch and the stepped shards' copies ([Note: stepped
# shards are staged] in engine/deferred.py) ran out of buffers with 90 % of the pool's bytes unused. Sized,
# the same bytes hold dozens of a block's 5 MB shards. The counts keep their meaning in slots: `free_count`
# is how many full-size buffers could still be lent, and `reserve` (a prefetcher's 1) leaves that many free
# after a `try_acquire`, so the critical path, which takes at most a slot at a time, is never starved.
# The optimizer's pool is not sized: its pipeline counts buffers held ([Note: one pipeline]), and a sub-group
# smaller than the slot cut from a slot's bytes could leave the largest group no whole slot to be read into.


class BufferPool:
    """`count` slots of `size` bytes, carved from one aligned allocation: a full slot per buffer, or the bytes a
    taker asks for (see the note above)."""

    def __init__(self, count: int, size: int, *, alignment: int = 4096, pin: bool | None = None,
                 sized: bool = False):
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(f"BufferPool: count must be an int >= 1, got {count!r}")
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"BufferPool: size must be an int >= 1, got {size!r}")
        # Round each slot up to the alignment so every buffer starts aligned
        # (O_DIRECT needs it) while the pool stays one allocation to pin.
        self.count = count
        self.sized = sized
        """A buffer asked for with `nbytes` takes just those bytes; otherwise every buffer is a full slot."""
        self._alignment, self._pin = alignment, pin
        self._carve(size)
        self._held: dict[int, PoolBuffer] = {}  # start byte -> the buffer lent there
        self._lent = 0  # buffers lent so far: their index
        self._cond = threading.Condition()
        self.acquired_total = 0
        self.peak_in_use = 0
        """The most slots ever unavailable at once (count - free_count): buffers held, for fixed-size use."""

    def _carve(self, size: int) -> None:
        self.size = size
        self.stride = -(-size // self._alignment) * self._alignment
        self._memory = aligned_empty(self.stride * self.count, self._alignment, pin=self._pin)
        self._free: list[list[int]] = [[0, self.stride * self.count]]  # [start, length], by start, merged

    def shrink(self, size: int) -> None:
        """Make every slot `size` bytes (no larger than now), in a new allocation; the old one is freed.

        For a pool sized for one phase and then used for a smaller one (the parameter pool holds fp32 shards
        while the model is built and compute-dtype shards after). Every buffer must be free: a held view would
        keep the old memory alive, and its holder would be writing into memory no longer the pool's.
        """
        if isinstance(size, bool) or not isinstance(size, int) or not 1 <= size <= self.size:
            raise ValueError(f"BufferPool.shrink: size must be an int in [1, {self.size}], got {size!r}")
        with self._cond:
            if self._held:
                raise RuntimeError(f"BufferPool.shrink: {len(self._held)} buffer(s) are in use (held by: "
                                   f"{self._holders()}); release them first")
            if size == self.size:
                return
            self._memory = None  # the old allocation is freed before the new one is made
            self._carve(size)

    def prefault(self) -> None:
        """Make every page of the pool resident (it is mapped lazily, see aligned_empty): for a measurement
        that counts the pool as memory already held, not as growth when a buffer is first written."""
        with self._cond:
            for start, length in self._free:
                self._memory[start:start + length].fill_(0)

    @property
    def nbytes(self) -> int:
        """Host memory the pool holds (its whole budget, allocated up front)."""
        return self._memory.numel()

    @property
    def free_count(self) -> int:
        """How many full-size buffers could be lent now."""
        with self._cond:
            return self._slots_free()

    @property
    def in_use(self) -> int:
        """Buffers lent and not yet released."""
        with self._cond:
            return len(self._held)

    def try_acquire(self, owner: str | None = None, *, reserve: int = 0, nbytes: int | None = None) -> \
            PoolBuffer | None:
        """A free buffer (a full slot, or `nbytes`), or None at once if taking it would leave fewer than
        `reserve` full slots free (what prefetchers use).

        A prefetcher passes reserve=1 so that the critical path, which takes
        one buffer at a time, always finds one: it can never be starved.
        """
        need = self._need(nbytes)
        with self._cond:
            at = self._fit(need, reserve)
            return None if at is None else self._take(owner, at, need, nbytes)

    def acquire(self, owner: str | None = None, timeout: float | None = None, *, nbytes: int | None = None) -> \
            PoolBuffer:
        """A free buffer (a full slot, or `nbytes`), waiting for one to be released; PoolExhausted after
        `timeout` seconds."""
        need = self._need(nbytes)
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while (at := self._fit(need, 0)) is None:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    short = (f"all {self.count} buffers of {self.size} B are in use" if nbytes is None else
                             f"no {need} B are free in one piece among {self.count} buffers of {self.size} B")
                    raise PoolExhausted(f"BufferPool: {short} after waiting {timeout} s (held by: "
                                        f"{self._holders()}); raise buffer_count or release buffers sooner")
                self._cond.wait(left)
            return self._take(owner, at, need, nbytes)

    def _need(self, nbytes: int | None) -> int:
        """The bytes a buffer of `nbytes` (None: a full slot) takes from the pool."""
        if nbytes is None:
            return self.stride
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
            raise ValueError(f"BufferPool: nbytes must be an int >= 0, got {nbytes!r}")
        if nbytes > self.size:
            raise ValueError(f"BufferPool: a buffer of {nbytes} B does not fit this pool's {self.size}-byte buffers; "
                             "raise the buffer size")
        return max(1, -(-nbytes // self._alignment)) * self._alignment if self.sized else self.stride

    def _slots_free(self) -> int:
        return sum(length // self.stride for _, length in self._free)

    def _fit(self, need: int, reserve: int) -> int | None:
        """Index into _free of the extent to cut `need` bytes from (best fit: the fewest full slots lost, then
        the smallest extent), or None if none fits with `reserve` full slots left free."""
        slots = self._slots_free()
        best, key = None, None
        for k, (_, length) in enumerate(self._free):
            if length < need:
                continue
            lost = length // self.stride - (length - need) // self.stride
            if slots - lost < reserve:
                continue
            if key is None or (lost, length) < key:
                best, key = k, (lost, length)
        return best

    def _take(self, owner, k: int, need: int, nbytes: int | None) -> PoolBuffer:
        start, length = self._free[k]
        if length == need:
            del self._free[k]
        else:
            self._free[k] = [start + need, length - need]
        size = need if self.sized and nbytes is not None else self.size
        buf = PoolBuffer(self, self._lent, self._memory[start:start + size], start, need)
        self._lent += 1
        buf.owner = owner or "?"
        self._held[start] = buf
        self.acquired_total += 1
        self.peak_in_use = max(self.peak_in_use, self.count - self._slots_free())
        return buf

    def release(self, buf: PoolBuffer) -> None:
        """Give a buffer back. Releasing twice, or a buffer of another pool, is an error."""
        if not isinstance(buf, PoolBuffer) or buf._pool is not self:
            raise ValueError(f"BufferPool.release: {buf!r} does not belong to this pool")
        with self._cond:
            if buf.owner is None or self._held.get(buf._start) is not buf:
                raise ValueError(f"BufferPool.release: buffer #{buf.index} was released twice")
            buf.owner = None
            del self._held[buf._start]
            self._give_back(buf._start, buf._span)
            self._cond.notify_all()  # a waiter may need more than what one release frees

    def _give_back(self, start: int, span: int) -> None:
        """Return [start, start + span) to the free extents, merged with its neighbours."""
        k = bisect.bisect_left(self._free, [start, 0])
        if k > 0 and self._free[k - 1][0] + self._free[k - 1][1] == start:
            k -= 1
            self._free[k][1] += span
        else:
            self._free.insert(k, [start, span])
        if k + 1 < len(self._free) and self._free[k][0] + self._free[k][1] == self._free[k + 1][0]:
            self._free[k][1] += self._free.pop(k + 1)[1]

    def _holders(self) -> str:
        return ", ".join(sorted({str(b.owner) for b in self._held.values()}))

    @contextmanager
    def borrow(self, owner: str | None = None, timeout: float | None = None):
        """`with pool.borrow() as buf:` acquire, and release however the block ends."""
        buf = self.acquire(owner, timeout)
        try:
            yield buf
        finally:
            self.release(buf)

    def __repr__(self) -> str:
        return (f"BufferPool({self.count} x {self.size} B{', sized' if self.sized else ''}, {self.in_use} in use, "
                f"peak {self.peak_in_use})")
