"""AsyncIO surface: futures, asyncio, aligned buffers, backend discovery."""

import asyncio
import os
import threading
import time

import numpy as np
import pytest
import torch

from infinity.io import AsyncIO, IOFuture, aligned_empty, available_backends, select_backend


def test_available_backends_lists_python_last():
    names = available_backends()
    assert names[-1] == "python"
    assert set(names) <= {"io_uring", "libaio", "threads", "python"}


def test_auto_picks_first_available():
    with AsyncIO() as h:
        assert h.backend == available_backends()[0]


def test_select_backend_probes_the_directory(disk_dir):
    assert select_backend(disk_dir) == available_backends()[0]
    assert not list(disk_dir.iterdir()), "the probe must remove its file"


def test_unknown_directory_in_select_backend(tmp_path):
    with pytest.raises(FileNotFoundError, match="select_backend: no such directory") as ei:
        select_backend(tmp_path / "missing")
    assert ei.value.filename == str(tmp_path / "missing")


@pytest.mark.parametrize("nbytes", [0, 1, 4095, 4096, 4097, 1 << 20])
@pytest.mark.parametrize("alignment", [64, 4096, 1 << 16])
def test_aligned_empty(nbytes, alignment):
    t = aligned_empty(nbytes, alignment, pin=False)
    assert t.dtype == torch.uint8 and t.numel() == nbytes and t.device.type == "cpu"
    if nbytes:
        assert t.data_ptr() % alignment == 0
        assert not t.any()
        t.fill_(7)  # writable
        assert int(t.sum()) == 7 * nbytes


def _thp_mode() -> str:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return "absent"


def _smaps_field(addr: int, field: str) -> int:
    """`field` of the /proc/self/smaps mapping that holds `addr`."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= addr < hi
            elif inside and head == field + ":":
                return int(line.split()[1])
    raise AssertionError(f"no {field} for {addr:#x}")


def test_large_aligned_buffers_ask_for_huge_pages(needs_native):
    # [Note: pool buffers on huge pages] in native/bindings.cpp: O_DIRECT pins one 2 MiB page per 1 MiB request
    # instead of 256 small ones. Whether the kernel then has a free huge page is its business; that the
    # buffer is 2 MiB aligned and eligible is ours.
    if _thp_mode() not in ("madvise", "always"):
        pytest.skip(f"transparent huge pages are {_thp_mode()} on this kernel")
    big = needs_native.AlignedBuffer(6 << 20, 4096)
    assert big.huge_pages and big.address % (2 << 20) == 0
    assert _smaps_field(big.address, "THPeligible") == 1
    small = needs_native.AlignedBuffer(1 << 20, 4096)
    assert not small.huge_pages and small.address % 4096 == 0


def test_aligned_empty_outlives_its_name():
    t = aligned_empty(1 << 20, pin=False)[4096:8192]
    import gc

    gc.collect()
    t.fill_(3)
    assert int(t.sum()) == 3 * 4096


@pytest.mark.parametrize("bad", [-1, 1.5, True])
def test_aligned_empty_bad_size(bad):
    with pytest.raises(ValueError, match="aligned_empty: nbytes must be an int >= 0"):
        aligned_empty(bad)


def test_aligned_empty_bad_alignment():
    with pytest.raises(ValueError, match="aligned_empty: alignment must be a power of two >= 8, got 3000"):
        aligned_empty(10, 3000)


def test_future_surface(backend, disk_dir):
    buf = aligned_empty(1 << 20, pin=False)
    buf.copy_(torch.arange(1 << 20).remainder(199).to(torch.uint8))
    with AsyncIO(backend=backend, block_size=1 << 16) as h:
        fut = h.pwrite(buf, disk_dir / "f.bin")
        assert isinstance(fut, IOFuture)
        assert fut.wait(timeout=30) == 1 << 20 and fut.done()
        assert fut.wait() == 1 << 20, "waiting twice returns the same result"
        assert "pwrite" in repr(fut) and "done" in repr(fut)
        back = aligned_empty(1 << 20, pin=False)
        futs = [h.pread(back[i:i + 4096], disk_dir / "f.bin", i) for i in range(0, 1 << 20, 4096)]
        assert h.wait_all() is None
        assert all(f.done() for f in futs)
        assert torch.equal(back, buf)
        assert h.bytes_written == 1 << 20 and h.bytes_read == 1 << 20


def test_wait_all_raises_an_unseen_error(native_backend, needs_native, disk_dir):
    with AsyncIO(backend=native_backend, block_size=4096) as h:
        needs_native.set_fault(1, "errno", 5)
        bad = h.pwrite(np.zeros(4 * 4096, np.uint8), disk_dir / "bad.bin")
        # Let it finish before anything else is queued, or the fault could
        # land on a later request's completion; done() does not report errors.
        while not bad.done():
            time.sleep(0.001)
        del bad  # nobody will ever wait on it
        for i in range(50):  # later submissions must not prune the failed one
            h.pwrite(np.zeros(10, np.uint8), disk_dir / f"ok{i}.bin").wait()
        with pytest.raises(OSError, match=r"\[Errno 5\] write failed") as ei:
            h.wait_all()
        assert ei.value.filename == str(disk_dir / "bad.bin")
        h.wait_all()  # reported once


def test_await_in_asyncio(backend, disk_dir):
    async def main():
        with AsyncIO(backend=backend) as h:
            src = np.arange(50000, dtype=np.int32)
            n = await h.pwrite(src, disk_dir / "a.bin")
            dst = np.zeros_like(src)
            got = await asyncio.gather(h.pread(dst[:25000], disk_dir / "a.bin", 0),
                                       h.pread(dst[25000:], disk_dir / "a.bin", 100000))
            return n, got, dst, src

    n, got, dst, src = asyncio.run(main())
    assert n == 200000 and got == [100000, 100000]
    assert np.array_equal(dst, src)


def test_dropped_future_keeps_buffer_alive(backend, disk_dir):
    with AsyncIO(backend=backend, block_size=4096, queue_depth=1) as h:
        for i in range(20):
            h.pwrite(np.full(1 << 16, i, np.uint8), disk_dir / f"d{i}.bin")  # future and buffer dropped
    for i in range(20):
        assert (disk_dir / f"d{i}.bin").read_bytes() == bytes([i]) * (1 << 16)


def test_buffered_mode(backend, disk_dir):
    with AsyncIO(backend=backend, direct=False) as h:
        assert h.direct is False
        src = np.arange(10007, dtype=np.uint8)
        h.write(src, disk_dir / "b.bin", 13)
        dst = np.zeros_like(src)
        h.read(dst, disk_dir / "b.bin", 13)
    assert np.array_equal(src, dst)


def _fds():
    """This process's open file descriptors: fd -> what it points at."""
    out = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            out[int(fd)] = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # the listing's own directory fd, closed by now
            pass
    return out


