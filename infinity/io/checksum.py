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


def crc32c_combine(crc_a: int, crc_b: int, len_b: int) -> int:
    """crc32c(A + B) from crc32c(A), crc32c(B) (both from seed 0) and len(B), without the bytes (see [Note:
    combining finished CRCs] in native/cpu/crc32c.cpp)."""
    combine = getattr(native, "crc32c_combine", None)  # None without the extension (or with a stale build)
    if combine is not None:
        return combine(crc_a, crc_b, len_b)
    result, base = 0x80000000, 0x00800000  # x^0 and x^8 in the register's reflected order
    n = len_b
    while n:
        if n & 1:
            result = _gf2_mul(result, base)
        base = _gf2_mul(base, base)
        n >>= 1
    return _gf2_mul(crc_a, result) ^ crc_b


def _gf2_mul(a: int, b: int) -> int:
    prod = 0
    for _ in range(32):
        if a & 0x80000000:
            prod ^= b
        a = (a << 1) & 0xFFFFFFFF
        b = (b >> 1) ^ (0x82F63B78 if b & 1 else 0)
    return prod


_TABLE: list[int] = []


def _table() -> list[int]:
    if not _TABLE:
        for i in range(256):
            c = i
            for _ in range(8):
                c = (c >> 1) ^ (0x82F63B78 if c & 1 else 0)
            _TABLE.append(c)
    return _TABLE
