"""TensorSwapper over several directories ([Note: several NVMe paths] in infinity/swap/swapper.py): striping,
its checksums, its failure paths, and leftovers of another layout."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

import infinity.swap.swapper as swapper_module
from infinity.errors import SwapCorruptionError
from infinity.io import AsyncIO
from infinity.swap import BufferPool, TensorSwapper
from infinity.testing.files import flip_bit


@pytest.fixture
def small_stripes(monkeypatch):
    monkeypatch.setattr(swapper_module, "MIN_STRIPE", 4096)


def _swapper(tmp_path, disks=2, **kw):
    aios = [AsyncIO() for _ in range(disks)]
    sw = TensorSwapper([tmp_path / f"d{k}" for k in range(disks)], BufferPool(2, 1 << 20), aios, **kw)
    return sw, aios


def _close(sw, aios):
    sw.close()
    for a in aios:
        a.close()


def test_a_striped_partition_is_a_chunk_per_disk_and_reads_back(tmp_path, small_stripes):
    sw, aios = _swapper(tmp_path, 3)
    try:
        x = torch.randn(10_000)  # 40,000 bytes: three chunks of 16 KiB, 16 KiB and the rest
        sw.swap_out("x", x.clone()).wait()
        ext = sw.extents("x")
        assert [n for *_, n in ext] == [16384, 16384, 40000 - 32768]
        assert len({Path(path).parents[2].name for _, path, *_ in ext}) == 3, "one chunk on each disk"
        assert torch.equal(sw.swap_in("x").wait(), x)
        sw.release("x")  # the read's buffer
        sw.remove("x")
        assert not list(tmp_path.rglob("*.swp")), "remove deletes every chunk"
    finally:
        _close(sw, aios)


def test_a_failed_chunk_submission_waits_for_the_chunks_already_reading_before_the_buffer_goes_back(
        tmp_path, small_stripes):
    sw, aios = _swapper(tmp_path)
    events = []
    try:
        sw.swap_out("x", torch.randn(10_000)).wait()
        real_pread = aios[0].pread

        class Watched:
            def __init__(self, fut):
                self.fut = fut

            def wait(self):
                events.append("chunk 0 waited")
                return self.fut.wait()

        def first(*a, **k):
            return Watched(real_pread(*a, **k))

        def second(*a, **k):
            raise OSError(24, "Too many open files")

        real_release = sw.pool.release

        def release(buf):
            events.append("buffer released")
            return real_release(buf)

        disk_of_first = sw._directory_of("x")
        handles = {disk_of_first: first, 1 - disk_of_first: second}
        for k, a in enumerate(aios):
            a.pread = handles[k]
        sw.pool.release = release
        with pytest.raises(OSError, match="Too many open files"):
            sw.swap_in("x")
        assert events == ["chunk 0 waited", "buffer released"]
    finally:
        for k, a in enumerate(aios):
            a.__dict__.pop("pread", None)
        sw.pool.__dict__.pop("release", None)
        _close(sw, aios)


def test_a_zero_byte_partition_reads_back(tmp_path):
    sw, aios = _swapper(tmp_path)
    try:
        sw.swap_out("z", torch.empty(0)).wait()
        assert sw.swap_in("z").wait().numel() == 0
    finally:
        _close(sw, aios)


def test_a_flipped_byte_in_a_later_chunk_names_every_chunk_file(tmp_path, small_stripes):
    sw, aios = _swapper(tmp_path)
    try:
        sw.swap_out("x", torch.randn(10_000)).wait()
        _, path, offset, _, _ = sw.extents("x")[1]
        flip_bit(path, offset + 5, 1)
        with pytest.raises(SwapCorruptionError) as info:
            sw.swap_in("x").wait()
        assert path in str(info.value) and sw.path_of("x") in str(info.value)
    finally:
        _close(sw, aios)


def test_leftovers_striped_over_another_number_of_disks_are_not_reused(tmp_path, small_stripes):
    """A crashed run's files record how many disks they were striped over; a run with another number does
    not read them as its own (they would be read with the wrong layout), and "clear" removes them later."""
    sw, aios = _swapper(tmp_path, 2, leftovers="reuse")
    sw.swap_out("x", torch.randn(10_000)).wait()
    sw.flush()
    for lock in sw._owners:  # a crash: the locks go, the files stay
        lock.release()
    swapper_module._CLAIMED.clear()
    sw._closed = True
    for a in aios:
        a.close()
    aios = [AsyncIO() for _ in range(3)]
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        sw3 = TensorSwapper([tmp_path / f"d{k}" for k in range(3)], BufferPool(2, 1 << 20), aios, leftovers="reuse")
    try:
        assert "x" not in sw3.registry
        assert any("reusing 0 of" in str(w.message) for w in seen), [str(w.message) for w in seen]
    finally:
        _close(sw3, aios)
