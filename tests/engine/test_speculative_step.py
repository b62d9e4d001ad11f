"""The speculative step ([Note: the speculative step] in infinity/engine/optimizer.py): with clipping or fp16,
parameters and optimizer on NVMe, a step during backward taken as a bet that the clip will not scale and
nothing will overflow, committed when it holds and rolled back when it does not. Every run here is held, bit
for bit, to the same run with `speculative_step: false` (the step after backward, finished by the next
forward): committed bets, lost bets (the clip fires, fp16 overflows, a reentrant checkpoint sends a gradient
after its group stepped), fp32, bf16 and fp16, and the disk-room check that turns it off."""

from __future__ import annotations

import logging
import os
import shutil

import pytest
import torch
import torch.nn as nn
import torch.utils.checkpoint as ckpt

from infinity.engine import initialize, zero_init
from tests.engine.test_deferred_step import VOCAB, NanoGPT, batch, config, same, weights

CLIP = 2.5
"""Between the global norms of these runs' steps (2.0-2.9): some clip and some do not."""


def build(disk, *, speculate, model=NanoGPT, **kw):
    cfg = config(disk, defer=True, speculate=speculate, **kw)
    torch.manual_seed(0)
    with zero_init(cfg):
        m = model()
    return initialize(m, cfg)


def run(disk, steps, *, poke=None, between=None, **kw):
    """Losses, final weights and each step's report of `steps` steps; poke(engine, step) before each, and
    between(engine, step) between the last backward and step()."""
    e = build(disk, **kw)
    try:
        losses = []
        for s in range(steps):
            if poke is not None:
                poke(e, s)
            for m in range(e.gradient_accumulation_steps()):
                x, y = batch(3 * (s % 3) + m)  # three batches, again and again: epochs of a tiny dataset
                loss = e(x, y)
                e.backward(loss)
                if between is not None:
                    between(e, s)
                e.step()
            losses.append(loss.item())
        return losses, weights(e), list(e.reports), e
    finally:
        e.close()


@pytest.mark.parametrize("precision,gas", [("bf16", 1), ("fp32", 2), ("fp16", 1)])
def test_a_bet_that_holds_is_the_step_after_backward(disk_dir, precision, gas):
    """No step clips: from the second step on (the first has no last step to go by) every step is a committed
    bet, and the run equals the one without bets, bit for bit."""
    runs = {}
    for speculate in (False, True):
        runs[speculate] = run(disk_dir / str(speculate), 5, speculate=speculate, precision=precision, gas=gas,
                              clip=1e4)
    (l0, w0, r0, _), (l1, w1, r1, e) = runs[False], runs[True]
    assert e.optimizer.can_speculate
    assert l1 == l0 and [r.grad_norm for r in r1] == [r.grad_norm for r in r0]
    same(w0, w1)
    assert [r.speculation for r in r0] == [None] * 5
    assert [r.speculation for r in r1] == [None] + ["committed"] * 4
    # A committed bet moves the step's bytes once, as the step after backward does.
    assert [r.optimizer_read_bytes for r in r1] == [r.optimizer_read_bytes for r in r0]


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_a_lost_bet_is_rolled_back_and_the_step_taken_after_backward(disk_dir, precision):
    """The clip fires on a step after one it did not: that bet is rolled back (no trace of it in the weights)
    and the step after backward taken; the next step does not bet. Bit for bit the run without bets."""
    clip = CLIP
    runs = {s: run(disk_dir / f"r{s}", 8, speculate=s, precision=precision, clip=clip) for s in (False, True)}
    (l0, w0, r0, _), (l1, w1, r1, _) = runs[False], runs[True]
    assert l1 == l0
    same(w0, w1)
    stood = [r.grad_norm + 1e-6 <= clip for r in r0]
    # A step bets when the last one stood, and the bet holds when this one stands too.
    expected = [None] + [None if not before else "committed" if now else "redone"
                         for before, now in zip(stood, stood[1:])]
    assert [r.speculation for r in r1] == expected
    assert "committed" in expected and "redone" in expected, f"norms {[r.grad_norm for r in r0]} do not " \
                                                              "exercise both outcomes"
    for k, r in enumerate(r1):  # a lost bet's I/O is counted with its step: the state read and written twice
        factor = 2 if r.speculation == "redone" else 1
        assert r.optimizer_read_bytes == factor * r0[k].optimizer_read_bytes


