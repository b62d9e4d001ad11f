"""This process's resident memory: RSS now, and the peak RSS since a reset.

Linux reports both in /proc (RSS in /proc/self/statm; the peak, VmHWM, in
/proc/self/status, which writing "5" to /proc/self/clear_refs resets to the
RSS of that moment). Where there is no /proc (macOS), the RSS is unknown (0)
and the peak is getrusage's ru_maxrss: the peak since the process started,
which no reset moves.

Measuring "what a piece of code added" is then:

    reset_peak()
    baseline = rss_bytes()
    ...                      # the code measured
    added = peak_rss_bytes() - baseline

`PeakSampler` instead samples the RSS on a thread, for a peak over a window
that must not disturb the process-wide VmHWM (or where it cannot be reset).
"""

from __future__ import annotations

import os
import sys
import threading

__all__ = ["rss_bytes", "anon_bytes", "reset_peak", "peak_rss_bytes", "PeakSampler"]


def rss_bytes() -> int:
    """Resident set size now, in bytes (VmRSS); 0 where /proc is missing.

    Read from /proc/self/statm, which is cheap enough to sample every few milliseconds.
    """
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def reset_peak() -> bool:
    """Restart the peak RSS (VmHWM) at the RSS now; False where the kernel does not allow it (no /proc)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_bytes() -> int:
    """The peak RSS in bytes since the last `reset_peak()` (VmHWM), or since the process started (ru_maxrss)
    where /proc is missing."""
    peak = _proc_status("VmHWM")
    if peak is not None:
        return peak
    import resource

    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return maxrss if sys.platform == "darwin" else maxrss * 1024  # bytes on macOS, KiB elsewhere


def anon_bytes() -> int:
    """RssAnon: resident memory not backed by a file (0 where /proc is missing). Memory-mapped files' pages
    (a datasets Arrow cache) count in the RSS but not here: the kernel takes them back under pressure."""
    return _proc_status("RssAnon") or 0


class PeakSampler:
    """`with PeakSampler() as s: ...`: samples the RSS (or `read()`, e.g. anon_bytes) every 5 ms on a thread;
    `s.peak` is the largest seen (bytes), counting the value at the start and at the end."""

    def __init__(self, interval_s: float = 0.005, read=None):
        self._read = read or rss_bytes
        self.peak = self._read()
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.wait(self._interval_s):
            self.peak = max(self.peak, self._read())

    def __enter__(self):
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, self._read())


def _proc_status(key: str) -> int | None:
    """A byte count from /proc/self/status (VmRSS, VmHWM, ...), or None where there is no such file or line."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None
