"""The step after backward finished by the next forward ([Note: the step finishes in the next forward] in
infinity/engine/deferred.py): with clipping (or fp16) under ZeRO-3 and the optimizer on NVMe, the sub-groups
holding no persistent parameter are stepped as the next forward first needs them. These tests hold it to the
step it replaces, bit for bit, on a nanoGPT-style model (tied embedding, LayerNorms and biases below the
persistence threshold), and through every way of reading the state before that forward: a checkpoint, a
gathered read, save_pretrained-style consolidation, an eval forward, zero_grad, close."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import infinity
from infinity.config import load_config
from infinity.engine import initialize, zero_init

VOCAB, CTX, DIM, HEADS = 512, 32, 64, 4


class CausalSelfAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.c_attn = nn.Linear(DIM, 3 * DIM)
        self.c_proj = nn.Linear(DIM, DIM)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(DIM, dim=2)
        q, k, v = (z.view(b, t, HEADS, c // HEADS).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1 = nn.LayerNorm(DIM)
        self.attn = CausalSelfAttention()
        self.ln_2 = nn.LayerNorm(DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class NanoGPT(nn.Module):
    def __init__(self, layers=3):
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(VOCAB, DIM), wpe=nn.Embedding(CTX, DIM),
            h=nn.ModuleList(Block() for _ in range(layers)), ln_f=nn.LayerNorm(DIM)))
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)
        self.transformer.wte.weight = self.lm_head.weight
        self.apply(self._init)

    @staticmethod
    def _init(m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx, targets=None):
        pos = torch.arange(idx.shape[1])
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().view(-1, VOCAB), targets.reshape(-1))


def config(disk, *, defer, precision="bf16", params="nvme", gas=1, clip=1.0, speculate=False, zero=None):
    """`zero`: zero_optimization keys set last (an offload_optimizer dict is merged into the one here)."""
    nvme = {"device": "nvme", "nvme_path": str(disk)}
    z = {"stage": 3, "sub_group_size": 20_000, "stage3_param_persistence_threshold": 1000,
         "offload_param": nvme if params == "nvme" else {"device": params},
         "offload_optimizer": dict(nvme, buffer_count=4)}
    for key, value in (zero or {}).items():
        z[key] = dict(z[key], **value) if key == "offload_optimizer" else value
    return load_config({
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": gas, "gradient_clipping": clip,
        "bf16": {"enabled": precision == "bf16"},
        "fp16": {"enabled": precision == "fp16", "initial_scale_power": 8},
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.1, "betas": [0.9, 0.95]}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 3e-3,
                                                     "warmup_num_steps": 3}},
        "zero_optimization": z,
        "infinity": {"step_during_forward": defer, "speculative_step": speculate}})


def build(disk, **kw):
    cfg = config(disk, **kw)
    torch.manual_seed(0)
    with zero_init(cfg):
        model = NanoGPT()
    return initialize(model, cfg)


def batch(s):
    x = torch.randint(0, VOCAB, (2, CTX + 1), generator=torch.Generator().manual_seed(1000 + s))
    return x[:, :-1], x[:, 1:]


def train(e, steps, first=0):
    losses = []
    for s in range(first, first + steps):
        for m in range(e.gradient_accumulation_steps()):
            x, y = batch(m)  # the same batches every step: the loss must fall
            loss = e(x, y)
            e.backward(loss)
            e.step()
        losses.append(loss.item())
    return losses


def weights(e):
    with infinity.gathered_parameters(e.module):
        return {k: v.detach().float().clone() for k, v in e.module.state_dict().items()}


def same(a, b):
    assert a.keys() == b.keys()
    bad = [k for k in a if not torch.equal(a[k], b[k])]
    assert not bad, f"differ: {bad[:5]}"


@pytest.mark.slow
@pytest.mark.parametrize("precision,params,gas", [("bf16", "nvme", 1), ("fp32", "nvme", 2), ("bf16", "cpu", 1)])
def test_the_deferred_step_is_the_same_step(disk_dir, precision, params, gas):
    """Losses and weights equal the step after backward's, bit for bit; the step really is left to forward."""
    runs = {}
    for defer in (False, True):
        e = build(disk_dir / f"{defer}", defer=defer, precision=precision, params=params, gas=gas)
        try:
            opt = e.optimizer
            persistent = [g for g in opt.groups if any(mp.persistent for mp in g.params)]
            assert persistent and len(persistent) < 3, "the persistent parameters pack into their own few groups"
            assert all(all(mp.persistent for mp in g.params) for g in persistent)
            losses = train(e, 2)
            if defer:
                pending = opt._deferred
                assert pending is not None and e.store.pending is pending, "step() left the rest to forward"
                assert len(pending.groups) == len(opt.groups) - len(persistent)
            else:
                assert opt._deferred is None
            losses += train(e, 3, first=2)
            runs[defer] = losses, weights(e)
            assert opt._deferred is None or opt._deferred.done, "a gathered read steps every group it reads"
        finally:
            e.close()
    assert runs[True][0] == runs[False][0]
    same(runs[True][1], runs[False][1])
    assert all(math.isfinite(v) for v in runs[True][0]) and runs[True][0][-1] < runs[True][0][0]


