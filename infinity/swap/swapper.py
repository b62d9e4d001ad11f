"""TensorSwapper: moves registered partitions between pool buffers and swap files.

On-disk layout (one file per partition, `<nvme_path>/infinity-swap/[<kind>-]rank<R>/<name>.swp`; with several
nvme_paths, each file is under one of them: [Note: several NVMe paths]):
  bytes [0, 4096)      header: UTF-8 JSON, padded with spaces: {"magic": "infinity-swap", "version": 1,
                       "id": ..., "dtype": "float32", "numel": N, "nbytes": B, "crc32c": C or null}
  bytes [4096, 4096+B) the partition's raw little-endian bytes (C-order), B = numel x element size
  bytes [4096+B, 4096+B+T) a write-only tail, when the header has "tail_nbytes": T (Partition.tail_nbytes);
                       swap_in never reads it and "crc32c" does not cover it
  striped over D > 1 disks, the header also has "disks": D, and the file holds the first chunk only
The directory also holds `owner.pid`, flocked by the swapper that owns it
([Note: directories are owned through flock] in infinity/dirlock.py). A
directory whose lock is free holds leftovers of a crashed run: `leftovers="clear"` removes them, `"reuse"`
registers every file whose header parses (its checksum is verified on first
read; a write of another layout before any read replaces the file, since a
new run's layout wins over a dead one's), `"error"` refuses to start. A clean
close removes the directory.

[Note: header last]
A swap-out submits only the data write on the caller's thread. The reaper
then computes the CRC-32C of the buffer while that write is in flight (both
only read the buffer), and submits the header once the CRC is known. So the
checksum costs the step thread nothing. A crash can land between the two
writes either way round; the header then does not match the data, and the
next read reports the corruption.

[Note: several NVMe paths]
nvme_path may list several directories, one per disk. Each gets its own
rank directory (claimed, cleared and removed as one alone is) and its own
AsyncIO handle, so that each disk has its own queue and threads. A
partition of at least MIN_STRIPE bytes per disk is striped: its content
(data and tail) is cut into N chunks of equal size (4 KiB multiples), chunk
k in file `<name>.k.swp` (chunk 0: `<name>.swp`, with the header) on disk
(first + k) mod N, at the same offset as in a whole file; so every read and
write of it keeps all disks busy at once. A smaller partition is one file,
on the disks in turn. `first` is the partition's turn: the k-th partition
this swapper meets goes first to disk k mod N, spreading the headers and
the small files. Placing whole files in turn was measured first: on two
disks throttled to 100 MB/s each, a gpt-25m step moved 1.68x the bytes per
second of one disk, because the deferred step's read of one group and write
of another often hit the same disk (bench/RESULTS.md has the striped
figure). A read's CRC is the chunks' CRCs combined (crc32c_combine).
Forward's reads of shards kept in the optimizer's files (engine/alias.py)
take the extents of their bytes from `extents`, each through its disk's
handle; with one directory, through the parameter store's own handle, a
queue beside the optimizer's. DeepSpeed answers several disks with "build
a RAID-0" (its issue 2195).

[Note: who releases a swap-out buffer]
A swap-out hands its pool buffer to the write. The swapper's reaper thread
waits for the write and then, on success, returns the buffer to the pool
(ON_DISK); on failure it keeps the bytes in the buffer (IN_CPU) and the
error is raised by the future. So buffers come back without anyone waiting,
and a caller that holds one buffer may block for another: pending writes
finish on their own.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import queue
import re
import shutil
import threading
import time
import warnings
from dataclasses import dataclass

import torch

from infinity.dtypes import BY_NAME, name_of
from infinity.errors import DirectoryInUse, SwapCorruptionError
from infinity.io import AsyncIO, aligned_empty
from infinity.io.checksum import crc32c, crc32c_combine
from infinity.dirlock import DirLock, probe
from infinity.swap.pool import BufferPool
from infinity.swap.registry import Partition, Registry, Residency
from infinity.swap.tier import HOST

HEADER = 4096
MIN_STRIPE = 1 << 20
"""A partition with fewer bytes than this per disk is not striped ([Note: several NVMe paths])."""
_CLAIMED: set = set()  # rank directories claimed by swappers of this process
_CLAIMED_LOCK = threading.Lock()


class SwapFuture:
    """The outcome of a swap_in (a tensor view in a pool buffer) or swap_out (None)."""

    def __init__(self, label: str = ""):
        self._done = threading.Event()
        self._value = None
        self._error: BaseException | None = None
        self.label = label
        self.t_submit = time.perf_counter()  # for telemetry: the I/O span is [t_submit, t_done]
        self.t_done = None

    def _set(self, value=None, error: BaseException | None = None):
        self._value, self._error = value, error
        self.t_done = time.perf_counter()
        self._done.set()

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None):
        if not self._done.wait(timeout):
            raise TimeoutError(f"swap not finished after {timeout} s")
        if self._error is not None:
            raise self._error
        return self._value


@dataclass(slots=True)
class _Reap:
    """One item of a reaper's queue: a swap whose native requests the reaper waits for, then finishes."""

    kind: str
    """"in" (a read), "out" (a data write; the reaper adds the header write), or "barrier" (flush)."""
    part: Partition | None
    futures: list
    """The native I/O futures of the swap."""
    done: SwapFuture
    """What the caller holds; set once the swap has finished or failed."""
    lengths: tuple = ()
    """A read's bytes per future, in order (a striped partition's chunks: their CRCs combine)."""


