"""PrefetchScheduler: reads NVMe parameter shards ahead of use, in the order the first step used them.

[Note: trace-based prefetch]
Step 1 records every shard fetch, forward and backward, in order: the
trace. On later steps each fetch advances a cursor along the trace and tops
up the reads in flight to `stage3_prefetch_bucket_size` elements ahead of
it. A prefetch takes a pool buffer only with `try_acquire(reserve=1)`, so
the one fetch on the critical path always finds a buffer: the pool can be
slow, never exhausted (DeepSpeed's "not enough buffers" cannot happen).
A parameter fetched again within `stage3_max_reuse_distance` elements of
trace (a tied weight used at the end of forward and the start of backward,
say) keeps its shard (on the compute device) in between instead of being read twice.
Which uses keep their shard is planned once, when the trace is recorded
(see [Note: the reuse cache is planned]).
When a fetch is not where the cursor expects, the order changed: the
cursor resynchronises if the shard is a little further on, otherwise the
step goes on without prefetching (still correct) and the next step records
a new trace. Prefetched shards not used by the end of a step are dropped.
Before reading a shard's file, a fetch or a prefetch asks the optimizer to
lend it from the group's master weights (see [Note: backward reads from the
state] in optimizer.py); a lent shard takes no parameter buffer and reads
nothing.
"""

from __future__ import annotations

import time

import torch
from dataclasses import dataclass

from infinity.errors import StaleLend

_RESYNC_WINDOW = 64

# [Note: the reuse cache is planned]
# The cache and the reads in flight share the prefetch bucket. Deciding at run time, at each fetch, whether
# the shard fits the cache let the prefetch skip a later use as "served from the cache" that the cache had
# then refused for want of room: that use became a read on the critical path. With activation checkpointing
# every block's weights are used in forward, again in backward's recomputation and again in its backward, so
# a 1e9 reuse distance (DeepSpeed's shipped value) filled the bucket with forward's copies, and gpt-125m's
# prefetch hit 59 % of fetches. So the plan decides, from the recorded trace, and the run follows it:
# - candidates are consecutive uses of one parameter within the reuse distance, taken shortest first (the
#   recomputation and its backward, a few shards apart, before forward and a far-off recomputation: each
#   kept element then saves a read for the least cache time);
# - one is kept only if the cache stays within `bucket - largest shard` over the whole span, so a read of any
#   shard always has room ahead of use;
# - a kept use's next use is skipped by the prefetch; a keep the run cannot honour (the trace resynchronised
#   past a use) hands that next use back to the prefetch for this step only, which reads it if it is still
#   ahead (else it is a miss); the next step follows the plan again.


@dataclass(kw_only=True, slots=True)
class PrefetchStats:
    """One step of parameter fetches from NVMe."""

    fetches: int = 0
    hits: int = 0
    """Fetches whose read was already submitted (or done) when asked for."""
    stall_s: float = 0.0
    """Time the compute thread waited for shard reads: the exposed parameter I/O."""
    bytes_read: int = 0
    lent: int = 0
    """Fetches served from the optimizer's master weights (no read of their own)."""
    staged: int = 0
    """Fetches served from a copy the deferred step staged as it stepped the shard (no read of their own, see
    [Note: stepped shards are staged] in deferred.py)."""
    critical_reads: int = 0
    """Misses that read their shard from its file on the critical path; the other misses took a staged copy or
    lent master weights, from memory (their wait, if any, is the deferred step's, counted as optimizer wait)."""
    recorded: bool = False
    """This step recorded the trace (its fetches are all misses by design)."""

    @property
    def hit_rate(self) -> float:
        return self.hits / self.fetches if self.fetches else 1.0


