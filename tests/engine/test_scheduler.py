"""PrefetchScheduler on its own: the trace it records, the bounds on what it reads ahead, and a change of order.

See [Note: trace-based prefetch] in infinity/engine/scheduler.py. The store is
built from a config (build_store, parameters offloaded to NVMe under
tmp_path) and driven by the engine's hooks, without an optimizer: every step
is one forward and backward of fixed weights, so the values can be compared
with the same torch model and the reads are the only use of the pool. The
swapper's swap_in and the scheduler's fetch are wrapped to log what is
read, when, whether as a prefetch, and how full the pool was at that moment.
"""

from __future__ import annotations

import copy

import pytest
import torch

from infinity.config import load_config
from infinity.engine.build import build_store
from infinity.engine.comm import Comm
from infinity.engine.hooks import ParamHooks
from infinity.engine.params import managed
from infinity.testing.recorders import GradientRecorder

DIM = 32
WEIGHT, BIAS = DIM * DIM, DIM  # elements of one Linear's weight and bias shard (one rank: the whole parameter)
SEED = 0


class Permuted(torch.nn.Module):
    """Linear layers run in `order`, not in the order they were built; `ran` logs the layers as they run."""

    def __init__(self, n: int, order: list[int]):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(DIM, DIM) for _ in range(n))
        self.order = list(order)
        self.ran: list[int] = []

    def forward(self, x):
        for i in self.order:
            self.ran.append(i)
            x = torch.tanh(self.layers[i](x))
        return x


class Run:
    """A store built from a config, with `model`'s parameters adopted and the engine's hooks installed."""

    def __init__(self, model: torch.nn.Module, nvme, *, buffers: int, bucket: int, reuse: int = 0):
        # No reuse cache by default (max reuse distance 0): every fetch is one read, so reads can be counted.
        cfg = load_config({
            "zero_optimization": {
                "stage": 3, "stage3_param_persistence_threshold": 0,
                "stage3_prefetch_bucket_size": bucket, "stage3_max_reuse_distance": reuse,
                "offload_param": {"device": "nvme", "nvme_path": str(nvme), "buffer_count": buffers,
                                  "buffer_size": WEIGHT, "max_in_cpu": 0}},  # every shard in a swap file
            "infinity": {"direct_io": False}})  # tmp_path may be a tmpfs without O_DIRECT
        self.model = model
        self.store = build_store(cfg, Comm())
        assert self.store.scheduler is not None, "offload_param nvme must come with a prefetch scheduler"
        for name, p in model.named_parameters():
            self.store.adopt(p, name)
        self.hooks = ParamHooks(self.store)
        self.hooks.install(model)
        self.grads = {}
        self.optimizer = GradientRecorder(grad_for=lambda mp: self.grads[mp.name])
        self.store.attach(self.optimizer)
        self.sched = self.store.scheduler
        self.pool = self.store.swap.pool
        self.log: list[tuple] = []
        self._spy()

    def _spy(self) -> None:
        sw, sched, pool, log = self.store.swap.swapper, self.sched, self.pool, self.log
        swap_in, fetch = sw.swap_in, sched.fetch

        def spy_swap_in(sid, *, prefetch=False, reserve=0):
            free = pool.free_count
            fut = swap_in(sid, prefetch=prefetch, reserve=reserve)
            if fut is not None:
                log.append(("read", sid, prefetch, free))
            return fut

        def spy_fetch(mp, sid, dtype, assemble):
            log.append(("fetch", sid, mp))
            return fetch(mp, sid, dtype, assemble)

        sw.swap_in, sched.fetch = spy_swap_in, spy_fetch

    def step(self, x):
        """One forward and backward as the engine runs them; the output, the gradients and the step's stats."""
        self.log.clear()
        self.grads = {mp.name: torch.zeros(mp.part) for mp in self.store.params}
        x = x.detach().to(self.store.device).requires_grad_()  # as Engine.__call__ moves the inputs
        self.sched.begin_step()
        with self.hooks.saved_tensors():
            out = self.model(x)
            out.square().sum().backward()
        self.optimizer.flush_grads()
        stats = self.sched.drain()
        assert self.pool.in_use == 0, "every buffer is back in the pool at the end of a step"
        return out.detach().cpu(), {k: g.clone() for k, g in self.grads.items()}, stats

    def fetched(self) -> list:
        """The parameters fetched this step, in order."""
        return [e[2] for e in self.log if e[0] == "fetch"]

    def reads(self) -> list[tuple]:
        return [e for e in self.log if e[0] == "read"]

    def close(self) -> None:
        self.hooks.remove()
        self.store.close()


