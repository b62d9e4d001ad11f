"""The NVMe optimizer swapper gives exactly the weights of in-memory CPU Adam."""

import json

import pytest
import torch

from infinity.optim import cpu_adam_step
from infinity.swap import BufferPool, TensorSwapper
from infinity.swap.optimizer import OptimizerSwapper
from infinity.swap.telemetry import Trace

NUMELS = [10_000, 3_333, 25_000, 1, 17_000]


@pytest.mark.parametrize("buffers", [1, 2, 4])
def test_ten_steps_equal_in_memory_adam(disk_dir, buffers):
    torch.manual_seed(0)
    params = [torch.randn(n) for n in NUMELS]
    ref = [(p.clone(), torch.zeros(n), torch.zeros(n)) for p, n in zip(params, NUMELS)]
    trace = Trace()
    with TensorSwapper(disk_dir, BufferPool(buffers, 12 * max(NUMELS), pin=False)) as sw:
        opt = OptimizerSwapper(sw, NUMELS, trace=trace)
        for i, p in enumerate(params):
            opt.initialize(i, p)
        lowp = [torch.empty(n, dtype=torch.bfloat16) for n in NUMELS]
        for step in range(1, 11):
            grads = [torch.randn(n) for n in NUMELS]
            stats = opt.step(grads, step=step, lr=1e-2, weight_decay=0.01, out_lowp=lowp)
            assert not stats.skipped and stats.bytes_read == 12 * sum(NUMELS)
            for (p, m, v), g in zip(ref, grads):
                cpu_adam_step(p, g, m, v, step=step, lr=1e-2, weight_decay=0.01)
        for i, (p, m, v) in enumerate(ref):
            got = opt.read_state(i)
            assert torch.equal(got[0], p) and torch.equal(got[1], m) and torch.equal(got[2], v)
            assert torch.equal(lowp[i], p.to(torch.bfloat16))
        assert sw.pool.free_count == buffers and sw.pool.peak_in_use <= buffers
    path = disk_dir / "trace.json"
    trace.export(path)
    events = json.loads(path.read_text())["traceEvents"]
    assert {e["cat"] for e in events} == {"io", "compute"} and all(e["dur"] >= 0 for e in events)


def test_overflow_skips_every_group(disk_dir):
    with TensorSwapper(disk_dir, BufferPool(2, 12 * 100, pin=False)) as sw:
        opt = OptimizerSwapper(sw, [100, 100])
        for i in range(2):
            opt.initialize(i, torch.ones(100))
        grads = [torch.ones(100), torch.ones(100)]
        grads[1][7] = float("inf")
        assert opt.step(grads, step=1, lr=0.1).skipped
        for i in range(2):
            assert torch.equal(opt.read_state(i)[0], torch.ones(100))


def test_buffer_too_small_says_what_fits(disk_dir):
    with TensorSwapper(disk_dir, BufferPool(2, 1000, pin=False)) as sw:
        with pytest.raises(ValueError, match=r"the largest sub-group \(100 parameters\) needs 1200 B per pool "
                                             r"buffer, the pool has 1000 B"):
            OptimizerSwapper(sw, [100])


def test_swap_context_from_a_shipped_config(disk_dir):
    import pathlib

    from infinity import load_config
    from infinity.swap import SwapContext

    cfg = load_config(pathlib.Path(__file__).resolve().parents[2] / "swap_configs" / "nvme_offload.json",
                      nvme_path=disk_dir)
    with SwapContext.for_optimizer(cfg, largest_group_numel=1000) as ctx:
        assert ctx.pool.count == cfg.zero_optimization.offload_optimizer.buffer_count == 4
        assert ctx.pool.size == 12 * 1000 and ctx.io.queue_depth == 32
        opt = OptimizerSwapper(ctx.swapper, [1000, 500])
        opt.initialize(0, torch.ones(1000))
        opt.initialize(1, torch.ones(500))
        assert not opt.step([torch.ones(1000), torch.ones(500)], step=1, lr=0.1).skipped
        assert (disk_dir / "infinity-swap" / "rank0").is_dir()
    assert not (disk_dir / "infinity-swap").exists()


def test_a_failure_mid_step_returns_every_buffer(disk_dir):
    with TensorSwapper(disk_dir, BufferPool(3, 12 * 1000, pin=False)) as sw:
        opt = OptimizerSwapper(sw, [1000, 1000, 1000])
        for i in range(3):
            opt.initialize(i, torch.ones(1000))
        bad = [torch.ones(1000), torch.ones(999), torch.ones(1000)]  # group 1's gradient has the wrong length
        with pytest.raises(ValueError, match="grad has 999 elements but param has 1000"):
            opt.step(bad, step=1, lr=0.1)
        sw.flush()
        assert sw.pool.free_count == 3
        assert all(sw.registry[i].residency.name == "ON_DISK" for i in opt.ids)
        assert not torch.equal(opt.read_state(0)[0], torch.ones(1000)), "group 0 was stepped and written"
        assert torch.equal(opt.read_state(1)[0], torch.ones(1000)), "group 1 keeps its old state"
        good = [torch.ones(1000)] * 3
        assert not opt.step(good, step=2, lr=0.1).skipped  # the swapper is still usable


def test_swap_context_respects_the_memory_budget(disk_dir):
    from infinity import ConfigError, load_config
    from infinity.swap import SwapContext

    cfg = load_config({"zero_optimization": {"stage": 3, "sub_group_size": 100_000_000, "offload_optimizer": {
        "device": "nvme", "nvme_path": str(disk_dir), "buffer_count": 4}}, "infinity": {"memory_budget": "1GiB"}})
    with pytest.raises(ConfigError, match=r"zero_optimization.offload_optimizer.buffer_count: 4 buffers x 1,200,000,000 B "
                                          r"\(100,000,000 parameters' state\) = 4.47 GiB exceeds infinity.memory_budget "
                                          r"\(1.00 GiB\)"):
        SwapContext.for_optimizer(cfg)