def _tasks():
    """This process's kernel threads (native workers included): tid -> name."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                out[int(tid)] = f.read().strip()
        except OSError:  # the thread ended while we looked
            pass
    return out


@pytest.mark.slow
def test_many_handle_lifetimes(native_backend, disk_dir):
    """100 handles, each with 2 workers, come and go: every one's I/O lands byte-exact, and closing
    them leaves no file descriptor and no thread behind."""
    # Unaligned head and tail around an aligned bulk: both the O_DIRECT and the buffered fd are used.
    n, off = 2 * 4096 + 123, 5
    with AsyncIO(backend=native_backend, queue_depth=2, threads=2) as h:  # first-use costs out of the count
        h.write(np.zeros(n, np.uint8), disk_dir / "warmup.bin", off)
    fds_before, tasks_before = _fds(), _tasks()
    py_threads_before = threading.active_count()

    # libaio's io_destroy waits for an RCU grace period (~35 ms), so 100 is plenty.
    written = []
    for i in range(100):
        src = np.random.default_rng(i).integers(0, 256, n, dtype=np.uint8)
        dst = np.zeros_like(src)
        with AsyncIO(backend=native_backend, queue_depth=2, threads=2) as h:
            assert h.write(src, disk_dir / f"l{i}.bin", off) == n
            assert h.read(dst, disk_dir / f"l{i}.bin", off) == n
            assert h.bytes_written == n and h.bytes_read == n, (i, h.bytes_written, h.bytes_read)
        assert h.closed
        assert np.array_equal(dst, src), f"handle {i} read back other bytes than it wrote"
        written.append(src)
    for i, src in enumerate(written):
        assert (disk_dir / f"l{i}.bin").read_bytes() == bytes(off) + src.tobytes(), f"file of handle {i}"

    # io_uring's io-wq threads leave a moment after their ring is freed, so allow the kernel that moment.
    deadline = time.monotonic() + 10
    while True:
        fds_after, tasks_after = _fds(), _tasks()
        if (len(fds_after) <= len(fds_before) and len(tasks_after) <= len(tasks_before)) or \
                time.monotonic() > deadline:
            break
        time.sleep(0.05)
    new_fds = {fd: what for fd, what in fds_after.items() if fds_before.get(fd) != what}
    new_tasks = {tid: name for tid, name in tasks_after.items() if tid not in tasks_before}
    assert len(fds_after) <= len(fds_before), f"file descriptors leaked by closed handles: {new_fds}"
    assert len(tasks_after) <= len(tasks_before), f"threads left running by closed handles: {new_tasks}"
    assert threading.active_count() <= py_threads_before, threading.enumerate()


def test_close_while_other_threads_submit(backend, disk_dir):
    """Every submission racing with close() is either refused or completed; nothing hangs."""
    h = AsyncIO(backend=backend, block_size=4096, queue_depth=2)
    futures, refused = [], []

    def submitter(k):
        for i in range(300):
            try:
                futures.append(h.pwrite(np.full(5000, k, np.uint8), disk_dir / f"r{k}.bin", i * 5000))
            except ValueError as exc:
                refused.append(str(exc))
                return

    threads = [threading.Thread(target=submitter, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    while len(futures) < 20 and any(t.is_alive() for t in threads):
        pass
    h.close()
    for t in threads:
        t.join(timeout=60)
        assert not t.is_alive(), f"submitter {t.name} still running 60 s after close()"
    assert all(f.done() for f in futures), "close() returned with requests still in flight"
    assert all(f.wait(timeout=0) == 5000 for f in futures)
    assert all("I/O handle is closed" in r for r in refused)


def test_infinite_timeout_means_forever(backend, disk_dir):
    with AsyncIO(backend=backend) as h:
        assert h.pwrite(np.zeros(100, np.uint8), disk_dir / "i.bin").wait(timeout=float("inf")) == 100
        assert h.pwrite(np.zeros(100, np.uint8), disk_dir / "i.bin").wait(timeout=1e300) == 100


@pytest.mark.parametrize("single_submit,overlap_events", [(False, True), (True, True), (False, False), (True, False)])
def test_submit_knobs_change_how_pieces_reach_the_kernel(native_backend, disk_dir, single_submit, overlap_events):
    # 64 pieces of 4 KiB through a queue 8 deep. single_submit hands the kernel one piece per call;
    # without overlap_events a batch of 8 goes out only into an empty queue, so 8 calls suffice.
    src = np.random.default_rng(3).integers(0, 256, 64 * 4096, dtype=np.uint8)
    dst = np.zeros_like(src)
    with AsyncIO(backend=native_backend, block_size=4096, queue_depth=8, single_submit=single_submit,
                 overlap_events=overlap_events) as h:
        h.write(src, disk_dir / "k.bin")
        writes = h.submit_calls
        h.read(dst, disk_dir / "k.bin")
        reads = h.submit_calls - writes
    assert np.array_equal(src, dst)
    for calls in (writes, reads):
        if single_submit or native_backend == "threads":  # threads: a blocking call per piece, always
            assert calls >= 64
        elif not overlap_events:
            assert 8 <= calls <= 12, calls
        else:
            assert 8 <= calls < 64, calls


def test_submit_knobs_must_be_bools():
    with pytest.raises(ValueError, match="single_submit must be True or False"):
        AsyncIO(single_submit="true")
    with pytest.raises(ValueError, match="overlap_events must be True or False"):
        AsyncIO(overlap_events=1)


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_native_handles_cache_their_fds_and_see_a_replaced_file(native_backend, disk_dir):
    """[Note: cached file descriptors]: one open per file however many requests, a file renamed over is read
    anew, a removed one is written anew, and close() leaves no fd open."""
    before = _open_fds()
    path = str(disk_dir / "cached.bin")
    a = torch.arange(16384, dtype=torch.int32)
    got = torch.zeros_like(a)
    with AsyncIO(backend=native_backend) as io:
        for _ in range(10):
            io.pwrite(a, path).wait()
            io.pread(got, path).wait()
        assert io.files_opened == 2 and io.fds_cached == 2  # one write fd, one read fd, for 20 requests
        assert torch.equal(got, a)
        b = a * 3
        b.numpy().tofile(str(disk_dir / "new.bin"))
        os.replace(disk_dir / "new.bin", path)
        io.pread(got, path).wait()
        assert torch.equal(got, b)
        os.unlink(path)
        io.pwrite(a, path).wait()
        assert os.path.getsize(path) == a.numel() * 4 and torch.equal(torch.from_file(path, size=a.numel(),
                                                                                      dtype=torch.int32), a)
    assert io.fds_cached == 0 and _open_fds() == before


def test_the_fd_cache_is_bounded_and_can_be_off(native_backend, disk_dir):
    a = torch.ones(1024, dtype=torch.int32)
    with AsyncIO(backend=native_backend, fd_cache=3) as io:
        for i in range(10):
            io.pwrite(a, str(disk_dir / f"f{i}")).wait()
        assert io.fds_cached == 3 and io.files_opened == 10
    with AsyncIO(backend=native_backend, fd_cache=0) as io:
        for _ in range(4):
            io.pwrite(a, str(disk_dir / "f0")).wait()
        assert io.fds_cached == 0 and io.files_opened == 4
    with pytest.raises(ValueError, match=r"AsyncIO: fd_cache must be in \[0, 65536\], got -1"):
        AsyncIO(backend=native_backend, fd_cache=-1)
