"""AsyncIO: the user-facing handle over the native engines or the Python fallback."""

from __future__ import annotations

import collections
import errno
import functools
import os
import tempfile
import threading

from infinity._native_loader import native
from infinity.io.buffers import aligned_empty, buffer_memory
from infinity.io.future import IOFuture
from infinity.io.python_backend import PythonHandle

# Preference order for "auto". On the reference machine libaio and io_uring
# both reach the disk's limit at 1 MiB x QD32 (bench/RESULTS.md,
# "Native I/O against fio"); io_uring comes first because it needs no aio-max-nr headroom
# and also does buffered I/O asynchronously.
_PREFERENCE = ("io_uring", "libaio", "threads", "python")


def available_backends() -> list[str]:
    """Backends that can start on this machine, fastest first. Always ends with "python"."""
    return list(_probe_backends())


@functools.lru_cache(maxsize=1)
def _probe_backends() -> tuple[str, ...]:
    # Probing starts a kernel queue per backend (io_destroy alone can take
    # tens of ms), and the answer cannot change within a process.
    out = []
    if native is not None:
        for name in _PREFERENCE[:-1]:
            if name in native.compiled_backends() and native.probe_backend(name) == "":
                out.append(name)
    out.append("python")
    return tuple(out)


def select_backend(directory: str | os.PathLike | None = None, *, direct: bool = True) -> str:
    """The fastest backend that really moves data in `directory`.

    Each candidate writes and reads back 8 KiB in a temporary file there, so
    a filesystem that rejects O_DIRECT or an io_uring blocked by seccomp is
    skipped rather than discovered during training.
    """
    candidates = available_backends()
    if directory is None:
        return candidates[0]
    directory = os.fspath(directory)
    if not os.path.isdir(directory):
        raise FileNotFoundError(errno.ENOENT, "select_backend: no such directory", directory)
    probe = aligned_empty(8192, pin=False)
    probe.copy_(_pattern(8192))
    errors = []
    for name in candidates:
        fd, path = tempfile.mkstemp(prefix=".infinity-probe-", dir=directory)
        os.close(fd)
        try:
            with AsyncIO(backend=name, block_size=4096, queue_depth=2, direct=direct) as h:
                h.write(probe, path)
                back = aligned_empty(8192, pin=False)
                h.read(back, path)
                if bool((back == probe).all()):
                    return name
                errors.append(f"{name}: read back different bytes")
        except (OSError, ValueError) as exc:
            errors.append(f"{name}: {exc}")
        finally:
            os.unlink(path)
    raise OSError(f"no I/O backend works in {directory}: " + "; ".join(errors))


def _pattern(n: int):
    import torch

    return torch.arange(n, dtype=torch.int64).remainder_(251).to(torch.uint8)


def _check_int(name: str, value, low: int, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"AsyncIO: {name} must be an int, got {value!r}")
    if value < low or (high is not None and value > high):
        bound = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"AsyncIO: {name} must be {bound}, got {value}")
    return value


