"""Per-group optimizer tiers (offload_optimizer.ratio), per-parameter shard homes (offload_param.max_in_cpu),
and the step during backward, unit by unit."""

import json
import subprocess
import sys

import pytest
import torch

from infinity.engine import initialize
from infinity.engine.optimizer import ShardedAdam
from infinity.swap.tier import Tier
from infinity.testing.parity import engine_config, engine_losses, gpt_engine, train_step

STEPS = 3


def _close(a, b, exact: bool) -> bool:
    """Equal bit for bit, or (the device tier's torch-op Adam against the CPU kernel) within 1e-5."""
    return a == b if exact else all(abs(x - y) <= 1e-5 * abs(y) for x, y in zip(a, b))


def test_partial_offload_keeps_the_last_groups_on_the_device_and_trains_the_same(tmp_path):
    """[Note: partial offload]: as DeepSpeed 0.19, sub-group i is offloaded when i < int(ratio x count)."""
    cfg = engine_config("cpu", str(tmp_path), **{"zero_optimization.offload_optimizer.ratio": 0.5})
    e = gpt_engine(cfg)
    try:
        tiers = [g.state.tier for g in e.optimizer.groups]
        k = int(0.5 * len(tiers))
        assert 0 < k < len(tiers) and tiers == [Tier.CPU] * k + [Tier.DEVICE] * (len(tiers) - k), tiers
        losses = [train_step(e, s) for s in range(STEPS)]
    finally:
        e.close()
    # On a CPU-only machine the device is the host and both tiers run the CPU kernel: bit-identical. On an
    # accelerator the device groups run torch ops (same math, another rounding).
    assert _close(losses, engine_losses(engine_config("cpu", str(tmp_path)), STEPS), not torch.cuda.is_available())


@pytest.mark.parametrize("stage,device", [(3, "nvme"), (2, "cpu")])
def test_partial_offload_elsewhere_is_said_to_have_no_effect(tmp_path, stage, device):
    cfg = engine_config(device, str(tmp_path), **{"zero_optimization.offload_optimizer.ratio": 0.5,
                                                  "zero_optimization.stage": stage})
    if stage < 3:
        cfg["zero_optimization"]["offload_param"] = {"device": "none"}
    with pytest.warns(UserWarning, match=rf"offload_optimizer.ratio \(partial offload applies at stage 3 with "
                                         rf"device cpu, as in DeepSpeed; here stage is {stage} and device '{device}'"):
        e = gpt_engine(cfg)
    try:
        assert {g.state.tier for g in e.optimizer.groups} == {Tier(device)}, "every group is offloaded"
    finally:
        e.close()


def test_the_device_tier_path_adam_in_torch_ops_and_checkpoints_staged_per_parameter(tmp_path, monkeypatch):
    """DeviceState's accelerator branch, run on the host: torch-op Adam, per-parameter staging for checkpoints,
    and a non-strict load that keeps what it does not fill."""
    from infinity.swap.state import DeviceState

    monkeypatch.setattr(DeviceState, "_on_host", lambda self: False)
    cfg = engine_config("cpu", str(tmp_path), **{"zero_optimization.offload_optimizer.ratio": 0.0})
    e = gpt_engine(cfg)
    try:
        assert {g.state.tier for g in e.optimizer.groups} == {Tier.DEVICE}
        losses = [train_step(e, s) for s in range(STEPS)]
        assert _close(losses, engine_losses(engine_config("cpu", str(tmp_path)), STEPS), exact=False)
        e.save_checkpoint(tmp_path / "ck")
        before = [torch.stack([t.clone() for t in (g.state.views.param, g.state.views.exp_avg,
                                                   g.state.views.exp_avg_sq)]) for g in e.optimizer.groups]
        train_step(e, STEPS)
        e.load_checkpoint(tmp_path / "ck")
        after = [torch.stack([g.state.views.param, g.state.views.exp_avg, g.state.views.exp_avg_sq])
                 for g in e.optimizer.groups]
        assert all(torch.equal(a, b) for a, b in zip(before, after)), "staged per parameter, both ways"
        # A non-strict load: a parameter the checkpoint lacks keeps its values through the staging copy.
        mp = e.store.params[0]
        g = e.optimizer.groups_of[id(mp)][0]
        off = g.offsets[g.params.index(mp)]
        g.state.views.exp_avg[off:off + mp.part].fill_(7.0)
        from infinity.checkpoint import load as load_mod

        real = load_mod.my_reads
        monkeypatch.setattr(load_mod, "my_reads", lambda engine, m: (r for r in real(engine, m) if r[0] is not mp))
        monkeypatch.setattr(load_mod, "check_compatible", lambda *a, **k: None)
        e.load_checkpoint(tmp_path / "ck")
        assert torch.equal(g.state.views.exp_avg[off:off + mp.part], torch.full((mp.part,), 7.0))
    finally:
        e.close()