def reference_step(ref: torch.nn.Module, x, device):
    """The plain model (on the store's compute device, so that the kernels are the same) on the same input."""
    ref.to(device).zero_grad()
    out = ref(x.detach().to(device).requires_grad_())
    out.square().sum().backward()
    return out.detach().cpu(), {n: torch.zeros(p.numel()) if p.grad is None else p.grad.reshape(-1).cpu()
                                for n, p in ref.named_parameters()}


def inputs(step: int):
    # Given requires_grad (see Run.step), backward needs every layer's weight, the first one's too.
    return torch.randn(4, DIM, generator=torch.Generator().manual_seed(100 + step))


def same(got, want, what: str) -> None:
    """Bit-identical: the shards hold the very fp32 values the reference model computes with."""
    assert got.shape == want.shape and torch.equal(got, want), \
        f"{what}: differs from plain torch by up to {(got - want).abs().max().item():g}"


@pytest.fixture(autouse=True)
def one_thread():
    # Tiny matmuls: torch's intra-op threads only contend with the swapper's threads on a small machine.
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def run(tmp_path):
    runs = []

    def make(model, **kw):
        runs.append(Run(model, tmp_path / f"nvme{len(runs)}", **kw))
        return runs[-1]

    yield make
    for r in runs:
        r.close()


def expected_trace(model: Permuted, ran: list[int]) -> list:
    """Forward fetches each layer's weight and bias as it runs; backward fetches the weights in reverse."""
    fwd = [p for i in ran for p in (model.layers[i].weight, model.layers[i].bias)]
    bwd = [model.layers[i].weight for i in reversed(ran)]
    return [managed(p) for p in fwd + bwd]


# --------------------------------------------------------------------------------------------- (a) the trace


def test_first_step_records_the_fetches_in_the_order_the_modules_ran(run):
    torch.manual_seed(SEED)
    order = [3, 0, 5, 1, 4, 2]  # not the order the layers were built in, nor its reverse
    model = Permuted(6, order)
    r = run(model, buffers=4, bucket=1 << 30)

    model.ran.clear()
    _, _, first = r.step(inputs(0))
    assert model.ran == order
    want = expected_trace(model, order)
    assert [mp.name for mp in r.fetched()] == [mp.name for mp in want]
    assert [mp.name for mp in r.sched.trace] == [mp.name for mp in want], "the trace is the fetch order"
    assert all(a is b for a, b in zip(r.sched.trace, want))
    assert first.recorded and first.fetches == len(want) and first.hits == 0
    assert first.critical_reads == first.fetches, "each recorded fetch read its file on the critical path"
    reads = r.reads()
    assert [e[1] for e in reads] == [e[1] for e in r.log if e[0] == "fetch"], "recording reads on demand"
    assert not any(e[2] for e in reads), "nothing is prefetched while recording"
    first_sids = [e[1] for e in reads]

    # Next step: the same shards are read in the same order, but ahead of use, so every fetch is a hit.
    _, _, second = r.step(inputs(1))
    assert not second.recorded
    assert [mp.name for mp in r.sched.trace] == [mp.name for mp in want], "a step in trace order keeps the trace"
    assert [e[1] for e in r.reads()] == first_sids
    assert all(e[2] for e in r.reads()), "every read of a step in trace order is a prefetch"
    assert second.fetches == len(want) and second.hits == second.fetches and second.critical_reads == 0


