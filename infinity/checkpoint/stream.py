"""Chunk files through AsyncIO: write values + CRC-32C, verify a chunk in bounded pieces, read a byte range.

Writes go straight from the caller's tensor (a pool buffer or the optimizer's
RAM state): nothing is copied on the way except by the native handle's
bounce buffer for memory that is not O_DIRECT-aligned.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from infinity._native_loader import native
from infinity.checkpoint.layout import CheckpointCorruptionError, CheckpointError
from infinity.io import AsyncIO, aligned_empty
from infinity.swap.checksum import crc32c

PIECE = 8 << 20  # bytes per verification read; two of them are the whole staging memory


def open_io(cfg, directory: str) -> AsyncIO:
    """An AsyncIO with the config's aio settings, O_DIRECT only where `directory`'s filesystem has it."""
    aio = cfg.aio
    direct = cfg.infinity.direct_io and native is not None and native.direct_alignment(directory) != 0
    return AsyncIO(backend=aio.backend, block_size=aio.block_size, queue_depth=aio.queue_depth,
                   threads=aio.intra_op_parallelism, direct=direct, single_submit=aio.single_submit,
                   overlap_events=aio.overlap_events)


class ChunkWriter:
    """Submit chunk writes; `wait()` raises the first error. The caller keeps each tensor alive until then."""

    def __init__(self, io: AsyncIO):
        self.io = io
        self.futures = []
        self.bytes = 0

    def write(self, path: str, values: torch.Tensor) -> None:
        """path := values' bytes, then their CRC-32C (little endian); the data write runs while the CRC is taken."""
        if values.device.type != "cpu" or not values.is_contiguous():
            raise ValueError(f"ChunkWriter.write({path}): needs a contiguous CPU tensor")
        nbytes = values.numel() * values.element_size()
        if nbytes:
            self.futures.append(self.io.pwrite(values, path, 0, nbytes=nbytes))
        trailer = np.array([crc32c(values, nbytes)], dtype="<u4")
        self.futures.append(self.io.pwrite(trailer, path, nbytes))
        self.bytes += nbytes + 4

    def wait(self) -> None:
        futures, self.futures = self.futures, []
        first = None
        for f in futures:
            try:
                f.wait()
            except BaseException as exc:  # noqa: BLE001 - every write must land or fail before we go on
                first = first or exc
        if first is not None:
            raise first


class ChunkReader:
    """Verify whole chunk files against their CRC-32C, and read byte ranges of them."""

    def __init__(self, io: AsyncIO):
        self.io = io
        self._stage = [aligned_empty(PIECE, pin=False), aligned_empty(PIECE, pin=False)]
        self.bytes = 0

    @staticmethod
    def check_size(path: str, nbytes: int, what: str) -> None:
        try:
            size = os.stat(path).st_size
        except FileNotFoundError:
            raise CheckpointError(f"checkpoint is partial: chunk file {path} of {what} is missing") from None
        if size != nbytes + 4:
            raise CheckpointError(f"checkpoint is partial: chunk file {path} of {what} has {size} bytes, "
                                  f"expected {nbytes + 4} ({nbytes} of values + 4 of CRC-32C)")

    def verify(self, path: str, nbytes: int, what: str) -> None:
        """Read the chunk in PIECE-sized pieces (two in flight) and compare the CRC-32C with its trailer."""
        self.check_size(path, nbytes, what)
        trailer = np.zeros(1, dtype="<u4")
        tail = self.io.pread(trailer, path, nbytes)
        crc, off, k = 0, 0, 0
        pending = self.io.pread(self._stage[0], path, 0, nbytes=min(PIECE, nbytes)) if nbytes else None
        while pending is not None:
            n = min(PIECE, nbytes - off)
            pending.wait()
            buf = self._stage[k % 2]
            nxt = off + n
            pending = (self.io.pread(self._stage[(k + 1) % 2], path, nxt, nbytes=min(PIECE, nbytes - nxt))
                       if nxt < nbytes else None)
            crc = crc32c(buf, n, crc)
            off, k = nxt, k + 1
        tail.wait()
        self.bytes += nbytes + 4
        if crc != int(trailer[0]):
            raise CheckpointCorruptionError(path, what, int(trailer[0]), crc)

    def read_into(self, dest: torch.Tensor, path: str, offset: int):
        """Start reading dest's bytes from `path` at `offset`; returns the future."""
        nbytes = dest.numel() * dest.element_size()
        self.bytes += nbytes
        return self.io.pread(dest, path, offset, nbytes=nbytes)


def crc_of_chunk_file(path: str) -> tuple[int, int]:
    """(stored CRC, CRC of the values) of one chunk file, read with plain reads (for `info --verify`/tests)."""
    with open(path, "rb") as f:
        data = f.read()
    if len(data) < 4:
        raise CheckpointError(f"chunk file {path} has {len(data)} bytes; too short for its CRC-32C")
    body = torch.frombuffer(bytearray(data[:-4]), dtype=torch.uint8) if len(data) > 4 else torch.empty(0)
    return int.from_bytes(data[-4:], "little"), crc32c(body, len(data) - 4)
