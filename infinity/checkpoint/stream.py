"""Chunk files through AsyncIO: write values + CRC-32C, verify a chunk in bounded pieces, read a byte range.

Writes go straight from the caller's tensor (a pool buffer or the optimizer's
RAM state): nothing is copied on the way except by the native handle's
bounce buffer for memory that is not O_DIRECT-aligned.
"""

from __future__ import annotations

import collections
import os

import numpy as np
import torch

from infinity.checkpoint.layout import CheckpointCorruptionError, CheckpointError
from infinity.io import AsyncIO, aligned_empty
from infinity.io.checksum import crc32c, crc32c_combine
from infinity.swap.tier import HOST

PIECE = 4 << 20  # bytes per verification read
DEPTH = 4  # verification reads in flight; PIECE x DEPTH is all the staging memory


def open_io(cfg, directory: str) -> AsyncIO:
    """An AsyncIO with the config's aio settings, O_DIRECT only where `directory`'s filesystem has it."""
    return AsyncIO.from_config(cfg, directory)


MAX_IN_FLIGHT = 64  # requests; the native handle holds a file open per request until it completes


class Window:
    """Submitted requests, at most MAX_IN_FLIGHT at a time (each holds file descriptors until done).

    `finish()` waits for every request, even after one has failed, and then
    raises the first error: a caller may reuse or release the memory those
    requests read or wrote only once finish() has returned or raised.
    `wait_upto(mark())` does the same for the requests submitted before the mark.
    """

    def __init__(self):
        self.futures = collections.deque()
        self.first = None
        self.submitted = 0
        self.settled = 0

    def add(self, submit) -> None:
        while len(self.futures) >= MAX_IN_FLIGHT:
            self._settle()
        self.futures.append(submit())
        self.submitted += 1

    def _settle(self) -> None:
        f = self.futures.popleft()
        self.settled += 1
        try:
            f.wait()
        except BaseException as exc:  # noqa: BLE001 - the first error is raised by finish()
            self.first = self.first or exc

    def mark(self) -> int:
        return self.submitted

    def wait_upto(self, mark: int) -> None:
        while self.settled < mark:
            self._settle()
        first, self.first = self.first, None
        if first is not None:
            raise first

    def finish(self) -> None:
        self.wait_upto(self.submitted)

    def finish_quietly(self) -> None:
        """finish() while another error is being raised (that one is the error that counts)."""
        try:
            self.finish()
        except BaseException:  # noqa: BLE001
            pass


class ChunkWriter(Window):
    """Chunk writes through a Window; the caller keeps each tensor alive until finish() returns or raises."""

    def __init__(self, io: AsyncIO):
        super().__init__()
        self.io = io
        self._crc: dict[str, tuple[int, int]] = {}  # a chunk written in pieces: (CRC-32C so far, bytes so far)

    def write_piece(self, path: str, values: torch.Tensor, *, last: bool) -> None:
        """The next piece of a chunk written in order, a piece at a time (a shard split over sub-groups: [Note:
        a large shard is split over sub-groups of its own] in engine/optimizer.py); after the last, the CRC-32C
        of them all, as write() leaves it."""
        if values.device != HOST or not values.is_contiguous():
            raise ValueError(f"ChunkWriter.write_piece({path}): needs a contiguous CPU tensor")
        nbytes = values.numel() * values.element_size()
        crc, at = self._crc.pop(path, (0, 0))
        if nbytes:
            self.add(lambda: self.io.pwrite(values, path, at, nbytes=nbytes))
        crc, at = crc32c_combine(crc, crc32c(values, nbytes), nbytes), at + nbytes
        if not last:
            self._crc[path] = (crc, at)
            return
        trailer = np.array([crc], dtype="<u4")
        self.add(lambda: self.io.pwrite(trailer, path, at))

    def write(self, path: str, values: torch.Tensor) -> None:
        """path := values' bytes, then their CRC-32C (little endian); the data write runs while the CRC is taken."""
        if values.device != HOST or not values.is_contiguous():
            raise ValueError(f"ChunkWriter.write({path}): needs a contiguous CPU tensor")
        nbytes = values.numel() * values.element_size()
        if nbytes:
            self.add(lambda: self.io.pwrite(values, path, 0, nbytes=nbytes))
        trailer = np.array([crc32c(values, nbytes)], dtype="<u4")
        self.add(lambda: self.io.pwrite(trailer, path, nbytes))


class ChunkReader:
    """Verify whole chunk files against their CRC-32C, and read byte ranges of them."""

    def __init__(self, io: AsyncIO):
        self.io = io
        self._stage = [aligned_empty(PIECE, pin=False) for _ in range(DEPTH)]

    @staticmethod
    def check_size(path: str, nbytes: int, what: str) -> None:
        try:
            size = os.stat(path).st_size
        except FileNotFoundError:
            raise CheckpointError(f"checkpoint is partial: chunk file {path} of {what} is missing") from None
        if size != nbytes + 4:
            raise CheckpointError(f"checkpoint is partial: chunk file {path} of {what} has {size} bytes, "
                                  f"expected {nbytes + 4} ({nbytes} of values + 4 of CRC-32C)")

    def verify(self, chunks) -> None:
        """Check chunk files [(path, value bytes, what)] against their stored CRC-32C.

        The files are read as one stream of pieces of at most PIECE bytes,
        DEPTH of them in flight across file boundaries (small chunks would
        otherwise each cost a round trip), and CRC'd in order.
        """
        chunks = list(chunks)
        for path, nbytes, what in chunks:
            self.check_size(path, nbytes, what)
        pieces = [(i, off, min(PIECE, n - off)) for i, (_, n, _) in enumerate(chunks) for off in range(0, n, PIECE)]
        crcs = [0] * len(chunks)
        window = Window()
        try:
            for k in range(min(DEPTH, len(pieces))):
                window.add(self._reader(chunks, pieces[k], k))
            for k, (i, off, n) in enumerate(pieces):
                window.futures.popleft().wait()
                window.settled += 1
                crcs[i] = crc32c(self._stage[k % DEPTH], n, crcs[i])
                if k + DEPTH < len(pieces):
                    window.add(self._reader(chunks, pieces[k + DEPTH], k + DEPTH))
        finally:
            window.finish()
        for (path, n, what), crc in zip(chunks, crcs):
            stored = _trailer(path, n)
            if crc != stored:
                raise CheckpointCorruptionError(path, what, stored, crc)

    def _reader(self, chunks, piece, k):
        i, off, n = piece
        return lambda: self.io.pread(self._stage[k % DEPTH], chunks[i][0], off, nbytes=n)

    def read_into(self, window: Window, dest: torch.Tensor, path: str, offset: int) -> None:
        """Queue a read of dest's bytes from `path` at `offset` on `window`."""
        nbytes = dest.numel() * dest.element_size()
        window.add(lambda: self.io.pread(dest, path, offset, nbytes=nbytes))


def _trailer(path: str, nbytes: int) -> int:
    """The CRC-32C stored after a chunk's values (a plain 4-byte read)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        data = os.pread(fd, 4, nbytes)
    finally:
        os.close(fd)
    if len(data) != 4:
        raise CheckpointError(f"checkpoint is partial: chunk file {path} ends before its CRC-32C")
    return int.from_bytes(data, "little")