def test_what_reads_the_state_before_the_next_forward_sees_the_stepped_values(disk_dir, tmp_path):
    """A checkpoint, a consolidated state dict, zero_grad and an eval forward right after step(): each sees the
    new values, and training goes on exactly as without deferral (the reference run)."""
    ref = build(disk_dir / "ref", defer=False)
    e = build(disk_dir / "d", defer=True)
    try:
        train(ref, 2)
        train(e, 2)
        assert e.optimizer._deferred is not None
        e.optimizer.zero_grad()  # what a Hugging Face-style loop does after step(): the pending gradients stay
        assert e.consolidated_16bit_state_dict().keys() == ref.consolidated_16bit_state_dict().keys()
        same(e.consolidated_16bit_state_dict(), ref.consolidated_16bit_state_dict())
        e.save_checkpoint(str(tmp_path / "ck"), tag="t")
        assert e.optimizer._deferred is None, "the checkpoint settled the step"
        same(weights(e), weights(ref))
        train(ref, 1, first=2)
        train(e, 1, first=2)
        e.eval()
        ref.eval()
        with torch.no_grad():
            x, _ = batch(99)
            assert torch.equal(e(x), ref(x)), "an eval forward fetches through the deferred step"
        e.train()
        ref.train()
        assert torch.equal(torch.tensor(train(e, 2, first=3)), torch.tensor(train(ref, 2, first=3)))
        sd, sr = e.module_state_dict(), ref.module_state_dict()
        same(sd, sr)
    finally:
        e.close()
        ref.close()
    # The checkpoint taken with a step pending loads and continues as the reference did.
    e = build(disk_dir / "l", defer=True)
    ref = build(disk_dir / "lr", defer=False)
    try:
        e.load_checkpoint(str(tmp_path / "ck"), tag="t")
        ref.load_checkpoint(str(tmp_path / "ck"), tag="t")
        assert train(e, 2, first=2) == train(ref, 2, first=2)
    finally:
        e.close()
        ref.close()


def test_a_settled_step_frees_every_buffer_and_close_settles_a_pending_one(disk_dir):
    e = build(disk_dir / "a", defer=True)
    pool = e.optimizer.swap.pool
    train(e, 2)
    assert e.optimizer._deferred is not None
    e.optimizer.settle()
    assert e.optimizer._deferred is None and e.store.pending is None
    assert pool.free_count == pool.count, "every optimizer buffer is back once the step is settled"
    e.close()
    e = build(disk_dir / "b", defer=True)
    train(e, 2)
    assert e.optimizer._deferred is not None
    from infinity.engine.deferred import DeferredStep

    def refuse(self):
        raise AssertionError("close() wrote the rest of the step into files it is about to delete")

    DeferredStep.settle, kept = refuse, DeferredStep.settle
    try:
        e.close()  # right after step(): the rest of the step is dropped with the swap files
    finally:
        DeferredStep.settle = kept
    assert e.optimizer._deferred is None and not any((disk_dir / "b").rglob("*.swp"))


