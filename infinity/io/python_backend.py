"""The pure-Python backend: os.preadv/os.pwritev on a thread pool.

It exists so that `infinity` works where the native extension cannot be
built. It has the same semantics and errors as the native backends but does
not use O_DIRECT (Python cannot promise the alignment), so reads may be
served from the page cache. The issue asked for aiofiles; aiofiles is itself
a thread pool around these same calls, so we use the calls directly and
avoid a dependency that would add nothing.
"""

from __future__ import annotations

import ctypes
import errno
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import torch

from infinity.io.checksum import crc32c


def _os_error(err: int, what: str, path: str, offset: int) -> OSError:
    exc = OSError(err, f"{what} ({os.strerror(err)}), at offset {offset}", path)
    exc.offset = offset
    return exc


class _Request:
    """Same surface as the native Future: wait(timeout) -> bool, done(), result()."""

    def __init__(self, nbytes: int, ptr: int = 0, checksum: bool = False):
        self._ptr, self._checksum, self._crc = ptr, checksum, None
        self._event = threading.Event()
        self._error: OSError | None = None
        self._nbytes = nbytes
        self._lock = threading.Lock()
        self._pending = 0

    def wait(self, timeout: float) -> bool:
        return self._event.wait(None if timeout < 0 else timeout)

    def done(self) -> bool:
        return self._event.is_set()

    def result(self) -> int:
        if not self._event.is_set():
            raise ValueError("result() called before the request finished; call wait() first")
        if self._error is not None:
            raise self._error
        return self._nbytes

    def crc32c(self) -> int:
        if not self._checksum:
            raise ValueError("crc32c(): this request was not submitted with checksum=True")
        self.result()
        return self._crc

    def _piece_done(self, error: OSError | None) -> bool:
        with self._lock:
            if error is not None and self._error is None:
                self._error = error
            self._pending -= 1
            return self._pending == 0


class PythonHandle:
    """Mirrors the native Handle: submit(write, ptr, nbytes, path, offset)."""

    def __init__(self, block_size: int, queue_depth: int, threads: int):
        self._block = block_size
        # queue_depth pieces in flight per worker, like the native engines.
        self._pool = ThreadPoolExecutor(max_workers=max(1, threads) * min(queue_depth, 8),
                                        thread_name_prefix="infinity-io")
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._inflight = 0
        self.closed = False
        self.bytes_read = 0
        self.bytes_written = 0

    @property
    def inflight(self) -> int:
        return self._inflight

    def submit(self, write: bool, ptr: int, nbytes: int, path: str, offset: int,
               checksum: bool = False) -> _Request:
        if offset < 0:
            raise ValueError(f"offset must be >= 0, got {offset} (path {path})")
        if checksum and write:
            raise ValueError(f"checksum is for reads: a write's caller has its bytes (path {path})")
        with self._lock:
            # Checked and counted under one lock, so close() waits for us.
            if self.closed:
                raise ValueError("I/O handle is closed; create a new AsyncIO")
            self._inflight += 1
        fd = -1
        try:
            flags = (os.O_WRONLY | os.O_CREAT) if write else os.O_RDONLY
            try:
                fd = os.open(path, flags | os.O_CLOEXEC, 0o644)
            except OSError as exc:
                raise _os_error(exc.errno, f"cannot open for {'writing' if write else 'reading'}", path,
                                offset) from None
            if not write:
                size = os.fstat(fd).st_size
                if nbytes > 0 and offset + nbytes > size:
                    raise _os_error(errno.ENODATA, f"read past end of file: the file has {size} bytes, "
                                    f"the request needs bytes [{offset}, {offset + nbytes})", path, offset)
            req = _Request(nbytes, ptr, checksum)
            pieces = [(lo, min(self._block, nbytes - lo)) for lo in range(0, nbytes, self._block)]
            req._pending = len(pieces)
        except BaseException:
            if fd >= 0:
                os.close(fd)
            self._release()
            raise
        if not pieces:
            self._finish(req, fd, write)
            return req
        for lo, n in pieces:
            self._pool.submit(self._run_piece, req, fd, write, ptr + lo, n, path, offset + lo)
        return req

    def _run_piece(self, req, fd, write, ptr, n, path, off):
        error = None
        done = 0
        try:
            view = memoryview((ctypes.c_char * n).from_address(ptr)).cast("B")
            while done < n:
                part = view[done:]
                moved = os.pwritev(fd, [part], off + done) if write else os.preadv(fd, [part], off + done)
                if moved == 0:
                    raise _os_error(errno.EIO if write else errno.ENODATA,
                                    "write made no progress" if write else
                                    "unexpected end of file: the file shrank while it was being read",
                                    path, off + done)
                done += moved
        except OSError as exc:
            error = exc if hasattr(exc, "offset") else _os_error(
                exc.errno, "write failed" if write else "read failed", path, off + done)
        except BaseException as exc:  # noqa: BLE001 - never leave the request hanging
            error = _os_error(errno.EIO, f"internal error: {exc!r}", path, off + done)
        if req._piece_done(error):
            self._finish(req, fd, write)

    def _finish(self, req, fd, write):
        """Close the fd, then publish the result; always runs to the end."""
        try:
            os.close(fd)
        except OSError as exc:
            # A deferred write error (network filesystems) shows up at close.
            if write and req._error is None:
                req._error = _os_error(exc.errno, "close after write failed", "", -1)
        if req._error is None and req._checksum:  # taken before the request is done, as the native one does
            try:
                req._crc = crc32c(torch.frombuffer((ctypes.c_char * req._nbytes).from_address(req._ptr),
                                                   dtype=torch.uint8) if req._nbytes else torch.empty(0))
            except BaseException as exc:  # noqa: BLE001 - reported by the request
                req._error = _os_error(errno.EIO, f"checksum failed: {exc!r}", "", -1)
        if req._error is None:
            with self._lock:
                if write:
                    self.bytes_written += req._nbytes
                else:
                    self.bytes_read += req._nbytes
        req._event.set()
        self._release()

    def _release(self):
        with self._lock:
            self._inflight -= 1
            self._idle.notify_all()

    def wait_all(self) -> None:
        with self._lock:
            self._idle.wait_for(lambda: self._inflight == 0)

    def close(self) -> None:
        with self._lock:
            self.closed = True
        self.wait_all()
        self._pool.shutdown(wait=True)
