"""File surgery for the corruption tests."""

from __future__ import annotations

import os


def flip_bit(path: str | os.PathLike, offset: int, mask: int = 0x10) -> None:
    """XOR the byte at `offset` of the file at `path` with `mask`, in place (a silent bit flip on disk)."""
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ mask]))
