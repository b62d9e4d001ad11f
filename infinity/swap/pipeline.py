"""StatePipeline: read ahead || work || write behind over sub-groups' states, bounded by the pool.

[Note: one pipeline]
The optimizer step, the checkpoint export, the checkpoint import and the
first write of the state all walk the sub-groups in order, and for states
on NVMe each wants the same overlap: the next group's read in flight while
this one is worked on, and the previous one's write landing meanwhile. They
differ only in what the work is and in whether the state is read (UPDATE,
READ) and written back (UPDATE, FILL). So one object does the walking:
- The critical path's read of group i is started first (it may wait for a
  buffer), then the read of i + 1 only if a buffer is free right now
  (`prefetch` never waits), so a read-ahead can never starve the group
  being worked on.
- A write hands its buffer to the swapper, whose reaper returns it when the
  write lands (see [Note: who releases a swap-out buffer]); nobody waits for
  a write until `finish()`.
- READ keeps a group's buffer until its consumer's wait has returned (the
  consumer writes from the views asynchronously), and at most two such
  groups are held; when the next read could not start for want of a
  buffer, all held groups are retired first, so a pool of one buffer works.
  RAM states hold no buffer, so their consumers' waits all come at the end.
- On any error every read and write in flight is finished, every buffer
  goes back, and the first error is raised: states already written hold the
  new values, the others the old (the file is rewritten only by a write).
  The exception is a failed write: its group keeps its buffer and its new
  bytes (IN_CPU, dirty; see [Note: residency transitions]). So before a read
  that could wait for a buffer, the walk waits on its own oldest write
  instead, and a failed one raises rather than leaving the read waiting for
  a buffer that will never come back.
The step during backward drives the same object one group at a time, as
gradients become final (`ahead` on the first gradient, `run` on the last).
RAM tiers go through the same calls, which cost them nothing.
"""

from __future__ import annotations

import enum
import time
from collections import deque

from infinity.swap.state import GroupState
from infinity.swap.swapper import wait_all
from infinity.swap.telemetry import StepStats, Trace


class Mode(enum.Enum):
    """What the pipeline does with each state."""

    UPDATE = "update"
    """Read it, change it in place, write it back: the optimizer step."""
    READ = "read"
    """Read it and hand it on; nothing is written: a checkpoint export."""
    FILL = "fill"
    """Write it anew without reading it: the first write, a checkpoint import."""


