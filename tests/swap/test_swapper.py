"""TensorSwapper: round trips, the pool bound, leftovers, corruption, ENOSPC."""

import errno
import json
import os
import random
import subprocess
import sys
import threading
import time

import pytest
import torch

from infinity import SwapCorruptionError
from infinity.swap import BufferPool, Residency, TensorSwapper
from infinity.swap.swapper import HEADER
from infinity.testing.files import flip_bit


@pytest.fixture
def swapper(disk_dir):
    sw = TensorSwapper(disk_dir, BufferPool(4, 1 << 20, pin=False))
    yield sw
    sw.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64])
@pytest.mark.parametrize("numel", [1, 1023, 4096, 100_003])
def test_round_trip(swapper, dtype, numel):
    t = (torch.randn(numel) * 100).to(dtype)
    swapper.swap_out("p", t).wait()
    assert swapper.registry["p"].residency is Residency.ON_DISK and swapper.pool.free_count == 4
    back = swapper.swap_in("p").wait()
    assert back.dtype == dtype and torch.equal(back, t)
    swapper.release("p")
    assert swapper.pool.free_count == 4


def test_file_layout_matches_the_spec(swapper):
    t = torch.arange(10, dtype=torch.float32)
    swapper.swap_out("layer.0/weight", t).wait()
    path = swapper.path_of("layer.0/weight")
    raw = open(path, "rb").read()
    head = json.loads(raw[:HEADER].decode())
    assert head == {"magic": "infinity-swap", "version": 1, "id": "layer.0/weight", "dtype": "float32",
                    "numel": 10, "nbytes": 40, "crc32c": head["crc32c"]}
    assert raw[HEADER:] == t.numpy().tobytes() and isinstance(head["crc32c"], int)


def test_a_write_only_tail_is_written_never_read_back_and_outside_the_checksum(swapper, disk_dir):
    # [Note: compute-dtype shards in the optimizer file]: a partition's write carries `tail_nbytes` more bytes
    # from its buffer; swap_in reads only the partition, and the header's CRC covers only the partition.
    buf = swapper.pool.acquire("test")
    state, tail = buf.view(torch.float32, 1000), buf.tensor[4000:4000 + 2 * 1000].view(torch.bfloat16)
    state.copy_(torch.arange(1000.0))
    tail.copy_(torch.arange(1000.0) / 7)
    swapper.swap_out_buffer("g", buf, torch.float32, 1000, tail_nbytes=2000).wait()
    assert swapper.bytes_written == 6000 and swapper.pool.free_count == 4 and "g" in swapper.registry
    path = swapper.path_of("g")
    raw = open(path, "rb").read()
    head = json.loads(raw[:HEADER].decode())
    assert head["nbytes"] == 4000 and head["tail_nbytes"] == 2000 and len(raw) == HEADER + 6000
    assert raw[HEADER + 4000:] == (torch.arange(1000.0) / 7).to(torch.bfloat16).view(torch.int16).numpy().tobytes()
    with open(path, "r+b") as f:  # a flipped tail byte is the tail readers' to catch, not the partition's
        f.seek(HEADER + 4100)
        f.write(b"\xff")
    view = swapper.swap_in("g").wait()
    assert torch.equal(view, torch.arange(1000.0)) and swapper.bytes_read == 4000
    view.add_(1)
    swapper.swap_out("g", view, tail_nbytes=2000).wait()  # written from the buffer it holds, tail included
    assert swapper.bytes_written == 12000
    # A copy into a fresh buffer would leave the tail undefined, so it is refused; so is a tail-less call.
    with pytest.raises(ValueError, match=r"a partition with a 2000-byte tail is written from the buffer that "
                                         r"holds it"):
        swapper.swap_out("g", torch.zeros(1000), tail_nbytes=2000)
    with pytest.raises(ValueError, match=r"registered as 1000 x torch.float32 with a 2000-byte tail, got 1000 x "
                                         r"torch.float32$"):
        swapper.swap_out("g", torch.zeros(1000))
    with pytest.raises(ValueError, match=r"do not fit a 1048576-byte pool buffer"):
        swapper.swap_out_buffer("big", swapper.pool.acquire("t2"), torch.float32, 1000, tail_nbytes=1 << 20)
    assert swapper.pool.free_count == 3  # an argument error leaves the buffer the caller's
    assert "big" not in swapper.registry  # and registers nothing


def test_in_place_update_is_written_without_a_copy(swapper):
    swapper.swap_out("m", torch.zeros(1000)).wait()
    view = swapper.swap_in("m").wait()
    view.add_(1)
    swapper.swap_out("m", view).wait()
    assert torch.equal(swapper.swap_in("m").wait(), torch.ones(1000))


