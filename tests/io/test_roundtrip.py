"""Bytes written come back exactly, on every backend, at every awkward size and alignment."""

import os
import random
import threading

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from infinity.io import AsyncIO, aligned_empty

SIZES = [0, 1, 4095, 4096, 4097, (1 << 20) - 1, (1 << 20) + 1]


def _bytes(n, seed=0):
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def _misaligned(n, shift, seed=0):
    """A numpy array of n bytes whose address is `shift` bytes past a 4 KiB boundary."""
    raw = aligned_empty(n + 4096, pin=False).numpy()
    view = raw[shift:shift + n]
    view[:] = _bytes(n, seed)
    return view


@pytest.mark.slow
@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("offset", [0, 1, 4096, 4097 + 8192])
@pytest.mark.parametrize("shift", [0, 3])
def test_round_trip_sizes_offsets_alignment(backend, disk_dir, size, offset, shift):
    path = disk_dir / "f.bin"
    src = _misaligned(size, shift, seed=size + offset)
    dst = _misaligned(size, (shift * 7) % 64, seed=99)
    dst[:] = 0
    with AsyncIO(backend=backend, block_size=64 << 10, queue_depth=8) as h:
        assert h.pwrite(src, path, offset).wait() == size
        assert os.path.getsize(path) == (offset + size if size else 0)
        assert h.pread(dst, path, offset).wait() == size
    assert np.array_equal(src, dst)


@pytest.mark.slow
@pytest.mark.parametrize("shift", [0, 5])
def test_round_trip_64mib_plus_123(backend, disk_dir, shift):
    n = (64 << 20) + 123
    src = _misaligned(n, shift, seed=1)
    dst = _misaligned(n, 0)
    dst[:] = 0
    with AsyncIO(backend=backend, threads=2) as h:
        assert h.write(src, disk_dir / "big.bin", 4096 + shift) == n
        assert h.read(dst, disk_dir / "big.bin", 4096 + shift) == n
    assert np.array_equal(src, dst)


def test_write_into_existing_file_keeps_other_bytes(backend, disk_dir):
    path = disk_dir / "f.bin"
    base = _bytes(3 * 4096 + 10, seed=3)
    patch = _bytes(5000, seed=4)
    with AsyncIO(backend=backend) as h:
        h.write(base, path)
        h.write(patch, path, 2000)
        back = np.zeros_like(base)
        h.read(back, path)
    expect = base.copy()
    expect[2000:7000] = patch
    assert np.array_equal(back, expect)
    assert os.path.getsize(path) == base.size


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64])
def test_torch_tensors_of_any_dtype(backend, disk_dir, dtype):
    src = torch.randn(12345).to(dtype)
    dst = torch.zeros_like(src)
    with AsyncIO(backend=backend) as h:
        assert h.write(src, disk_dir / "t.bin") == src.numel() * src.element_size()
        h.read(dst, disk_dir / "t.bin")
    assert torch.equal(src, dst)


def test_bytes_bytearray_memoryview(backend, disk_dir):
    data = bytes(range(256)) * 33
    out = bytearray(len(data))
    with AsyncIO(backend=backend) as h:
        h.write(data, disk_dir / "b.bin")
        h.read(memoryview(out), disk_dir / "b.bin")
    assert bytes(out) == data


def test_nbytes_moves_a_prefix(backend, disk_dir):
    src = _bytes(10000)
    with AsyncIO(backend=backend) as h:
        assert h.write(src, disk_dir / "p.bin", nbytes=6000) == 6000
        assert os.path.getsize(disk_dir / "p.bin") == 6000
        dst = np.zeros(10000, np.uint8)
        assert h.read(dst, disk_dir / "p.bin", nbytes=6000) == 6000
    assert np.array_equal(dst[:6000], src[:6000]) and not dst[6000:].any()