def chunk_layout(nbytes: int, disks: int, first: int) -> list[tuple[int, int, int]]:
    """(disk, first byte, end byte) of each chunk of a partition of `nbytes` content bytes whose turn is
    `first`, on `disks` disks ([Note: several NVMe paths]). Its files take HEADER + (end - first byte) bytes
    each (chunk 0's header; the others keep the same offsets)."""
    if disks == 1 or nbytes < disks * MIN_STRIPE:
        return [(first % disks, 0, nbytes)]
    size = -(-(-(-nbytes // disks)) // 4096) * 4096
    return [((first + k) % disks, lo, min(nbytes, lo + size)) for k, lo in enumerate(range(0, nbytes, size))]


def read_extents(extents, into: torch.Tensor, *, checksum: bool, aio=None) -> tuple[list, list]:
    """Submit a read of each extent ((AsyncIO, path, file offset, byte in `into`, bytes), as
    TensorSwapper.extents gives them, with the byte made relative to `into`), through its own handle or `aio`;
    (futures, lengths). If a submission fails, the reads already submitted are waited for before the error
    goes on: the caller may then hand `into` back."""
    futs, lengths = [], []
    try:
        for handle, path, offset, at, n in extents:
            futs.append((aio or handle).pread(into[at:], path, offset, nbytes=n, checksum=checksum))
            lengths.append(n)
    except BaseException:
        wait_all_quietly(futs)
        raise
    return futs, lengths


def combined_crc(futs, lengths) -> int:
    """The CRC-32C of the bytes the reads `futs` (of `lengths` bytes, in order) took, each taken by the I/O
    thread that finished it ([Note: checksum on completion]); 0 for no bytes."""
    crc = 0
    for fut, n in zip(futs, lengths):
        crc = crc32c_combine(crc, fut.crc32c(), n)
    return crc


def wait_all_quietly(futures) -> None:
    """Wait for every future, ignoring their errors (an error path that raises its own)."""
    for f in futures:
        try:
            f.wait()
        except BaseException:  # noqa: BLE001 - the caller raises the error that matters
            pass


def wait_all(futures) -> None:
    """Wait for every future, even after one has failed; then raise the first error."""
    first = None
    for f in futures:
        try:
            f.wait()
        except BaseException as exc:  # noqa: BLE001 - the first error is raised below
            first = first or exc
    if first is not None:
        raise first


class TensorSwapper:
    """Swap partitions in and out of files under `directory` (one, or a list: [Note: several NVMe paths]),
    through `pool`."""

    def __init__(self, directory, pool: BufferPool, aio=None, *, rank: int = 0, kind: str = "",
                 checksums: bool = True, leftovers: str = "clear", registry: Registry | None = None,
                 world: int | None = None):
        """`aio`: one AsyncIO for every directory, or a list of one per directory (None: made here).
        `world`, the job's number of ranks, lets rank 0 clear the directories of ranks at or beyond it that
        a larger run left (leftovers "clear"): see [Note: a smaller run clears a larger one's dead ranks]."""
        if leftovers not in ("clear", "reuse", "error"):
            raise ValueError(f"TensorSwapper: leftovers must be clear, reuse or error, got {leftovers!r}")
        roots = [os.fspath(d) for d in directory] if isinstance(directory, (list, tuple)) else [os.fspath(directory)]
        if not roots:
            raise ValueError("TensorSwapper: no directory given")
        if isinstance(aio, (list, tuple)) and len(aio) != len(roots):
            raise ValueError(f"TensorSwapper: {len(aio)} AsyncIO handles for {len(roots)} directories; give one "
                             "per directory, or one for all")
        self.pool = pool
        self._own_aio = aio is None
        self.aios = list(aio) if isinstance(aio, (list, tuple)) else [aio or AsyncIO()] * len(roots)
        self.aio = self.aios[0]
        self.registry = registry or Registry()
        self.checksums = checksums
        # `kind` keeps two swappers of one rank (parameters, optimizer state) in separate directories.
        sub = f"{kind}-rank{rank}" if kind else f"rank{rank}"
        self.dirs = [os.path.join(root, "infinity-swap", sub) for root in roots]
        self.dir = self.dirs[0]
        self._slot: dict[str, int] = {}  # part id -> its directory's index (see the note)
        self._owners: list = []
        self.rank = rank
        self.kind = kind
        self._crc: dict[str, int | None] = {}
        # Re-entrant: swap_out of a partition in memory submits its write (_write) under the lock, and a failed
        # submission (an OSError, or a KeyboardInterrupt landing there) takes it again to undo the transition; a
        # plain Lock hung the rank there, with the read reaper stuck behind it.
        self._lock = threading.RLock()
        self._stale: set[str] = set()  # ids adopted from a crashed run's files, not yet read or written by this one
        self._claim_keys: list = []
        try:
            self.leftovers_found = self._claim_directory(leftovers)
            if rank == 0 and world is not None and leftovers == "clear":
                self._clear_dead_ranks(world)
        except BaseException:
            self._unclaim()
            raise
        # One reaper for reads and one for writes: a read that has landed is checked and handed over at
        # once, not after the writes queued before it (see [Note: who releases a swap-out buffer]).
        self._reads: queue.Queue = queue.Queue()
        self._writes: queue.Queue = queue.Queue()
        self._headers: list = []  # 4 KiB aligned header buffers, reused by the write reaper
        self._on_write: dict = {}  # part id -> fn(buffer), run by the write reaper at its next write
        self._header_of: dict = {}
        self._reapers = [threading.Thread(target=self._reap_loop, args=(q,), name=f"infinity-swap-{n}-reaper",
                                          daemon=True) for q, n in ((self._reads, "read"), (self._writes, "write"))]
        for t in self._reapers:
            t.start()
        self.bytes_written = 0
        self.bytes_read = 0
        self._closed = False

    # ------------------------------------------------------------ directory

    def _claim_directory(self, policy: str) -> int:
        """Claim every directory (each under its own lock) and deal with a crashed run's files in it; the
        number of such files."""
        return sum(self._claim_one(k, d, policy) for k, d in enumerate(self.dirs))

    def _claim_one(self, k: int, directory: str, policy: str) -> int:
        key = os.path.realpath(directory)
        with _CLAIMED_LOCK:
            if key in _CLAIMED:
                raise RuntimeError(f"TensorSwapper: {directory} is already used by another swapper in this process; "
                                   "give each one its own directory or rank")
            _CLAIMED.add(key)
        self._claim_keys.append(key)
        # [Note: directories are owned through flock] in infinity/dirlock.py: one live owner, whoever races
        self._owners.append(DirLock(directory, what="TensorSwapper: the swap directory",
                                    fix="give each job its own nvme_path"))
        found = [f for f in os.listdir(directory) if f.endswith(".swp")]
        if found:  # the lock was free: whoever wrote them is gone
            if policy == "error":
                raise RuntimeError(f"TensorSwapper: {directory} holds {len(found)} swap files from a crashed run; "
                                   'remove them, or set infinity.leftovers to "clear" or "reuse"')
            if policy == "clear":
                for f in found:
                    os.unlink(os.path.join(directory, f))
                warnings.warn(f"infinity: removed {len(found)} swap files left in {directory} by a crashed run",
                              stacklevel=4)
            else:
                reused = sum(self._adopt(os.path.join(directory, f), k) for f in found)
                warnings.warn(f"infinity: reusing {reused} of {len(found)} swap files left in {directory}",
                              stacklevel=4)
        return len(found)

    def _clear_dead_ranks(self, world: int) -> None:
        """[Note: a smaller run clears a larger one's dead ranks]
        Each rank clears the leftovers of its own directory as it claims it (`_claim_directory`). A run killed
        with 4 ranks and followed by one with 2 on the same nvme_path leaves rank2/ and rank3/ to nobody: no
        rank of the smaller run claims them, and their files hold the disk forever. So rank 0 also removes the
        files of every sibling directory of this kind numbered at or beyond `world`, where it can take that
        directory's lock (whoever held it is gone); a directory another live job holds is left alone."""
        pattern = re.compile(re.escape(f"{self.kind}-rank" if self.kind else "rank") + r"(\d+)")
        for parent in (os.path.dirname(d) for d in self.dirs):
            removed = 0
            for name in sorted(os.listdir(parent)):
                m = pattern.fullmatch(name)
                if m is None or int(m.group(1)) < world:
                    continue
                path = os.path.join(parent, name)
                try:
                    removed += self._clear_dead(path)
                except (OSError, DirectoryInUse):  # not ours to clear (another user's, read-only, live, gone): left
                    continue
            if removed:
                warnings.warn(f"infinity: removed {removed} swap files that dead ranks (numbered {world} and up) of "
                              f"an earlier, larger run left in {parent}", stacklevel=4)

    @staticmethod
    def _clear_dead(path: str) -> int:
        """The swap files of `path`, removed under its lock if its owner is gone (its owner.pid unlocked); the
        number removed. A directory without owner.pid, or on a filesystem without flock, is left alone."""
        if probe(path) is not False:
            return 0
        lock = DirLock(path, what="TensorSwapper: the swap directory", fix="")
        try:
            if not lock.held:
                return 0
            files = [f for f in os.listdir(path) if f.endswith(".swp")]
            for f in files:
                os.unlink(os.path.join(path, f))
        finally:
            lock.release()
        try:
            os.rmdir(path)
        except OSError:  # something else is in it: left as it is
            pass
        return len(files)

    def _unclaim(self) -> None:
        for owner in self._owners:
            owner.release()
        with _CLAIMED_LOCK:
            for key in self._claim_keys:
                _CLAIMED.discard(key)

    def _adopt(self, path: str, k: int) -> bool:
        try:
            with open(path, "rb") as f:
                head = json.loads(f.read(HEADER).decode("utf-8"))
            if head.get("magic") != "infinity-swap" or head.get("dtype") not in BY_NAME:
                return False
            if head.get("disks", 1) != len(self.dirs):  # striped over another number of disks: not this layout
                return False
            self.registry.register(head["id"], dtype=BY_NAME[head["dtype"]], numel=int(head["numel"]),
                                   tail_nbytes=int(head.get("tail_nbytes", 0)))
            self._crc[head["id"]] = head.get("crc32c")
            self._stale.add(head["id"])
            self._slot[head["id"]] = k
            return True
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return False  # not one of ours, or torn: left for a later run's "clear"

    def path_of(self, part_id: str) -> str:
        """The file of part_id that holds its header (its only file unless it is striped)."""
        return self._file(part_id, 0, self._directory_of(part_id))

    def _file(self, part_id: str, chunk: int, disk: int) -> str:
        safe = re.sub(r"[^A-Za-z0-9._-]", "_", part_id)[:80]
        digest = hashlib.sha1(part_id.encode()).hexdigest()[:8]
        return os.path.join(self.dirs[disk], f"{safe}-{digest}{f'.{chunk}' if chunk else ''}.swp")

    def aio_of(self, part_id: str):
        """The AsyncIO handle of the disk that holds part_id's header."""
        return self.aios[self._directory_of(part_id)]

    def _chunks(self, part_id: str, nbytes: int) -> list[tuple[int, int, int]]:
        return chunk_layout(nbytes, len(self.dirs), self._directory_of(part_id))

    def extents(self, part_id: str, lo: int = 0, hi: int | None = None) -> list[tuple]:
        """Where bytes [lo, hi) of part_id's content are (default: all of it, tail included): (AsyncIO, path,
        file offset, content offset, bytes) for each file holding some, in order."""
        part = self.registry[part_id]
        hi = part.write_nbytes if hi is None else hi
        out = []
        for k, (disk, a, b) in enumerate(self._chunks(part_id, part.write_nbytes)):
            s, e = max(a, lo), min(b, hi)
            if s < e:
                out.append((self.aios[disk], self._file(part_id, k, disk), HEADER + s - a, s, e - s))
        return out

    def _directory_of(self, part_id: str) -> int:
        """Its directory's index: fixed the first time a partition is met, the next in turn ([Note: several
        NVMe paths])."""
        k = self._slot.get(part_id)
        if k is None:
            with self._lock:
                k = self._slot.setdefault(part_id, len(self._slot) % len(self.dirs))
        return k

    # ------------------------------------------------------------ swap out

    def swap_out(self, part_id: str, tensor: torch.Tensor, *, tail_nbytes: int = 0) -> SwapFuture:
        """Write `tensor` as partition `part_id`; its pool buffer returns when the write lands.

        If the partition is IN_CPU and `tensor` is its buffer's view (modified
        in place after swap_in), no copy is made. A partition with a tail
        (`tail_nbytes`, see Partition) is written from the buffer it holds,
        tail included: it must be IN_CPU, and the caller must have filled the
        tail (swap_in never reads it, so after one the buffer holds stale bytes there).
        """
        self._check_open()
        if tensor.device != HOST or not tensor.is_contiguous():
            raise ValueError(f"swap_out({part_id!r}): needs a contiguous CPU tensor")
        part = self._partition_for(part_id, tensor.dtype, tensor.numel(), tail_nbytes)
        with self._lock:
            if part.residency is Residency.IN_CPU:
                # The write starts under the same lock as the check, so no
                # release() can slip in between (see [Note: residency transitions]).
                buf = part.buffer
                view = buf.view(part.dtype, part.numel)
                if tensor.data_ptr() != view.data_ptr():
                    view.copy_(tensor.reshape(-1))
                part.begin_write()
                return self._write(part, buf)
            if part.residency is not Residency.ON_DISK:
                raise RuntimeError(f"swap_out({part_id!r}): partition is {part.residency.name}; wait for its "
                                   "pending swap first")
            if part.tail_nbytes:
                raise ValueError(f"swap_out({part_id!r}): a partition with a {part.tail_nbytes}-byte tail is "
                                 "written from the buffer that holds it (swap it in, or use swap_out_buffer)")
        buf = self.pool.acquire(owner=f"swap_out:{part_id}", nbytes=part.nbytes)
        try:
            buf.view(part.dtype, part.numel).copy_(tensor.reshape(-1))
            with self._lock:
                part.begin_write(buf)  # raises if another thread got there first
        except BaseException:
            self.pool.release(buf)
            raise
        return self._write(part, buf)

    def swap_out_buffer(self, part_id: str, buf, dtype: torch.dtype, numel: int, *,
                        tail_nbytes: int = 0) -> SwapFuture:
        """Write the first numel `dtype` values of a pool buffer the caller holds (and `tail_nbytes` after them,
        see Partition); the swapper takes it over.

        This is how state is first written without a second buffer. On an
        argument error the buffer stays the caller's.
        """
        self._check_open()
        need = numel * dtype.itemsize + tail_nbytes
        if need > self.pool.size:  # before registering: a refused call leaves nothing behind
            raise ValueError(f"swap_out_buffer({part_id!r}): {need} bytes do not fit a {self.pool.size}-byte pool "
                             "buffer")
        part = self._partition_for(part_id, dtype, numel, tail_nbytes)
        with self._lock:
            part.begin_write(buf)  # asserts ON_DISK or IN_CPU
        return self._write(part, buf)

    def preallocate(self, part_id: str, dtype: torch.dtype, numel: int, *, tail_nbytes: int = 0) -> bool:
        """Register `part_id` as swap_out would and reserve its files' blocks now (posix_fallocate), so that its
        first write does not extend them: an O_DIRECT write past the end of a file allocates as it goes (and
        libaio may block in submission). False, with nothing reserved, where the filesystem cannot (EOPNOTSUPP,
        EINVAL): the first write allocates, as for any new file. Any other failure (ENOSPC) raises an OSError
        naming the file."""
        self._check_open()
        self._partition_for(part_id, dtype, numel, tail_nbytes)
        for _, path, offset, _, n in self.extents(part_id):
            fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
            try:
                os.posix_fallocate(fd, 0, offset + n)
            except OSError as exc:
                if exc.errno in (errno.EOPNOTSUPP, errno.EINVAL):
                    return False
                raise OSError(exc.errno, f"reserving {offset + n:,} bytes for a swap file: {exc.strerror}",
                              path) from None
            finally:
                os.close(fd)
        return True

    def swap_out_as(self, src_id: str, dst_id: str, *, tail_nbytes: int = 0) -> SwapFuture:
        """Write the buffer partition `src_id` holds (read in, changed in place) as partition `dst_id`, and leave
        `src_id` on disk with the bytes its file had: a write to a second slot that keeps the first (see [Note: a
        speculative step writes a second slot] in swap/state.py). `src_id` must be IN_CPU and clean, `dst_id`
        on disk (or new); `dst_id` takes `src_id`'s numel and dtype, and `tail_nbytes`. A failed write leaves
        `dst_id` IN_CPU and dirty, holding the buffer (release it with discard=True to drop it)."""
        self._check_open()
        src = self.registry[src_id]
        dst = self._partition_for(dst_id, src.dtype, src.numel, tail_nbytes)
        with self._lock:
            if dst.residency is not Residency.ON_DISK:
                raise RuntimeError(f"swap_out_as({src_id!r}, {dst_id!r}): {dst_id} is {dst.residency.name}; "
                                   "wait for its pending swap first")
            buf = src.drop()  # refuses a dirty partition: its bytes are not in its file
            dst.begin_write(buf)
        return self._write(dst, buf)

    def on_next_write(self, part_id: str, fn) -> None:
        """Run fn(buffer) on the write reaper during the next write of `part_id` (the PoolBuffer it is written
        from, tail included), before its own checksum and before its future completes (an error fn raises goes
        to that future). fn may return (k, crc): the CRC-32C of the buffer's first k bytes, which the
        partition's checksum then continues from instead of reading them again. It replaces a hook set earlier
        and not yet run."""
        with self._lock:
            self._on_write[part_id] = fn

    def _write(self, part: Partition, buf) -> SwapFuture:
        """Submit the data write of a partition already in WRITING; on failure it goes back to IN_CPU.

        The checksum and the header are the reaper's job (see [Note: header last]).
        """
        futs = []
        try:
            _header_text(part, 0xFFFFFFFF)  # an id too long for the header fails here, not in the reaper
            for aio, path, offset, at, n in self.extents(part.id):
                futs.append(aio.pwrite(buf.tensor[at:], path, offset, nbytes=n))
        except BaseException:
            wait_all_quietly(futs)  # a chunk already submitted reads the buffer until it lands
            with self._lock:
                part.fail_write()
            raise
        out = SwapFuture(f"write {part.id}")
        self._writes.put(_Reap("out", part, futs, out))
        return out

    def _partition_for(self, part_id: str, dtype: torch.dtype, numel: int, tail_nbytes: int = 0) -> Partition:
        try:
            part = self.registry[part_id]
        except KeyError:
            return self.registry.register(part_id, dtype=dtype, numel=numel, tail_nbytes=tail_nbytes)
        layout = (dtype, numel, tail_nbytes)
        if part_id in self._stale:
            self._stale.discard(part_id)
            if (part.dtype, part.numel, part.tail_nbytes) != layout and part.residency is Residency.ON_DISK:
                # A dead run's file of another layout, never read by this run: this write replaces it.
                hook = self._on_write.get(part_id)
                self.remove(part_id)
                if hook is not None:  # set for this write (on_next_write), not for the dead run's file
                    self._on_write[part_id] = hook
                return self.registry.register(part_id, dtype=dtype, numel=numel, tail_nbytes=tail_nbytes)
        if (part.dtype, part.numel, part.tail_nbytes) != layout:
            def what(n, d, tail):
                return f"{n} x {d}" + (f" with a {tail}-byte tail" if tail else "")
            raise ValueError(f"swap_out({part_id!r}): registered as {what(part.numel, part.dtype, part.tail_nbytes)}"
                             f", got {what(numel, dtype, tail_nbytes)}")
        return part

    # ------------------------------------------------------------- swap in

    def swap_in(self, part_id: str, *, prefetch: bool = False, reserve: int = 0) -> SwapFuture | None:
        """Start reading a partition into a pool buffer; the future gives a typed view of it.

        With prefetch=True it never waits for a buffer: it returns None when
        the pool has none free (see BufferPool).
        """
        self._check_open()
        part = self.registry[part_id]
        with self._lock:
            done = self._already_in(part)  # no buffer taken for a partition in memory or on its way
            if done is not None:
                return done
        owner = f"swap_in:{part_id}"
        need = part.write_nbytes  # the tail too: the caller may write it before the buffer goes back out
        buf = (self.pool.try_acquire(owner, reserve=reserve, nbytes=need) if prefetch
               else self.pool.acquire(owner, nbytes=need))
        if buf is None:
            return None
        try:
            with self._lock:
                done = self._already_in(part)  # another thread read it, or started to, meanwhile
                if done is not None:
                    self.pool.release(buf)
                    return done
                part.begin_read(buf)
                self._stale.discard(part_id)  # read by this run: from now on its layout is the one it is read as
        except BaseException:
            if buf.owner is not None and part.buffer is not buf:
                self.pool.release(buf)
            raise
        try:
            futs, lengths = read_extents(self.extents(part_id, 0, part.nbytes), buf.tensor,
                                         checksum=self.checksums and self._crc.get(part_id) is not None)
        except BaseException:  # what was submitted has landed: the buffer can go back
            with self._lock:
                self.pool.release(part.fail_read())
            raise
        out = SwapFuture(f"read {part_id}")
        self._reads.put(_Reap("in", part, futs, out, tuple(lengths)))
        return out

    @staticmethod
    def _already_in(part: Partition) -> SwapFuture | None:
        """Under the lock: a done future for a partition in memory, None for one on disk (to be read); a
        partition on its way in or out is refused."""
        if part.residency is Residency.IN_CPU:
            done = SwapFuture()
            done._set(part.buffer.view(part.dtype, part.numel))
            return done
        if part.residency is not Residency.ON_DISK:
            raise RuntimeError(f"swap_in({part.id!r}): partition is {part.residency.name}; wait for its pending "
                               "swap first")
        return None

    def release(self, part_id: str, *, discard: bool = False) -> None:
        """Drop the in-memory copy of a partition whose file is current; its buffer goes back to the pool.

        Refused for a partition whose last write failed, unless discard=True.
        """
        part = self.registry[part_id]
        with self._lock:
            buf = part.drop(discard=discard)
        self.pool.release(buf)

    def remove(self, part_id: str) -> None:
        """Forget a partition that is ON_DISK and delete its swap files (its bytes are no longer needed)."""
        self._check_open()
        files = [(aio, path) for aio, path, *_ in self.extents(part_id)] or [(self.aio_of(part_id),
                                                                              self.path_of(part_id))]
        with self._lock:
            self.registry.unregister(part_id)
            self._crc.pop(part_id, None)
            self._on_write.pop(part_id, None)
        for aio, path in files:
            aio.forget(path)  # its cached fds would keep the file's blocks allocated
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass

    # ------------------------------------------------------------- reaping

    def _reap_loop(self, q: queue.Queue) -> None:
        while True:
            item = q.get()
            if item is None:
                return
            if item.kind == "barrier":
                item.done._set()
                continue
            futs, crc, error = item.futures, None, None
            if item.kind == "out":
                futs, crc, error = self._write_header(item.part, futs)
            for fut in futs:
                try:
                    fut.wait()
                except BaseException as exc:  # noqa: BLE001 - the reaper must never die
                    error = error or exc
                head = self._header_of.pop(id(fut), None)
                if head is not None:
                    self._headers.append(head)
            try:
                if item.kind == "out":
                    self._finish_out(item.part, crc, error, item.done)
                else:
                    self._finish_in(item.part, item.futures, item.lengths, error, item.done)
            except BaseException as exc:  # noqa: BLE001
                if not item.done.done():
                    item.done._set(None, exc)

    def _write_header(self, part: Partition, futs: list):
        """While the data write is in flight: checksum the buffer, then write the header (see the note)."""
        try:
            with self._lock:
                hook = self._on_write.pop(part.id, None)
            covered = hook(part.buffer) if hook is not None else None
            crc = None
            if self.checksums:
                k, crc = covered if covered is not None else (0, 0)
                if not 0 <= k <= part.nbytes:
                    raise ValueError(f"write hook of {part.id}: it covered {k} bytes of {part.nbytes}")
                crc = crc32c(part.buffer.tensor[k:], part.nbytes - k, seed=crc)
            head = self._headers.pop() if self._headers else aligned_empty(HEADER, pin=False)
            text = _header_text(part, crc, len(self.dirs))
            head.fill_(ord(" "))
            head[:len(text)] = torch.frombuffer(bytearray(text), dtype=torch.uint8)
            fut = self.aio_of(part.id).pwrite(head, self.path_of(part.id), 0)
            self._header_of[id(fut)] = head
            return futs + [fut], crc, None
        except BaseException as exc:  # noqa: BLE001 - reported through the swap's future
            return futs, None, exc

    def _finish_out(self, part: Partition, crc, error, out: SwapFuture) -> None:
        with self._lock:
            if error is None:
                self._crc[part.id] = crc
                buf = part.finish_write()
                self.bytes_written += part.write_nbytes
            else:
                part.fail_write()  # the bytes are still good in the buffer
                buf = None
        if buf is not None:
            self.pool.release(buf)
        out._set(None, error)

    def _finish_in(self, part: Partition, futs: list, lengths: tuple, error, out: SwapFuture) -> None:
        buf = part.buffer
        if error is None and self.checksums and self._crc.get(part.id) is not None:
            try:
                actual = combined_crc(futs, lengths)  # a striped partition's chunks, in order
                if actual != self._crc[part.id]:
                    files = " and ".join(path for _, path, *_ in self.extents(part.id, 0, part.nbytes))
                    error = SwapCorruptionError(files or self.path_of(part.id), part.id, self._crc[part.id], actual)
            except BaseException as exc:  # noqa: BLE001 - still end the read below
                error = exc
        with self._lock:
            if error is None:
                part.finish_read()
                self.bytes_read += part.nbytes
                value = buf.view(part.dtype, part.numel)
            else:
                self.pool.release(part.fail_read())
                value = None
        out._set(value, error)

    # ------------------------------------------------------------ lifetime

    def flush(self) -> None:
        """Wait until every swap started so far has finished (errors stay with their futures)."""
        if not all(t.is_alive() for t in self._reapers):
            raise RuntimeError("TensorSwapper: the swapper is closed; nothing to flush")
        markers = []
        for q in (self._reads, self._writes):
            markers.append(SwapFuture())
            q.put(_Reap("barrier", None, [], markers[-1]))  # each reaper works in order
        for m in markers:
            m._done.wait()

    def close(self) -> None:
        """Finish pending swaps, stop the reaper and remove this rank's swap files."""
        if self._closed:
            return
        self.flush()
        self._closed = True
        for q in (self._reads, self._writes):
            q.put(None)
        for t in self._reapers:
            t.join()
        if self._own_aio:
            self.aio.close()  # one handle for every directory
        for d in self.dirs:
            shutil.rmtree(d, ignore_errors=True)
        self._unclaim()
        for d in self.dirs:
            try:
                os.rmdir(os.path.dirname(d))  # infinity-swap/, if no other rank is using it
            except OSError:
                pass

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError("TensorSwapper is closed")

    def __enter__(self) -> "TensorSwapper":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _header_text(part: Partition, crc, disks: int = 1) -> bytes:
    head = {"magic": "infinity-swap", "version": 1, "id": part.id, "dtype": name_of(part.dtype),
            "numel": part.numel, "nbytes": part.nbytes, "crc32c": crc}
    if disks > 1:  # the chunk layout is chunk_layout(content bytes, disks, this file's directory)
        head["disks"] = disks
    if part.tail_nbytes:
        head["tail_nbytes"] = part.tail_nbytes
    text = json.dumps(head).encode()
    if len(text) > HEADER:
        raise ValueError(f"partition id {part.id!r} is too long for the swap-file header")
    return text


__all__ = ["TensorSwapper", "SwapFuture", "HEADER", "chunk_layout", "combined_crc", "read_extents"]