def test_an_fp16_overflow_skips_the_step_and_drops_the_reads_started_for_it(disk_dir):
    """fp16: the reads read_ahead_for_step started during the overflowing backward go back unused."""
    e = build(disk_dir, defer=True, precision="fp16")
    try:
        pool = e.optimizer.swap.pool
        train(e, 1)
        e.optimizer.settle()
        x, y = batch(5)
        loss = e(x, y)
        e.backward(loss * float("inf"))
        assert e.optimizer._early, "the step's first states are read during backward"
        assert not e.step(), "the overflow skips the step"
        assert e.optimizer._deferred is None and not e.optimizer._early
        assert pool.free_count == pool.count, "no buffer is left with an unused read"
        assert math.isfinite(train(e, 1, first=1)[0])
    finally:
        e.close()


def test_the_next_forward_steps_each_group_when_it_first_needs_it(disk_dir, monkeypatch):
    """With no read ever counted as landed, poll() runs nothing, so only forward's reads of the shards step the
    groups: one at a time, in forward's order, and all of them by the end of that forward."""
    from infinity.swap.state import NvmeState

    monkeypatch.setattr(NvmeState, "read_landed", lambda self: False)
    e = build(disk_dir, defer=True)
    try:
        train(e, 1)
        pending = e.optimizer._deferred
        assert pending is not None and pending.next == 0, "step() stepped only the persistent groups"
        seen = []
        need = e.optimizer.need
        e.optimizer.need = lambda mp: (need(mp), seen.append((mp.name, pending.next)))
        x, y = batch(0)
        loss = e(x, y)
        assert pending.done, "the forward needed every group"
        firsts = {}
        for name, stepped in seen:
            firsts.setdefault(name, stepped)
        # The tied embedding was registered last (built as lm_head) and is used first: it is stepped first.
        assert next(iter(firsts)) == "transformer.wte.weight" and firsts["transformer.wte.weight"] == 2
        assert firsts["transformer.h.2.mlp.2.weight"] == len(pending.groups), "the last block's group came last"
        assert list(firsts.values()) == sorted(firsts.values()), "groups are stepped in forward's order"
        e.backward(loss)
        e.step()
    finally:
        e.close()


def test_an_error_in_the_deferred_walk_drops_the_unstepped_groups_gradients_and_says_so(disk_dir, caplog,
                                                                                        monkeypatch):
    """A failure part-way (here the Adam of the third deferred group) reaches the forward that asked; the groups
    not stepped keep their values and lose their gradients, no buffer stays taken, and a warning says so."""
    from infinity.swap.state import NvmeState

    monkeypatch.setattr(NvmeState, "read_landed", lambda self: False)  # only forward's reads step groups
    e = build(disk_dir, defer=True)
    try:
        train(e, 1)
        pending = e.optimizer._deferred
        assert pending.next == 0
        victim = pending.groups[2]

        def broken(views):
            raise OSError(5, "injected failure in the Adam of a deferred group")

        pending.works[victim.index] = broken
        x, y = batch(0)
        with caplog.at_level("WARNING", logger="infinity"), pytest.raises(OSError, match="injected failure"):
            e(x, y)
        assert "the optimizer step was cut short: 9 of 11 sub-groups" in caplog.text
        assert all(g.grad is None and all(mp.grad is None for mp in g.params) for g in pending.groups[2:])
        assert e.optimizer._deferred is None and e.store.pending is None
        pool = e.optimizer.swap.pool
        assert pool.free_count == pool.count, "every buffer is back"
    finally:
        e.close()


