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

PIECE = 4 << 20  # bytes per verification read
DEPTH = 4  # verification reads in flight; PIECE x DEPTH is all the staging memory


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
        self._stage = [aligned_empty(PIECE, pin=False) for _ in range(DEPTH)]
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
        trailers = np.zeros(len(chunks), dtype="<u4")
        tails = [self.io.pread(trailers[i:i + 1], path, n) for i, (path, n, _) in enumerate(chunks)]
        crcs = [0] * len(chunks)
        inflight = []
        for k in range(min(DEPTH, len(pieces))):
            inflight.append(self._read_piece(chunks, pieces[k], k))
        for k, (i, off, n) in enumerate(pieces):
            inflight.pop(0).wait()
            crcs[i] = crc32c(self._stage[k % DEPTH], n, crcs[i])
            if k + DEPTH < len(pieces):
                inflight.append(self._read_piece(chunks, pieces[k + DEPTH], k + DEPTH))
        for t in tails:
            t.wait()
        for (path, n, what), crc, stored in zip(chunks, crcs, trailers.tolist()):
            self.bytes += n + 4
            if crc != stored:
                raise CheckpointCorruptionError(path, what, stored, crc)

    def _read_piece(self, chunks, piece, k):
        i, off, n = piece
        return self.io.pread(self._stage[k % DEPTH], chunks[i][0], off, nbytes=n)

    def read_into(self, dest: torch.Tensor, path: str, offset: int):
        """Start reading dest's bytes from `path` at `offset`; returns the future."""
        nbytes = dest.numel() * dest.element_size()
        self.bytes += nbytes
        return self.io.pread(dest, path, offset, nbytes=nbytes)