def test_a_write_to_a_second_slot_keeps_the_first(swapper):
    """swap_out_as: the buffer a partition was read into, changed, is written as another partition; the first
    keeps its file's bytes (a speculative step's rollback reads them again) and both checksums hold."""
    old = torch.arange(5000, dtype=torch.float32)
    swapper.swap_out("a", old).wait()
    view = swapper.swap_in("a").wait()
    view.mul_(-1)
    swapper.swap_out_as("a", "a.b").wait()
    assert swapper.registry["a"].residency is Residency.ON_DISK and swapper.registry["a.b"].residency is \
        Residency.ON_DISK and swapper.pool.free_count == 4
    assert torch.equal(swapper.swap_in("a").wait(), old)
    assert torch.equal(swapper.swap_in("a.b").wait(), -old)
    # The target busy (here: in memory): refused before anything moves; the source keeps its buffer.
    with pytest.raises(RuntimeError, match="a.b is IN_CPU; wait for its pending swap first"):
        swapper.swap_out_as("a", "a.b")
    assert swapper.registry["a"].residency is Residency.IN_CPU
    swapper.release("a")
    swapper.release("a.b")
    assert swapper.pool.free_count == 4


def test_a_preallocated_partition_has_its_blocks_before_its_first_write(swapper):
    """preallocate reserves the file (header and content) at once; the first write then fills it,
    and reads back as any other partition. A layout that does not match is refused."""
    if not swapper.preallocate("p.b", torch.float32, 200_000):
        pytest.skip("this filesystem has no posix_fallocate (the first write allocates)")
    assert os.stat(swapper.path_of("p.b")).st_size == HEADER + 4 * 200_000
    t = torch.randn(200_000)
    swapper.swap_out("p.b", t).wait()
    assert torch.equal(swapper.swap_in("p.b").wait(), t)
    swapper.release("p.b")
    with pytest.raises(ValueError, match="registered as 200000 x torch.float32"):
        swapper.swap_out("p.b", torch.zeros(10))


def test_shape_mismatch(swapper):
    swapper.swap_out("a", torch.zeros(10)).wait()
    with pytest.raises(ValueError, match=r"swap_out\('a'\): registered as 10 x torch.float32, got 11 x torch.float32"):
        swapper.swap_out("a", torch.zeros(11))


def test_pool_bound_under_random_concurrent_swaps(disk_dir):
    pool = BufferPool(3, 64 << 10, pin=False)
    with TensorSwapper(disk_dir, pool) as sw:
        data = {f"p{i}": torch.randn(random.Random(i).randrange(1, 16000)) for i in range(12)}
        for k, v in data.items():
            sw.swap_out(k, v).wait()
        errors = []

        def worker(seed):
            rng = random.Random(seed)
            try:
                for _ in range(60):
                    k = f"p{rng.randrange(0, 12, 1) // 4 * 4 + seed}"  # each thread owns its partitions
                    view = sw.swap_in(k).wait()
                    assert torch.equal(view, data[k])
                    assert pool.in_use <= pool.count
                    if rng.random() < 0.5:
                        sw.release(k)
                    else:
                        sw.swap_out(k, view).wait()
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(s,)) for s in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
            assert not t.is_alive(), f"{t.name} still running after 120 s: a swap hung"
        assert not errors, errors
        assert pool.peak_in_use <= pool.count
        for k in data:
            if sw.registry[k].residency is Residency.IN_CPU:
                sw.release(k)
        assert pool.free_count == pool.count


def test_corruption_is_detected(swapper):
    t = torch.randn(5000)
    swapper.swap_out("w", t).wait()
    path = swapper.path_of("w")
    flip_bit(path, HEADER + 1234)
    with pytest.raises(SwapCorruptionError) as ei:
        swapper.swap_in("w").wait()
    e = ei.value
    assert e.errno == errno.EIO and e.filename == path and e.partition == "w"
    assert "swap file of partition 'w' is corrupted: CRC-32C is 0x" in str(e)
    assert swapper.registry["w"].residency is Residency.ON_DISK and swapper.pool.free_count == 4


def test_clean_close_removes_files(disk_dir):
    sw = TensorSwapper(disk_dir, BufferPool(2, 4096, pin=False))
    sw.swap_out("x", torch.zeros(10)).wait()
    sw.close()
    assert not (disk_dir / "infinity-swap").exists()