class PrefetchScheduler:
    def __init__(self, store, bucket_elements: int, reuse_distance: int = 0):
        self.store = store
        self.bucket = bucket_elements
        self.reuse_distance = reuse_distance
        self.trace: list = []
        self.reused: list[bool] = []  # trace[j] comes from the reuse cache (see the note)
        self.keep: list[bool] = []  # after trace[j]'s fetch, keep the shard for its next use
        self.next_use: list[int] = []  # trace index of trace[j]'s next use (-1: none)
        self._handed_back: set[int] = set()  # this step's planned cache uses the cache could not keep
        self.recording = True
        self.pos = 0
        self.ahead = 0
        self.broken = False
        self.inflight: dict[str, tuple] = {}  # swap id -> (future, elements, lent, its reader)
        self.cached = 0  # elements in the reuse cache
        self.turn: int | None = None  # trace index of backward's first fetch (None: not recorded)
        self.in_backward = False
        self._busy = None
        self.stats = PrefetchStats(recorded=True)
        self.history: list[PrefetchStats] = []

    def resize(self, bucket_elements: int) -> None:
        """A new prefetch bucket (stage3_prefetch_bucket_size once "auto" is resolved), from the next fetch on."""
        self.bucket = bucket_elements

    def begin_step(self) -> None:
        """Start of a forward: read the head of the trace before the first module asks."""
        self.in_backward = False
        self._handed_back = set()
        # A forward whose backward never came (evaluation with grad on, a load_checkpoint in between) left reads
        # and cached shards behind: they may be stale, or lent from a state read that was since dropped.
        self._forget_pending()
        if self.recording:  # a trace is one forward and its backward
            self.trace, self.turn = [], None
        if not self.recording and not self.broken:
            self.pos = self.ahead = 0
            self._prefetch()

    def backward_begins(self) -> None:
        """Fetches from here on are backward's (see [Note: backward reads from the state] in optimizer.py)."""
        self.in_backward = True
        if self.recording:
            self.turn = len(self.trace)

    def fetch(self, mp, sid: str, dtype, assemble) -> "torch.Tensor":
        """assemble(shard, owned) of `mp`'s shard in `dtype` (see ShardHome.gather), from the reuse cache or the
        prefetched reads; the shard's pool buffer is released once assemble returns."""
        st = self.stats
        st.fetches += 1
        j = self._advance(mp)
        cached, mp.reuse = mp.reuse, None
        if cached is not None:
            self.cached -= mp.part
            st.hits += 1
            out = assemble(cached, True)
        else:
            hit = self.inflight.pop(sid, None)
            if hit is not None:
                st.hits += 1
                fut, _, lent, reader = hit  # released through the reader that started it
            else:
                reader = mp.home.reader_of(mp)
                fut, lent = self._start(mp, sid, self.in_backward)
            self._busy = sid  # its buffer is still ours: no prefetch of the same partition until released
            try:
                try:
                    self._prefetch()
                except BaseException:  # the fetch's own read must not keep its buffer
                    self._let_go(reader, sid, fut, lent)
                    raise
                t0 = time.perf_counter()
                try:
                    try:
                        view = fut.wait()
                    except StaleLend:  # lent before its group stepped in a bet: the live file has the old weights
                        fut, lent = reader.swap_in(sid), False
                        view = fut.wait()
                finally:
                    st.stall_s += time.perf_counter() - t0
                try:
                    shard = view.to(dtype)  # a copy only when the file's dtype is another
                    out = assemble(shard, shard is not view)
                finally:
                    if not lent:
                        reader.release(sid)
            finally:
                self._busy = None
            if lent:
                st.lent += 1
            elif getattr(fut, "from_memory", False):  # a staged copy (alias.py)
                st.staged += 1
            else:
                st.bytes_read += view.numel() * view.element_size()
                st.critical_reads += hit is None
            self._prefetch()
        if j is not None and self.keep[j]:
            if self.cached + mp.part <= self.bucket:
                # The cache keeps this rank's shard: out itself with one rank (it is the padded full parameter),
                # else a copy of the shard's slice of the gathered value.
                mp.reuse = cached if cached is not None else self.store.own_slice(out)
                self.cached += mp.part
            else:  # off the plan (a resync skipped a use): this step reads the next use (a miss if already passed)
                self._handed_back.add(self.next_use[j])
        return out

    def _start(self, mp, sid: str, backward: bool, **prefetch):
        """(future, lent): mp's shard lent from the optimizer's state, else a read of its file (None when a
        prefetch finds no free buffer). `backward`: the use is backward's."""
        pending = self.store.pending
        if prefetch and pending is not None and not pending.ready(mp):
            self.store.advance()  # step what has been read: its shards are staged, or their writes start sooner
            pending = self.store.pending  # None once the walk is settled
            if pending is not None and not pending.ready(mp):
                return None, False  # its group's step is not finished: a later fetch tries again
        fut = self.store.lend(mp, backward=backward) if mp.trainable else None
        if fut is not None:
            return fut, True
        return mp.home.reader_of(mp).swap_in(sid, **prefetch), False

    def _held(self) -> int:
        """Elements held ahead of use: reads in flight plus the reuse cache. Reads start only within the prefetch
        bucket; the cache may keep a planned shard beyond it by the reads in flight (at most one shard's worth
        over, see [Note: the reuse cache is planned])."""
        return self.cached + sum(n for _, n, _, _ in self.inflight.values())

    def _advance(self, mp) -> int | None:
        """Move the cursor past `mp`; its trace index, or None when recording or off the trace."""
        if self.recording:
            self.trace.append(mp)
            return None
        if self.broken:
            return None
        end = min(len(self.trace), self.pos + _RESYNC_WINDOW)
        for j in range(self.pos, end):
            if self.trace[j] is mp:
                self.pos = j + 1
                self.ahead = max(self.ahead, self.pos)
                return j
        self.broken = True  # the order changed: see [Note: trace-based prefetch]
        self._drop_cache()
        return None

    def _drop_cache(self) -> None:
        for mp in self.trace:
            mp.reuse = None
        self.cached = 0

    def _plan_reuse(self) -> None:
        """After recording: which fetches keep their shard for the next use (see [Note: the reuse cache is
        planned])."""
        n = len(self.trace)
        self.keep = [False] * n
        self.reused = [False] * n
        self.next_use = [-1] * n
        last: dict[int, int] = {}
        between = [0] * (n + 1)
        pairs = []
        for j, mp in enumerate(self.trace):
            between[j + 1] = between[j] + mp.part
            i = last.get(id(mp))
            if i is not None:
                self.next_use[i] = j
                distance = between[j] - between[i + 1]
                if distance <= self.reuse_distance:
                    pairs.append((distance, i, j))
            last[id(mp)] = j
        cap = self.bucket - max((mp.part for mp in self.trace), default=0)
        occupied = [0] * n  # cached elements once trace[t]'s fetch has returned, for the kept spans so far
        for _, i, j in sorted(pairs):
            part = self.trace[i].part  # cached from the end of fetch i until fetch j takes it
            if max(occupied[i:j]) + part > cap:
                continue
            for t in range(i, j):
                occupied[t] += part
            self.keep[i] = self.reused[j] = True

    def _prefetch(self) -> None:
        if self.recording or self.broken:
            return
        budget = self.bucket - self._held()
        j = self.ahead
        while j < len(self.trace):
            mp = self.trace[j]
            sid = mp.home.swap_id(mp)
            if self.reused[j] and j not in self._handed_back:
                pass  # served from the reuse cache
            elif sid in self.inflight or sid == self._busy:
                break  # an earlier use of the same shard is still in flight: one read per partition at a time
            else:
                if mp.part > budget:
                    break
                backward = self.in_backward or (self.turn is not None and j >= self.turn)
                fut, lent = self._start(mp, sid, backward, prefetch=True, reserve=1)
                if fut is None:
                    break  # the pool is busy: try again on the next fetch
                self.inflight[sid] = (fut, mp.part, lent, mp.home.reader_of(mp))
                budget -= mp.part
            j += 1
        self.ahead = j

    def _let_go(self, reader, sid: str, fut, lent: bool) -> None:
        """A read nobody will use: let it land and give its buffer back to `reader`, quietly."""
        try:
            fut.wait()
            if not lent:
                reader.release(sid)
        except BaseException:  # noqa: BLE001 - the read's error belongs to no one now; the file is unchanged
            pass

    def _forget_pending(self) -> None:
        """Drop unused prefetches and the reuse cache."""
        for sid, (fut, _, lent, reader) in list(self.inflight.items()):
            self._let_go(reader, sid, fut, lent)
        self.inflight.clear()
        self._drop_cache()

    def drain(self) -> PrefetchStats:
        """End of a step: drop unused prefetches, close the step's stats, decide whether to re-record."""
        self._forget_pending()
        done = self.stats
        self.history.append(done)
        if self.recording:
            self.recording = False
            self._plan_reuse()
        elif self.broken:
            self.trace = []
            self.turn = None
            self.recording = True
        self.broken = False
        self.pos = self.ahead = 0
        self._handed_back = set()
        self.stats = PrefetchStats(recorded=self.recording)
        return done
