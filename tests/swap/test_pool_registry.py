"""The pool never exceeds its budget, never leaks, and residency transitions are asserted."""

import random
import threading

import pytest
import torch

from infinity.swap import BufferPool, PoolExhausted, Registry, Residency


def test_pool_buffers_are_aligned_and_disjoint():
    pool = BufferPool(4, 10_000, pin=False)
    bufs = [pool.acquire() for _ in range(4)]
    ptrs = sorted(b.tensor.data_ptr() for b in bufs)
    assert all(p % 4096 == 0 for p in ptrs)
    assert all(b - a >= 10_000 for a, b in zip(ptrs, ptrs[1:]))
    assert all(b.tensor.numel() == 10_000 for b in bufs)
    assert pool.nbytes == 4 * 12_288
    assert pool.try_acquire() is None and pool.free_count == 0


def _run_four(worker):
    """worker(seed) on four threads at once; each must end within 120 s."""
    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
        assert not t.is_alive(), f"{t.name} still running after 120 s: the pool deadlocked or starved it"


def test_pool_accounting_after_10000_random_concurrent_swaps():
    pool = BufferPool(3, 4096, pin=False)
    over, errors = [], []
    live = [0]
    lock = threading.Lock()

    def worker(seed):
        rng = random.Random(seed)
        held = []
        try:
            for _ in range(2500):
                if held and (rng.random() < 0.5 or len(held) == 2):
                    buf = held.pop(rng.randrange(len(held)))
                    buf.tensor[0] = seed  # the buffer is ours until released
                    with lock:
                        live[0] -= 1
                    pool.release(buf)
                else:
                    # Only a thread holding nothing may block (the critical path); one that already
                    # holds a buffer only takes a free one (a prefetcher). That rule is what makes the
                    # pool deadlock-free: every blocked thread holds nothing.
                    blocking = not held and rng.random() < 0.5
                    buf = pool.acquire(f"w{seed}", timeout=30) if blocking else pool.try_acquire(f"w{seed}")
                    if buf is None:
                        continue
                    with lock:
                        live[0] += 1
                        if live[0] > pool.count:
                            over.append(live[0])
                    held.append(buf)
            for buf in held:
                with lock:
                    live[0] -= 1
                pool.release(buf)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    _run_four(worker)
    assert not errors, errors
    assert not over, "more buffers out than the pool has"
    assert pool.free_count == pool.count and pool.in_use == 0
    assert pool.acquired_total > 1000 and pool.peak_in_use <= pool.count
    assert pool._free == [[0, pool.nbytes]], "the free space merged back into one extent: nothing lost"


def test_acquire_waits_for_a_release():
    pool = BufferPool(1, 4096, pin=False)
    first = pool.acquire("a")
    got = []
    t = threading.Thread(target=lambda: got.append(pool.acquire("b", timeout=30)))
    t.start()
    t.join(0.2)
    assert t.is_alive() and not got, "acquire must wait while the pool is empty"
    first.release()
    t.join(30)
    assert not t.is_alive(), "acquire still blocked 30 s after the only buffer was released"
    assert got and got[0].tensor.data_ptr() == first.tensor.data_ptr(), "the released bytes were lent again"


def test_exhausted_pool_names_the_holders():
    pool = BufferPool(2, 4096, pin=False)
    pool.acquire("prefetch:layer3")
    pool.acquire("optimizer:group0")
    assert pool.try_acquire("x") is None
    with pytest.raises(PoolExhausted) as ei:
        pool.acquire("me", timeout=0.05)
    assert str(ei.value) == ("BufferPool: all 2 buffers of 4096 B are in use after waiting 0.05 s (held by: "
                             "optimizer:group0, prefetch:layer3); raise buffer_count or release buffers sooner")


def test_double_and_foreign_release():
    a, b = BufferPool(1, 4096, pin=False), BufferPool(1, 4096, pin=False)
    buf = a.acquire()
    a.release(buf)
    with pytest.raises(ValueError, match="buffer #0 was released twice"):
        a.release(buf)
    with pytest.raises(ValueError, match="does not belong to this pool"):
        b.release(a.acquire())


def test_borrow_releases_on_error():
    pool = BufferPool(1, 4096, pin=False)
    with pytest.raises(RuntimeError):
        with pool.borrow("x"):
            raise RuntimeError("boom")
    assert pool.free_count == 1


