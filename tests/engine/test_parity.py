"""The engine against plain PyTorch: same losses, on every offload tier, stage, precision and rank count."""

from pathlib import Path

import pytest
import torch

from infinity.engine import gathered_parameters, zero_init
from infinity.models import GPT, GPTConfig
from infinity.testing.files import flip_bit
from infinity.testing.parity import (MODEL, batch, engine_config, engine_losses, gpt_engine, spawn_losses,
                                     torch_losses, train_step)

STEPS = 20


@pytest.fixture(scope="module")
def reference():
    return torch_losses(STEPS)


def rel_err(a, b):
    assert len(a) == len(b)
    return max(abs(x - y) / abs(x) for x, y in zip(a, b))



@pytest.mark.parametrize("tier", ["none", "cpu", "nvme"])
def test_fp32_stage3_matches_torch_adamw_over_20_steps(reference, tier, disk_dir):
    reports = []
    got = engine_losses(engine_config(tier, disk_dir), STEPS, reports=reports)
    assert rel_err(reference, got) <= 1e-5
    assert got[-1] < got[0] - 0.1, "the loss must fall"
    assert not any(r.skipped for r in reports)


def test_prefetch_hits_after_the_first_step(disk_dir):
    # (That the loss falls is asserted over 20 steps above; 6 steps at this lr are within the batch noise.)
    reports = []
    engine_losses(engine_config("nvme", disk_dir), 6, reports=reports)
    assert reports[0].param_fetches > 0
    for r in reports[1:]:
        assert r.prefetch_hit_rate >= 0.95, (r.prefetch_hits, r.param_fetches)
        assert r.param_read_bytes > 0 and r.io_write_bytes > 0


@pytest.mark.parametrize("stage,opt_tier", [(0, "none"), (1, "cpu"), (2, "cpu"), (2, "nvme")])
def test_stages_0_1_2_match_torch(reference, stage, opt_tier, disk_dir):
    cfg = engine_config("none")
    cfg["zero_optimization"]["stage"] = stage
    cfg["zero_optimization"]["offload_optimizer"] = {"device": opt_tier}
    if opt_tier == "nvme":
        cfg["zero_optimization"]["offload_optimizer"].update(nvme_path=str(disk_dir), buffer_count=3)
    assert rel_err(reference[:8], engine_losses(cfg, 8)) <= 1e-5


def test_gradient_accumulation_matches_the_full_batch(reference):
    assert rel_err(reference[:8], engine_losses(engine_config("cpu"), 8, gas=2)) <= 1e-5


def test_clipping_uses_the_global_norm_like_torch():
    ref = torch_losses(10, clip=0.5)
    assert rel_err(ref, engine_losses(engine_config("cpu", gradient_clipping=0.5), 10)) <= 1e-5
    unclipped = torch_losses(10)
    assert rel_err(ref, unclipped) > 1e-4, "clip 0.5 must actually clip this model"


def test_activation_checkpointing_on_nvme(reference, disk_dir):
    ck = GPTConfig(vocab=MODEL.vocab, seq=MODEL.seq, layers=MODEL.layers, dim=MODEL.dim, heads=MODEL.heads,
                   checkpoint=True)
    assert rel_err(reference[:8], engine_losses(engine_config("nvme", disk_dir), 8, model=ck)) <= 1e-5


# bf16 rounds every weight and activation to 8 bits of mantissa, fp16 to 11: over 20 steps of this model they
# stayed within 1.4e-4 and 1.6e-5 of the fp32 curve; the bounds leave about 5x of room.
@pytest.mark.parametrize("precision,tol", [("bf16", 1e-3), ("fp16", 1e-4)])
def test_low_precision_tracks_fp32(reference, precision, tol):
    reports = []
    got = engine_losses(engine_config("cpu", **{f"{precision}.enabled": True}), STEPS, reports=reports)
    assert rel_err(reference, got) <= tol
    assert not any(r.skipped for r in reports)


@pytest.mark.parametrize("hysteresis,scale_after", [(2, 256.0), (1, 128.0)])
def test_fp16_overflow_skips_exactly_that_step(hysteresis, scale_after):
    over = {"fp16.enabled": True, "fp16.initial_scale_power": 8, "fp16.hysteresis": hysteresis}
    reports = []
    got = engine_losses(engine_config("cpu", **over), 8, overflow_at=5, reports=reports)
    assert [i for i, r in enumerate(reports) if r.skipped] == [5]
    assert reports[5].loss_scale == scale_after
    clean = engine_losses(engine_config("cpu", **over), 5)
    assert got[:5] == clean  # the steps before are untouched
    # the skipped step changed nothing: step 6 sees the weights step 4 left
    after_skip = engine_losses(engine_config("cpu", **over), 7, overflow_at=5)
    assert after_skip[6] == got[6]


