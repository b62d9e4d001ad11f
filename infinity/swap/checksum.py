"""CRC-32C of a tensor's bytes (native SSE4.2 when built, zlib-free portable fallback otherwise)."""

from __future__ import annotations

import torch

from infinity._native_loader import native


def crc32c(t: torch.Tensor, nbytes: int | None = None, seed: int = 0) -> int:
    """CRC-32C of the first nbytes (default: all) bytes of a contiguous CPU tensor.

    `seed` is the CRC of the bytes before these, so a stream can be checked piece by piece.
    """
    n = t.numel() * t.element_size() if nbytes is None else nbytes
    if native is not None:
        return native.crc32c(t.data_ptr(), n, seed)
    table = _table()
    crc = seed ^ 0xFFFFFFFF
    for b in t.reshape(-1).view(torch.uint8)[:n].tolist():
        crc = (crc >> 8) ^ table[(crc ^ b) & 0xFF]
    return crc ^ 0xFFFFFFFF


_TABLE: list[int] = []


def _table() -> list[int]:
    if not _TABLE:
        for i in range(256):
            c = i
            for _ in range(8):
                c = (c >> 1) ^ (0x82F63B78 if c & 1 else 0)
            _TABLE.append(c)
    return _TABLE
