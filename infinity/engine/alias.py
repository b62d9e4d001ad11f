"""Parameter shards read straight from the optimizer's swap files (fp32: the master; bf16/fp16: a tail copy).

[Note: fp32 shards live in the optimizer file]
In fp32 the parameter a forward needs is exactly the master weight the
optimizer keeps, and an NVMe sub-group's file is [p | m | v]. Writing the
shard to a file of its own after every step would move 4 more bytes per
parameter (36 instead of 32) for a second copy of the same numbers. So when
compute is fp32 and both parameters and optimizer are on NVMe, a shard is
read from its slice of the p region of its group's file, and never written
by the parameter store. Its CRC-32C is taken from the bytes the group's write
carries (on the swapper's write reaper, before that write completes; at setup
when the first state is made) and checked after each read; the
file's own header checksum still covers the whole group on the optimizer's
reads. The shards tile the p region, so their CRCs, combined, are the CRC of
p, and the group's checksum continues from there over m and v: each byte is
checksummed once per write. Reads of a group's slices never race its write: a shard's group is
written only once its gradient is final, after its last use in the step,
and every write has landed before the next forward starts. From the moment
the optimizer produces new values until the write's reaper has taken their
CRCs, a shard's expected CRC is PENDING: a read then (a write whose
submission failed, and a caller who carried on) raises instead of accepting
the file's older weights.

[Note: compute-dtype shards in the optimizer file]
With bf16 (or fp16) compute the shard is not the master but its rounding,
which CPU Adam writes in the same pass that updates the master. Kept in a
file of its own, each step staged Adam's output into a parameter-pool buffer
per shard and wrote it as a separate request: a copy, a wait for a free
parameter buffer (the same buffers backward's prefetches use), and one
more write per parameter. Instead, an NVMe sub-group's partition gets a
write-only tail (Partition.tail_nbytes): its buffer is
[p | m | v | w], where w is the n weights in the compute dtype, and the kernel
writes w straight into it (AdamViews.lowp). The group's one write carries
w; its reads bring in only [p | m | v] (w is never an input to Adam), so the
bytes per step are unchanged (forward 2 + read 12 + write 12 + 2) and the
copy, the extra requests and the parameter-pool waits are gone. A forward
reads a shard as its slice of w, exactly as in fp32 above, with the same
checksum scheme: the header's CRC covers [p | m | v] only, and each slice's
CRC is taken on the write reaper from the bytes being written (at setup and
at a checkpoint load, too: every write of the state writes w, from the
master when Adam did not). The pool's buffers grow by 2 bytes per
sub-group parameter (SwapContext.for_optimizer), the parameter pool serves
reads only.
"""

from __future__ import annotations

import torch

from infinity.errors import SwapCorruptionError
from infinity.io.checksum import crc32c, crc32c_combine
from infinity.swap.swapper import combined_crc, read_extents, wait_all, wait_all_quietly

PENDING = -1  # no CRC-32C is negative: the shard's new values are not known to be in its file yet


class _SliceFuture:
    """The read of one shard: one read per piece (one, unless the shard is split over sub-groups; a piece over
    two chunks of a striped file is two), each piece checked against its own CRC-32C."""

    def __init__(self, reader, sid, reads, view):
        self._reader, self._sid, self._reads, self._view = reader, sid, reads, view

    def wait(self):
        try:
            wait_all(f for futs, *_ in self._reads for f in futs)  # every read lands before the buffer goes back
            for futs, lengths, expected, path in self._reads:
                if expected == PENDING:
                    raise RuntimeError(f"{self._sid}: the last write of its optimizer sub-group ({path}) has not "
                                       "completed, so the file holds older weights than the optimizer. Either an "
                                       "earlier error stopped it (restart from a checkpoint), or backward read the "
                                       "parameter again after its sub-group had stepped during backward (reentrant "
                                       "activation checkpointing of a parameter also used outside the checkpoint: "
                                       "use non-reentrant checkpointing, or set gradient_clipping to step after "
                                       "backward)")
                if expected is not None:
                    actual = combined_crc(futs, lengths)  # a piece over two chunks of a striped file: both
                    if actual != expected:
                        raise SwapCorruptionError(path, self._sid, expected, actual)
        except BaseException:
            self._reader.release(self._sid)  # the caller never gets the buffer
            raise
        return self._view


class _Staged:
    """What swap_in returns for a staged shard: its values are in the buffer already; nothing was read."""

    from_memory = True

    def __init__(self, view):
        self._view = view

    def wait(self):
        return self._view


