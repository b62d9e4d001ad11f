"""Per-step I/O and compute accounting, and a Chrome-trace (Perfetto) export of every span."""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field


@dataclass(kw_only=True, slots=True)
class StepStats:
    """What one offloaded optimizer step did."""

    wall_s: float = 0.0
    """Whole step, first read submitted to last write landed."""
    io_wait_s: float = 0.0
    """Time the step thread sat waiting on reads and on the final writes (exposed I/O)."""
    compute_s: float = 0.0
    """Time in the Adam kernel."""
    bytes_read: int = 0
    bytes_written: int = 0
    skipped: bool = False
    """True when a gradient was inf/nan and nothing was stepped."""


@dataclass
class Trace:
    """Spans collected for a Chrome trace: open the JSON at ui.perfetto.dev or chrome://tracing."""

    spans: list = field(default_factory=list)
    t0: float = field(default_factory=time.perf_counter)
    limit: int = 500_000
    """Spans kept (about 100 B each): a long run keeps its first ones and counts the rest in `dropped`."""
    dropped: int = 0

    def add(self, name: str, cat: str, start: float, end: float, track: int = 0) -> None:
        if len(self.spans) >= self.limit:
            self.dropped += 1
            return
        self.spans.append((name, cat, start, end, track))

    def export(self, path: str | os.PathLike) -> None:
        events = [{"name": n, "cat": c, "ph": "X", "ts": (s - self.t0) * 1e6, "dur": max(0.0, (e - s) * 1e6),
                   "pid": os.getpid(), "tid": track} for n, c, s, e, track in self.spans]
        tmp = f"{os.fspath(path)}.tmp"
        with open(tmp, "w") as f:
            json.dump({"traceEvents": events, "displayTimeUnit": "ms",
                       "otherData": {"spans_dropped_past_limit": self.dropped}}, f)
        os.replace(tmp, path)