def test_zero_init_gives_exactly_the_values_of_a_normal_build(tmp_path, disk_dir):
    torch.manual_seed(3)
    plain = GPT(MODEL)
    for tier in ("cpu", "nvme"):
        torch.manual_seed(3)
        with zero_init(engine_config(tier, disk_dir)) as store:
            built = GPT(MODEL)
            params = dict(built.named_parameters())
            assert all(p.data.untyped_storage().nbytes() <= 4 for p in params.values()), "all released"
            with gathered_parameters(built):
                for name, p in plain.named_parameters():
                    assert torch.equal(p, params[name]), name
        store.close()


def test_gathered_parameters_modifier_is_kept_before_initialize(disk_dir):
    with zero_init(engine_config("nvme", disk_dir)) as store:
        model = GPT(MODEL)
        with gathered_parameters(model.blocks[0].fc.weight, modifier_rank=0):
            model.blocks[0].fc.weight.data.fill_(0.5)
        with gathered_parameters(model.blocks[0].fc):
            assert torch.all(model.blocks[0].fc.weight == 0.5)
        assert model.blocks[0].fc.weight.data.untyped_storage().nbytes() <= 4, "released again: the placeholder"
        # Until initialize, a read outside a gather sees the real values (see [Note: partitioned access]).
        assert torch.all(model.blocks[0].fc.weight == 0.5)
    store.close()