def slice_id(mp) -> str:
    """The id of mp's shard among the reader's slices (what NvmeHome.swap_id gives in alias mode)."""
    return f"alias/{mp.index}"


class OptimizerSliceReader:
    """The scheduler's reader in alias mode: swap_in/release like a TensorSwapper, over slices of the optimizer's
    files that hold shards in `dtype` (fp32: the master; a compute dtype: the tail)."""

    def __init__(self, store, dtype: torch.dtype = torch.float32):
        self.pool = store.swap.pool
        self.aio = store.swap.io
        self.checksums = store.swap.swapper.checksums
        self.dtype = dtype
        self.itemsize = torch.empty((), dtype=dtype).element_size()
        # sid -> its pieces, in order: (the group's NvmeState, byte offset in its partition's content, elements,
        # at, key); the files and offsets come from its swapper's extents of its live slot when read
        self.where: dict[str, list] = {}
        self.crc: dict[str, int] = {}  # by piece key: of the bytes in the live slots' files
        self._next_crc: dict[str, int] = {}  # by piece key: of a speculative write's (commit_pending)
        self._held: dict = {}
        self._staged: dict = {}  # sid -> a pool buffer holding the shard's newest values (stage())
        self._partial: dict = {}  # sid -> [its buffer, elements in so far]: a split shard being staged

    @staticmethod
    def key(sid: str, at: int) -> str:
        """The name a piece of shard `sid` starting at its element `at` is checksummed under (the shard's own id
        for a whole shard; see [Note: a large shard is split over sub-groups of its own] in optimizer.py)."""
        return sid if at == 0 else f"{sid}@{at}"

    def place(self, sid: str, state, offset: int, numel: int, *, at: int = 0) -> None:
        """Shard `sid`'s elements [at, at + numel) are values of self.dtype at byte `offset` of the content of
        sub-group state `state`'s live partition (an NvmeState of the optimizer's swapper; one file, or chunks on
        several disks: [Note: several NVMe paths] in swap/swapper.py). Pieces are placed in order; at 0 starts
        the shard afresh."""
        piece = (state, offset, numel, at, self.key(sid, at))
        if at == 0:
            self.where[sid] = [piece]
        else:
            self.where[sid].append(piece)

    def files_of(self, sid: str) -> list[tuple[str, int, int]]:
        """(path, file offset, bytes) of each stretch of file that holds shard `sid`, in order."""
        return [(path, off, n) for state, offset, numel, _, _ in self.where[sid]
                for _, path, off, _, n in state.swapper.extents(state.id, offset, offset + numel * self.itemsize)]

    def record(self, sid: str, values: torch.Tensor) -> None:
        """The optimizer just produced this shard's new values (they are about to be written)."""
        if self.checksums:
            self.crc[sid] = crc32c(values, values.numel() * self.itemsize)

    def record_on_write(self, swapper, state_id: str, shards: list[tuple[str, int, int]], *,
                        pending: bool = False) -> None:
        """The optimizer just produced these shards' values ((sid, byte offset in the buffer, numel) of
        sub-group partition `state_id`); take their checksums from the bytes of that partition's next write.
        `pending`: that write goes to a slot not yet live ([Note: a speculative step writes a second slot] in
        swap/state.py), so the checksums wait for commit_pending(), and reads keep checking the live slot's."""
        if not self.checksums:
            return
        crcs = self._next_crc if pending else self.crc
        for sid, _, _ in shards:
            crcs[sid] = PENDING
        size = self.itemsize

        def take(buf):
            # Shards that tile the partition from its first byte (fp32: the p region) hand their CRCs on,
            # combined, so that the partition's own checksum does not read those bytes a second time.
            end, whole = 0, 0
            for sid, off, numel in shards:
                crc = crc32c(buf.tensor[off:off + numel * size], numel * size)
                crcs[sid] = crc
                if end is not None and off == end:
                    whole, end = crc32c_combine(whole, crc, numel * size), end + numel * size
                else:
                    end = None
            return None if not end else (end, whole)

        swapper.on_next_write(state_id, take)

    def commit_pending(self) -> None:
        """The speculative writes' slots are live now: their checksums are the ones reads check."""
        self.crc.update(self._next_crc)
        self._next_crc = {}

    def drop_pending(self) -> None:
        """The speculative writes were rolled back: reads go on checking the live slots' checksums."""
        self._next_crc = {}

    def stage(self, sid: str, values: torch.Tensor) -> bool:
        """Keep a copy of shard `sid`'s new values (the optimizer just produced them and their write is in
        flight) in a free pool buffer, for the next swap_in of `sid` instead of a read of the file that must wait
        for the write (see [Note: stepped shards are staged] in engine/deferred.py). False, and nothing kept,
        when no buffer is free beyond the one the critical path needs."""
        if sid in self._staged:
            raise RuntimeError(f"OptimizerSliceReader: {sid} is already staged")
        buf = self.pool.try_acquire(f"stage {sid}", reserve=1, nbytes=values.numel() * self.itemsize)
        if buf is None:
            return False
        try:
            buf.view(self.dtype, values.numel()).copy_(values)
        except BaseException:
            self.pool.release(buf)
            raise
        self._staged[sid] = (buf, values.numel())
        return True

    def stage_piece(self, sid: str, at: int, values: torch.Tensor, total: int) -> bool:
        """stage() for a shard split over sub-groups: its elements [at, at + values.numel()) of `total`, as one
        piece's group steps. The first piece (at 0) takes the buffer (False, and nothing kept, when none is
        free); the shard is staged once every element is in. A piece whose shard has no buffer is not kept."""
        if sid in self._staged:
            raise RuntimeError(f"OptimizerSliceReader: {sid} is already staged")
        partial = self._partial.get(sid)
        if partial is None:
            if at != 0:  # its first piece found no buffer (or was not staged): the shard is read from the file
                return False
            buf = self.pool.try_acquire(f"stage {sid}", reserve=1, nbytes=total * self.itemsize)
            if buf is None:
                return False
            partial = self._partial[sid] = [buf, 0]
        buf = partial[0]
        try:
            buf.view(self.dtype, total)[at:at + values.numel()].copy_(values)
        except BaseException:
            del self._partial[sid]
            self.pool.release(buf)
            raise
        partial[1] += values.numel()
        if partial[1] == total:
            del self._partial[sid]
            self._staged[sid] = (buf, total)
        return True

    def staged(self, sid: str) -> bool:
        return sid in self._staged

    def drop_staged(self) -> None:
        """Give back every staged copy not taken, whole or in part (before the optimizer next changes the
        state)."""
        staged, self._staged = self._staged, {}
        partial, self._partial = self._partial, {}
        for buf, _ in [*staged.values(), *partial.values()]:
            self.pool.release(buf)

    def swap_in(self, sid: str, *, prefetch: bool = False, reserve: int = 0):
        if sid in self._held:
            raise RuntimeError(f"OptimizerSliceReader: {sid} is already being read")
        staged = self._staged.pop(sid, None)
        if staged is not None:
            buf, numel = staged
            self._held[sid] = buf
            return _Staged(buf.view(self.dtype, numel))
        partial = self._partial.pop(sid, None)
        if partial is not None:  # not every piece was staged (a walk settled without staging): the file has them
            self.pool.release(partial[0])
        pieces = self.where[sid]
        need = (pieces[-1][3] + pieces[-1][2]) * self.itemsize
        buf = (self.pool.try_acquire(f"read {sid}", reserve=reserve, nbytes=need) if prefetch
               else self.pool.acquire(f"read {sid}", nbytes=need))
        if buf is None:
            return None
        self._held[sid] = buf
        reads = []
        try:
            for state, offset, numel, at, key in pieces:
                expected = self.crc.get(key)
                swapper = state.swapper
                extents = [(aio, path, file_offset, at * self.itemsize + start - offset, n) for aio, path,
                           file_offset, start, n in swapper.extents(state.id, offset,
                                                                    offset + numel * self.itemsize)]
                # With one disk, through the store's own handle: a queue beside the optimizer's.
                futs, lengths = read_extents(extents, buf.tensor, checksum=expected not in (None, PENDING),
                                             aio=None if len(swapper.aios) > 1 else self.aio)
                reads.append((futs, lengths, expected, " and ".join(e[1] for e in extents)))
        except BaseException:  # this piece's submitted reads have landed (read_extents); the others' too, now
            wait_all_quietly(f for futs, *_ in reads for f in futs)
            self.release(sid)
            raise
        total = pieces[-1][3] + pieces[-1][2]
        return _SliceFuture(self, sid, reads, buf.view(self.dtype, total))

    def release(self, sid: str, **_) -> None:
        buf = self._held.pop(sid, None)
        if buf is not None:
            self.pool.release(buf)