# ------------------------------------------------------------------------------------ (b) bounded prefetch


@pytest.mark.parametrize("buffers,bucket,bound", [
    (2, 1 << 30, "pool"),  # one buffer kept for the critical path, one to read ahead with
    (3, 1 << 30, "pool"),
    (16, 2 * WEIGHT + 2 * BIAS, "bucket"),  # about two layers ahead; the pool is never nearly full
    (16, WEIGHT - 1, "bucket"),  # smaller than a weight: only biases can be read ahead
])
def test_prefetch_stays_within_the_pool_and_the_prefetch_bucket(run, buffers, bucket, bound):
    torch.manual_seed(SEED)
    model = Permuted(8, [5, 2, 7, 0, 3, 6, 1, 4])
    r = run(model, buffers=buffers, bucket=bucket)
    r.step(inputs(0))  # records the trace
    n_fetches = len(r.sched.trace)
    for s in range(1, 4):
        acquired = r.pool.acquired_total
        _, _, stats = r.step(inputs(s))
        assert not stats.recorded and stats.fetches == n_fetches
        reads = r.reads()
        assert r.pool.acquired_total - acquired == len(reads) == n_fetches, \
            "one buffer per read, one read per fetch (no reuse cache here)"
        part = {e[1]: e[2].part for e in r.log if e[0] == "fetch"}  # sid -> elements of its shard
        ahead: dict[str, int] = {}  # read ahead and not yet asked for: sid -> elements
        most_ahead = most_in_use = 0
        for e in r.log:
            if e[0] == "fetch":
                ahead.pop(e[1], None)
            elif e[0] == "read":
                _, sid, prefetch, free = e
                most_in_use = max(most_in_use, buffers - free + 1)
                if prefetch:
                    assert free >= 2, "a prefetch never takes the pool's last free buffer"
                    ahead[sid] = part[sid]
                    assert sum(ahead.values()) <= bucket, f"read ahead {sum(ahead.values())} > bucket {bucket}"
                    most_ahead = max(most_ahead, sum(ahead.values()))
                else:
                    assert free >= 1, "a read on the critical path always finds a free buffer"
        prefetched = sum(1 for e in reads if e[2])
        if bucket >= WEIGHT:  # every shard fits in the bucket: all of them are read ahead, as far as allowed
            assert prefetched == n_fetches and stats.hits == n_fetches, (prefetched, stats)
        if bound == "pool":
            assert most_in_use == buffers - 1, "prefetch fills the pool but for the critical path's buffer"
        elif bucket >= WEIGHT:
            assert most_ahead > WEIGHT + BIAS, "the bucket lets it read more than one layer ahead"
            assert most_in_use < buffers - 1, "the bucket, not the pool, is what bounds it"
        else:
            assert 0 < most_ahead <= BIAS, "biases are read ahead; a weight does not fit in the bucket"
            assert 0 < prefetched < n_fetches and stats.hits == prefetched, (prefetched, stats)
            assert stats.critical_reads == n_fetches - prefetched, "every miss read on the critical path"
    assert r.pool.peak_in_use <= buffers - 1, "over the whole run, one buffer always stayed free"


# ------------------------------------------------------------------------------------- (c) a change of order


class Swappable(Permuted):
    """Six layers; with `swapped`, layers 1 and 4 trade places in forward (so backward's order changes too)."""

    def __init__(self):
        super().__init__(6, [0, 1, 2, 3, 4, 5])
        self.swapped = False

    def forward(self, x):
        self.order = [0, 4, 2, 3, 1, 5] if self.swapped else [0, 1, 2, 3, 4, 5]
        return super().forward(x)