class Reorder(torch.nn.Module):
    """Calls its layers in an order that changes every step, and one layer twice."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(32, 32)
        self.b = torch.nn.Linear(32, 32)
        self.c = torch.nn.Linear(32, 32)
        self.flip = False

    def forward(self, x):
        first, second = (self.a, self.b) if self.flip else (self.b, self.a)
        self.flip = not self.flip
        return self.c(second(torch.tanh(first(torch.tanh(self.c(x)))))).square().mean()


def test_changing_module_order_and_reuse_stay_exact(disk_dir):
    from infinity.engine import initialize

    def data(s):
        return torch.randn(8, 32, generator=torch.Generator().manual_seed(s))

    torch.manual_seed(0)
    ref = Reorder()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.0)
    want = []
    for s in range(6):
        loss = ref(data(s))
        loss.backward()
        opt.step()
        opt.zero_grad()
        want.append(loss.item())
    torch.manual_seed(0)
    cfg = engine_config("nvme", str(disk_dir), **{"optimizer.params.weight_decay": 0.0,
                                                  "optimizer.params.lr": 1e-2})
    engine = initialize(Reorder(), cfg)
    got = []
    for s in range(6):
        loss = engine(data(s))
        engine.backward(loss)
        engine.step()
        got.append(loss.item())
    history = engine.store.scheduler.history
    engine.close()
    assert rel_err(want, got) <= 1e-5
    assert any(h.recorded for h in history[1:]), "the changed order must trigger a new trace"


@pytest.mark.slow
def test_two_gloo_ranks_match_one_rank(reference, tmp_path):
    # small buckets: many asynchronous reduce-scatters in flight during backward
    cfg = engine_config("none", **{"zero_optimization.reduce_bucket_size": 5000})
    got = spawn_losses(2, cfg, STEPS, str(tmp_path / "losses.json"))
    assert rel_err(reference, got) <= 1e-5


@pytest.mark.slow
def test_two_gloo_ranks_on_nvme_match_one_rank(reference, disk_dir, tmp_path):
    got = spawn_losses(2, engine_config("nvme", disk_dir), 6, str(tmp_path / "losses.json"))
    assert rel_err(reference[:6], got) <= 1e-5


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_nvme_moves_28_bytes_per_parameter_and_detects_a_flipped_byte(disk_dir, precision):
    import infinity

    torch.manual_seed(0)
    # Room to read every sub-group's state ahead (3 groups; one buffer stays free for the critical path).
    cfg = engine_config("nvme", disk_dir, **{"zero_optimization.offload_optimizer.buffer_count": 6,
                                           "bf16.enabled": precision == "bf16"})
    engine = gpt_engine(cfg)
    model = engine.module
    e = 4 if precision == "fp32" else 2
    try:
        assert engine.store.alias is not None, "shards are read from the optimizer's files"
        assert engine.store.alias.dtype == engine.store.dtype
        numel = sum(mp.numel for mp in engine.store.params)
        for s in range(3):
            train_step(engine, s)
        r = engine.last_report
        # fp32: forward 4 + read p, m, v 12 + write p, m, v 12. bf16: forward 2 + read 12 + write 12 and the
        # bf16 weights 2, in the same write ([Note: compute-dtype shards in the optimizer file]). Backward's
        # weights come from the read Adam uses, so only forward reads shards. The tied embedding is read at both
        # of its forward uses (they are further apart than the reuse distance).
        assert r.param_lent > 0
        assert r.param_read_bytes <= e * (numel + model.wte.weight.numel())
        part = sum(mp.part for mp in engine.store.params)
        assert r.optimizer_read_bytes == 12 * part
        assert r.optimizer_write_bytes == (12 if e == 4 else 14) * part
        assert r.param_write_bytes == 0
        assert (r.optimizer_read_bytes + r.optimizer_write_bytes + r.param_read_bytes
                <= 28 * part + e * model.wte.weight.numel())  # the floor, and the tied embedding's second read
        if e == 2:  # the trained shards have no files of their own
            assert not list(Path(engine.store.swap.swapper.dir).glob("*.swp"))
        mp = engine.store.params[5]
        path, offset, _ = engine.store.alias.files_of(f"alias/{mp.index}")[0]  # its first (or only) piece
        flip_bit(path, offset + 4)
        x, y = batch(3)
        with pytest.raises(infinity.SwapCorruptionError, match="is corrupted") as info:
            engine.backward(engine(x, y))
        assert info.value.filename == path
    finally:
        engine.close()


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_shard_checksums_are_taken_on_the_write_reaper(disk_dir, monkeypatch, precision):
    # "Checksums on, off the step thread": after each step the shards' CRCs come from the group's bytes as
    # the swapper writes them, and the reads' CRCs are taken by the I/O thread; the step thread only compares
    # them (the flipped-byte test above shows they still catch corruption).
    import threading

    import infinity.engine.alias as alias
    import infinity.swap.swapper as swapper_module

    torch.manual_seed(0)
    cfg = engine_config("nvme", disk_dir, **{"bf16.enabled": precision == "bf16"})
    engine = gpt_engine(cfg)
    e = 4 if precision == "fp32" else 2

    def spy_on(module) -> list:
        """(thread name, bytes) of each crc32c call `module` makes."""
        calls, real = [], module.crc32c

        def spy(t, nbytes, *a, **k):
            calls.append((threading.current_thread().name, nbytes))
            return real(t, nbytes, *a, **k)

        monkeypatch.setattr(module, "crc32c", spy)
        return calls

    taken, whole = spy_on(alias), spy_on(swapper_module)
    reader = engine.store.alias
    verified, real_pread = [], reader.aio.pread

    def pread(buf, path, offset=0, nbytes=None, *, checksum=False):
        if checksum:
            verified.append((threading.current_thread().name, nbytes))
        return real_pread(buf, path, offset, nbytes, checksum=checksum)

    monkeypatch.setattr(reader, "aio", type("SpyIO", (), {"pread": staticmethod(pread)})())
    try:
        assert engine.store.alias is not None
        for s in range(2):
            taken.clear()
            whole.clear()
            verified.clear()
            train_step(engine, s)
            part = sum(mp.part for mp in engine.store.params if mp.trainable)
            shards = e * part
            on_reaper = sum(n for who, n in taken if who == "infinity-swap-write-reaper")
            assert on_reaper == shards, (on_reaper, shards)
            # The groups' own checksums ([p | m | v]) continue from the shards' combined CRCs in fp32, so the p
            # region is not read twice; in bf16 the shards are the tail, outside that checksum.
            group_crc = sum(n for who, n in whole if who == "infinity-swap-write-reaper")
            assert group_crc == (8 if e == 4 else 12) * part, (group_crc, part)
            # The step thread computes no checksum at all: every shard it read was checked against the CRC the
            # I/O thread took as the read finished ([Note: checksum on completion]).
            assert all(who == "infinity-swap-write-reaper" for who, _ in taken), taken
            assert sum(n for _, n in verified) == engine.last_report.param_read_bytes > 0, verified
    finally:
        engine.close()


def test_a_shard_whose_group_write_never_ran_is_refused_not_read_stale(disk_dir):
    # Between the optimizer producing a group's values and its write's reaper taking their checksums, the
    # shards' expected CRC is PENDING. If that write never starts (its submission raised and the caller went
    # on), the next read of a shard must fail loudly rather than hand back the previous step's weights.

    torch.manual_seed(0)
    engine = gpt_engine(engine_config("nvme", disk_dir))
    try:
        train_step(engine, 0)
        opt = engine.optimizer
        g = opt.groups[0]
        shards = [(f"alias/{mp.index}", 4 * off, mp.part) for mp, off in zip(g.params, g.offsets)]
        engine.store.alias.record_on_write(g.state.swapper, g.state.id, shards)  # as _publish does; no write
        x, y = batch(1)
        with pytest.raises(RuntimeError, match="has not completed, so the file holds older weights"):
            engine(x, y)
    finally:
        engine.close()


@pytest.mark.slow
@pytest.mark.parametrize("over,kw", [({"bf16.enabled": True}, {}), ({"fp16.enabled": True}, {}),
                                     ({"bf16.enabled": True,
                                       "zero_optimization.offload_optimizer.moments_dtype": "bf16"}, {}),
                                     ({"bf16.enabled": True}, {"gas": 2}),
                                     ({"fp16.enabled": True, "fp16.initial_scale_power": 8}, {"overflow_at": 4})],
                         ids=["bf16", "fp16", "bf16-moments", "bf16-gas2", "fp16-overflow"])
def test_low_precision_on_nvme_is_bit_identical_to_ram(disk_dir, over, kw):
    # On NVMe the compute-dtype shards are the optimizer file's tail ([Note: compute-dtype shards in the
    # optimizer file]); fp16 steps after backward (the overflow check), bf16 during it, and an overflow
    # skips the step, tail included.
    reports = []
    ram = engine_losses(engine_config("cpu", **over), 8, **kw)
    assert engine_losses(engine_config("nvme", disk_dir, **over), 8, reports=reports, **kw) == ram
    assert [i for i, r in enumerate(reports) if r.skipped] == ([kw["overflow_at"]] if "overflow_at" in kw else [])



def _without_lending(monkeypatch):
    from infinity.engine.optimizer import ShardedAdam

    monkeypatch.setattr(ShardedAdam, "lend", lambda self, mp, **_: None)


@pytest.mark.slow
@pytest.mark.parametrize("over,lends", [({}, True), ({"bf16.enabled": True}, True),
                                        ({"zero_optimization.offload_optimizer.buffer_count": 2}, True),
                                        ({"gradient_clipping": 0.5}, True),
                                        ({"zero_optimization.offload_optimizer": {"device": "cpu"}}, True)],
                         ids=["fp32", "bf16", "two-buffers", "clipping", "optimizer-cpu"])
def test_shards_lent_from_the_optimizer_state_change_no_bit(disk_dir, monkeypatch, over, lends):
    """[Note: backward reads from the state]: the same losses, bit for bit, as reading every shard's file.
    With clipping the step runs after backward, and the states it takes first are read during backward
    (read_ahead_for_step), so backward lends from those."""
    reports = []
    got = engine_losses(engine_config("nvme", disk_dir, **over), 5, reports=reports)
    with monkeypatch.context() as m:
        _without_lending(m)
        plain = []
        assert engine_losses(engine_config("nvme", disk_dir, **over), 5, reports=plain) == got
    assert sum(r.param_lent for r in plain) == 0
    if lends:
        assert sum(r.param_lent for r in reports) > 0
        assert sum(r.param_read_bytes for r in reports) < sum(r.param_read_bytes for r in plain)
    else:
        assert [r.param_read_bytes for r in reports] == [r.param_read_bytes for r in plain]


def test_bf16_nvme_reads_each_shard_only_in_forward(disk_dir):
    reports = []
    engine_losses(engine_config("nvme", disk_dir, **{"bf16.enabled": True,
                                                   "zero_optimization.offload_optimizer.buffer_count": 6}),
                  3, reports=reports)
    model = GPT(MODEL)
    numel = sum(p.numel() for p in model.parameters())
    r = reports[-1]
    # forward 2 (the tied embedding twice) + read p, m, v 12 + write p, m, v 12 + the new bf16 shards 2, which
    # the optimizer's write carries ([Note: compute-dtype shards in the optimizer file]): no parameter file is
    # written
    assert r.param_lent > 0 and r.param_read_bytes <= 2 * (numel + model.wte.weight.numel())
    assert r.optimizer_read_bytes == 12 * numel
    assert r.optimizer_write_bytes == 14 * numel
    assert r.param_write_bytes == 0


def test_optimizer_in_ram_serves_every_nvme_shard_read(disk_dir):
    """offload_param nvme with offload_optimizer cpu: the master weights in RAM are the shards' source."""
    reports = []
    cfg = engine_config("nvme", disk_dir, **{"zero_optimization.offload_optimizer": {"device": "cpu"}})
    got = engine_losses(cfg, 4, reports=reports)
    assert all(r.param_read_bytes == 0 and r.param_lent > 0 for r in reports)
    assert got == engine_losses(engine_config("cpu"), 4)


