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


def _os_error(err: int, what: str, path: str, offset: int) -> OSError:
    exc = OSError(err, f"{what} ({os.strerror(err)}), at offset {offset}", path)
    exc.offset = offset
    return exc


class _Request:
    """Same surface as the native Future: wait(timeout) -> bool, done(), result()."""

    def __init__(self, nbytes: int):
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

    def submit(self, write: bool, ptr: int, nbytes: int, path: str, offset: int) -> _Request:
        if self.closed:
            raise ValueError("I/O handle is closed; create a new AsyncIO")
        if offset < 0:
            raise ValueError(f"offset must be >= 0, got {offset} (path {path})")
        flags = (os.O_WRONLY | os.O_CREAT) if write else os.O_RDONLY
        try:
            fd = os.open(path, flags | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise _os_error(exc.errno, f"cannot open for {'writing' if write else 'reading'}", path,
                            offset) from None
        if not write:
            size = os.fstat(fd).st_size
            if nbytes > 0 and offset + nbytes > size:
                os.close(fd)
                raise _os_error(errno.ENODATA, f"read past end of file: the file has {size} bytes, "
                                f"the request needs bytes [{offset}, {offset + nbytes})", path, offset)
        req = _Request(nbytes)
        pieces = [(lo, min(self._block, nbytes - lo)) for lo in range(0, nbytes, self._block)]
        with self._lock:
            self._inflight += 1
        if not pieces:
            self._finish(req, fd, write, None)
            return req
        req._pending = len(pieces)
        for lo, n in pieces:
            self._pool.submit(self._run_piece, req, fd, write, ptr + lo, n, path, offset + lo)
        return req

    def _run_piece(self, req, fd, write, ptr, n, path, off):
        view = memoryview((ctypes.c_char * n).from_address(ptr)).cast("B")
        error = None
        done = 0
        try:
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
        if req._piece_done(error):
            self._finish(req, fd, write, req._error)

    def _finish(self, req, fd, write, error):
        os.close(fd)
        req._event.set()
        with self._lock:
            if error is None:
                if write:
                    self.bytes_written += req._nbytes
                else:
                    self.bytes_read += req._nbytes
            self._inflight -= 1
            self._idle.notify_all()

    def wait_all(self) -> None:
        with self._lock:
            self._idle.wait_for(lambda: self._inflight == 0)

    def close(self) -> None:
        self.closed = True
        self.wait_all()
        self._pool.shutdown(wait=True)