def test_max_in_cpu_keeps_the_first_shards_in_ram_and_trains_the_same(tmp_path):
    full = engine_config("nvme", str(tmp_path))
    budget = 20_000
    cfg = engine_config("nvme", str(tmp_path), **{"zero_optimization.offload_param.max_in_cpu": budget})
    e = gpt_engine(cfg)
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
    e = gpt_engine(engine_config("nvme", str(tmp_path)))
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
    e = gpt_engine(cfg)
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
            then = [ev for ev in events[last + 1:]]
            then = then[:next((k for k, ev in enumerate(then) if ev[0] == "grad"), len(then))]
            # right after: before the next gradient (the pieces of a split shard all step on its one gradient)
            assert ("step", g.index) in then, f"group {g.index} steps right after its last gradient"
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
    events = []
    real_step, real_end = e.optimizer._step_now, e.optimizer.end_overlapped_step
    e.optimizer._step_now = lambda g: (events.append(("step", g.index)), real_step(g))[1]
    e.optimizer.end_overlapped_step = lambda **kw: (events.append(("backward done",)), real_end(**kw))[1]
    try:
        g_unused = e.optimizer.groups_of[id(e.store.params[2])][0]
        g_used = e.optimizer.groups_of[id(e.store.params[0])][0]
        before = g_unused.state.views.param.clone()
        loss = e(torch.randn(4, 8))
        e.backward(loss)
        e.step()
        assert events.index(("step", g_used.index)) < events.index(("backward done",)) < events.index(
            ("step", g_unused.index)), events
        # AdamW with weight decay moves even a zero-gradient parameter: it was stepped, after backward.
        assert not torch.equal(g_unused.state.views.param, before)
        assert e.optimizer.step_count == 1
    finally:
        e.close()


def test_trace_path_writes_a_chrome_trace_of_the_steps(tmp_path):
    import json

    path = tmp_path / "trace.json"
    cfg = engine_config("nvme", str(tmp_path), **{"infinity.trace_path": str(path)})
    e = gpt_engine(cfg)
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


_CRASH = """
import os, sys
from infinity.engine import initialize, zero_init
from infinity.models import GPT
from infinity.testing.parity import MODEL, engine_config, train_step
cfg = engine_config("nvme", sys.argv[1])
with zero_init(cfg):
    m = GPT(MODEL)
train_step(initialize(m, cfg), 0)
os._exit(0)  # dies without close(): its fp32 swap files stay
"""


