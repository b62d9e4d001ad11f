"""Registry: every partition that has a swap file, and where its bytes are right now.

[Note: residency transitions]
A partition whose home is NVMe moves ON_DISK -> READING -> IN_CPU -> WRITING
-> ON_DISK. A transition is a method that asserts the state it leaves and
sets the new state last, so a failed read or write leaves the partition in a
state that says what is true. Only IN_CPU and the in-flight states hold a
pool buffer; who holds it is the partition (`buffer`), and only the
transition that ends the holding (finish_write, or drop) gives it back.
"""

from __future__ import annotations

import enum
import threading
from dataclasses import dataclass

import torch


class Residency(enum.Enum):
    """Where a partition's bytes are right now, and what that costs."""

    ON_DISK = "on_disk"
    """Only in its swap file; costs no host memory."""
    READING = "reading"
    """A read into a pool buffer is in flight; costs one pool buffer."""
    IN_CPU = "in_cpu"
    """In a pool buffer, current; costs one pool buffer."""
    WRITING = "writing"
    """A write from its pool buffer is in flight; costs one pool buffer until it finishes."""


@dataclass(eq=False)
class Partition:
    """One flat partition of a parameter or of optimizer state, backed by one swap file."""

    id: str
    dtype: torch.dtype
    numel: int
    residency: Residency = Residency.ON_DISK
    buffer: object = None  # the PoolBuffer while READING/IN_CPU/WRITING
    dirty: bool = False  # IN_CPU bytes newer than the file (a write failed)
    tail_nbytes: int = 0
    """Bytes every write carries after the partition's own, from the same buffer, and no swap_in reads back: a
    write-only tail whose readers read and check slices of it themselves (see [Note: compute-dtype shards in
    the optimizer file] in engine/alias.py). The header's checksum covers only `nbytes`."""

    @property
    def nbytes(self) -> int:
        """What a swap_in reads and the header's checksum covers."""
        return self.numel * torch.empty(0, dtype=self.dtype).element_size()

    @property
    def write_nbytes(self) -> int:
        """What a swap_out writes: the partition and its tail."""
        return self.nbytes + self.tail_nbytes

    def _check(self, expected: tuple, new: Residency) -> None:
        if self.residency not in expected:
            want = " or ".join(r.name for r in expected)
            raise RuntimeError(f"partition {self.id}: cannot go to {new.name} from {self.residency.name} "
                               f"(expected {want}); see [Note: residency transitions]")

    def _move(self, expected: tuple, new: Residency) -> None:
        self._check(expected, new)
        self.residency = new

    def begin_read(self, buffer) -> None:
        self._check((Residency.ON_DISK,), Residency.READING)
        self.buffer = buffer
        self.residency = Residency.READING

    def finish_read(self) -> None:
        self._move((Residency.READING,), Residency.IN_CPU)

    def fail_read(self):
        """The read failed: back to ON_DISK (the file is unchanged); returns the buffer to release."""
        self._check((Residency.READING,), Residency.ON_DISK)
        buf, self.buffer = self.buffer, None
        self.residency = Residency.ON_DISK
        return buf

    def begin_write(self, buffer=None) -> None:
        """Start writing from `buffer` (or the one already held, when IN_CPU)."""
        self._check((Residency.IN_CPU, Residency.ON_DISK), Residency.WRITING)
        if buffer is not None:
            self.buffer = buffer
        self.residency = Residency.WRITING

    def finish_write(self):
        """The write is durable enough to drop the bytes: ON_DISK; returns the buffer to release."""
        self._check((Residency.WRITING,), Residency.ON_DISK)
        self.dirty = False
        buf, self.buffer = self.buffer, None
        self.residency = Residency.ON_DISK
        return buf

    def fail_write(self) -> None:
        """The write failed: the bytes are still valid in the buffer, so IN_CPU, and newer than the file."""
        self._move((Residency.WRITING,), Residency.IN_CPU)
        self.dirty = True

    def drop(self, *, discard: bool = False):
        """Forget the in-memory copy of a clean partition (the file is current); returns the buffer.

        A dirty partition (its last write failed) refuses, unless `discard`.
        """
        if self.dirty and not discard:
            raise RuntimeError(f"partition {self.id}: its in-memory bytes were never written (the last write "
                               "failed); swap_out again, or release with discard=True to lose them")
        self._check((Residency.IN_CPU,), Residency.ON_DISK)
        self.dirty = False
        buf, self.buffer = self.buffer, None
        self.residency = Residency.ON_DISK
        return buf


class Registry:
    """All partitions, by id. Thread-safe for registration and lookup."""

    def __init__(self):
        self._parts: dict[str, Partition] = {}
        self._lock = threading.Lock()

    def register(self, id: str, *, dtype: torch.dtype, numel: int, tail_nbytes: int = 0) -> Partition:
        if not isinstance(numel, int) or numel < 0:
            raise ValueError(f"Registry.register: numel must be an int >= 0, got {numel!r} (partition {id})")
        if not isinstance(tail_nbytes, int) or tail_nbytes < 0:
            raise ValueError(f"Registry.register: tail_nbytes must be an int >= 0, got {tail_nbytes!r} "
                             f"(partition {id})")
        part = Partition(id=id, dtype=dtype, numel=numel, tail_nbytes=tail_nbytes)
        with self._lock:
            if id in self._parts:
                raise ValueError(f"Registry.register: partition {id!r} is already registered")
            self._parts[id] = part
        return part

    def __getitem__(self, id: str) -> Partition:
        try:
            return self._parts[id]
        except KeyError:
            raise KeyError(f"no partition {id!r} is registered") from None

    def unregister(self, id: str) -> Partition:
        """Forget a partition that holds no buffer (ON_DISK)."""
        with self._lock:
            part = self[id]
            if part.buffer is not None:
                raise RuntimeError(f"Registry.unregister: partition {id!r} is {part.residency.name} and holds a "
                                   "pool buffer; release it first")
            return self._parts.pop(id)

    def __len__(self) -> int:
        return len(self._parts)

    def __contains__(self, id: str) -> bool:
        return id in self._parts

    def __iter__(self):
        return iter(list(self._parts.values()))

    def count_by_residency(self) -> dict[Residency, int]:
        out = {r: 0 for r in Residency}
        for p in self:
            out[p.residency] += 1
        return out
