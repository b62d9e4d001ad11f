"""DeferredStep: the NVMe optimizer step after backward, finished group by group as the next forward needs them.

[Note: the step finishes in the next forward]
With gradient clipping (Hugging Face's default max_grad_norm is 1.0, and
most DeepSpeed configs clip) or fp16, the step cannot start until backward
has produced every gradient: the global norm scales them all, and an
overflow anywhere skips the step. So the step during backward ([Note:
stepping during backward] in optimizer.py) is off, and with the optimizer
on NVMe the step after backward is a walk of pure I/O (12 B/param read, 12
or 14 written) with the CPU idle: at gpt-125m in bf16, 1.4 s of a 6.5 s
step.

Nothing needs a sub-group's new values before the next forward's first use
of one of its parameters. So `ShardedAdam.step(defer=True)` decides
everything the step needs at once (overflow, norm, clip coefficient, and
each group's hyper-parameters, before the lr scheduler moves them), steps
at once only the groups holding a persistent parameter (those are read
without a fetch, as plain tensors, so they must be current when forward
starts; `plan.pack` packs them first, into few groups), and hands the rest to
this object in the order forward first uses them (as recorded by the store
at each forward's gathers: a tied embedding is registered where it was
built, at the LM head, and used first). The
parameter store then asks it, before any read of a trained shard
(`ParamStore._padded_full`, `read_shard`), to finish the walk through that
shard's groups (`need`), and the prefetch scheduler starts no read of a
shard whose groups are not finished (`ready`). Each ask also advances the
walk as far as it can without waiting (`poll`): the groups whose state has
been read get their Adam and their write, and the next groups' reads start
while a buffer is free. So the optimizer's reads and writes run under the
next forward's compute instead of after backward.

[Note: stepped shards are staged]
In alias mode a shard's file holds its new values only once its group's
write has landed, so a forward that reached a group the walk had just
stepped waited for that write and then read the shard back: 2 B/param of
reads after 14 of writes, on the critical path, and a prefetch of it could
not start before (at 1B, 52 % of fetches hit). But the new values are in
the group's buffer the moment Adam has run. So, right after a group's Adam,
the walk copies each of its whole shards (in the dtype forward reads: the
compute-dtype tail, or the fp32 master) into a free parameter-pool buffer
(`OptimizerSliceReader.stage`, reserve 1 like any prefetch), and the next
read of that shard takes the copy instead of the file: no read, no wait for
the write. A shard is ready for prefetch once it is stepped and staged (or
written), and a prefetch that finds its group not yet stepped first steps
what has been read (`poll`), so the copies are made ahead of forward. A
copy is taken once; the ones not taken are given back before the optimizer
next changes the state (its next step, a checkpoint import), when the walk
is abandoned, and at close. Groups stepped only to settle the walk (at
backward's start, a checkpoint) are not staged: nobody is about to read them.
A shard split over sub-groups (at gpt-125m the tied embedding, the first
thing forward reads) is staged piece by piece: its first piece stepped
takes a buffer for the whole shard, each piece is copied in as its group
steps, and the shard counts as staged once the last one is in. A shard
that finds no buffer free is read from the file after the write, as
before. The pool's bytes bound what is staged ([Note: a pool of full-size
slots lends smaller buffers] in swap/pool.py: a copy takes its own size,
not a slot), so this holds no memory the prefetch would not.

The result is the same step, bit for bit: the same gradients, the same
clip coefficient, the same hyper-parameters per group, applied to the same
state; only when each group's I/O happens changes. In alias mode (shards
read from the optimizer's files, alias.py) a shard is read only after its
group's write has landed (`need` waits for it, `ready` checks it), which is
the ordering the step after backward gave by finishing first.

Whatever else touches the state settles the walk first (`settle`: every
remaining group, every write): the next backward, the next step, a
checkpoint export or import. zero_grad leaves the pending groups'
gradients alone (the walk drops each after its Adam). At close the rest
of the step is dropped: the swap files go with the engine. After an error
the walk is abandoned: the groups not yet stepped keep their old values,
their gradients are dropped (so the next backward does not add onto
them), and a warning says so. The bytes of the whole step are counted in
its own StepStats when it is decided; the time the walk holds up its
callers (its I/O waits and the Adam it runs for them) is counted in
`wait_s`, which the engine reports as optimizer wait with the next step.
"""

from __future__ import annotations

import logging
import time

from infinity.swap.pipeline import Mode, StatePipeline
from infinity.swap.telemetry import StepStats

log = logging.getLogger("infinity")