@pytest.mark.slow
def test_leftovers_reuse_after_a_crashed_run_of_another_layout_trains_like_a_clean_run(tmp_path):
    out = subprocess.run([sys.executable, "-c", _CRASH, str(tmp_path / "crashed")], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    left = [json.loads(f.read_bytes()[:4096]) for f in (tmp_path / "crashed").glob("infinity-swap/*/*.swp")]
    optim = [h for h in left if h["id"].startswith("optim/")]
    assert optim and not any(h.get("tail_nbytes") for h in optim)  # fp32: no bf16 tail, unlike the run below
    bf16 = {"bf16.enabled": True}
    with pytest.warns(UserWarning, match=r"reusing \d+ of \d+ swap files"):
        reused = engine_losses(engine_config("nvme", str(tmp_path / "crashed"), **bf16, **{"infinity.leftovers":
                                                                                          "reuse"}), STEPS)
    assert reused == engine_losses(engine_config("nvme", str(tmp_path / "clean"), **bf16), STEPS)


def test_the_nvme_parameter_pool_fits_the_model_when_initialize_builds_it(tmp_path):
    """[Note: the parameter pool fits the model]: buffers of the largest shard, not of buffer_size (DeepSpeed's
    1e8 elements, 2 GB for 5 buffers); under zero_init, or with a buffer_size below the largest shard, the
    config's buffer_size stands."""
    import infinity

    def cfg(**param):
        off = {"device": "nvme", "nvme_path": str(tmp_path), **param}
        return {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                      "offload_param": off, "offload_optimizer": {"device": "cpu"}}}

    model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.Linear(96, 8))
    with infinity.initialize(model, cfg()) as engine:
        assert engine.store.swap.pool.size == 4 * 64 * 96, "one fp32 shard of the largest parameter"
        loss = engine(torch.randn(2, 64)).square().mean()
        engine.backward(loss)
        engine.step()
    with pytest.raises(ValueError, match="raise the buffer size"):  # below the largest shard: kept, and refused
        infinity.initialize(torch.nn.Linear(64, 96), cfg(buffer_size=1000))
    assert not list(tmp_path.rglob("*.swp"))
    from infinity.engine.params import managed

    with infinity.zero_init(cfg(buffer_size=5000)):
        built = torch.nn.Linear(64, 32)
    assert managed(built.weight).store.swap.pool.size == 4 * 5000, "under zero_init the store came first"
    with infinity.initialize(built, cfg(buffer_size=5000)) as engine:
        # [Note: the parameter pool shrinks after setup]: once the shards are known, the pool holds the largest
        assert engine.store.swap.pool.size == 4 * 64 * 32


class _WithAnEmptyParameter(torch.nn.Module):
    """A zero-size parameter that receives a gradient (a LoRA of rank 0, a bias of an empty projection), as
    plain torch trains it."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)
        self.empty = torch.nn.Parameter(torch.zeros(0, 8))

    def forward(self, x):
        return (self.fc(x) + self.empty.sum(0)).square().mean()


@pytest.mark.parametrize("tier", ["none", "cpu", "nvme"])
def test_a_zero_size_parameter_with_a_gradient_trains_as_in_torch(tmp_path, tier):
    """Probe finding 6 of the issue "Engine assembled from one typed plan": backward crashed on every tier
    (output with shape [1] doesn't match the broadcast shape [0])."""
    xs = [torch.randn(4, 8, generator=torch.Generator().manual_seed(s)) for s in range(STEPS)]
    torch.manual_seed(0)
    ref = _WithAnEmptyParameter()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    want = []
    for x in xs:
        loss = ref(x)
        loss.backward()
        opt.step()
        opt.zero_grad()
        want.append(loss.item())
    torch.manual_seed(0)
    cfg = engine_config(tier, str(tmp_path), **{"optimizer.params.lr": 1e-2, "optimizer.params.weight_decay": 0.01,
                                                "gradient_clipping": 0.0})
    with initialize(_WithAnEmptyParameter(), cfg) as e:
        got = []
        for x in xs:
            loss = e(x)
            e.backward(loss)
            e.step()
            got.append(loss.item())
    assert all(abs(a - b) <= 1e-6 * abs(b) for a, b in zip(got, want)), (got, want)


def test_a_float64_parameter_is_refused_by_name(tmp_path):
    """Probe finding 7: float64 was silently computed in float32, and the user then met torch's "mat1 and mat2
    must have the same dtype"."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2).double())
    with pytest.raises(ValueError, match=r"parameter 1\.weight is float64; .*cast the model to float32 "
                                         r"\(model\.float\(\)\) before initialize, or build it under zero_init"):
        initialize(model, engine_config("cpu", str(tmp_path)))
    with initialize(model.float(), engine_config("cpu", str(tmp_path))) as e:
        assert e(torch.randn(3, 4)).shape == (3, 2)


class _NoParameters(torch.nn.Module):
    def forward(self, x):
        return x


def test_a_model_without_parameters_is_refused_and_leaves_nothing_in_the_swap_path(tmp_path):
    """Issue 30, probe finding 8: the refusal used to leave infinity-swap/param-rank0/owner.pid behind. (Under
    zero_init the block's store exists already; it is removed when the process exits, as any zero_init store
    that no initialize took.)"""
    with pytest.raises(ValueError, match="no parameter to train"):
        initialize(_NoParameters(), engine_config("nvme", str(tmp_path)))
    assert list(tmp_path.iterdir()) == []
