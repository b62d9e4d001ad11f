"""Injected EIO, short and empty transfers are propagated, never reported as success."""

import errno
import os
import subprocess
import sys

import numpy as np
import pytest

from infinity.io import AsyncIO

BLOCK = 64 << 10


@pytest.fixture
def data(disk_dir):
    src = np.random.default_rng(7).integers(0, 256, 16 * BLOCK, dtype=np.uint8)
    path = disk_dir / "d.bin"
    path.write_bytes(src.tobytes())
    return src, path


@pytest.mark.parametrize("op", ["read", "write"])
def test_eio_fails_only_its_request(native_backend, needs_native, data, op):
    """One of two concurrent requests gets EIO; the other completes with the right bytes."""
    src, path = data
    other = path.with_name("other.bin")
    other.write_bytes(src.tobytes())
    with AsyncIO(backend=native_backend, block_size=BLOCK, queue_depth=4) as h:
        needs_native.set_fault(5, "errno", errno.EIO)
        bufs = [np.zeros_like(src) if op == "read" else src.copy() for _ in range(2)]
        submit = h.pread if op == "read" else h.pwrite
        futs = [submit(bufs[0], path), submit(bufs[1], other)]
        outcomes = []
        for fut in futs:
            try:
                outcomes.append(fut.wait(timeout=30))
            except OSError as exc:
                outcomes.append(exc)
    errors = [o for o in outcomes if isinstance(o, OSError)]
    assert len(errors) == 1, outcomes
    e = errors[0]
    assert e.errno == errno.EIO and e.filename in (str(path), str(other))
    assert e.offset % BLOCK == 0 and 0 <= e.offset < src.size
    assert str(e).startswith(f"[Errno 5] {op} failed (Input/output error), at offset {e.offset}")
    ok = outcomes.index(src.size)
    if op == "read":
        assert np.array_equal(bufs[ok], src)


def test_short_read_is_completed_not_truncated(native_backend, needs_native, data):
    src, path = data
    dst = np.zeros_like(src)
    with AsyncIO(backend=native_backend, block_size=BLOCK, queue_depth=4) as h:
        needs_native.set_fault(3, "short")
        assert h.read(dst, path) == src.size
    assert np.array_equal(dst, src), "a short read must be resubmitted, not reported as done"


def test_short_write_is_completed_not_truncated(native_backend, needs_native, data):
    src, path = data
    new = src[::-1].copy()
    with AsyncIO(backend=native_backend, block_size=BLOCK, queue_depth=4) as h:
        needs_native.set_fault(2, "short")
        assert h.write(new, path) == src.size
    assert path.read_bytes() == new.tobytes()


def test_zero_byte_read_is_end_of_file_error(native_backend, needs_native, data):
    src, path = data
    with AsyncIO(backend=native_backend, block_size=BLOCK, queue_depth=4) as h:
        needs_native.set_fault(1, "zero")
        with pytest.raises(OSError) as ei:
            h.read(np.zeros_like(src), path)
    assert ei.value.errno == errno.ENODATA and ei.value.filename == str(path)
    assert "unexpected end of file" in str(ei.value)


def test_zero_byte_write_is_an_error(native_backend, needs_native, data):
    src, path = data
    with AsyncIO(backend=native_backend, block_size=BLOCK, queue_depth=4) as h:
        needs_native.set_fault(1, "zero")
        with pytest.raises(OSError, match=r"\[Errno 5\] write made no progress"):
            h.write(src, path)


@pytest.mark.slow
def test_fault_from_environment(native_backend, needs_native, data):
    _, path = data
    code = ("import numpy as np, sys\nfrom infinity.io import AsyncIO\n"
            f"h = AsyncIO(backend={native_backend!r}, block_size={BLOCK})\n"
            "try:\n    h.read(np.zeros(4 * %d, np.uint8), sys.argv[1])\n" % BLOCK +
            "except OSError as e:\n    print(e.errno, e.offset % " + str(BLOCK) + ")\n")
    env = dict(os.environ, INFINITY_IO_FAULT="2:errno:28")
    out = subprocess.run([sys.executable, "-c", code, str(path)], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["28", "0"]


def test_bad_fault_mode(needs_native):
    with pytest.raises(ValueError, match="fault mode must be errno, short or zero, got boom"):
        needs_native.set_fault(1, "boom")


def test_a_failed_checksummed_read_raises_its_error_not_a_checksum(native_backend, needs_native, data):
    src, path = data
    dst = np.zeros_like(src)
    with AsyncIO(backend=native_backend, block_size=BLOCK, queue_depth=4) as h:
        needs_native.set_fault(2, "errno", errno.EIO)
        fut = h.pread(dst, path, checksum=True)
        with pytest.raises(OSError, match=r"Input/output error"):
            fut.wait(timeout=30)
        with pytest.raises(OSError, match=r"Input/output error"):
            fut.crc32c()
