"""Gradient buckets ([Note: gradient buckets] in infinity/engine/buckets.py) with a fake two-rank Comm.

ParamStore.on_grad is the post-accumulate-grad hook; here it is called
directly with chosen gradients, in one process, with a Comm that says it is
rank r of `world`, records every packed tensor handed to
reduce_scatter_mean_async and answers with a slice the test chose. The
optimizer's side is a recorder that takes the gradients through real GradientBuckets. So each
test sees exactly what is packed, when it is sent, and when and where it lands.
"""

from __future__ import annotations

import pytest
import torch

from infinity.config import load_config
from infinity.engine.build import build_store
from infinity.engine.comm import Comm
from infinity.testing.recorders import GradientRecorder

BASE = 0.5  # what every gradient shard holds before this backward: landing adds to it


class FakeComm(Comm):
    """Rank `rank` of `world` in one process. Each reduce-scatter is recorded; its pending's wait() returns
    `answer(k, packed)` for the k-th one (default: a marker, 1000 (k + 1) + i at element i)."""

    def __init__(self, rank: int, world: int, answer=None):
        super().__init__()  # one process, no torch.distributed: then claim to be one of `world` ranks
        self.rank, self.world = rank, world
        self.answer = answer or (lambda k, packed: 1000.0 * (k + 1) + torch.arange(packed.numel() // world,
                                                                                  dtype=torch.float32))
        self.sent: list[torch.Tensor] = []  # the packed tensors, as they were when sent
        self.replies: list[torch.Tensor] = []
        self.waits: list[int] = []  # wait() calls per reduce-scatter

    def reduce_scatter_mean_async(self, flat: torch.Tensor):
        assert flat.dim() == 1 and flat.dtype == torch.float32 and flat.numel() % self.world == 0
        k = len(self.sent)
        self.sent.append(flat.detach().clone())
        self.replies.append(self.answer(k, flat.detach().clone()))
        self.waits.append(0)
        return _Pending(self, k)

    def _unexpected(self, *args, **kwargs):
        raise AssertionError("only reduce_scatter_mean_async is expected while gradients are bucketed")

    all_gather = reduce_scatter_mean = all_reduce_ = broadcast_ = _unexpected


class _Pending:
    def __init__(self, comm: FakeComm, k: int):
        self.comm, self.k = comm, k

    def wait(self) -> torch.Tensor:
        self.comm.waits[self.k] += 1
        return self.comm.replies[self.k].clone()


class Bench:
    """A stage-3 store (offload none, every parameter partitioned) over a FakeComm, with recorders for the
    optimizer's side: `grads[name]` is this rank's fp32 gradient shard, `ready` the grad_ready calls in order."""

    def __init__(self, shapes: dict, *, rank: int = 0, world: int = 2, bucket: int = 1 << 40, answer=None):
        self.comm = FakeComm(rank, world, answer)
        cfg = load_config({"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                                 "reduce_bucket_size": bucket, "offload_param": {"device": "none"},
                                                 "offload_optimizer": {"device": "none"}}})
        self.store = build_store(cfg, self.comm)
        self.params = {name: torch.nn.Parameter(torch.zeros(shape)) for name, shape in shapes.items()}
        self.mps = {name: self.store.adopt(p, name) for name, p in self.params.items()}
        self.grads = {name: torch.full((mp.part,), BASE) for name, mp in self.mps.items()}
        self.ready: list[str] = []
        self.optimizer = GradientRecorder(grad_for=lambda mp: self.grads[mp.name],
                                          grad_ready=lambda mp: self.ready.append(mp.name), comm=self.comm,
                                          reduce_bucket=bucket)
        self.store.attach(self.optimizer)

    def grad(self, name: str, g: torch.Tensor) -> None:
        """What autograd does: accumulate `g` into .grad, then call the post-accumulate-grad hook."""
        p = self.params[name]
        p.grad = g.reshape(p.shape).clone()
        self.store.on_grad(p)
        assert p.grad is None, "on_grad takes the gradient out of .grad"

    def untouched(self, *names) -> bool:
        return all(torch.equal(self.grads[n], torch.full_like(self.grads[n], BASE)) for n in names)

    def close(self) -> None:
        self.store.close()