def test_stepped_shards_are_staged_for_forward_instead_of_read_back(disk_dir, monkeypatch):
    """[Note: stepped shards are staged]: with the shards in the optimizer's files, forward takes a stepped
    shard from a copy made right after its Adam instead of waiting for the group's write and reading it back.
    The same losses and weights, bit for bit, as the walk without copies; fewer bytes read; and every copy not
    taken goes back to the pool."""
    from infinity.engine.alias import OptimizerSliceReader

    runs = {}
    whole = []  # split shards staged whole, piece by piece (the tied embedding: 32,768 > 20,000 elements)
    real_piece = OptimizerSliceReader.stage_piece

    def stage_piece(self, sid, at, values, total):
        kept = real_piece(self, sid, at, values, total)
        if self.staged(sid):
            whole.append(sid)
        return kept

    monkeypatch.setattr(OptimizerSliceReader, "stage_piece", stage_piece)
    # No prefetch: every fetch is on the critical path, so whether a fetch reads its file depends only on
    # whether a staged copy was there, not on how fast this machine's disk was that second.
    from infinity.engine.scheduler import PrefetchScheduler

    monkeypatch.setattr(PrefetchScheduler, "_prefetch", lambda self: None)
    for staging in (True, False):
        if not staging:
            monkeypatch.setattr(OptimizerSliceReader, "stage", lambda self, sid, values: False)
            monkeypatch.setattr(OptimizerSliceReader, "stage_piece", lambda self, sid, at, values, total: False)
        e = build(disk_dir / str(staging), defer=True)
        try:
            losses, reports = [], []
            for s in range(4):
                x, y = batch(s % 2)
                loss = e(x, y)
                e.backward(loss)
                e.step()
                losses.append(loss.item())
                reports.append(e.last_report)
            runs[staging] = losses, weights(e), reports
            pool, reader = e.store.swap.pool, e.store.alias
            e.optimizer.settle()
            assert pool.in_use == len(reader._staged) and not reader._partial, \
                "every buffer is free or a copy not taken"
        finally:
            e.close()
        assert not reader._staged, "close gives the copies back"
    assert len(whole) >= 2, "the split embedding was staged in the deferred steps"
    staged, plain = runs[True][2][2:], runs[False][2][2:]  # after the trace is recorded and a step deferred
    assert all(r.param_staged > 0 for r in staged) and all(r.param_staged == 0 for r in plain)
    assert all(r.param_critical_reads <= r.param_fetches - r.prefetch_hits for r in staged + plain)
    assert sum(r.param_critical_reads for r in staged) < sum(r.param_critical_reads for r in plain), \
        "a staged copy taken by a fetch is no read on the critical path"
    assert sum(r.param_read_bytes for r in staged) < sum(r.param_read_bytes for r in plain)
    assert runs[True][0] == runs[False][0]
    same(runs[True][1], runs[False][1])


def test_a_split_shard_is_staged_whole_or_not_at_all():
    """OptimizerSliceReader.stage_piece: the first piece takes one buffer of the whole shard's bytes; a later
    piece whose first found no buffer keeps nothing; copies not taken go back."""
    from types import SimpleNamespace

    from infinity.engine.alias import OptimizerSliceReader
    from infinity.swap import BufferPool

    pool = BufferPool(2, 4 * 3000, pin=False, sized=True)
    store = SimpleNamespace(swap=SimpleNamespace(pool=pool, io=None, swapper=SimpleNamespace(checksums=False)))
    reader = OptimizerSliceReader(store, torch.float32)
    values = torch.arange(3000, dtype=torch.float32)
    assert not reader.stage_piece("a", 2000, values[2000:], 3000) and pool.in_use == 0, \
        "a piece without its first keeps nothing"
    assert reader.stage_piece("b", 0, values[:2000], 3000) and not reader.staged("b") and pool.in_use == 1
    assert reader.stage_piece("b", 2000, values[2000:], 3000) and reader.staged("b") and pool.in_use == 1
    assert torch.equal(reader.swap_in("b").wait(), values)
    reader.release("b")
    assert reader.stage_piece("c", 0, values[:2000], 3000) and pool.in_use == 1
    assert not reader.stage_piece("d", 0, values[:2000], 3000), "a second whole slot would leave none free"
    reader.drop_staged()
    assert pool.in_use == 0 and not reader._partial
