"""StatePipeline over GroupStates: the one read-ahead / work / write-behind walk (see [Note: one pipeline])."""

import pytest
import torch

from infinity.swap import BufferPool, Residency, TensorSwapper
from infinity.swap.pipeline import Mode, StatePipeline
from infinity.swap.state import HostState, NvmeState

NUMELS = [1000, 700, 1000, 300]


def _states(tmp_path, count: int, numels=NUMELS):
    pool = BufferPool(count, 12 * max(numels), pin=False)
    sw = TensorSwapper(tmp_path, pool)
    states = [NvmeState(n, sw, f"g{i}") for i, n in enumerate(numels)]
    StatePipeline(Mode.FILL).over(states, lambda i, v: (v.param.fill_(i), v.exp_avg.fill_(10 + i),
                                                        v.exp_avg_sq.fill_(20 + i)))
    return sw, states


def _params(states):
    out = []
    StatePipeline(Mode.READ).over(states, lambda i, v: out.append(v.param.clone()))
    return out


@pytest.mark.parametrize("count", [1, 2, 3, 5])
def test_update_reads_works_and_writes_every_group_within_the_pool(tmp_path, count):
    sw, states = _states(tmp_path, count)
    try:
        sw.pool.peak_in_use = 0
        seen = []

        def work(i, v):
            seen.append((i, v.param[0].item(), v.exp_avg[0].item(), v.exp_avg_sq[-1].item()))
            v.param.add_(100)

        stats = StatePipeline(Mode.UPDATE).over(states, work)
        assert seen == [(i, float(i), 10.0 + i, 20.0 + i) for i in range(len(NUMELS))]
        assert sw.pool.peak_in_use <= count and sw.pool.free_count == count
        assert stats.bytes_read == stats.bytes_written == 12 * sum(NUMELS)
        assert [p[0].item() for p in _params(states)] == [100.0 + i for i in range(len(NUMELS))]
        assert all(s.at_rest() for s in states)
    finally:
        sw.close()


def test_update_reads_ahead_while_a_group_is_worked_on(tmp_path):
    sw, states = _states(tmp_path, 5)  # enough buffers that a read-ahead never waits for a write to land
    try:
        ahead = []
        StatePipeline(Mode.UPDATE).over(states, lambda i, v: ahead.append(
            i + 1 < len(states) and sw.registry[states[i + 1].id].residency in (Residency.READING,
                                                                                Residency.IN_CPU)))
        assert ahead == [True, True, True, False], "group i + 1 is being read while group i is worked on"
    finally:
        sw.close()


@pytest.mark.parametrize("count", [1, 2, 4])
def test_read_keeps_a_buffer_until_its_consumer_is_done(tmp_path, count):
    sw, states = _states(tmp_path, count)
    try:
        done = set()

        def use(i, v):
            # Earlier groups whose consumer has not been waited on still hold their buffers: at most one besides
            # this group's, and none when the pool has a single buffer.
            held = [k for k in range(i) if k not in done]
            assert len(held) <= (1 if count > 1 else 0), held

            def wait():
                assert sw.registry[states[i].id].residency is Residency.IN_CPU, "the buffer outlives the wait"
                done.add(i)
            return wait

        StatePipeline(Mode.READ).over(states, use)
        assert done == set(range(len(NUMELS))) and sw.pool.free_count == count
        assert all(sw.registry[s.id].residency is Residency.ON_DISK for s in states)
    finally:
        sw.close()


def test_fill_writes_without_reading(tmp_path):
    sw, states = _states(tmp_path, 2)
    try:
        stats = StatePipeline(Mode.FILL).over(states, lambda i, v: (v.param.fill_(-i), v.exp_avg.zero_(),
                                                                    v.exp_avg_sq.zero_()))
        assert stats.bytes_read == 0 and stats.bytes_written == 12 * sum(NUMELS) and sw.bytes_read == 0
        assert [p[0].item() for p in _params(states)] == [-float(i) for i in range(len(NUMELS))]
    finally:
        sw.close()


@pytest.mark.parametrize("mode", [Mode.UPDATE, Mode.READ, Mode.FILL])
def test_an_error_in_the_work_returns_every_buffer_and_leaves_old_or_new_state(tmp_path, mode):
    sw, states = _states(tmp_path, 3)
    try:
        def work(i, v):
            if i == 2:
                raise ValueError("boom in group 2")
            v.param.fill_(50 + i)
            return (lambda: None) if mode is Mode.READ else None

        with pytest.raises(ValueError, match="boom in group 2"):
            StatePipeline(mode).over(states, work)
        assert sw.pool.free_count == 3, "no buffer may stay borrowed after a failure"
        assert all(s.at_rest() for s in states)
        got = [p[0].item() for p in _params(states)]
        if mode is Mode.READ:
            assert got == [0.0, 1.0, 2.0, 3.0], "READ writes nothing"
        else:
            assert got == [50.0, 51.0, 2.0, 3.0], "groups before the failure hold the new state, the rest the old"
    finally:
        sw.close()


def test_a_read_ahead_leaves_the_reserved_buffer_free(tmp_path):
    sw, states = _states(tmp_path, 2)
    try:
        pipe = StatePipeline(Mode.UPDATE, reserve=1)
        pipe.ahead(states[0])
        pipe.ahead(states[1])  # only one buffer would be left: not started
        assert states[0].ready() and not states[1].ready() and sw.pool.free_count == 1
        pipe.run(states[1], lambda v: v.param.fill_(7))  # the critical path still gets its buffer
        pipe.finish()  # the unopened read-ahead of group 0 is dropped
        assert sw.pool.free_count == 2 and all(s.at_rest() for s in states)
        assert [p[0].item() for p in _params(states)][:2] == [0.0, 7.0]
    finally:
        sw.close()


def test_a_failed_write_raises_instead_of_waiting_for_its_buffer(tmp_path):
    """A failed write keeps its buffer (its bytes are newer than the file); with a pool of one, the next group's
    read would wait for ever. The walk waits on the write instead and raises its error."""
    import errno
    import threading

    class _Failed:
        def wait(self, timeout=None):
            raise OSError(errno.EIO, "write failed (injected)")

    sw, states = _states(tmp_path, 1, numels=[1000, 1000])
    try:
        sw.aio.pwrite = lambda *args, **kwargs: _Failed()  # every write from here on fails
        outcome = []

        def step():
            try:
                StatePipeline(Mode.UPDATE).over(states, lambda i, v: v.param.add_(1))
                outcome.append("returned")
            except OSError as exc:
                outcome.append(exc)

        t = threading.Thread(target=step, daemon=True)
        t.start()
        t.join(60)
        assert not t.is_alive(), "the step hung waiting for a buffer a failed write holds"
        assert isinstance(outcome[0], OSError) and outcome[0].errno == errno.EIO, outcome
        part = sw.registry[states[0].id]
        assert part.residency is Residency.IN_CPU and part.dirty, "the failed group keeps its new bytes"
        assert part.buffer.view(torch.float32, 1000)[0].item() == 1.0
        assert states[1].at_rest(), "the next group was never read"
    finally:
        sw.release(states[0].id, discard=True)
        sw.close()


def test_ram_states_go_through_the_same_walk():
    states = [HostState(n) for n in NUMELS]
    StatePipeline(Mode.FILL).over(states, lambda i, v: v.param.fill_(i))
    stats = StatePipeline(Mode.UPDATE).over(states, lambda i, v: v.param.mul_(2))
    assert [s.views.param[0].item() for s in states] == [0.0, 2.0, 4.0, 6.0]
    assert stats.bytes_read == stats.bytes_written == 0
