"""Asynchronous file I/O for swapping tensors to NVMe.

    with infinity.io.AsyncIO(backend="auto") as h:
        buf = infinity.io.aligned_empty(1 << 20)
        h.pwrite(buf, "/nvme/x.swp").wait()
        h.pread(buf, "/nvme/x.swp").wait()

How files are opened and cached: every request opens its file itself and
closes it when the request finishes, so no descriptor outlives a request.
Writes open with O_CREAT (mode 0644) and never truncate. With direct=True the
aligned bulk of a request goes through an O_DIRECT descriptor and bypasses the
page cache; the unaligned head and tail (each under one alignment unit) go
through an ordinary buffered descriptor. With direct=False everything is
buffered and the page cache may serve reads.
"""

from infinity.io.buffers import aligned_empty
from infinity.io.handle import AsyncIO, available_backends, select_backend
from infinity.io.future import IOFuture

__all__ = ["AsyncIO", "IOFuture", "aligned_empty", "available_backends", "select_backend"]