def test_an_fp16_overflow_during_a_bet_skips_the_step(disk_dir):
    """A loss scale that overflows, set on a step that bets: the bet is rolled back and the step skipped, as
    without the bet; the scaler goes on the same way."""
    kept = {}

    def poke(e, s):
        if s == 3:
            kept["scale"], e.scaler.scale = e.scaler.scale, 2.0 ** 60  # the fp16 gradients overflow
        if s == 4:
            e.scaler.scale = kept["scale"]
    runs = {s: run(disk_dir / f"r{s}", 6, speculate=s, precision="fp16", clip=1e4, poke=poke) for s in (False, True)}
    (l0, w0, r0, _), (l1, w1, r1, _) = runs[False], runs[True]
    assert l1 == l0
    same(w0, w1)
    assert [r.skipped for r in r1] == [r.skipped for r in r0] == [False] * 3 + [True] + [False] * 2
    assert [r.loss_scale for r in r1] == [r.loss_scale for r in r0]
    assert [r.speculation for r in r1] == [None, "committed", "committed", "redone", None, "committed"]


class Shared(nn.Module):
    """A block under reentrant activation checkpointing whose output projection is also used outside it: its
    gradient arrives twice in one backward, the second after its group could have stepped."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 64)
        self.inner = nn.Linear(64, 64)
        self.proj = nn.Linear(64, 64)
        self.head = nn.Linear(64, VOCAB)

    def _block(self, x):
        return self.proj(torch.tanh(self.inner(x)))

    def forward(self, idx, targets):
        x = self.emb(idx)
        x = x + ckpt.checkpoint(self._block, x, use_reentrant=True)
        x = self.proj(x)
        return nn.functional.cross_entropy(self.head(x).float().view(-1, VOCAB), targets.reshape(-1))


def test_a_gradient_after_its_group_stepped_loses_the_bet(disk_dir):
    """With the exact step during backward (no clipping) backward's second use of a stepped group's parameter
    is an error; under a bet it reads the slot still live and only loses the bet, and the run equals the one
    without bets."""
    kw = dict(model=Shared, clip=1e4)
    runs = {s: run(disk_dir / f"r{s}", 4, speculate=s, **kw) for s in (False, True)}
    (l0, w0, _, _), (l1, w1, r1, _) = runs[False], runs[True]
    assert l1 == l0
    same(w0, w1)
    # The first lost bet turns bets off for the run: each would be lost the same way.
    assert [r.speculation for r in r1] == [None, "redone", None, None]
    # Which of the two loud errors comes first depends on whether the group's write has landed when backward
    # reads the parameter again: its second gradient, or the read of a file whose write is pending.
    with pytest.raises(RuntimeError, match="received a gradient after its group was stepped|read the parameter "
                                           "again after its sub-group had stepped"):
        run(disk_dir / "exact", 2, speculate=False, model=Shared, clip=0.0)


def test_no_room_for_a_second_copy_turns_the_bet_off(disk_dir, monkeypatch, caplog):
    """A filesystem with room for the optimizer's files once but not twice: no bet, said once with the path,
    and the run is the step after backward's."""
    real = shutil.disk_usage
    need = {}

    def usage(path):
        u = real(path)
        free = need.get("free")
        return u if free is None else u._replace(free=free)

    monkeypatch.setattr(shutil, "disk_usage", usage)
    e = build(disk_dir / "probe", speculate=True)
    d, = e.plan.disk
    e.close()
    need["free"] = d.param_bytes + 2 * d.optimizer_bytes - 1
    with caplog.at_level(logging.INFO, logger="infinity"):
        losses, _, reports, e = run(disk_dir / "short", 4, speculate=True, clip=1e4)
    assert not e.optimizer.can_speculate
    assert [r.speculation for r in reports] == [None] * 4
    said = [r.getMessage() for r in caplog.records if "speculative_step" in r.getMessage()]
    assert len(said) == 1 and "no room" in said[0] and str(disk_dir / "short") in said[0]


def second_slots(engine) -> list:
    return [pid for g in engine.optimizer.groups for pid in [g.state.id + ".b"] if pid in g.state.swapper.registry]