class StatePipeline:
    """Drives GroupStates through one mode; see [Note: one pipeline]."""

    def __init__(self, mode: Mode, *, stats: StepStats | None = None, reserve: int = 0, trace: Trace | None = None):
        self.mode = mode
        self.stats = stats if stats is not None else StepStats()
        self.reserve = reserve
        """Buffers a read-ahead must leave free (1 during backward: the critical path takes one at a time)."""
        self.trace = trace
        self._ahead: list[GroupState] = []  # read ahead, not yet opened
        self._held: deque = deque()  # READ: (state, wait) whose consumer may still be using the views
        self._writes: list = []  # (state, future) of writes in flight

    def ahead(self, state: GroupState) -> None:
        """Start reading `state` if a buffer is free now; never waits."""
        if self.mode is Mode.FILL or state in self._ahead:
            return
        state.prefetch(reserve=self.reserve)
        if state.ready():
            self._ahead.append(state)

    def run(self, state: GroupState, work, *, then: GroupState | None = None) -> None:
        """Open `state`, call work(views), then write it back (READ: keep it until work's wait has returned).

        `then` is the state the caller will run next: its read starts, if a
        buffer is free, once this one's has.
        """
        if self.mode is Mode.READ:
            while self._buffers_held() > 1 or (self._buffers_held() and not state.ready()):
                self._retire()
        t0 = time.perf_counter()
        if self.mode is not Mode.FILL and not state.ready():
            self._make_room(state)
            state.fetch()  # the critical path: may wait for a buffer
            self._ahead.append(state)
        if then is not None:
            self.ahead(then)
        try:
            views = state.open(blank=self.mode is Mode.FILL)
        finally:
            if state in self._ahead:
                self._ahead.remove(state)
        t1 = time.perf_counter()
        try:
            result = work(views)
        except BaseException:
            state.abandon()
            raise
        t2 = time.perf_counter()
        self.stats.io_wait_s += t1 - t0
        self.stats.compute_s += t2 - t1
        self._span(state.last_read, 1)
        if self.trace is not None:
            self.trace.add(f"{self.mode.value} {state.label}", "compute", t1, t2, 3)
        if self.mode is not Mode.FILL:
            self.stats.bytes_read += state.io_bytes
        if self.mode is Mode.READ:
            self._held.append((state, result))
            return
        fut = state.close(write=True)
        self.stats.bytes_written += state.io_write_bytes
        if fut is not None:
            self._writes.append((state, fut))

    def over(self, states: list[GroupState], work) -> StepStats:
        """The whole walk: work(i, views) on each state in order, reading ahead; then finish()."""
        t0 = time.perf_counter()
        try:
            for i, state in enumerate(states):
                self.run(state, lambda views, i=i: work(i, views),
                         then=states[i + 1] if i + 1 < len(states) else None)
        except BaseException:
            self.abandon()
            raise
        self.finish()
        self.stats.wall_s = time.perf_counter() - t0
        return self.stats

    def written(self, state: GroupState) -> bool:
        """No write of `state` started by this walk is still in flight (a failed one raises here)."""
        for st, fut in self._writes:
            if st is state and fut.done():
                fut.wait()
        return not any(st is state and not fut.done() for st, fut in self._writes)

    def wait_written(self, state: GroupState) -> None:
        """Wait for this walk's writes of `state` to land; a failed one raises."""
        for st, fut in self._writes:
            if st is state:
                fut.wait()

    def reap(self) -> None:
        """Forget the writes that have landed (a failed one raises)."""
        landed = [fut for _, fut in self._writes if fut.done()]
        for fut in landed:
            fut.wait()
            self._span(fut, 2)
        self._writes = [(st, fut) for st, fut in self._writes if not any(fut is f for f in landed)]

    def idle(self) -> bool:
        """Nothing of this walk is in flight or held (landed writes are forgotten first)."""
        self.reap()
        return not self._writes and not self._held and not self._ahead

    def finish(self) -> None:
        """Retire held states, drop read-aheads nobody opened, wait for every write; raise the first error."""
        t0 = time.perf_counter()
        first = None
        while self._held:
            try:
                self._retire()
            except BaseException as exc:  # noqa: BLE001 - every state is retired; the first error is raised
                first = first or exc
        for state in self._ahead:
            state.abandon()
        self._ahead = []
        writes, self._writes = self._writes, []
        try:
            wait_all(fut for _, fut in writes)
        except BaseException as exc:  # noqa: BLE001
            first = first or exc
        for _, fut in writes:
            self._span(fut, 2)
        self.stats.io_wait_s += time.perf_counter() - t0
        if first is not None:
            raise first

    def abandon(self) -> None:
        """After an error: finish quietly (the error being raised is the one that counts)."""
        try:
            self.finish()
        except BaseException:  # noqa: BLE001
            pass

    def _make_room(self, state: GroupState) -> None:
        """Before a read that may wait for a buffer: start it now if one is free; else wait for this walk's oldest
        write, which either lands (and its buffer comes back) or raises. A failed write keeps its buffer (its
        bytes are newer than the file), so blocking on the pool instead could wait for ever."""
        while True:
            for _, fut in self._writes:
                if fut.done():
                    fut.wait()  # raises a failed write's error; a landed one returns at once
            state.prefetch()
            pending = [fut for _, fut in self._writes if not fut.done()]
            if state.ready() or not pending:
                return
            pending[0].wait()

    def _buffers_held(self) -> int:
        return sum(1 for state, _ in self._held if state.io_bytes)

    def _retire(self) -> None:
        state, wait = self._held.popleft()
        try:
            if wait is not None:
                wait()
        finally:
            state.close(write=False)

    def _span(self, fut, track: int) -> None:
        if self.trace is not None and fut is not None and fut.t_done is not None:
            self.trace.add(fut.label, "io", fut.t_submit, fut.t_done, track)