def shard(full: torch.Tensor, rank: int, part: int) -> torch.Tensor:
    """Rank `rank`'s shard of a full value, per [Note: shard layout]: elements [r part, (r+1) part), zero-padded."""
    flat = full.reshape(-1)
    out = torch.zeros(part)
    piece = flat[rank * part:(rank + 1) * part]
    out[:piece.numel()] = piece
    return out


@pytest.fixture
def bench():
    made = []

    def make(*args, **kwargs):
        made.append(Bench(*args, **kwargs))
        return made[-1]

    yield make
    for b in made:
        b.close()


# ------------------------------------------------------------------------------------- (a) rank-major packing


@pytest.mark.parametrize("rank", [0, 1])
def test_packing_is_rank_major_with_zero_padding_and_each_rank_lands_its_own_shards(bench, rank):
    # What a real reduce-scatter gives when both ranks hold the same gradients: the mean is row `rank` itself.
    b = bench({"w": (2, 2), "v": (3,), "u": (5,)}, rank=rank,
              answer=lambda k, packed: packed.view(2, -1)[rank].clone())
    assert [b.mps[n].part for n in "wvu"] == [2, 2, 3]
    b.grad("w", torch.tensor([[1.0, 2.0], [3.0, 4.0]]))
    b.grad("v", torch.tensor([5.0, 6.0, 7.0]))
    b.grad("u", torch.tensor([8.0, 9.0, 10.0, 11.0, 12.0]))
    assert b.comm.sent == [] and b.ready == [], "nothing is sent before the bucket is full or flushed"
    b.optimizer.flush_grads()
    assert len(b.comm.sent) == 1
    #        w      v          u                  w      v         u
    row0 = [1, 2,  5, 6,     8, 9, 10]
    row1 = [3, 4,  7, 0,    11, 12, 0]  # v and u do not divide by 2: their last shard ends in a zero
    assert b.comm.sent[0].tolist() == [float(x) for x in row0 + row1]
    mine = (row0, row1)[rank]
    assert b.grads["w"].tolist() == [BASE + x for x in mine[0:2]]
    assert b.grads["v"].tolist() == [BASE + x for x in mine[2:4]]
    assert b.grads["u"].tolist() == [BASE + x for x in mine[4:7]]
    assert b.ready == ["w", "v", "u"]
    assert b.comm.waits == [1]