def test_second_slots_are_reserved_only_where_a_bet_can_come(disk_dir):
    """Reserved at setup with clipping (one per sub-group, a file each); none without clipping, where the exact
    step during backward needs none."""
    for clip, expect in ((1.0, True), (0.0, False)):
        e = build(disk_dir / str(clip), speculate=True, clip=clip)
        try:
            slots = second_slots(e)
            assert (len(slots) == len(e.optimizer.groups)) if expect else not slots
            assert all(os.path.exists(e.optimizer.groups[0].state.swapper.path_of(pid)) for pid in slots)
        finally:
            e.close()


def test_a_failed_write_during_a_bet_leaves_every_group_as_it_was(disk_dir):
    """A write to the slot not yet live that fails part-way through a bet: backward raises it, every group is
    back on its live slot and at rest, every pool buffer is free, the step count is unchanged, and training goes
    on."""
    e = build(disk_dir, speculate=True, clip=1e4)
    try:
        for s in range(2):
            x, y = batch(s)
            e.backward(e(x, y))
            e.step()
        opt = e.optimizer
        swapper = opt.groups[0].state.swapper
        real, failed = swapper._write, []

        def write(part, buf):
            if opt.overlapping and opt.groups[0].state.write_id != opt.groups[0].state.id and not failed:
                failed.append(part.id)
                with swapper._lock:
                    part.fail_write()
                raise OSError(5, "injected write failure", part.id)
            return real(part, buf)

        swapper._write = write
        steps = opt.step_count
        x, y = batch(2)
        loss = e(x, y)
        with pytest.raises(OSError, match="injected write failure"):
            e.backward(loss)
        swapper._write = real
        assert failed and opt.step_count == steps
        assert all(g.state.at_rest() for g in opt.groups)
        assert swapper.pool.free_count == swapper.pool.count
        e.zero_grad()
        for s in range(3, 5):
            x, y = batch(s)
            loss = e(x, y)
            e.backward(loss)
            e.step()
            assert torch.isfinite(loss)
    finally:
        e.close()


def test_two_ranks_bet_together_and_match_the_step_after_backward(tmp_path):
    """2 gloo ranks, the repo's GPT with every parameter partitioned: both ranks bet and roll back together
    (the outcome is agreed through the same collectives the step after backward makes), and the run equals
    the one without bets, bit for bit."""
    from infinity.testing.ckpt import spawn_train
    from infinity.testing.parity import engine_config

    clip = 1.55  # between this run's global norms (1.24-1.61): some steps clip, some do not
    out = {}
    for speculate in (False, True):
        cfg = engine_config("nvme", tmp_path / f"swap{speculate}", **{
            "bf16.enabled": True, "gradient_clipping": clip, "infinity.speculative_step": speculate})
        out[speculate] = spawn_train(2, cfg, 8, str(tmp_path / f"out{speculate}.pt"))
    a, b = out[False], out[True]
    assert a["losses"] == b["losses"]
    same(a["weights"], b["weights"])
    stood = [norm + 1e-6 <= clip for norm, _ in a["reports"]]
    expected = [None] + [None if not before else "committed" if now else "redone"
                         for before, now in zip(stood, stood[1:])]
    assert [s for _, s in b["reports"]] == expected
    assert "committed" in expected and "redone" in expected, f"norms {a['reports']} do not exercise both outcomes"


def test_an_lr_changed_between_backward_and_step_rolls_the_bet_back(disk_dir, caplog):
    """A bet used the lr from when backward began; one changed before step() rolls it back, and the step after
    backward takes the new one: bit for bit the run without bets. The exact step during backward (no clipping)
    cannot go back, and says so, once."""
    def halve(e, s):
        if s >= 2:
            for pg in e.optimizer.param_groups:
                pg["lr"] *= 0.5

    runs = {sp: run(disk_dir / str(sp), 4, speculate=sp, clip=1e4, between=halve) for sp in (False, True)}
    same(runs[False][1], runs[True][1])
    assert [r.speculation for r in runs[True][2]] == [None, "committed", "redone", None]  # then no more bets
    with caplog.at_level(logging.WARNING, logger="infinity"):
        run(disk_dir / "exact", 4, speculate=True, clip=0.0, between=halve)
    said = [r.getMessage() for r in caplog.records if "changed between backward and step()" in r.getMessage()]
    # the bet's run: bets off after the first (each would be lost); the exact run: the values it used, once
    assert len(said) == 2 and "speculative step is off" in said[0] and "without gradient clipping" in said[1]


