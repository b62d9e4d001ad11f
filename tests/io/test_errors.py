"""Every failure is one clear exception with errno, path and offset, and nothing hangs."""

import errno
import os
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import torch

from infinity.io import AsyncIO


def test_missing_file_on_read(backend, disk_dir):
    path = disk_dir / "absent.bin"
    with AsyncIO(backend=backend) as h, pytest.raises(FileNotFoundError) as ei:
        h.pread(np.zeros(10, np.uint8), path, 7)
    e = ei.value
    assert (e.errno, e.filename, e.offset) == (errno.ENOENT, str(path), 7)
    assert str(e) == f"[Errno 2] cannot open for reading (No such file or directory), at offset 7: '{path}'"


def test_missing_directory_on_write(backend, disk_dir):
    path = disk_dir / "no" / "such" / "dir.bin"
    with AsyncIO(backend=backend) as h, pytest.raises(FileNotFoundError) as ei:
        h.pwrite(np.zeros(10, np.uint8), path)
    assert (ei.value.errno, ei.value.filename, ei.value.offset) == (errno.ENOENT, str(path), 0)
    assert "cannot open for writing" in str(ei.value)


def test_directory_instead_of_file(backend, disk_dir):
    with AsyncIO(backend=backend) as h, pytest.raises(IsADirectoryError) as ei:
        h.pwrite(np.zeros(10, np.uint8), disk_dir)
    assert ei.value.filename == str(disk_dir)


_NO_DAC = textwrap.dedent("""
    import ctypes, os, sys, platform
    # Running as root bypasses file permissions; drop CAP_DAC_OVERRIDE and
    # CAP_DAC_READ_SEARCH from this thread (threads started later inherit).
    if os.geteuid() == 0:
        assert platform.machine() == "x86_64"
        libc = ctypes.CDLL(None, use_errno=True)
        class Hdr(ctypes.Structure):
            _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]
        class Data(ctypes.Structure):
            _fields_ = [("eff", ctypes.c_uint32), ("perm", ctypes.c_uint32), ("inh", ctypes.c_uint32)]
        hdr, data = Hdr(0x20080522, 0), (Data * 2)()
        assert libc.syscall(125, ctypes.byref(hdr), data) == 0  # capget
        data[0].eff &= ~((1 << 1) | (1 << 2))
        assert libc.syscall(126, ctypes.byref(hdr), data) == 0  # capset
    import numpy as np
    from infinity.io import AsyncIO
    backend, path, op = sys.argv[1], sys.argv[2], sys.argv[3]
    with AsyncIO(backend=backend) as h:
        try:
            (h.pread if op == "read" else h.pwrite)(np.zeros(10, np.uint8), path, 4096)
        except PermissionError as e:
            print(e.errno, e.filename, e.offset, str(e))
""")


