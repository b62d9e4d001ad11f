"""Byte sizes as people write them: 4096, 64KiB, 1MiB, 1GiB, 1G (= GiB)."""

from __future__ import annotations

import re

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1000, "kib": 1 << 10, "m": 1 << 20, "mb": 1000 ** 2,
          "mib": 1 << 20, "g": 1 << 30, "gb": 1000 ** 3, "gib": 1 << 30, "t": 1 << 40, "tb": 1000 ** 4,
          "tib": 1 << 40}


def parse_size(text: str | int, *, name: str = "size") -> int:
    """Parse '1GiB' -> 1073741824. Single letters (K, M, G, T) are binary, like fio."""
    if isinstance(text, int) and not isinstance(text, bool):
        return text
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"{name}: cannot read {text!r} as a size; write e.g. 4096, 64KiB, 1MiB or 1GiB")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def format_size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale}{unit}"
    return f"{n}B"


def parse_count(text: str, *, name: str = "count") -> int:
    """Parse a parameter count: '250M' -> 250_000_000 (K/M/G/B are powers of 1000)."""
    t = str(text).strip().upper()
    scale = {"K": 10 ** 3, "M": 10 ** 6, "G": 10 ** 9, "B": 10 ** 9}.get(t[-1:], 1)
    try:
        return int(float(t[:-1] if scale > 1 else t) * scale)
    except ValueError:
        raise ValueError(f"{name}: cannot read {t!r} as a parameter count; write e.g. 10M or 1000000") from None