class SometimesShared(Shared):
    """Shared, with the reentrant checkpoint only on the steps `shared_on` names: a late gradient after bets
    that held (the live files are the second ones by then)."""

    shared_on: set = set()
    step = 0

    def forward(self, idx, targets):
        x = self.emb(idx)
        block = self._block(x) if self.step not in self.shared_on else ckpt.checkpoint(self._block, x,
                                                                                           use_reentrant=True)
        x = self.proj(x + block)
        return nn.functional.cross_entropy(self.head(x).float().view(-1, VOCAB), targets.reshape(-1))


def test_a_late_gradient_after_held_bets_loses_that_bet_only(disk_dir):
    """Bets hold, then one step sends a late gradient: that bet is rolled back from whichever slot is live, the
    step taken after backward, and bets stop; bit for bit the run without bets."""
    SometimesShared.shared_on = {2}

    def poke(e, s):
        e.module.step = s

    runs = {s: run(disk_dir / f"r{s}", 4, speculate=s, model=SometimesShared, clip=1e4, poke=poke)
            for s in (False, True)}
    (l0, w0, _, _), (l1, w1, r1, _) = runs[False], runs[True]
    assert l1 == l0
    same(w0, w1)
    assert [r.speculation for r in r1] == [None, "committed", "redone", None]


def test_a_second_backward_before_step_takes_the_step_after_backward(disk_dir):
    """A held bet whose step() comes after another backward (an auxiliary loss): the bet is rolled back by that
    backward, and step() takes the step after backward with both gradients, as without bets."""
    def auxiliary(e, s):
        if s == 2:
            x, y = batch(7)
            e.backward(e(x, y), retain_graph=True)  # retain_graph: never a step during backward

    out = {sp: run(disk_dir / str(sp), 3, speculate=sp, clip=1e4, between=auxiliary) for sp in (False, True)}
    same(out[False][1], out[True][1])
    assert [r.speculation for r in out[True][2]] == [None, "committed", "redone"]
    assert out[True][3].optimizer.step_count == out[False][3].optimizer.step_count == 3


LEAN = {"stage3_prefetch_bucket_size": 10 ** 8, "stage3_max_reuse_distance": 0,
        "stage3_param_persistence_threshold": 0, "offload_optimizer": {"buffer_count": 16}}
"""A prefetch that runs far ahead, no reuse cache: backward's reads are lent from the states being read."""


def test_a_forward_between_backward_and_step_leaves_no_read_behind(disk_dir):
    """A forward (grad on) between backward and step() starts reads of the state for the next step; the commit
    that follows drops those of the files that stop being live, and the bets go on, bit for bit."""
    def forward(e, s):
        if s == 2:
            e(*batch(9))

    def at_rest(e, s):  # before each step: the last one left no read behind (or its step is deferred)
        assert all(g.state.at_rest() for g in e.optimizer.groups) or e.optimizer.pending is not None

    out = {sp: run(disk_dir / str(sp), 5, speculate=sp, clip=1e4, zero=LEAN, between=forward, poke=at_rest)
           for sp in (False, True)}
    same(out[False][1], out[True][1])
    assert [r.speculation for r in out[True][2]] == [None] + ["committed"] * 4


def test_a_weight_lent_before_its_group_stepped_in_a_bet_is_read_again(disk_dir):
    """Reentrant checkpointing with a far prefetch: backward's recompute takes a parameter lent from its state
    before the bet stepped that state in place; it is read from the live file instead (the old weights), the
    bet lost and bets stopped; bit for bit the run without bets."""
    runs = {s: run(disk_dir / f"r{s}", 4, speculate=s, model=Shared, clip=1e4, zero=LEAN) for s in (False, True)}
    (l0, w0, _, _), (l1, w1, r1, _) = runs[False], runs[True]
    assert l1 == l0
    same(w0, w1)
    assert [r.speculation for r in r1] == [None, "redone", None, None]