def test_threads_share_one_handle(backend, disk_dir):
    """Eight Python threads write and read their own regions through one handle."""
    errors = []
    region = 3 * 4096 + 17
    with AsyncIO(backend=backend, block_size=8192, queue_depth=4, threads=2) as h:
        def worker(k):
            try:
                rng = np.random.default_rng(k)
                for i in range(25):
                    src = rng.integers(0, 256, region, dtype=np.uint8)
                    h.write(src, disk_dir / "shared.bin", k * region)
                    dst = np.empty_like(src)
                    h.read(dst, disk_dir / "shared.bin", k * region)
                    assert np.array_equal(src, dst), f"thread {k} iteration {i}"
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(k,)) for k in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert not errors, errors


FILE_SPAN = 1 << 20


@st.composite
def _batches(draw):
    """Rounds of non-overlapping writes, each followed by reads of random ranges."""
    rounds = []
    for _ in range(draw(st.integers(1, 3))):
        writes = []
        for _ in range(draw(st.integers(1, 120))):
            off = draw(st.integers(0, FILE_SPAN - 1))
            n = draw(st.integers(0, min(40000, FILE_SPAN - off)))
            if all(off + n <= o or o + m <= off for o, m, _ in writes):
                writes.append((off, n, draw(st.integers(0, 63))))
        reads = [(draw(st.integers(0, FILE_SPAN - 1)), draw(st.integers(0, 40000)), draw(st.integers(0, 63)))
                 for _ in range(draw(st.integers(1, 120)))]
        rounds.append((writes, reads))
    return rounds


@pytest.mark.slow
@pytest.mark.parametrize("queue_depth,threads", [(32, 1), (3, 2)])
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rounds=_batches(), seed=st.integers(0, 2 ** 31))
def test_many_requests_in_flight_match_memory_model(backend, disk_dir, queue_depth, threads, rounds, seed):
    """Hundreds of concurrent random reads/writes, checked byte-exact against an in-memory file."""
    path = disk_dir / f"model-{queue_depth}-{threads}.bin"
    if path.exists():
        path.unlink()
    model = bytearray()
    rng = random.Random(seed)
    with AsyncIO(backend=backend, block_size=16384, queue_depth=queue_depth, threads=threads) as h:
        for writes, reads in rounds:
            futs = []
            for off, n, shift in writes:
                buf = _misaligned(n, shift, seed=rng.randrange(1 << 30))
                futs.append((h.pwrite(buf, path, off), n, buf))
                if off + n > len(model) and n:
                    model.extend(bytes(off + n - len(model)))
                model[off:off + n] = buf.tobytes()
            for fut, n, _ in futs:
                assert fut.wait() == n
            assert os.path.getsize(path) == len(model)
            pending = []
            for off, n, shift in reads:
                n = max(0, min(n, len(model) - off))
                buf = _misaligned(n, shift)
                pending.append((h.pread(buf, path, off), off, n, buf))
            for fut, off, n, buf in pending:
                assert fut.wait() == n
                assert buf.tobytes() == bytes(model[off:off + n]), f"read [{off}, {off + n})"


@pytest.mark.parametrize("size", [0, 1, 4097, (1 << 20) + 1])
@pytest.mark.parametrize("shift", [0, 3])
def test_read_with_checksum_gives_the_crc_of_what_landed(backend, disk_dir, size, shift):
    """pread(checksum=True): the I/O thread takes the CRC-32C of the bytes it read (unaligned heads and tails,
    bounce copies included), the same number crc32c gives for the source."""
    from infinity.io.checksum import crc32c

    path = disk_dir / "c.bin"
    src = _misaligned(size, shift, seed=size)
    dst = _misaligned(size, (shift * 5) % 64)
    with AsyncIO(backend=backend, block_size=64 << 10, queue_depth=4) as h:
        h.write(src, path, 4096 + shift)
        fut = h.pread(dst, path, 4096 + shift, checksum=True)
        assert fut.wait() == size
        assert fut.crc32c() == crc32c(torch.from_numpy(src.copy())), "the checksum of the bytes read"
        plain = h.pread(dst, path, 4096 + shift)
        plain.wait()
        with pytest.raises(ValueError, match=r"not submitted with checksum=True"):
            plain.crc32c()
