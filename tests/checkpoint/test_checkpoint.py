"""Checkpoints: bit-exact resume, resharding across world sizes and tiers, zarr interop, export.

Crash safety and bad input are in test_crash.py and test_errors.py.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from infinity.tools.cli import main
from infinity.testing.ckpt import spawn_train, train
from infinity.testing.parity import engine_config

STEPS, SAVE_AT = 5, 2
_REFERENCE: dict = {}


def config(tier: str, dtype: str, root) -> dict:
    swap = os.path.join(root, "swap")
    os.makedirs(swap, exist_ok=True)
    cfg = engine_config(tier, swap)
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    if dtype == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 2}
    return cfg


def reference(tier: str, dtype: str, root) -> dict:
    """The uninterrupted run (cached per tier and dtype)."""
    key = (tier, dtype)
    if key not in _REFERENCE:
        _REFERENCE[key] = train(config(tier, dtype, root), STEPS)
    return _REFERENCE[key]


def assert_same_weights(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k}: max diff {(a[k] - b[k]).abs().max().item()}"


@pytest.mark.slow
@pytest.mark.parametrize("tier,dtype", [("none", "fp32"), ("cpu", "fp16"), ("nvme", "fp32"), ("nvme", "bf16")])
def test_resume_is_bit_exact(disk_dir, tier, dtype):
    """N steps, save, a new process state, load, M more steps == N+M uninterrupted steps, bit for bit."""
    cfg = config(tier, dtype, disk_dir)
    full = reference(tier, dtype, disk_dir)
    first = train(cfg, SAVE_AT, save=str(disk_dir / "ck"))
    second = train(cfg, STEPS - SAVE_AT, start=SAVE_AT, load=str(disk_dir / "ck"))
    assert first["losses"] + second["losses"] == full["losses"]
    assert_same_weights(second["weights"], full["weights"])
    assert second["client_state"] == {"next_step": SAVE_AT}


def test_resume_with_gradient_accumulation(disk_dir):
    cfg = config("nvme", "fp32", disk_dir)
    full = train(cfg, 4, gas=2)
    first = train(cfg, 2, gas=2, save=str(disk_dir / "ck"))
    second = train(cfg, 2, start=2, gas=2, load=str(disk_dir / "ck"))
    assert first["losses"] + second["losses"] == full["losses"]
    assert_same_weights(second["weights"], full["weights"])


def test_a_checkpoint_moves_between_offload_tiers(disk_dir):
    """Saved from NVMe, resumed in RAM (cpu, then none): the same fp32 numbers, so the same curve."""
    full = reference("nvme", "fp32", disk_dir)
    train(config("nvme", "fp32", disk_dir), SAVE_AT, save=str(disk_dir / "a"))
    mid = train(config("cpu", "fp32", disk_dir), 1, start=SAVE_AT, load=str(disk_dir / "a"), save=str(disk_dir / "b"))
    last = train(config("none", "fp32", disk_dir), STEPS - SAVE_AT - 1, start=SAVE_AT + 1, load=str(disk_dir / "b"))
    assert mid["losses"] + last["losses"] == full["losses"][SAVE_AT:]
    assert_same_weights(last["weights"], full["weights"])


@pytest.mark.slow
def test_two_ranks_resume_bit_exactly_and_reshard_to_one_two_and_three(disk_dir):
    cfg = config("nvme", "fp32", disk_dir)
    full2 = spawn_train(2, cfg, STEPS, str(disk_dir / "full2.pt"))
    first2 = spawn_train(2, cfg, SAVE_AT, str(disk_dir / "first2.pt"), save=str(disk_dir / "w2"))
    second2 = spawn_train(2, cfg, STEPS - SAVE_AT, str(disk_dir / "second2.pt"), start=SAVE_AT,
                          load=str(disk_dir / "w2"))
    assert first2["losses"] + second2["losses"] == full2["losses"]
    assert_same_weights(second2["weights"], full2["weights"])

    # 2 -> 1: the weights loaded are exactly the ones saved; training goes on as it would have on 2 ranks
    # (up to the order of the gradient reduction).
    one = train(config("cpu", "fp32", disk_dir), 0, start=SAVE_AT, load=str(disk_dir / "w2"))
    assert_same_weights(one["weights"], first2["weights"])
    on1 = train(config("cpu", "fp32", disk_dir), STEPS - SAVE_AT, start=SAVE_AT, load=str(disk_dir / "w2"),
                save=str(disk_dir / "w1"))
    np.testing.assert_allclose(on1["losses"], second2["losses"], rtol=1e-5)

    # 1 -> 2 and 2 -> 3: rank shards cut from other chunks than were written (3 ranks: every part is padded).
    back = spawn_train(2, cfg, 0, str(disk_dir / "back.pt"), start=STEPS, load=str(disk_dir / "w1"))
    assert_same_weights(back["weights"], on1["weights"])
    three = spawn_train(3, config("cpu", "fp32", disk_dir), 0, str(disk_dir / "three.pt"), start=SAVE_AT,
                        load=str(disk_dir / "w2"))
    assert_same_weights(three["weights"], first2["weights"])


def test_zarr_reads_the_checkpoint_and_checks_its_sums(disk_dir):
    import zarr
    out = train(config("none", "fp32", disk_dir), 2, save=str(disk_dir / "ck"))
    root = disk_dir / "ck" / "global_step2"
    group = zarr.open_group(str(root), mode="r")
    for name, w in out["weights"].items():
        arr = group["master"][name]
        assert list(arr.attrs["shape"]) == list(w.shape)
        np.testing.assert_array_equal(np.asarray(arr[:]).reshape(w.shape), w.numpy())
    # zarr itself verifies the crc32c codec
    name = next(iter(out["weights"]))
    chunk = root / "master" / name / "c.0"
    data = bytearray(chunk.read_bytes())
    data[5] ^= 0xFF
    chunk.write_bytes(bytes(data))
    with pytest.raises(Exception, match="(?i)checksum|crc"):
        zarr.open_group(str(root), mode="r")["master"][name][:]


class WithBuffers(torch.nn.Module):
    """The GPT plus what a checkpoint must also carry: a float buffer, a bf16 buffer, a frozen parameter."""

    def __init__(self):
        from infinity.models import GPT
        from infinity.testing.parity import MODEL

        super().__init__()
        self.gpt = GPT(MODEL)
        self.register_buffer("scale", torch.full((3,), 2.0))
        self.register_buffer("steps_seen", torch.zeros((), dtype=torch.bfloat16))
        self.frozen = torch.nn.Parameter(torch.arange(4.0), requires_grad=False)

    def forward(self, x, y):
        return self.gpt(x, y) * self.scale.mean() / 2 + self.frozen.sum() * 0


def test_buffers_and_frozen_parameters_round_trip(disk_dir):
    from infinity.engine import gathered_parameters, initialize

    cfg = config("cpu", "fp32", disk_dir)
    e = initialize(WithBuffers(), cfg)
    try:
        e.module.scale.fill_(3.0)
        e.module.steps_seen.fill_(7.0)
        with gathered_parameters(e.module.frozen, modifier_rank=0):  # frozen: partitioned, and may change any time
            e.module.frozen.data.fill_(5.0)
        e.save_checkpoint(disk_dir / "ck")
        e.module.scale.zero_()
        e.module.steps_seen.zero_()
        with gathered_parameters(e.module.frozen, modifier_rank=0):
            e.module.frozen.data.zero_()
        e.load_checkpoint(disk_dir / "ck")
        assert torch.equal(e.module.scale, torch.full((3,), 3.0))
        assert e.module.steps_seen.item() == 7.0 and e.module.steps_seen.dtype == torch.bfloat16
        with gathered_parameters(e.module.frozen):
            assert torch.equal(e.module.frozen.data, torch.full((4,), 5.0))
    finally:
        e.close()


def test_export_writes_a_plain_state_dict(disk_dir, capsys):
    from safetensors.torch import load_file

    from infinity.models import GPT
    from infinity.testing.parity import MODEL

    out = train(config("nvme", "bf16", disk_dir), 2, save=str(disk_dir / "ck"))
    for name in ("w.safetensors", "w.pt"):
        assert main(["checkpoint", "export", str(disk_dir / "ck"), str(disk_dir / name)]) == 0
        assert "wrote" in capsys.readouterr().out
    st, pt = load_file(str(disk_dir / "w.safetensors")), torch.load(str(disk_dir / "w.pt"))
    plain = GPT(MODEL)
    assert st.keys() == pt.keys() == plain.state_dict().keys()  # tied names included
    plain.load_state_dict(pt, strict=True)
    # Exported values are the fp32 master weights; the bf16 weights the run used are their rounding.
    for k, w in out["weights"].items():
        assert st[k].dtype == torch.float32
        assert torch.equal(st[k], pt[k])
        assert torch.equal(st[k].to(torch.bfloat16).float(), w), k
    assert not [p for p in os.listdir(disk_dir) if p.endswith(".tmp") or ".tmp." in p]


def test_info_summarises_and_verifies(disk_dir, capsys):
    train(config("none", "fp32", disk_dir), 2, save=str(disk_dir / "ck"))
    assert main(["checkpoint", "info", str(disk_dir / "ck"), "--verify", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["tag"] == "global_step2" and info["is_latest"] and info["world_size"] == 1
    assert info["global_steps"] == 2 and info["client_state"] == {"next_step": 2}
    assert info["verified_bytes"] == 3 * 4 * sum(int(np.prod(p)) for p in _param_shapes())
    assert main(["checkpoint", "info", str(disk_dir / "ck")]) == 0
    text = capsys.readouterr().out
    assert "global_step2 (latest)" in text and "step 2" in text


def _param_shapes():
    from infinity.models import GPT
    from infinity.testing.parity import MODEL

    return [p.shape for p in GPT(MODEL).parameters()]


@pytest.mark.slow
def test_save_and_load_memory_stays_near_the_pools(disk_dir):
    """Saving and loading a model whose state is ~10x the allowance grows RSS by a small constant only:
    the state streams through the swap pools the engine already holds (see infinity/checkpoint/save.py)."""
    from infinity.bench.checkpoint import _ours, trained_engine

    e = trained_engine(str(disk_dir), layers=4, dim=512, vocab=8192, precision="bf16", offload="nvme", seq=64)
    try:
        numel = sum(mp.numel for mp in e.store.params)
        r = _ours(e, str(disk_dir / "ck"), "t")
    finally:
        e.close()
    state = 12 * numel
    allowance = 64 << 20
    assert state > 3 * allowance
    assert r["checkpoint_bytes"] > state
    assert r["save_rss_growth"] < allowance, r
    assert r["load_rss_growth"] < allowance, r


def test_load_module_only_starts_adam_afresh_from_the_weights(disk_dir):
    """Weights only: the same as building the model with those weights and initializing a new engine."""
    from infinity.checkpoint.export import export
    from infinity.engine import initialize
    from infinity.models import GPT
    from infinity.testing.parity import MODEL, batch
    from safetensors.torch import load_file

    cfg = config("cpu", "fp32", disk_dir)
    train(cfg, 3, save=str(disk_dir / "ck"))
    export(disk_dir / "ck", disk_dir / "w.safetensors")

    def one_step(e):
        x, y = batch(7)
        e.backward(e(x, y))
        e.step()
        g = e.optimizer.groups
        return [getattr(grp.state.views, k).clone() for grp in g for k in ("param", "exp_avg", "exp_avg_sq")]

    torch.manual_seed(1)
    a = initialize(GPT(MODEL), cfg)
    b_model = GPT(MODEL)
    b_model.load_state_dict(load_file(str(disk_dir / "w.safetensors")))
    b = initialize(b_model, cfg)
    try:
        a.load_checkpoint(disk_dir / "ck", load_module_only=True)
        assert a.optimizer.step_count == 0 and a.global_steps == 0
        assert all(torch.equal(x, y) for x, y in zip(one_step(a), one_step(b)))
    finally:
        a.close()
        b.close()


def test_scheduler_state_that_json_cannot_carry_round_trips(disk_dir):
    """MultiStepLR keeps its milestones in a Counter with int keys: stored pickled, restored exactly."""
    from infinity.engine import initialize
    from infinity.models import GPT
    from infinity.testing.parity import MODEL, batch

    cfg = config("none", "fp32", disk_dir)

    def sched(opt):
        return torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[2, 4], gamma=0.5)

    a = initialize(GPT(MODEL), cfg, lr_scheduler=sched)
    b = initialize(GPT(MODEL), cfg, lr_scheduler=sched)
    try:
        for s in range(3):
            x, y = batch(s)
            a.backward(a(x, y))
            a.step()
        a.save_checkpoint(disk_dir / "ck")
        b.load_checkpoint(disk_dir / "ck")
        assert b.lr_scheduler.state_dict() == a.lr_scheduler.state_dict()
        assert b.optimizer.param_groups[0]["lr"] == a.optimizer.param_groups[0]["lr"] == 0.0005
        for e in (a, b):
            x, y = batch(3)
            e.backward(e(x, y))
            e.step()
        assert b.optimizer.param_groups[0]["lr"] == a.optimizer.param_groups[0]["lr"] == 0.00025
    finally:
        a.close()
        b.close()


@pytest.mark.slow
def test_parameters_smaller_than_the_world_reshard(disk_dir):
    """A 1-element parameter (rank 1 of 2 owns only padding, so writes no chunk) and a 5-element one: 2 -> 1
    and 1 -> 2 give the saved weights, and zarr reads the one-chunk array."""
    import zarr

    cfg = config("cpu", "fp32", disk_dir)
    two = spawn_train(2, cfg, 2, str(disk_dir / "two.pt"), save=str(disk_dir / "w2"), net="tiny")
    assert not (disk_dir / "w2" / "global_step2" / "master" / "gain" / "c.1").exists()
    one = train(cfg, 0, start=2, load=str(disk_dir / "w2"), net="tiny")
    assert_same_weights(one["weights"], two["weights"])
    group = zarr.open_group(str(disk_dir / "w2" / "global_step2"), mode="r")
    assert float(group["master"]["gain"][0]) == two["weights"]["gain"].item()
    np.testing.assert_array_equal(group["master"]["lin.bias"][:], two["weights"]["lin.bias"].numpy())
    train(cfg, 1, start=2, load=str(disk_dir / "w2"), save=str(disk_dir / "w1"), net="tiny")
    back = spawn_train(2, cfg, 0, str(disk_dir / "back.pt"), start=3, load=str(disk_dir / "w1"), net="tiny")
    again = train(cfg, 0, start=3, load=str(disk_dir / "w1"), net="tiny")
    assert_same_weights(back["weights"], again["weights"])


def _with_head():
    """The GPT plus a new head: a fine-tuning model loaded from a checkpoint of the GPT alone."""
    from infinity.models import GPT
    from infinity.testing.parity import MODEL

    model = GPT(MODEL)
    model.head = torch.nn.Linear(4, 4)
    return model


@pytest.mark.parametrize("tier,dtype", [("cpu", "fp32"), ("nvme", "fp32"), ("nvme", "bf16")])
def test_a_non_strict_load_keeps_what_the_checkpoint_lacks(disk_dir, tier, dtype):
    """load_module_strict=False (torch's strict=False): parameters on one side only are allowed; the model's
    extra head keeps its weights and Adam state, the rest is the checkpoint's, bit for bit."""
    from infinity.checkpoint.layout import CheckpointError
    from infinity.engine import gathered_parameters, initialize
    from infinity.models import GPT
    from infinity.testing.parity import MODEL, batch

    cfg = config(tier, dtype, disk_dir)
    torch.manual_seed(0)
    src = initialize(GPT(MODEL), cfg)
    try:
        x, y = batch(0)
        src.backward(src(x, y))
        src.step()
        src.save_checkpoint(disk_dir / "ck")
        with gathered_parameters(src.module):
            saved = {k: v.clone() for k, v in src.module.state_dict().items()}
    finally:
        src.close()
    def head_state(e):
        """The head weight's [param, exp_avg, exp_avg_sq] shard, from the optimizer."""
        out = []

        def use(g, p, m, v):
            for mp, off in zip(g.params, g.offsets):
                if mp.name == "head.weight":
                    out.extend(t[off:off + mp.part].clone() for t in (p, m, v))
            return lambda: None

        e.optimizer.export_state(use)
        return out

    torch.manual_seed(1)
    dst = initialize(_with_head(), cfg)
    try:
        x, y = batch(3)
        dst.backward(dst(x, y) + dst.module.head.weight.sum())  # the head gets a gradient and Adam state
        dst.step()
        with gathered_parameters(dst.module.head):
            head = dst.module.head.weight.clone()
        before = head_state(dst)
        assert before[1].abs().sum() > 0
        with pytest.raises(CheckpointError, match="parameter head.weight is not in the checkpoint"):
            dst.load_checkpoint(disk_dir / "ck")
        with pytest.warns(UserWarning, match=r"2 parameters of the model are not in it and keep their values "
                                             r"\(\['head.bias', 'head.weight'\]\), 0 of its parameters"):
            path, _ = dst.load_checkpoint(disk_dir / "ck", load_module_strict=False)
        assert path.endswith("global_step1") and dst.global_steps == 1 and dst.optimizer.step_count == 1
        with gathered_parameters(dst.module):
            assert torch.equal(dst.module.head.weight, head), "the head keeps its weights"
            now = dst.module.state_dict()
            for k, v in saved.items():
                assert torch.equal(now[k], v), k
        assert all(torch.equal(a, b) for a, b in zip(head_state(dst), before)), "and its master weights and moments"
        x, y = batch(1)
        dst.backward(dst(x, y))
        dst.step()  # and trains on from there
    finally:
        dst.close()
    wrapped = torch.nn.Sequential(GPT(MODEL))  # every name gains a "0." prefix: nothing in common
    other = initialize(wrapped, cfg, model_parameters=wrapped.parameters())
    try:
        with pytest.raises(CheckpointError, match=r"has none of this model's parameters \(the model has e.g. "
                                                  r"'0\..*', the checkpoint \['.*'\]\); a non-strict load would "
                                                  r"change nothing, so check that the names match"):
            other.load_checkpoint(disk_dir / "ck", load_module_strict=False)
    finally:
        other.close()


def test_a_checkpoint_without_the_frozen_weights_loads_into_the_base_model(disk_dir, capsys):
    """save_checkpoint(exclude_frozen_parameters=True), DeepSpeed's PEFT option: the frozen weights are not written;
    a load into a model built from the same base keeps them; a model that trains one of them is refused."""
    from infinity.checkpoint.layout import CheckpointError
    from infinity.engine import gathered_parameters, initialize
    from infinity.models import GPT
    from infinity.testing.parity import MODEL, batch

    def build(trainable_head: bool = False):
        torch.manual_seed(0)
        model = GPT(MODEL)
        for name, p in model.named_parameters():
            p.requires_grad_(name.startswith("blocks.1.") or (trainable_head and name == "ln_f.weight"))
        return model

    cfg = config("nvme", "fp32", disk_dir)
    src = initialize(build(), cfg)
    try:
        x, y = batch(0)
        src.backward(src(x, y))
        src.step()
        path = src.save_checkpoint(disk_dir / "ck", exclude_frozen_parameters=True)
        with gathered_parameters(src.module):
            saved = {k: v.clone() for k, v in src.module.state_dict().items()}
    finally:
        src.close()
    assert not os.path.exists(os.path.join(path, "master", "ln_f.weight")), "frozen weights are not written"
    assert os.path.exists(os.path.join(path, "master", "blocks.1.fc.weight"))
    dst = initialize(build(), cfg)
    try:
        with gathered_parameters(dst.module.ln_f.bias, modifier_rank=0):
            dst.module.ln_f.bias.data.fill_(0.25)  # a frozen weight of the loading model's own
        saved["ln_f.bias"] = torch.full_like(saved["ln_f.bias"], 0.25)
        dst.load_checkpoint(disk_dir / "ck")
        with gathered_parameters(dst.module):
            now = dst.module.state_dict()
            assert all(torch.equal(now[k], v) for k, v in saved.items()), "trained from the file, frozen kept"
    finally:
        dst.close()
    other = initialize(build(trainable_head=True), cfg)
    try:
        with pytest.raises(CheckpointError, match="parameter ln_f.weight was frozen and left out when saved"):
            other.load_checkpoint(disk_dir / "ck")
    finally:
        other.close()
    assert main(["checkpoint", "export", str(disk_dir / "ck"), str(disk_dir / "w.safetensors")]) == 0
    assert "frozen parameters were left out when it was saved" in capsys.readouterr().out
    from infinity.checkpoint.export import export_hf

    with pytest.raises(CheckpointError, match=r"was saved with exclude_frozen_parameters, so it lacks \d+ frozen "
                                              r"weights \(e.g. .*\); from_pretrained would initialise them at random"):
        export_hf(disk_dir / "ck", disk_dir / "hf")
    assert not (disk_dir / "hf").exists(), "nothing is written"