def test_shrink_frees_the_old_memory_and_refuses_while_a_buffer_is_held():
    pool = BufferPool(3, 3 * 4096 + 100)
    held = pool.acquire("reader")
    held.view(torch.float32, 10).fill_(1.0)
    with pytest.raises(RuntimeError, match=r"1 buffer\(s\) are in use \(held by: reader\); release them first"):
        pool.shrink(4096)
    pool.release(held)
    with pytest.raises(ValueError, match=r"size must be an int in \[1, 12388\]"):
        pool.shrink(20000)
    pool.shrink(5000)
    assert pool.size == 5000 and pool.stride == 8192 and pool.nbytes == 3 * 8192
    bufs = [pool.acquire(f"b{i}") for i in range(3)]
    views = [b.view(torch.uint8, 5000) for b in bufs]
    assert all(v.data_ptr() % 4096 == 0 for v in views)
    assert len({v.data_ptr() for v in views}) == 3
    with pytest.raises(ValueError, match="raise the buffer size"):
        bufs[0].view(torch.uint8, 5001)


def test_a_large_pool_is_resident_only_where_written():
    """aligned_empty maps large buffers lazily: a pool sized far past its use (DeepSpeed's buffer_size of 1e8
    elements) costs the pages its shards touch, and they read as zero."""
    import gc

    from infinity.memory_stats import rss_bytes

    gc.collect()
    before = rss_bytes()
    pool = BufferPool(4, 256 << 20, pin=False)  # page-locked (CUDA) memory is resident by definition
    assert rss_bytes() - before < 32 << 20, "1 GiB reserved, not touched"
    buf = pool.acquire("shard")
    assert buf.tensor.data_ptr() % 4096 == 0 and int(buf.tensor[: 1 << 20].sum()) == 0
    buf.view(torch.float32, 16 << 20).fill_(1.0)  # 64 MiB written
    assert 48 << 20 < rss_bytes() - before < 128 << 20
    pool.release(buf)
    del pool, buf
    gc.collect()
    assert rss_bytes() - before < 32 << 20, "unmapped with the pool"


def test_typed_view_and_size_check():
    pool = BufferPool(1, 4096, pin=False)
    with pool.borrow() as buf:
        v = buf.view(torch.float32, 1024)
        assert v.numel() == 1024 and v.data_ptr() == buf.tensor.data_ptr()
        with pytest.raises(ValueError, match="1025 x torch.float32 needs 4100 bytes but this pool buffer has 4096"):
            buf.view(torch.float32, 1025)


@pytest.mark.parametrize("count,size", [(0, 10), (1, 0), (True, 10)])
def test_bad_pool_arguments(count, size):
    with pytest.raises(ValueError, match="BufferPool: (count|size) must be an int >= 1"):
        BufferPool(count, size, pin=False)


def test_residency_life_cycle_and_asserted_transitions():
    reg = Registry()
    p = reg.register("layer0.weight/exp_avg", dtype=torch.float32, numel=1000)
    assert p.residency is Residency.ON_DISK and p.nbytes == 4000
    pool = BufferPool(1, 4096, pin=False)
    buf = pool.acquire(p.id)
    p.begin_read(buf)
    with pytest.raises(RuntimeError, match=r"partition layer0.weight/exp_avg: cannot go to WRITING from READING "
                                           r"\(expected IN_CPU or ON_DISK\)"):
        p.begin_write(object())
    assert p.residency is Residency.READING and p.buffer is buf, "a refused transition changes nothing"
    p.finish_read()
    p.begin_write()
    p.fail_write()
    assert p.residency is Residency.IN_CPU and p.buffer is buf, "a failed write keeps the bytes"
    p.begin_write()
    pool.release(p.finish_write())
    assert p.residency is Residency.ON_DISK and p.buffer is None and pool.free_count == 1
    with pytest.raises(RuntimeError, match="cannot go to IN_CPU from ON_DISK"):
        p.finish_read()


def test_registry_bookkeeping():
    reg = Registry()
    reg.register("a", dtype=torch.bfloat16, numel=10)
    reg.register("b", dtype=torch.float32, numel=10)
    with pytest.raises(ValueError, match="partition 'a' is already registered"):
        reg.register("a", dtype=torch.float32, numel=1)
    with pytest.raises(KeyError, match="no partition 'zz' is registered"):
        reg["zz"]
    counts = reg.count_by_residency()
    assert counts[Residency.ON_DISK] == 2 and counts[Residency.IN_CPU] == 0 and len(reg) == 2