_CRASH = """
import os, sys, torch
from infinity.swap import BufferPool, TensorSwapper
sw = TensorSwapper(sys.argv[1], BufferPool(2, 1 << 16, pin=False))
sw.swap_out("opt/g0", torch.arange(1000, dtype=torch.float32)).wait()
sw.swap_out("opt/g1", torch.ones(10, dtype=torch.bfloat16)).wait()
buf = sw.pool.acquire("tail")
buf.view(torch.float32, 3).copy_(torch.tensor([1.0, 2.0, 3.0]))
sw.swap_out_buffer("opt/g2", buf, torch.float32, 3, tail_nbytes=6).wait()
os._exit(0)  # dies without close(): the files stay
"""


@pytest.fixture
def crashed_dir(disk_dir):
    out = subprocess.run([sys.executable, "-c", _CRASH, str(disk_dir)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return disk_dir


def test_leftovers_cleared_and_reported(crashed_dir):
    with pytest.warns(UserWarning, match="removed 3 swap files left in .* by a crashed run"):
        sw = TensorSwapper(crashed_dir, BufferPool(2, 4096, pin=False))
    assert sw.leftovers_found == 3 and len(sw.registry) == 0
    sw.close()


def test_leftovers_reused(crashed_dir):
    with pytest.warns(UserWarning, match="reusing 3 of 3 swap files"):
        sw = TensorSwapper(crashed_dir, BufferPool(2, 1 << 16, pin=False), leftovers="reuse")
    assert torch.equal(sw.swap_in("opt/g0").wait(), torch.arange(1000, dtype=torch.float32))
    assert sw.registry["opt/g1"].dtype == torch.bfloat16
    assert sw.registry["opt/g2"].tail_nbytes == 6  # the header keeps it: the next write carries the tail again
    assert torch.equal(sw.swap_in("opt/g2").wait(), torch.tensor([1.0, 2.0, 3.0]))
    sw.close()


def test_a_reused_leftover_of_another_layout_is_replaced_by_this_runs_first_write(crashed_dir):
    with pytest.warns(UserWarning, match="reusing 3 of 3"):
        sw = TensorSwapper(crashed_dir, BufferPool(2, 1 << 16, pin=False), leftovers="reuse")
    old = os.path.getsize(sw.path_of("opt/g0"))
    held = [sw.pool.acquire("test"), sw.pool.acquire("test")]
    assert sw.swap_in("opt/g0", prefetch=True) is None  # no buffer: nothing was read, so it stays replaceable
    for b in held:
        sw.pool.release(b)
    sw.swap_out("opt/g0", torch.full((10,), 7.0, dtype=torch.bfloat16)).wait()  # was 1000 x float32
    assert sw.registry["opt/g0"].dtype == torch.bfloat16 and sw.registry["opt/g0"].numel == 10
    assert os.path.getsize(sw.path_of("opt/g0")) < old  # replaced, not written over the old bytes
    assert torch.equal(sw.swap_in("opt/g0").wait(), torch.full((10,), 7.0, dtype=torch.bfloat16))
    sw.release("opt/g0")
    # Once this run has read or written a partition, its layout is this run's: a mismatch is a caller's error.
    assert torch.equal(sw.swap_in("opt/g1").wait(), torch.ones(10, dtype=torch.bfloat16))
    sw.release("opt/g1")
    with pytest.raises(ValueError, match=r"registered as 10 x torch.bfloat16, got 4 x torch.float32"):
        sw.swap_out("opt/g1", torch.zeros(4))
    with pytest.raises(ValueError, match=r"registered as 10 x torch.bfloat16, got 3 x torch.float32"):
        sw.swap_out("opt/g0", torch.zeros(3))
    sw.close()


def test_leftovers_refused(crashed_dir):
    with pytest.raises(RuntimeError, match=r"holds 3 swap files from a crashed run; remove them, or set "
                                           r"infinity.leftovers to \"clear\" or \"reuse\""):
        TensorSwapper(crashed_dir, BufferPool(2, 4096, pin=False), leftovers="error")


def test_directory_in_use_by_a_live_process(disk_dir):
    """[Note: directories are owned through flock]: another process's swapper holds the directory."""
    from infinity.dirlock import DirectoryInUse

    code = ("import sys, time; from infinity.swap import BufferPool, TensorSwapper; "
            f"sw = TensorSwapper({str(disk_dir)!r}, BufferPool(1, 4096, pin=False)); print('ready', flush=True); "
            "sys.stdin.read()")
    holder = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "ready"
        with pytest.raises(DirectoryInUse, match=f"swap directory .*rank0 is in use by running process {holder.pid}; "
                                                 "give each job its own nvme_path"):
            TensorSwapper(disk_dir, BufferPool(1, 4096, pin=False))
    finally:
        holder.kill()
        holder.wait()
    # Killed (no close): the lock died with it, and the directory is this process's to claim.
    sw = TensorSwapper(disk_dir, BufferPool(1, 4096, pin=False))
    sw.close()


def test_a_pid_file_without_its_lock_is_no_owner(disk_dir):
    """A pid in owner.pid proves nothing (pids are reused, and a killed run leaves its file): only the lock."""
    d = disk_dir / "infinity-swap" / "rank0"
    d.mkdir(parents=True)
    (d / "owner.pid").write_text(str(os.getppid()))  # a live process, which holds no lock on it
    sw = TensorSwapper(disk_dir, BufferPool(1, 4096, pin=False))
    sw.close()


@pytest.mark.slow
def test_simultaneous_claims_of_one_swap_directory_have_one_winner(disk_dir):
    """40 processes released at once claim one directory through the lock the swapper takes (DirLock, loaded on
    its own so that each process starts in milliseconds and they really race): exactly one owns it, each other
    one is refused by name. The pid-file claim let 3 of 40 in beside the owner, and one read the other's values."""
    import infinity.dirlock
    import infinity.errors

    # dirlock imports infinity.errors; a bare package stands in for `infinity` so that torch is not imported.
    code = ("import importlib.util, sys, time, types\n"
            "sys.modules['infinity'] = types.ModuleType('infinity'); sys.modules['infinity'].__path__ = []\n"
            f"spec = importlib.util.spec_from_file_location('infinity.errors', {infinity.errors.__file__!r})\n"
            "e = importlib.util.module_from_spec(spec); sys.modules['infinity.errors'] = e; spec.loader.exec_module(e)\n"
            f"spec = importlib.util.spec_from_file_location('dirlock', {infinity.dirlock.__file__!r})\n"
            "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)\n"
            "assert 'torch' not in sys.modules\n"
            "time.sleep(max(0, float(sys.argv[1]) - time.time()))\n"
            f"try:\n lock = m.DirLock({str(disk_dir / 'rank0')!r}, what='swap directory', fix='x')\n"
            "except m.DirectoryInUse:\n print('refused', flush=True); sys.exit(0)\n"
            "print('owner', flush=True); sys.stdin.read()")  # held until every process has tried
    t0 = time.time() + 3
    procs = [subprocess.Popen([sys.executable, "-c", code, str(t0)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True) for _ in range(40)]
    try:
        outs = [p.stdout.readline().strip() for p in procs]
    finally:
        for p in procs:
            p.stdin.close()
            p.wait(60)
    assert all(p.returncode == 0 for p in procs)
    assert outs.count("owner") == 1 and outs.count("refused") == 39, outs


def test_enospc_mid_swap_out_keeps_the_partition_in_memory(tiny_fs):
    pool = BufferPool(1, 8 << 20, pin=False)
    sw = TensorSwapper(tiny_fs, pool)
    t = torch.randn(2 << 20)  # 8 MiB > the 4 MiB filesystem
    fut = sw.swap_out("big", t)
    with pytest.raises(OSError) as ei:
        fut.wait(60)
    assert ei.value.errno == errno.ENOSPC and ei.value.filename == sw.path_of("big")
    part = sw.registry["big"]
    assert part.residency is Residency.IN_CPU, "a failed write must keep the bytes"
    assert torch.equal(part.buffer.view(torch.float32, t.numel()), t)
    assert torch.equal(sw.swap_in("big").wait(), t)
    with pytest.raises(RuntimeError, match="partition big: its in-memory bytes were never written"):
        sw.release("big")  # the file is not current: dropping would lose the data
    os.unlink(sw.path_of("big"))
    sw.release("big", discard=True)
    sw.close()


def test_two_swappers_of_one_process_cannot_share_a_directory(disk_dir):
    with TensorSwapper(disk_dir, BufferPool(1, 4096, pin=False)):
        with pytest.raises(RuntimeError, match="is already used by another swapper in this process"):
            TensorSwapper(disk_dir, BufferPool(1, 4096, pin=False))
    TensorSwapper(disk_dir, BufferPool(1, 4096, pin=False)).close()  # free again after close


def test_concurrent_swap_in_of_one_partition_shares_the_buffer(swapper):
    swapper.swap_out("s", torch.arange(100.0)).wait()
    results, refused = [], []

    def reader():
        try:
            results.append(swapper.swap_in("s"))
        except RuntimeError as exc:  # a caller that raced a read in flight is told to wait
            refused.append(str(exc))

    threads = [threading.Thread(target=reader) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results and all("wait for its pending swap first" in r for r in refused)
    views = [fut.wait() for fut in results]
    swapper.flush()
    assert all(torch.equal(v, torch.arange(100.0)) for v in views)
    swapper.release("s")
    assert swapper.pool.free_count == swapper.pool.count, "no buffer may leak from racing swap_ins"


def test_a_write_hook_sees_the_written_bytes_once_and_its_error_reaches_the_write(swapper):
    import threading

    t = torch.arange(1000, dtype=torch.float32)
    seen = []
    swapper.on_next_write("p", lambda b: seen.append(("replaced", b.view(torch.float32, 1000).clone())))
    swapper.on_next_write("p", lambda b: seen.append((threading.current_thread().name,
                                                      b.view(torch.float32, 1000).clone())))
    swapper.swap_out("p", t).wait()
    assert len(seen) == 1 and seen[0][0] == "infinity-swap-write-reaper" and torch.equal(seen[0][1], t)
    swapper.swap_out("p", t + 1).wait()  # one-shot: the next write runs no hook
    assert len(seen) == 1

    def boom(_):
        raise ValueError("hook failed")

    swapper.on_next_write("p", boom)
    with pytest.raises(ValueError, match="hook failed"):
        swapper.swap_out("p", t + 2).wait()


def test_a_failed_submission_of_an_in_memory_partitions_write_raises_and_keeps_the_bytes(swapper, monkeypatch):
    """swap_out of a partition held in memory submits its write under the swapper's lock; a submission that fails
    there (an OSError, or a KeyboardInterrupt landing in it) must raise and leave the partition in memory, not
    hang the caller on the lock it already holds (seen as a hung Ctrl-C of `infinity train`)."""
    swapper.swap_out("p", torch.arange(1000, dtype=torch.float32)).wait()
    view = swapper.swap_in("p").wait()
    view.add_(1)

    def refuse(*a, **k):
        raise OSError(errno.EIO, "injected submission failure")

    monkeypatch.setattr(swapper.aio, "pwrite", refuse)
    result = {}

    def attempt():
        try:
            swapper.swap_out("p", view)
        except OSError as exc:
            result["error"] = exc

    t = threading.Thread(target=attempt, daemon=True)
    t.start()
    t.join(30)
    assert not t.is_alive(), "swap_out hung on its own lock after a failed submission"
    assert "injected submission failure" in str(result["error"])
    part = swapper.registry["p"]
    assert part.residency is Residency.IN_CPU, "the bytes stay in memory, not yet written"
    monkeypatch.undo()
    swapper.swap_out("p", view).wait()
    assert torch.equal(swapper.swap_in("p").wait(), torch.arange(1000, dtype=torch.float32) + 1)


def _dead_rank(disk_dir, rank: int) -> None:
    """A rank of an earlier run killed without close(): its directory keeps its swap files."""
    code = ("import os, sys, torch; from infinity.swap import BufferPool, TensorSwapper; "
            f"sw = TensorSwapper(sys.argv[1], BufferPool(1, 1 << 16, pin=False), rank={rank}); "
            "sw.swap_out('g0', torch.ones(100)).wait(); os._exit(0)")
    out = subprocess.run([sys.executable, "-c", code, str(disk_dir)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


@pytest.mark.slow
def test_rank_0_of_a_smaller_run_clears_the_dead_ranks_of_a_larger_one(disk_dir):
    """[Note: a smaller run clears a larger one's dead ranks]: rank2/ and rank3/ of a killed 4-rank run go when a
    2-rank run starts there; rank 1's belongs to the new run (its own rank clears it); a live job's stays."""
    from infinity.dirlock import DirLock

    for rank in (1, 2, 3, 4):
        _dead_rank(disk_dir, rank)
    root = disk_dir / "infinity-swap"
    live = DirLock(root / "rank4", what="a live job's swap directory", fix="")  # another job, still running
    try:
        with pytest.warns(UserWarning, match=r"removed 2 swap files that dead ranks \(numbered 2 and up\)"):
            sw = TensorSwapper(disk_dir, BufferPool(1, 4096, pin=False), rank=0, world=2)
        sw.close()
        assert sorted(os.listdir(root)) == ["rank1", "rank4"]
        assert any(f.endswith(".swp") for f in os.listdir(root / "rank4")), "a live job's files were removed"
    finally:
        live.release()
    # Without `world` (a swapper outside an engine) nothing beyond its own directory is touched.
    sw = TensorSwapper(disk_dir, BufferPool(1, 4096, pin=False), rank=0)
    sw.close()
    assert sorted(os.listdir(root)) == ["rank1", "rank4"]
