"""CRC-32C: the standard check value, chaining through the seed, and combining finished CRCs."""

import pytest
import torch

import infinity.io.checksum as checksum
from infinity.io.checksum import crc32c, crc32c_combine


def _bytes(n: int) -> torch.Tensor:
    return (torch.arange(n, dtype=torch.int64) * 2654435761 >> 13).to(torch.uint8)


@pytest.mark.parametrize("native", [True, False], ids=["native", "python"])
def test_check_value_seed_chaining_and_combine_agree(monkeypatch, native):
    if not native:
        monkeypatch.setattr(checksum, "native", None)
    elif checksum.native is None:
        pytest.skip("the native extension is not built")
    assert crc32c(torch.frombuffer(bytearray(b"123456789"), dtype=torch.uint8)) == 0xE3069283
    data = _bytes(30011 if native else 3001)  # the python table is slow
    n = data.numel()
    full = crc32c(data)
    for split in (0, 1, 7, n // 3, n - 1, n):
        a, b = data[:split], data[split:]
        crc_a, crc_b = crc32c(a, split), crc32c(b, n - split)
        assert crc32c(b, n - split, seed=crc_a) == full  # a stream, piece by piece
        assert crc32c_combine(crc_a, crc_b, n - split) == full  # two finished CRCs
    assert crc32c_combine(full, crc32c(data), n) != full


def test_python_combine_matches_the_native_one():
    if checksum.native is None:
        pytest.skip("the native extension is not built")
    for a, b, n in ((0, 0, 0), (0xDEADBEEF, 0x12345678, 1), (0xFFFFFFFF, 1, 4096), (7, 9, 123456789)):
        assert checksum.native.crc32c_combine(a, b, n) == _python_combine(a, b, n)


def _python_combine(a, b, n):
    saved = checksum.native
    try:
        checksum.native = None
        return crc32c_combine(a, b, n)
    finally:
        checksum.native = saved