class AsyncIO:
    """A thread-safe handle for asynchronous file reads and writes.

    Args:
        backend: "auto", "io_uring", "libaio", "threads" (C++ pool doing
            pread/pwrite) or "python" (no extension needed).
        block_size: a request is cut into pieces of this many bytes (a
            multiple of 4096).
        queue_depth: pieces kept in flight per worker thread.
        threads: worker threads; each has its own kernel queue.
        direct: use O_DIRECT for the aligned bulk of every request, so that
            swapped data does not pollute (or get served from) the page cache.
        single_submit: one piece per submit syscall instead of a batch
            (DeepSpeed's aio.single_submit).
        overlap_events: refill the queue as pieces complete; False submits a
            batch and waits for all of it before the next (DeepSpeed's
            aio.overlap_events). The threads and python backends make one
            blocking call per piece, so neither applies to them.
        fd_cache: open file descriptors kept for reuse (native backends; at
            most a quarter of the process's RLIMIT_NOFILE; 0 opens and closes
            one per request). A file replaced on disk is
            opened again; close() closes them all (see [Note: cached file
            descriptors] in native/io/fd_cache.hpp).

    Argument errors raise ValueError at the call. I/O errors raise OSError
    (FileNotFoundError, PermissionError, ...) carrying `errno`, `filename`
    and `offset`: open errors at the call, transfer errors from `wait()`.
    """

    def __init__(self, backend: str = "auto", block_size: int = 1 << 20, queue_depth: int = 32,
                 threads: int = 1, direct: bool = True, single_submit: bool = False,
                 overlap_events: bool = True, fd_cache: int = 1024):
        _check_int("block_size", block_size, 4096, 1 << 30)
        _check_int("fd_cache", fd_cache, 0, 1 << 16)
        if block_size % 4096:
            raise ValueError(f"AsyncIO: block_size must be a multiple of 4096, got {block_size}")
        _check_int("queue_depth", queue_depth, 1, 4096)
        _check_int("threads", threads, 1, 256)
        for name, flag in (("direct", direct), ("single_submit", single_submit), ("overlap_events", overlap_events)):
            if not isinstance(flag, bool):
                raise ValueError(f"AsyncIO: {name} must be True or False, got {flag!r}")
        usable = available_backends()
        if backend == "auto":
            backend = usable[0]
        elif backend not in _PREFERENCE:
            raise ValueError(f"AsyncIO: unknown backend {backend!r}; choose one of "
                             f"{', '.join(('auto',) + _PREFERENCE)}")
        elif backend not in usable:
            why = "the native extension is not built" if native is None else (
                native.probe_backend(backend) if backend in native.compiled_backends()
                else "it was not compiled in (its headers were missing at build time)")
            raise ValueError(f"AsyncIO: backend {backend!r} is not usable here: {why}; "
                             f"available: {usable}")
        self.backend = backend
        self.block_size = block_size
        self.queue_depth = queue_depth
        self.threads = threads
        self.single_submit = single_submit
        self.overlap_events = overlap_events
        # The Python backend cannot guarantee O_DIRECT alignment; see its module.
        self.direct = direct and backend != "python"
        if backend == "python":
            self._impl = PythonHandle(block_size, queue_depth, threads)
        else:
            self._impl = native.Handle(backend, block_size, queue_depth, threads, direct,
                                       single_submit=single_submit, overlap_events=overlap_events,
                                       fd_cache=fd_cache)
        self._lock = threading.Lock()
        self._pending: collections.deque[IOFuture] = collections.deque()
        self._prune_at = 256

    # ------------------------------------------------------------ requests


    @classmethod
    def from_config(cls, cfg, directory: str | os.PathLike | None = None) -> "AsyncIO":
        """A handle with a loaded config's `aio` section and `infinity.direct_io`; with `directory`, O_DIRECT
        only where that directory's filesystem supports it."""
        aio = cfg.aio
        direct = cfg.infinity.direct_io
        if directory is not None:
            direct = direct and native is not None and native.direct_alignment(os.fspath(directory)) != 0
        return cls(backend=aio.backend, block_size=aio.block_size, queue_depth=aio.queue_depth,
                   threads=aio.intra_op_parallelism, direct=direct, single_submit=aio.single_submit,
                   overlap_events=aio.overlap_events)
    def pwrite(self, buf, path, offset: int = 0, nbytes: int | None = None) -> IOFuture:
        """Start writing `buf` (or its first `nbytes` bytes) to `path` at `offset`."""
        return self._submit(True, buf, path, offset, nbytes)

    def pread(self, buf, path, offset: int = 0, nbytes: int | None = None, *, checksum: bool = False) -> IOFuture:
        """Start reading len(buf) (or `nbytes`) bytes of `path` at `offset` into `buf`.

        checksum=True: the I/O thread that finishes the read takes the CRC-32C of the bytes it brought in,
        and the future's crc32c() returns it, so whoever waits does not read them again to verify them.
        """
        if not isinstance(checksum, bool):
            raise ValueError(f"pread: checksum must be True or False, got {checksum!r} (path {path})")
        return self._submit(False, buf, path, offset, nbytes, checksum)

    def write(self, buf, path, offset: int = 0, nbytes: int | None = None) -> int:
        """Blocking pwrite; returns the bytes written."""
        return self.pwrite(buf, path, offset, nbytes).wait()

    def read(self, buf, path, offset: int = 0, nbytes: int | None = None) -> int:
        """Blocking pread; returns the bytes read."""
        return self.pread(buf, path, offset, nbytes).wait()

    def wait_all(self) -> None:
        """Wait for every request submitted so far.

        Raises the first OSError among requests whose failure nobody has
        seen yet through their own future's wait().
        """
        self._impl.wait_all()
        with self._lock:
            pending = list(self._pending)
            self._pending.clear()
        errors = []
        for fut in pending:
            if not fut._observed:
                try:
                    fut.wait()
                except OSError as exc:
                    errors.append(exc)
        if errors:
            if len(errors) > 1:
                errors[0].add_note(f"{len(errors) - 1} more request(s) failed too: " + "; ".join(
                    str(e) for e in errors[1:4]) + ("; ..." if len(errors) > 4 else ""))
            raise errors[0]

    def _submit(self, write: bool, buf, path, offset, nbytes, checksum: bool = False) -> IOFuture:
        op = "pwrite" if write else "pread"
        try:
            path = os.fspath(path)
        except TypeError:
            raise ValueError(f"{op}: path must be a str or os.PathLike, got {type(path).__name__}") from None
        if isinstance(offset, bool) or not isinstance(offset, int):
            raise ValueError(f"{op}: offset must be an int, got {offset!r} (path {path})")
        if offset < 0:
            raise ValueError(f"{op}: offset must be >= 0, got {offset} (path {path})")
        addr, size, keep = buffer_memory(buf, writable=not write, op=op)
        if nbytes is None:
            nbytes = size
        elif isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
            raise ValueError(f"{op}: nbytes must be an int >= 0, got {nbytes!r} (path {path})")
        elif nbytes > size:
            raise ValueError(f"{op}: buffer too small: it has {size} bytes but nbytes={nbytes} "
                             f"(path {path}, offset {offset})")
        if self._impl.closed:
            raise ValueError(f"{op}: I/O handle is closed; create a new AsyncIO (path {path})")
        req = self._impl.submit(write, addr, nbytes, path, offset, checksum)
        fut = IOFuture(req, keep, op, path, offset, nbytes)
        with self._lock:
            # Keep the futures (and through them the buffers) until done, and
            # failed ones until someone has seen the error.
            while self._pending and self._pending[0]._settled():
                self._pending.popleft()
            if len(self._pending) > self._prune_at:
                # A slow request at the front must not pin every later
                # buffer; a full sweep now and then keeps this amortised O(1).
                self._pending = collections.deque(f for f in self._pending if not f._settled())
                self._prune_at = max(256, 2 * len(self._pending))
            self._pending.append(fut)
        return fut

    # ------------------------------------------------------------ lifetime

    @property
    def closed(self) -> bool:
        return self._impl.closed

    @property
    def bytes_read(self) -> int:
        return self._impl.bytes_read

    @property
    def bytes_written(self) -> int:
        return self._impl.bytes_written

    @property
    def submit_calls(self) -> int | None:
        """Batches handed to the kernel so far (None for the python backend, which has no queue)."""
        return getattr(self._impl, "submit_calls", None)

    @property
    def files_opened(self) -> int | None:
        """Files opened so far (None for the python backend, which opens one per request)."""
        return getattr(self._impl, "files_opened", None)

    @property
    def fds_cached(self) -> int:
        """Open file descriptors held for reuse now."""
        return getattr(self._impl, "fds_cached", 0)

    def forget(self, path) -> None:
        """Drop the cached fds of `path`. Call it before removing a file this handle wrote or read: a cached fd
        keeps the removed file's blocks allocated until it closes."""
        f = getattr(self._impl, "forget", None)
        if f is not None:
            f(os.fspath(path))

    def close(self) -> None:
        """Wait for everything in flight, stop the workers and close the cached fds. Safe to call twice."""
        self._impl.close()
        with self._lock:
            self._pending.clear()

    def __enter__(self) -> "AsyncIO":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        impl = getattr(self, "_impl", None)
        if impl is not None:
            try:
                impl.close()
            except OSError:  # a deferred close error of a cached fd: nobody is left to raise it to
                pass

    def __repr__(self) -> str:
        return (f"AsyncIO(backend={self.backend!r}, block_size={self.block_size}, "
                f"queue_depth={self.queue_depth}, threads={self.threads}, direct={self.direct}, "
                f"single_submit={self.single_submit}, overlap_events={self.overlap_events})")