def test_a_change_of_order_re_records_the_trace_and_keeps_values_exact(run):
    torch.manual_seed(SEED)
    model = Swappable()
    ref = copy.deepcopy(model)
    r = run(model, buffers=4, bucket=1 << 30)
    plan = [False, False, True, True, True, False, False]
    # recorded: the step records a new trace; hit_all: every fetch was read ahead
    want = [dict(recorded=True, hit_all=False), dict(recorded=False, hit_all=True),
            dict(recorded=False, hit_all=False),  # the order changed: this step stops prefetching ...
            dict(recorded=True, hit_all=False),  # ... and the next one records the new order
            dict(recorded=False, hit_all=True),
            dict(recorded=False, hit_all=False), dict(recorded=True, hit_all=False)]
    for s, swapped in enumerate(plan):
        model.swapped = ref.swapped = swapped
        model.ran.clear()
        x = inputs(s)
        out, grads, stats = r.step(x)
        want_out, want_grads = reference_step(ref, x, r.store.device)
        same(out, want_out, f"step {s}: forward output")
        for name, g in want_grads.items():
            same(grads[name], g, f"step {s}: gradient of {name}")
        assert stats.fetches == len(expected_trace(model, model.ran))
        assert stats.recorded == want[s]["recorded"], f"step {s}: {stats}"
        assert (stats.hits == stats.fetches) == want[s]["hit_all"], f"step {s}: {stats}"
        if stats.recorded:
            assert [mp.name for mp in r.sched.trace] == [mp.name for mp in expected_trace(model, model.ran)], \
                f"step {s}: the new trace follows the new order"
    assert r.sched.history[-1].recorded


def test_a_skipped_module_resynchronises_without_re_recording(run):
    """A fetch a little further along the trace than expected moves the cursor there: prefetch goes on."""
    torch.manual_seed(SEED)
    model = Permuted(6, [0, 1, 2, 3, 4, 5])
    ref = copy.deepcopy(model)
    r = run(model, buffers=4, bucket=1 << 30)
    r.step(inputs(0))
    trace = list(r.sched.trace)
    model.order = ref.order = [0, 1, 3, 4, 5]  # layer 2 skipped
    model.ran.clear()
    x = inputs(1)
    out, grads, stats = r.step(x)
    want_out, want_grads = reference_step(ref, x, r.store.device)
    same(out, want_out, "forward output")
    for name, g in want_grads.items():
        same(grads[name], g, f"gradient of {name}")
    assert not stats.recorded and stats.fetches == len(expected_trace(model, [0, 1, 3, 4, 5]))
    assert stats.hits >= stats.fetches - 2, f"prefetch resumes after the skip: {stats}"
    model.order = ref.order = [0, 1, 2, 3, 4, 5]
    _, _, again = r.step(inputs(2))
    assert not again.recorded and again.hits == again.fetches
    assert r.sched.trace == trace, "the trace of the first step is kept"


class _RankZeroOfTwo(Comm):
    """Rank 0 of 2 without a process group: all_gather appends a zero shard for rank 1, and records where the
    shard it was given lies."""

    def __init__(self):
        super().__init__()
        self.rank, self.world = 0, 2
        self.inputs: list[int] = []

    def all_gather(self, shard):
        self.inputs.append(shard.data_ptr())
        return torch.cat([shard, torch.zeros_like(shard)])


