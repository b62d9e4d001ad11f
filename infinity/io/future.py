"""IOFuture: the result of one pread/pwrite."""

from __future__ import annotations

import asyncio
import math


class IOFuture:
    """One read or write in flight.

    It holds the caller's buffer until the request finishes, so dropping the
    future early never frees memory the kernel is still writing into. The
    request runs whether or not anyone waits on it.
    """

    __slots__ = ("_req", "_buf", "_observed", "op", "path", "offset", "nbytes")

    def __init__(self, req, buf, op: str, path: str, offset: int, nbytes: int):
        self._req = req
        self._buf = buf
        self._observed = False
        self.op = op
        self.path = path
        self.offset = offset
        self.nbytes = nbytes

    def done(self) -> bool:
        """True once the request has finished, successfully or not."""
        return self._req.done()

    def wait(self, timeout: float | None = None) -> int:
        """Block until finished; return the bytes moved or raise its OSError.

        Raises TimeoutError if `timeout` seconds pass first; the request keeps
        running and can be waited on again.
        """
        forever = timeout is None or not math.isfinite(timeout) or timeout > 1e9
        if not self._req.wait(-1.0 if forever else max(0.0, float(timeout))):
            raise TimeoutError(f"{self.op} of {self.nbytes} bytes at offset {self.offset} of {self.path} "
                               f"not finished after {timeout} s")
        self._buf = None
        self._observed = True
        return self._req.result()

    def crc32c(self) -> int:
        """The CRC-32C of what a read submitted with checksum=True brought in; call after wait()."""
        return self._req.crc32c()

    def _settled(self) -> bool:
        """Done, and either successful or already reported to someone."""
        if not self._req.done():
            return False
        if self._observed:
            return True
        try:
            self._req.result()
        except OSError:
            return False
        self._buf = None
        return True

    def __await__(self):
        # The wait blocks in native code with the GIL released; an executor
        # thread lets the event loop run meanwhile.
        loop = asyncio.get_running_loop()
        return loop.run_in_executor(None, self.wait).__await__()

    def __repr__(self) -> str:
        state = "done" if self.done() else "pending"
        return f"IOFuture({self.op} {self.nbytes} B at {self.offset} of {self.path!r}, {state})"