def test_a_forward_without_its_backward_gives_back_the_reads_it_started(disk_dir, tmp_path):
    """The step's state reads start in forward (see [Note: backward reads from the state]); a forward whose
    backward never comes must not keep them: the next forward, a checkpoint save and load all find the state at
    rest, and training goes on exactly as without that forward."""
    from infinity.engine import initialize

    def run(extra_forward: bool):
        torch.manual_seed(0)
        cfg = engine_config("nvme", disk_dir, **{"zero_optimization.offload_optimizer.buffer_count": 6})
        with zero_init(cfg):
            model = GPT(MODEL)
        engine = initialize(model, cfg)
        losses = []
        try:
            for s in range(4):
                if extra_forward and s == 2:
                    x, y = batch(99)
                    engine(x, y)  # grad enabled, on a boundary: its backward would have stepped
                    pool = engine.optimizer.swap.pool
                    assert pool.in_use > 0, "the forward started the step's reads"
                    engine.save_checkpoint(str(tmp_path / "ckpt"), tag="t")
                    assert pool.in_use == 0
                    engine(x, y)
                    engine.load_checkpoint(str(tmp_path / "ckpt"), tag="t")
                    assert pool.in_use == 0
                x, y = batch(s)
                loss = engine(x, y)
                engine.backward(loss)
                engine.step()
                losses.append(loss.item())
        finally:
            engine.close()
        return losses

    assert run(True) == run(False)