def test_sized_buffers_share_a_slot_and_merge_back():
    """[Note: a pool of full-size slots lends smaller buffers]: small buffers are cut from the slots' bytes,
    aligned and disjoint; the counts stay in full slots; released space merges so full slots come back."""
    fixed = BufferPool(2, 40_000, pin=False)
    one = fixed.acquire("a", nbytes=100)
    assert one.tensor.numel() == 40_000 and fixed.free_count == 1, "a pool that is not sized lends whole slots"
    with pytest.raises(ValueError, match="a buffer of 40001 B does not fit this pool.s 40000-byte buffers; raise the"):
        fixed.acquire("huge", nbytes=40_001)
    pool = BufferPool(3, 40_000, pin=False, sized=True)  # 3 slots of 40,960 B
    small = [pool.try_acquire(f"s{k}", nbytes=4000) for k in range(20)]
    assert all(b is not None for b in small), "20 buffers of 4,096 B fit in 3 slots' 122,880 B"
    spans = sorted((b.tensor.data_ptr(), b.tensor.numel()) for b in small)
    assert all(p % 4096 == 0 and n == 4096 for p, n in spans)
    assert all(a + n <= b for (a, n), (b, _) in zip(spans, spans[1:])), "buffers overlap"
    assert pool.in_use == 20 and pool.free_count == 1, "best fit kept one full slot whole"
    assert pool.try_acquire("x", nbytes=4000, reserve=1) is None, "it would break the last full slot"
    assert pool.try_acquire("big", reserve=1) is None, "a full slot taken would leave none for the critical path"
    x = pool.try_acquire("x", nbytes=4000)
    assert x is not None and pool.free_count == 0
    x.release()
    big = pool.acquire("big", timeout=1)
    assert big.tensor.numel() == 40_000 and pool.free_count == 0
    with pytest.raises(ValueError, match="a buffer of 40001 B does not fit this pool.s 40000-byte buffers; raise the"):
        pool.acquire("huge", nbytes=40_001)
    with pytest.raises(ValueError, match="needs 8000 bytes but this pool buffer has 4096"):
        small[0].view(torch.float64, 1000)
    for b in small:
        b.release()
    with pytest.raises(ValueError, match="released twice"):
        small[0].release()
    assert pool.in_use == 1 and pool.free_count == 2, "the small ones merged back around the full one"
    for b in list(pool._held.values()):
        b.release()
    assert pool.free_count == 3 and pool._free == [[0, pool.nbytes]]
    assert pool.peak_in_use == 3


def test_a_waiter_for_a_full_slot_wakes_when_small_releases_make_one():
    pool = BufferPool(1, 8192, pin=False, sized=True)
    a, b = pool.acquire("a", nbytes=4096), pool.acquire("b", nbytes=4096)
    got = []
    t = threading.Thread(target=lambda: got.append(pool.acquire("full", timeout=30)))
    t.start()
    a.release()
    t.join(0.2)
    assert t.is_alive() and not got, "half a slot is not a slot"
    b.release()
    t.join(30)
    assert got and got[0].tensor.numel() == 8192


def test_sized_buffers_never_overlap_under_10000_random_concurrent_takes():
    """Four threads take and give back buffers of random sizes; each fills its buffer with its own mark and
    finds the mark intact at release, so no two buffers ever shared a byte. Only a thread holding nothing
    blocks (the critical path); the others take with reserve=1, and the blocked one always gets through."""
    pool = BufferPool(3, 64 << 10, pin=False, sized=True)
    errors = []

    def worker(seed):
        rng = random.Random(seed)
        held = []
        try:
            for k in range(2500):
                if held and (rng.random() < 0.5 or len(held) == 4):
                    buf, mark = held.pop(rng.randrange(len(held)))
                    assert bool((buf.tensor == mark).all()), "another buffer wrote into this one"
                    pool.release(buf)
                    continue
                nbytes = rng.choice([None, rng.randrange(0, 64 << 10)])
                buf = (pool.acquire(f"w{seed}", timeout=30, nbytes=nbytes) if not held
                       else pool.try_acquire(f"w{seed}", reserve=1, nbytes=nbytes))
                if buf is not None:
                    mark = (seed * 37 + k) % 251
                    buf.tensor.fill_(mark)
                    held.append((buf, mark))
            for buf, _ in held:
                pool.release(buf)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    _run_four(worker)
    assert not errors, errors
    assert pool.in_use == 0 and pool.free_count == 3 and pool._free == [[0, pool.nbytes]]
    assert pool.acquired_total > 1000
