"""Per-group optimizer tiers (offload_optimizer.ratio), per-parameter shard homes (offload_param.max_in_cpu),
and the step during backward, unit by unit."""

import copy

import pytest
import torch

from infinity.engine import initialize, zero_init
from infinity.engine.optimizer import ShardedAdam
from infinity.models import GPT
from infinity.swap.tier import Tier
from infinity.testing.parity import MODEL, engine_config, engine_losses, train_step

STEPS = 3


def _engine(cfg):
    torch.manual_seed(0)
    with zero_init(cfg):
        m = GPT(MODEL)
    return initialize(m, cfg)


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_partial_offload_splits_the_groups_and_trains_the_same(tmp_path, tier):
    cfg = engine_config(tier, str(tmp_path), **{"zero_optimization.offload_optimizer.ratio": 0.5})
    e = _engine(copy.deepcopy(cfg))
    try:
        tiers = [g.state.tier for g in e.optimizer.groups]
        total = sum(g.numel for g in e.optimizer.groups)
        offloaded = sum(g.numel for g in e.optimizer.groups if g.state.tier is Tier(tier))
        assert Tier(tier) in tiers and Tier.DEVICE in tiers, tiers
        assert tiers.index(Tier.DEVICE) > 0 and offloaded <= 0.5 * total, "offloaded first, up to the ratio"
        losses = [train_step(e, s) for s in range(STEPS)]
        if tier == "nvme":  # only the offloaded groups move, 12 bytes per element each way
            assert e.last_report.optimizer_read_bytes == e.last_report.optimizer_write_bytes == 12 * offloaded
    finally:
        e.close()
    assert losses == engine_losses(engine_config(tier, str(tmp_path)), STEPS), \
        "where a group's state lives changes no number"


def test_max_in_cpu_keeps_the_first_shards_in_ram_and_trains_the_same(tmp_path):
    full = engine_config("nvme", str(tmp_path))
    budget = 20_000
    cfg = engine_config("nvme", str(tmp_path), **{"zero_optimization.offload_param.max_in_cpu": budget})
    e = _engine(copy.deepcopy(cfg))
    try:
        homes = [mp.home.tier for mp in e.store.params]
        in_ram = sum(mp.part for mp in e.store.params if mp.home.tier is Tier.CPU)
        assert homes[0] is Tier.CPU and Tier.NVME in homes and 0 < in_ram <= budget
        assert homes == sorted(homes, key=lambda t: t is Tier.NVME), "RAM first, in registration order"
        files = set(e.store.swap.swapper.registry._parts)
        assert not any(f.startswith(("param/", "alias/")) and int(f.split("/")[1]) == mp.index
                       for f in files for mp in e.store.params if mp.home.tier is Tier.CPU)
        losses = [train_step(e, s) for s in range(STEPS)]
    finally:
        e.close()
    assert losses == engine_losses(full, STEPS), "where a shard lives changes no number"


def test_max_in_cpu_zero_is_every_shard_on_nvme(tmp_path):
    e = _engine(engine_config("nvme", str(tmp_path)))
    try:
        assert {mp.home.tier for mp in e.store.params} == {Tier.NVME}
    finally:
        e.close()


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_a_group_steps_exactly_when_its_last_gradient_lands(tmp_path, tier, monkeypatch):
    """[Note: stepping during backward]: each sub-group is stepped right after its last parameter's gradient,
    before backward produces the next gradient; a group with an unused parameter is stepped after backward."""
    cfg = engine_config(tier, str(tmp_path), **{"zero_optimization.sub_group_size": 5_000})
    events = []
    real_ready, real_step = ShardedAdam.grad_ready, ShardedAdam._step_now

    def ready(self, mp):
        events.append(("grad", mp.name))
        return real_ready(self, mp)

    def step_now(self, g):
        events.append(("step", g.index))
        return real_step(self, g)

    monkeypatch.setattr(ShardedAdam, "grad_ready", ready)
    monkeypatch.setattr(ShardedAdam, "_step_now", step_now)
    e = _engine(cfg)
    try:
        groups = e.optimizer.groups
        assert len(groups) > 3
        train_step(e, 0)
        grads = [name for kind, name in events if kind == "grad"]
        steps = [i for kind, i in events if kind == "step"]
        assert sorted(steps) == list(range(len(groups))), "every group is stepped once"
        for g in groups:
            names = {mp.name for mp in g.params}
            last = max(k for k, ev in enumerate(events) if ev[0] == "grad" and ev[1] in names)
            assert events[last + 1] == ("step", g.index), f"group {g.index} steps right after its last gradient"
        assert len(grads) == len(e.store.params), "one gradient per parameter"
        assert not e.optimizer.overlapping and all(g.grad is None for g in groups), "gradient buffers freed"
    finally:
        e.close()


def test_a_parameter_without_a_gradient_is_stepped_after_backward(tmp_path):
    class Two(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.used = torch.nn.Linear(8, 8)
            self.unused = torch.nn.Linear(8, 8)

        def forward(self, x):
            return self.used(x).square().mean()

    cfg = engine_config("cpu", str(tmp_path), **{"zero_optimization.sub_group_size": 80})
    torch.manual_seed(0)
    e = initialize(Two(), cfg)
    try:
        g_unused = e.optimizer.group_of[id(e.store.params[2])]
        before = g_unused.state.views.param.clone()
        loss = e(torch.randn(4, 8))
        e.backward(loss)
        e.step()
        # AdamW with weight decay moves even a zero-gradient parameter: it was stepped, after backward.
        assert not torch.equal(g_unused.state.views.param, before)
        assert e.optimizer.step_count == 1
    finally:
        e.close()


def test_trace_path_writes_a_chrome_trace_of_the_steps(tmp_path):
    import json

    path = tmp_path / "trace.json"
    cfg = engine_config("nvme", str(tmp_path), **{"infinity.trace_path": str(path)})
    e = _engine(cfg)
    try:
        for s in range(2):
            train_step(e, s)
        assert not path.exists(), "written at close"
    finally:
        e.close()
    events = json.loads(path.read_text())["traceEvents"]
    names = [ev["name"] for ev in events]
    groups = len({n for n in names if n.startswith("update optim/")})
    assert names.count("forward") == 2 and names.count("backward") == 2
    assert groups > 1 and sum(n.startswith("read optim/") for n in names) == 2 * groups, "every group read each step"
    assert all(ev["ph"] == "X" and ev["dur"] >= 0 for ev in events)