def test_a_group_whose_read_could_not_start_early_is_read_ahead_before_its_turn(disk_dir, monkeypatch):
    # The tied embedding's sub-group is fetched at the head (the first thing backward does) and final at the
    # very end. Its first triggers find no buffer free beyond the reserve; the step must try again as groups
    # finish, so that its read is under way when the group before it steps (_read_ahead), instead of being
    # started by its own turn with backward waiting on it. A model shaped like bench train's: the embedding
    # (vocab x dim) is the largest parameter and the sub-group size, one block per sub-group after it.
    import argparse

    from infinity.bench.train import config
    from infinity.engine import initialize
    from infinity.swap.pipeline import StatePipeline

    shape = argparse.Namespace(vocab=2048, seq=64, layers=6, dim=128, heads=4, batch=2, precision="bf16")
    model_cfg, cfg = config(shape, "nvme", str(disk_dir))
    torch.manual_seed(0)
    with zero_init(cfg):
        model = GPT(model_cfg)
    engine = initialize(model, cfg)
    events = []
    real_run = StatePipeline.run

    def run(self, state, work, **kw):
        events.append((state.label, {s.label for s in engine.optimizer._states() if s.ready()}))
        return real_run(self, state, work, **kw)

    monkeypatch.setattr(StatePipeline, "run", run)
    try:
        tied = engine.optimizer.groups_of[id(engine.store.params[0])][0].state.label  # wte: index 0, tied to the head
        early = []
        for s in range(4):
            events.clear()
            x, y = batch(s, size=2, model=model_cfg)
            engine.backward(engine(x, y))
            engine.step()
            assert len(events) == 7 and events[-1][0] == tied, events  # seven sub-groups; the embedding's last
            early.append(tied in events[-2][1])
        assert any(early[1:]), f"{tied} was never read ahead of its turn after step 1: {early}"
    finally:
        engine.close()


def test_the_gpu_checks_parity_entry_point_runs_every_tier_on_this_device(capsys):
    """`python -m infinity.testing.parity` (bench/gpu_check.sh) on whatever device there is (CI: the CPU)."""
    from infinity.testing.parity import main

    device = "cuda" if torch.cuda.is_available() else "cpu"
    assert main() == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in out[:3]] == [f"{device} offload={t}" for t in ("none", "cpu", "nvme")]
    assert out[-1] == "PASS"