@pytest.mark.parametrize("world", [2, 3])
def test_packing_matches_the_shard_layout_for_any_shapes(bench, world):
    torch.manual_seed(0)
    shapes = {"a": (3, 5), "b": (7,), "c": (4, 4), "d": (1,), "e": (2, 3, 2)}
    rank = world - 1
    b = bench(shapes, rank=rank, world=world, answer=lambda k, packed: packed.view(world, -1)[rank].clone())
    full = {name: torch.randn(shape) for name, shape in shapes.items()}
    order = ["c", "a", "e", "b", "d"]  # bucket order is the order gradients arrive, not registration order
    for name in order:
        b.grad(name, full[name])
    b.optimizer.flush_grads()
    assert len(b.comm.sent) == 1
    parts = [b.mps[n].part for n in order]
    assert parts == [-(-full[n].numel() // world) for n in order]
    rows = b.comm.sent[0].view(world, sum(parts))
    for r in range(world):
        want = torch.cat([shard(full[n], r, b.mps[n].part) for n in order])
        assert torch.equal(rows[r], want), f"row {r} holds every shard rank {r} owns, in bucket order"
    for name in order:
        assert torch.equal(b.grads[name], BASE + shard(full[name], rank, b.mps[name].part)), name
    assert b.ready == order


# ------------------------------------------------------------------------------ (b) when buckets go and land


def test_a_full_bucket_is_sent_and_lands_when_the_next_is_sent_or_backward_ends(bench):
    # Bucket of 10 elements. numel (padded to 2 ranks): p0 4, p1 6 -> 10: full; p2 5 (6), p3 6 -> full;
    # p4 7 (8): still open when backward ends.
    shapes = {"p0": (4,), "p1": (2, 3), "p2": (5,), "p3": (6,), "p4": (7,)}
    b = bench(shapes, bucket=10)
    torch.manual_seed(0)
    full = {name: torch.randn(shape) for name, shape in shapes.items()}

    def landed(name, k, offset):
        """p's shard got bucket k's reply at `offset`: the marker 1000 (k + 1) + offset + i."""
        part = b.mps[name].part
        want = BASE + 1000.0 * (k + 1) + torch.arange(offset, offset + part, dtype=torch.float32)
        return torch.equal(b.grads[name], want)

    b.grad("p0", full["p0"])
    assert b.comm.sent == []
    b.grad("p1", full["p1"])  # reaches 10: sent, in flight
    assert len(b.comm.sent) == 1 and b.comm.waits == [0], "a full bucket is sent at once, not waited for"
    assert b.comm.sent[0].numel() == 2 * (2 + 3)
    assert b.untouched(*shapes) and b.ready == [], "in flight: nothing has landed"

    b.grad("p2", full["p2"])
    assert len(b.comm.sent) == 1 and b.untouched(*shapes) and b.ready == []
    b.grad("p3", full["p3"])  # the second bucket is sent: the first one lands
    assert len(b.comm.sent) == 2 and b.comm.waits == [1, 0]
    assert landed("p0", 0, 0) and landed("p1", 0, 2), "bucket 0's reply lands on its owners, in bucket order"
    assert b.untouched("p2", "p3", "p4")
    assert b.ready == ["p0", "p1"]

    b.grad("p4", full["p4"])
    assert len(b.comm.sent) == 2 and b.comm.waits == [1, 0] and b.ready == ["p0", "p1"]

    b.optimizer.flush_grads()  # the end of backward: the open bucket is sent and everything lands
    assert len(b.comm.sent) == 3 and b.comm.waits == [1, 1, 1]
    assert landed("p0", 0, 0) and landed("p1", 0, 2), "a landed bucket is not added twice"
    assert landed("p2", 1, 0) and landed("p3", 1, 3)
    assert landed("p4", 2, 0)
    assert b.ready == ["p0", "p1", "p2", "p3", "p4"], "grad_ready once per parameter, as each lands"

    # What was sent is what was given: each packed row is that rank's shards (bucket 1: p2 then p3).
    rows = b.comm.sent[1].view(2, -1)
    for r in range(2):
        assert torch.equal(rows[r], torch.cat([shard(full["p2"], r, 3), shard(full["p3"], r, 3)]))

    b.optimizer.flush_grads()  # nothing pending: nothing sent, nothing lands again
    assert len(b.comm.sent) == 3 and b.comm.waits == [1, 1, 1] and len(b.ready) == 5


def test_flush_without_final_sends_but_does_not_wait(bench):
    b = bench({"a": (4,), "b": (4,)})
    b.grad("a", torch.ones(4))
    b.optimizer.buckets.flush(final=False)
    assert len(b.comm.sent) == 1 and b.comm.waits == [0] and b.untouched("a") and b.ready == []
    b.grad("b", torch.ones(4))
    b.optimizer.flush_grads()
    assert b.comm.waits == [1, 1] and b.ready == ["a", "b"]


def test_bucket_size_zero_sends_every_gradient_on_its_own(bench):
    names = ["a", "b", "c"]
    b = bench({n: (3,) for n in names}, bucket=0)
    for i, n in enumerate(names):
        b.grad(n, torch.full((3,), float(i + 1)))
        assert len(b.comm.sent) == i + 1, "each gradient is a bucket of its own"
        assert b.ready == names[:i], "only the previous one has landed"
    b.optimizer.flush_grads()
    assert b.ready == names and b.comm.waits == [1, 1, 1]
    assert [t.tolist() for t in b.comm.sent] == [[1, 1, 1, 0], [2, 2, 2, 0], [3, 3, 3, 0]]


def test_discard_drops_the_open_bucket_and_lands_nothing_of_the_one_in_flight(bench):
    """A backward that did not finish (a checkpoint load replaced its state): its gradients go nowhere, and the
    next backward starts from empty buckets."""
    b = bench({"a": (4,), "b": (4,)})
    b.grad("a", torch.ones(4))
    b.optimizer.buckets.flush(final=False)  # in flight
    b.grad("b", torch.ones(4))  # in the open bucket
    b.optimizer.buckets.discard()
    assert b.comm.waits == [1], "the collective every rank started is waited for"
    assert b.untouched("a") and b.untouched("b") and b.ready == []
    b.optimizer.flush_grads()
    assert len(b.comm.sent) == 1 and b.untouched("a") and b.untouched("b") and b.ready == []