class DeferredStep:
    """The rest of one optimizer step: `groups` (in the order forward first needs them), each with its work."""

    def __init__(self, optimizer, groups: list, works: dict, stats: StepStats, *, wait_writes: bool):
        self.optimizer = optimizer
        self.groups = groups
        self.works = works  # group index -> work(views)
        self.stats = stats
        self.wait_writes = wait_writes
        """Shards are read from the optimizer's files (alias mode): a group is finished only when its write has
        landed."""
        self.pipe = StatePipeline(Mode.UPDATE, trace=optimizer.trace)
        self.pos = {g.index: k for k, g in enumerate(groups)}
        self.next = 0  # groups[:next] have had their Adam and their write started
        self.wait_s = 0.0
        for g in groups:
            stats.bytes_read += g.state.io_bytes
            stats.bytes_written += g.state.io_write_bytes

    @property
    def done(self) -> bool:
        return self.next == len(self.groups)

    def ready(self, mp) -> bool:
        """mp's shards hold this step's values (and, in alias mode, their files do, or a staged copy does). A
        failed write reads as not ready: need() raises it."""
        staged = self.wait_writes and self._staged(mp)
        for g in self.optimizer.groups_of.get(id(mp), ()):
            k = self.pos.get(g.index)
            if k is None:
                continue
            if k >= self.next:
                return False
            if self.wait_writes and not staged:
                try:
                    if not self.pipe.written(g.state):
                        return False
                except BaseException:  # noqa: BLE001 - need() of this parameter raises it
                    return False
        return True

    def need(self, mp) -> None:
        """Finish the walk through mp's groups (and their writes, in alias mode), then advance it without
        waiting."""
        t0 = time.perf_counter()
        groups = [g for g in self.optimizer.groups_of.get(id(mp), ()) if g.index in self.pos]
        if groups:
            last = max(self.pos[g.index] for g in groups)
            while self.next <= last:
                self._run_next(stage=True)
            if self.wait_writes and not self._staged(mp) and not self._prefetched(mp):
                for g in groups:
                    self.pipe.wait_written(g.state)
        self.poll()
        self.wait_s += time.perf_counter() - t0

    def advance(self) -> None:
        """poll(), its time counted as the walk's wait (a prefetch asked)."""
        t0 = time.perf_counter()
        self.poll()
        self.wait_s += time.perf_counter() - t0

    def poll(self) -> None:
        """Step every group whose state has already been read, then start reads ahead while buffers are free."""
        while not self.done and self.groups[self.next].state.ready() and self.groups[self.next].state.read_landed():
            self._run_next(stage=True)
        self.pipe.reap()
        for g in self.groups[self.next:]:
            if not g.state.io_bytes:
                continue  # a state in memory is read by nothing
            self.pipe.ahead(g.state)
            if not g.state.ready():
                break  # no buffer free: the next ask tries again

    def settle(self) -> None:
        """Finish every remaining group and wait for every write."""
        t0 = time.perf_counter()
        while not self.done:
            self._run_next(stage=False)  # what forward did not need: nobody is about to read its shards
        self.pipe.finish()
        self.wait_s += time.perf_counter() - t0

    def abandon(self, *, quiet: bool = False) -> None:
        """After an error (or at close, `quiet`): let what was started finish and give every buffer back. The
        groups not stepped keep their old state and lose their gradients, so the next backward does not add onto
        this step's."""
        self.pipe.abandon()
        if self.wait_writes:  # a copy may be of a group whose step failed part-way: reads go to the files
            self.optimizer.store.alias.drop_staged()
        left = self.groups[self.next:]
        for g in left:
            g.state.abandon()  # a read started for it and not yet taken by the walk
            g.grad = None
            for mp in g.params:
                mp.grad = None
        if left and not quiet:
            log.warning("infinity: the optimizer step was cut short: %d of %d sub-groups deferred to forward were "
                        "not stepped and keep their previous values (their gradients are dropped); restart from a "
                        "checkpoint for an exact run", len(left), len(self.groups))

    def _staged(self, mp) -> bool:
        return self.optimizer.store.alias.staged(mp.home.swap_id(mp))

    def _prefetched(self, mp) -> bool:
        """A prefetch of mp's shard is in flight: it started once ready() said so, so it reads no stale file."""
        scheduler = self.optimizer.store.scheduler
        return scheduler is not None and mp.home.swap_id(mp) in scheduler.inflight

    def _stage(self, g, views) -> None:
        """Copy g's whole shards' new values into free parameter-pool buffers (see [Note: stepped shards are
        staged]), until none is free."""
        reader = self.optimizer.store.alias
        src = views.lowp if views.lowp is not None else views.param
        if g.split:  # one piece: into the buffer its shard's first staged piece took
            (mp, off, lo, hi), = g.entries()
            reader.stage_piece(mp.home.swap_id(mp), lo, src[off:off + hi - lo], mp.part)
            return
        for mp, off in zip(g.params, g.offsets):  # a group that is not a piece holds whole shards
            if not reader.stage(mp.home.swap_id(mp), src[off:off + mp.part]):
                return

    def _run_next(self, *, stage: bool) -> None:
        g = self.groups[self.next]
        after = self.groups[self.next + 1].state if self.next + 1 < len(self.groups) else None
        work = self.works[g.index]
        if stage and self.wait_writes:
            def work(views, adam=work, g=g):
                adam(views)
                self._stage(g, views)
        self.pipe.run(g.state, work, then=after)
        self.next += 1
        g.grad = None  # its gradient has been used; the next backward starts a new buffer
        for mp in g.params:
            mp.grad = None