@pytest.mark.slow
@pytest.mark.parametrize("op", ["read", "write"])
def test_no_permission(backend, disk_dir, op):
    if os.geteuid() == 0 and os.uname().machine != "x86_64":
        pytest.skip("dropping root's file-permission capabilities is only wired for x86_64")
    path = disk_dir / "locked.bin"
    path.write_bytes(b"x" * 8192)
    path.chmod(0)
    out = subprocess.run([sys.executable, "-c", _NO_DAC, backend, str(path), op], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    verb = "reading" if op == "read" else "writing"
    assert out.stdout.strip() == (f"{errno.EACCES} {path} 4096 [Errno 13] cannot open for {verb} "
                                  f"(Permission denied), at offset 4096: '{path}'")


def test_read_past_end_of_file(backend, disk_dir):
    path = disk_dir / "short.bin"
    path.write_bytes(b"a" * 5000)
    with AsyncIO(backend=backend) as h, pytest.raises(OSError) as ei:
        h.pread(np.zeros(4096, np.uint8), path, 4000)
    e = ei.value
    assert (e.errno, e.filename, e.offset) == (errno.ENODATA, str(path), 4000)
    assert str(e) == (f"[Errno 61] read past end of file: the file has 5000 bytes, the request needs bytes "
                      f"[4000, 8096) (No data available), at offset 4000: '{path}'")


def test_bad_arguments_raise_value_error(backend, disk_dir):
    path = disk_dir / "a.bin"
    with AsyncIO(backend=backend) as h:
        with pytest.raises(ValueError, match=r"pwrite: offset must be >= 0, got -1 \(path .*a.bin\)"):
            h.pwrite(np.zeros(4, np.uint8), path, -1)
        with pytest.raises(ValueError, match=r"pread: buffer is read-only: pread needs a writable buffer"):
            h.pread(b"abcd", path)
        with pytest.raises(ValueError, match=r"pread: buffer too small: it has 4 bytes but nbytes=8 "
                                             r"\(path .*a.bin, offset 0\)"):
            h.pread(np.zeros(4, np.uint8), path, nbytes=8)
        with pytest.raises(ValueError, match=r"pwrite: buffer is not contiguous"):
            h.pwrite(np.zeros((4, 4), np.uint8)[:, 1], path)
        with pytest.raises(ValueError, match=r"pwrite: buf is not contiguous"):
            h.pwrite(torch.zeros(4, 4)[:, 1], path)
        with pytest.raises(ValueError, match=r"pwrite: buf must be a contiguous CPU torch.Tensor, a numpy "
                                             r"array or a buffer, got list"):
            h.pwrite([1, 2, 3], path)
        with pytest.raises(ValueError, match=r"pwrite: offset must be an int, got 1.5"):
            h.pwrite(np.zeros(4, np.uint8), path, 1.5)
        with pytest.raises(ValueError, match=r"pwrite: path must be a str or os.PathLike, got int"):
            h.pwrite(np.zeros(4, np.uint8), 3)
    assert not path.exists(), "a rejected request must not create the file"


@pytest.mark.parametrize("kwargs,message", [
    (dict(block_size=1000), r"AsyncIO: block_size must be in \[4096, 1073741824\], got 1000"),
    (dict(block_size=2 << 30), r"AsyncIO: block_size must be in \[4096, 1073741824\], got 2147483648"),
    (dict(block_size=6000), "AsyncIO: block_size must be a multiple of 4096, got 6000"),
    (dict(queue_depth=0), r"AsyncIO: queue_depth must be in \[1, 4096\], got 0"),
    (dict(threads=0), r"AsyncIO: threads must be in \[1, 256\], got 0"),
    (dict(direct="yes"), "AsyncIO: direct must be True or False, got 'yes'"),
    (dict(backend="spdk"), "AsyncIO: unknown backend 'spdk'; choose one of auto, io_uring, libaio"),
])
def test_bad_handle_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        AsyncIO(**kwargs)


def test_closed_handle(backend, disk_dir):
    h = AsyncIO(backend=backend)
    h.close()
    h.close()  # idempotent
    with pytest.raises(ValueError, match=r"pwrite: I/O handle is closed; create a new AsyncIO \(path .*x.bin\)"):
        h.pwrite(np.zeros(4, np.uint8), disk_dir / "x.bin")


def test_close_waits_for_requests_in_flight(backend, disk_dir):
    src = np.random.default_rng(0).integers(0, 256, 8 << 20, dtype=np.uint8)
    h = AsyncIO(backend=backend, block_size=64 << 10, queue_depth=4)
    fut = h.pwrite(src, disk_dir / "c.bin")
    h.close()
    assert fut.done() and fut.wait() == src.size
    assert (disk_dir / "c.bin").read_bytes() == src.tobytes()


def test_no_space_left(backend, tiny_fs):
    path = tiny_fs / "big.bin"
    src = np.ones(8 << 20, np.uint8)
    with AsyncIO(backend=backend, block_size=256 << 10) as h:
        fut = h.pwrite(src, path)
        with pytest.raises(OSError) as ei:
            fut.wait(timeout=60)
        # The handle stays usable after the failure.
        small = tiny_fs / "small.bin"
        h.forget(path)  # a cached fd would keep the removed file's blocks (see [Note: cached file descriptors])
        os.unlink(path)
        # io_uring drops its own file references a moment after completion, and the blocks are freed only
        # then: give the kernel up to 5 s to hand the space back.
        for _ in range(50):
            try:
                assert h.write(np.arange(100, dtype=np.uint8), small) == 100
                break
            except OSError as again:
                if again.errno != errno.ENOSPC:
                    raise
                time.sleep(0.1)
        else:
            raise AssertionError("the removed file's space never came back")
    e = ei.value
    assert e.errno == errno.ENOSPC and e.filename == str(path)
    assert 0 <= e.offset < src.size and e.offset % 4096 == 0
    assert str(e).startswith("[Errno 28] write failed (No space left on device), at offset ")


def test_a_path_with_a_nul_byte_is_refused_not_cut(backend, disk_dir):
    """open(2) would stop at the NUL and write to the file named by what comes before it."""
    cut = disk_dir / "a"
    with AsyncIO(backend=backend) as h:
        for op in (h.pwrite, h.pread):
            with pytest.raises(ValueError, match=r"(path contains a NUL byte|embedded null byte)"):
                op(np.zeros(4, np.uint8), f"{cut}\0b")
    assert not cut.exists(), "nothing may be written to the path cut at the NUL"


def test_checksum_is_for_reads_and_is_a_bool(backend, disk_dir):
    path = disk_dir / "a.bin"
    with AsyncIO(backend=backend) as h:
        with pytest.raises(ValueError, match=r"pread: checksum must be True or False, got 1 \(path .*a.bin\)"):
            h.pread(np.zeros(4, np.uint8), path, checksum=1)
        with pytest.raises(TypeError):
            h.pwrite(np.zeros(4, np.uint8), path, checksum=True)
    assert not path.exists(), "a rejected request must not create the file"


def test_a_file_removed_behind_the_handles_back_gives_its_space_back(native_backend, tiny_fs):
    """Probe finding 5: a cached fd kept a removed file's blocks until the handle closed, so on a full disk the
    next write failed with ENOSPC on io_uring, libaio and threads (a run rotating checkpoints fills the disk).
    The next open drops cached fds of files with no name left ([Note: cached fds never keep a deleted file])."""
    big, small = tiny_fs / "big.bin", tiny_fs / "small.bin"
    st = os.statvfs(tiny_fs)
    free = st.f_bavail * st.f_frsize // (64 << 10) * (64 << 10)
    with AsyncIO(backend=native_backend) as h:
        h.pwrite(np.ones(free * 3 // 4 // 4096 * 4096, np.uint8), big).wait(60)  # most of the free space
        os.unlink(big)  # by someone else: no forget()
        src = np.full(free // 2 // 4096 * 4096, 7, np.uint8)  # fits only once big's blocks are free
        for _ in range(50):  # io_uring drops its own file references a moment after completion
            try:
                h.pwrite(src, small).wait(60)
                break
            except OSError as exc:
                assert exc.errno == errno.ENOSPC
                time.sleep(0.1)
        else:
            pytest.fail("the removed file's blocks were never given back while the handle lived")
    assert small.read_bytes() == src.tobytes()


@pytest.fixture
def ramfs(tmp_path):
    """A directory on ramfs: a filesystem that refuses O_DIRECT at open (tmpfs takes it on recent kernels)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a ramfs (a filesystem without O_DIRECT) needs root")
    mnt = tmp_path / "ramfs"
    mnt.mkdir()
    done = subprocess.run(["mount", "-t", "ramfs", "ramfs", str(mnt)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a ramfs here: {done.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def test_a_write_refused_for_o_direct_leaves_no_empty_file(native_backend, ramfs):
    # Linux creates the file before it refuses O_DIRECT: see [Note: a refused O_DIRECT open leaves no file].
    path = ramfs / "shard.swp"
    with AsyncIO(backend=native_backend) as h, pytest.raises(OSError) as ei:
        h.pwrite(np.zeros(4096, np.uint8), path).wait()
    assert ei.value.errno == errno.EINVAL and "does not support O_DIRECT" in str(ei.value)
    assert os.listdir(ramfs) == [], "the refused open left a file behind"
    path.write_bytes(b"kept")  # a file that was there before is left as it was
    with AsyncIO(backend=native_backend) as h, pytest.raises(OSError):
        h.pwrite(np.zeros(4096, np.uint8), path).wait()
    assert path.read_bytes() == b"kept"
