"""offload_optimizer.moments_dtype "bf16" through the engine: every tier trains alike (and so with "int8"),
NVMe moves 8 B per parameter per direction, checkpoints record the dtype and convert across it with a message."""

import json
import os
import warnings

import pytest
import torch

from infinity._native_loader import native
from infinity.checkpoint.export import info
from infinity.config import ConfigError, load_config
from infinity.swap.state import DeviceState
from infinity.testing.parity import engine_config, engine_losses, gpt_engine, train_step

pytestmark = pytest.mark.skipif(native is None, reason="bf16 moments need the native extension")
STEPS = 5
BF16 = {"zero_optimization.offload_optimizer.moments_dtype": "bf16"}



@pytest.fixture(scope="module")
def fp32_losses():
    return engine_losses(engine_config("none"), STEPS)


@pytest.mark.parametrize("moments", ["bf16", "int8"])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_every_tier_trains_the_same_and_close_to_fp32_moments(disk_dir, fp32_losses, moments, rounding):
    over = {"zero_optimization.offload_optimizer.moments_dtype": moments,
            "zero_optimization.offload_optimizer.moments_rounding": rounding}
    runs = {tier: engine_losses(engine_config(tier, disk_dir, **over), STEPS) for tier in ("none", "cpu", "nvme")}
    # one kernel, one random stream per (step, group); on a CPU-only host "none" is the host tier's code too
    assert runs["none"] == runs["cpu"] == runs["nvme"]
    assert runs["cpu"] != fp32_losses  # the moments really are stored compressed
    assert all(abs(a - b) < 1e-3 * abs(b) for a, b in zip(runs["cpu"], fp32_losses))
    assert runs["cpu"][-1] < runs["cpu"][0]


def test_nvme_moves_8_bytes_per_parameter_each_way(disk_dir):
    reports = []
    e = gpt_engine(engine_config("nvme", disk_dir, **BF16))
    try:
        for s in range(3):
            train_step(e, s)
            reports.append(e.last_report)
        states = [g.state for g in e.optimizer.groups]
        trained = sum(g.numel for g in e.optimizer.groups)
        assert {s.moments for s in states} == {torch.bfloat16}
        assert all(s.io_bytes == 8 * s.numel for s in states)
        # the file: a 4 KiB header, then the partition (rounded up to the filesystem's O_DIRECT block)
        assert all(0 <= os.path.getsize(s.path) - 4096 - 8 * s.numel < 4096 for s in states)
    finally:
        e.close()
    r = reports[-1]
    assert r.optimizer_read_bytes == r.optimizer_write_bytes == 8 * trained  # 12 with fp32 moments


@pytest.mark.parametrize("moments", ["bf16", "int8"])
def test_the_accelerator_path_rounds_with_the_kernels_bits(disk_dir, monkeypatch, moments):
    """DeviceState on an accelerator steps in torch ops and rounds with the ported hash (8-bit moments: through
    moments8's codec); run here on the host, it tracks the CPU kernel within fp32 noise."""
    over = {"zero_optimization.offload_optimizer.moments_dtype": moments}
    cpu = engine_losses(engine_config("cpu", disk_dir, **over), STEPS)
    monkeypatch.setattr(DeviceState, "_on_host", lambda self: False)
    dev = engine_losses(engine_config("none", disk_dir, **over), STEPS)
    assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(dev, cpu))


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_checkpoints_record_the_dtype_and_convert_across_it(disk_dir, tier):
    ck = str(disk_dir / "ck")
    e = gpt_engine(engine_config(tier, disk_dir, **BF16))
    try:
        for s in range(2):
            train_step(e, s)
        e.save_checkpoint(ck)
        after = [train_step(e, s) for s in range(2, 4)]
    finally:
        e.close()
    meta = info(ck, verify=True)
    assert meta["moments_dtype"] == "bfloat16"
    root = meta["path"]
    arr = json.load(open(os.path.join(root, "exp_avg", "blocks.0.fc.weight", "zarr.json")))
    assert arr["data_type"] == "uint16" and arr["attributes"]["dtype"] == "bfloat16"

    # The same dtype: exactly where it left off, and nothing said.
    e = gpt_engine(engine_config(tier, disk_dir, **BF16))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            e.load_checkpoint(ck)
        assert [train_step(e, s) for s in range(2, 4)] == after
    finally:
        e.close()

    # Into fp32 moments: widened exactly, and said.
    e = gpt_engine(engine_config(tier, str(disk_dir)))
    try:
        with pytest.warns(UserWarning, match=r"holds Adam moments in bfloat16, this engine keeps them in float32 "
                                             r"\(offload_optimizer.moments_dtype\); they were converted "
                                             r"\(widened exactly\)"):
            e.load_checkpoint(ck)
        state = e.optimizer.groups[0].state
        views = state.open()
        m = views.exp_avg.clone()
        state.close(write=False)
        assert m.dtype == torch.float32 and torch.equal(m, m.bfloat16().float()) and m.abs().sum() > 0
        assert train_step(e, 2) == after[0]  # the loss before any update from the loaded state
    finally:
        e.close()


def test_fp32_checkpoint_into_bf16_moments_is_rounded_and_said(disk_dir):
    ck = str(disk_dir / "ck32")
    e = gpt_engine(engine_config("cpu", str(disk_dir)))
    try:
        train_step(e, 0)
        e.save_checkpoint(ck)
    finally:
        e.close()
    assert info(ck)["moments_dtype"] == "float32"
    e = gpt_engine(engine_config("cpu", disk_dir, **BF16))
    try:
        with pytest.warns(UserWarning, match=r"holds Adam moments in float32, this engine keeps them in bfloat16 "
                                             r".*converted \(rounded to nearest even\)"):
            e.load_checkpoint(ck)
        assert e.optimizer.groups[0].state.views.exp_avg.dtype == torch.bfloat16
        assert e.optimizer.groups[0].state.views.exp_avg.abs().sum() > 0
    finally:
        e.close()


def test_a_wrong_moments_dtype_is_named():
    cfg = {"train_micro_batch_size_per_gpu": 1,
           "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "moments_dtype": "fp16"}}}
    with pytest.raises(ConfigError, match=r'zero_optimization.offload_optimizer.moments_dtype.*must be one of '
                                          r'fp32, bf16, int8, got "fp16"'):
        load_config(cfg)
    cfg["zero_optimization"]["offload_optimizer"].update(moments_dtype="bf16", moments_rounding="down")
    with pytest.raises(ConfigError, match=r'moments_rounding.*must be one of nearest, stochastic, got "down"'):
        load_config(cfg)