@pytest.mark.parametrize("reuse", [0, 4 * WEIGHT])
def test_a_gather_feeds_the_pool_buffer_to_all_gather_and_keeps_nothing_in_it(tmp_path, reuse):
    """[Note: gathered from the buffer]: the read's pool buffer is all-gather's input (no copy of the shard
    first), the gathered value lies outside the pool, and every buffer is free again at the end of the step; a
    shard kept for reuse (the weight, used again after the bias) is a copy of this rank's slice."""
    cfg = load_config({
        "zero_optimization": {
            "stage": 3, "stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": 4 * WEIGHT,
            "stage3_max_reuse_distance": reuse,
            "offload_param": {"device": "nvme", "nvme_path": str(tmp_path), "buffer_count": 3,
                              "buffer_size": WEIGHT, "max_in_cpu": 0}},
        "infinity": {"direct_io": False}})
    comm = _RankZeroOfTwo()
    store = build_store(cfg, comm)
    torch.manual_seed(SEED)
    lin = torch.nn.Linear(DIM, DIM)
    values = {n: p.detach().clone().reshape(-1) for n, p in lin.named_parameters()}
    mps = {n: store.adopt(p, n) for n, p in lin.named_parameters()}
    pool = store.swap.pool
    lo, hi = pool._memory.data_ptr(), pool._memory.data_ptr() + pool.nbytes
    from_cache = 0
    try:
        for _ in range(3):  # the first records the trace; the later ones prefetch, and (reuse) keep the weight
            store.scheduler.begin_step()
            for name in ("weight", "bias", "weight"):
                mp, mine = mps[name], values[name][:mps[name].part]
                comm.inputs.clear()
                cached = mp.reuse
                store.use(mp)
                full = mp.param.data
                assert torch.equal(full, torch.cat([mine, torch.zeros_like(mine)])[:mp.numel].view(mp.shape))
                assert not lo <= full.data_ptr() < hi
                assert len(comm.inputs) == 1
                if cached is None:
                    assert lo <= comm.inputs[0] < hi, "the shard was copied out of its pool buffer first"
                else:
                    assert comm.inputs[0] == cached.data_ptr()
                    from_cache += 1
                if mp.reuse is not None:  # kept for the next use: this rank's slice, in memory of its own
                    assert mp.reuse.numel() == mp.part and torch.equal(mp.reuse, mine)
                    assert not lo <= mp.reuse.data_ptr() < hi
                store.unuse(mp)
            store.scheduler.drain()
            assert pool.free_count == pool.count
        assert store.scheduler.keep == [bool(reuse), False, False]
        assert from_cache == (2 if reuse else 0)  # the second use of the weight in steps 2 and 3
    finally:
        store.close()


class Checkpointed(torch.nn.Module):
    """Layers under non-reentrant activation checkpointing, as HF's gradient_checkpointing_enable() runs them:
    each weight is fetched in forward, again when backward recomputes the layer, and again for its backward."""

    def __init__(self, n: int):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(DIM, DIM) for _ in range(n))

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        for layer in self.layers:
            x = checkpoint(lambda h, layer=layer: torch.tanh(layer(h)), x, use_reentrant=False)
        return x


def test_a_planned_reuse_cache_never_turns_a_use_into_a_read_on_the_critical_path(run):
    """A reuse distance that covers the whole trace (DeepSpeed's shipped 1e9) with a bucket of three weights:
    the cache keeps only what the plan fits beside one read of the largest shard, shortest spans first, and every
    fetch after the recording step is served by the cache or by a read already in flight (see [Note: the reuse
    cache is planned]). Values stay bit-identical to torch's."""
    torch.manual_seed(SEED)
    model = Checkpointed(6)
    ref = copy.deepcopy(model)
    r = run(model, buffers=4, bucket=3 * WEIGHT, reuse=10 ** 9)
    cached = []  # the cache's elements after each fetch, as the run held them
    inner = r.sched.fetch

    def fetch(*a, **kw):
        out = inner(*a, **kw)
        cached.append(r.sched.cached)
        return out

    r.sched.fetch = fetch
    for step in range(3):
        out, grads, stats = r.step(inputs(step))
        want_out, want_grads = reference_step(ref, inputs(step), r.store.device)
        same(out, want_out, f"step {step} output")
        for name, g in grads.items():
            same(g, want_grads[name], f"step {step} gradient of {name}")
        if step:
            assert stats.hit_rate == 1.0, f"step {step}: {stats.hits} of {stats.fetches} fetches were ready"
            reads = len(r.reads())
            assert reads < stats.fetches, "the cache served some uses"
    assert 0 < max(cached) <= 3 * WEIGHT - WEIGHT, "the cache was used, leaving room to read the largest shard"
