"""offload_optimizer.moments_dtype "int8" through the engine ([Note: 8-bit moments] in optim/moments8.py): NVMe
moves the format's bytes, checkpoints record the format, resume bit for bit and convert across formats with a
message. That every tier (and the accelerator path) trains alike and close to fp32 moments is in
test_bf16_moments.py, for both compressed formats."""

import json
import os
import warnings

import pytest
import torch

from infinity._native_loader import native
from infinity.checkpoint.export import info
from infinity.optim import OffloadAdamW, moments8
from infinity.swap.state import EIGHT_BIT, DeviceState, state_nbytes
from infinity.testing.parity import engine_config, gpt_engine, train_step

pytestmark = pytest.mark.skipif(native is None, reason="8-bit moments need the native extension")
INT8 = {"zero_optimization.offload_optimizer.moments_dtype": "int8"}


def test_nvme_moves_the_formats_bytes_each_way(disk_dir):
    reports = []
    e = gpt_engine(engine_config("nvme", disk_dir, **INT8))
    try:
        for s in range(3):
            train_step(e, s)
            reports.append(e.last_report)
        states = [g.state for g in e.optimizer.groups]
        assert {s.moments for s in states} == {EIGHT_BIT}
        # fp32 master, then each moment's codes and one fp32 scale per 256: about 6 B per parameter
        assert all(s.io_bytes == 4 * s.numel + 2 * moments8.nbytes(s.numel) for s in states)
        assert all(s.io_bytes <= 6.04 * s.numel + 16 for s in states)
        assert all(0 <= os.path.getsize(s.path) - 4096 - s.io_bytes < 4096 for s in states)
        total = sum(s.io_bytes for s in states)
    finally:
        e.close()
    r = reports[-1]
    assert r.optimizer_read_bytes == r.optimizer_write_bytes == total


def _moments(e) -> list[torch.Tensor]:
    """Every group's decoded moments, in order."""
    out = []
    for g in e.optimizer.groups:
        state = g.state
        views = state.open()
        if views.exp_avg.dtype == EIGHT_BIT:
            out += [moments8.decode(views.exp_avg, state.numel, "exp_avg"),
                    moments8.decode(views.exp_avg_sq, state.numel, "exp_avg_sq")]
        else:
            out += [views.exp_avg.float().clone(), views.exp_avg_sq.float().clone()]
        state.close(write=False)
    return out


def _save_after_two_steps(cfg: dict, ck: str) -> tuple[list[torch.Tensor], list[float]]:
    """Train 2 steps, save to `ck`; the moments saved, and the losses of steps 2 and 3 that follow."""
    e = gpt_engine(cfg)
    try:
        for s in range(2):
            train_step(e, s)
        e.save_checkpoint(ck)
        saved = _moments(e)
        return saved, [train_step(e, s) for s in range(2, 4)]
    finally:
        e.close()


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_checkpoints_record_the_format_and_resume_bit_for_bit(disk_dir, tier):
    ck = str(disk_dir / "ck")
    saved, after = _save_after_two_steps(engine_config(tier, disk_dir, **INT8), ck)
    meta = info(ck, verify=True)
    assert meta["moments_dtype"] == "int8"
    arr = json.load(open(os.path.join(meta["path"], "exp_avg", "blocks.0.fc.weight", "zarr.json")))
    assert arr["data_type"] == "float32"  # the decoded values, which encode back to the same codes

    e = gpt_engine(engine_config(tier, disk_dir, **INT8))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            e.load_checkpoint(ck)
        assert all(torch.equal(a, b) for a, b in zip(_moments(e), saved))
        assert [train_step(e, s) for s in range(2, 4)] == after
    finally:
        e.close()

    # Into fp32 moments: the same values, and said.
    e = gpt_engine(engine_config(tier, str(disk_dir)))
    try:
        with pytest.warns(UserWarning, match=r"holds Adam moments in int8, this engine keeps them in float32 "
                                             r"\(offload_optimizer.moments_dtype\); they were converted "
                                             r"\(widened exactly\)"):
            e.load_checkpoint(ck)
        assert all(torch.equal(a, b) for a, b in zip(_moments(e), saved))
    finally:
        e.close()


def test_fp32_checkpoint_into_int8_moments_is_encoded_and_said(disk_dir):
    ck = str(disk_dir / "ck32")
    e = gpt_engine(engine_config("cpu", str(disk_dir)))
    try:
        train_step(e, 0)
        e.save_checkpoint(ck)
        fp32 = _moments(e)
    finally:
        e.close()
    e = gpt_engine(engine_config("cpu", disk_dir, **INT8))
    try:
        with pytest.warns(UserWarning, match=r"holds Adam moments in float32, this engine keeps them in int8 "
                                             r".*converted \(encoded into 8-bit blocks, rounded to nearest\)"):
            e.load_checkpoint(ck)
        got = _moments(e)
        assert e.optimizer.groups[0].state.views.exp_avg.dtype == EIGHT_BIT
        for a, b in zip(got, fp32):
            kept = b.abs() >= b.abs().max() * 2.0 ** -12  # far above each block's flush-to-zero floor
            assert torch.allclose(a[kept], b[kept], rtol=2.0 ** -4, atol=0)
    finally:
        e.close()


def test_int8_and_bf16_checkpoints_convert_both_ways_and_say_so(disk_dir):
    saved = {}
    for name, over in (("int8", INT8), ("bf16", {"zero_optimization.offload_optimizer.moments_dtype": "bf16"})):
        e = gpt_engine(engine_config("cpu", disk_dir, **over))
        try:
            for s in range(2):
                train_step(e, s)
            e.save_checkpoint(str(disk_dir / name))
            saved[name] = _moments(e)
        finally:
            e.close()
    e = gpt_engine(engine_config("cpu", disk_dir, **{"zero_optimization.offload_optimizer.moments_dtype": "bf16"}))
    try:
        with pytest.warns(UserWarning, match=r"holds Adam moments in int8, this engine keeps them in bfloat16 .*"
                                             r"\(rounded to nearest even\)"):
            e.load_checkpoint(str(disk_dir / "int8"))
        assert all(torch.equal(a, b.bfloat16().float()) for a, b in zip(_moments(e), saved["int8"]))
    finally:
        e.close()
    e = gpt_engine(engine_config("cpu", disk_dir, **INT8))
    try:
        with pytest.warns(UserWarning, match=r"holds Adam moments in bfloat16, this engine keeps them in int8 .*"
                                             r"\(encoded into 8-bit blocks, rounded to nearest\)"):
            e.load_checkpoint(str(disk_dir / "bf16"))
        for a, b in zip(_moments(e), saved["bf16"]):
            kept = b.abs() >= b.abs().max() * 2.0 ** -12
            assert torch.allclose(a[kept], b[kept], rtol=2.0 ** -4, atol=0)
    finally:
        e.close()


def test_other_sub_groups_re_encode_and_the_load_says_how_many_values_changed(disk_dir):
    """8-bit blocks are counted from each sub-group's start. A value keeps its code in any block whose largest
    is within 2^15 of it, so a load into other sub-groups usually changes nothing; where a block comes to hold a
    value 2^15 times smaller than its largest, the value changes, and the load counts and says so."""
    ck = str(disk_dir / "ck")
    e = gpt_engine(engine_config("cpu", disk_dir, **INT8, **{"zero_optimization.sub_group_size": 1}))
    try:
        train_step(e, 0)
        assert all(len(g.params) == 1 for g in e.optimizer.groups)  # one parameter per sub-group

        def fill(g, p, m, v):  # every other parameter's moments 2^20 times smaller: exact in their own blocks
            big = g.index % 2 == 0
            m.fill_(1.0 if big else 2.0 ** -20)
            v.fill_(1.0 if big else 2.0 ** -40)

        assert e.optimizer.import_state(fill, keep_unfilled=True) == 0
        e.save_checkpoint(ck)
    finally:
        e.close()
    e = gpt_engine(engine_config("cpu", disk_dir, **INT8))  # sub-groups of 40,000: blocks span parameters
    try:
        assert any(len(g.params) > 1 for g in e.optimizer.groups)
        with pytest.warns(UserWarning, match=r"[\d,]+ of this rank's Adam moment values changed when re-encoded "
                                             r"into 8-bit blocks: its sub-groups differ"):
            e.load_checkpoint(ck)
    finally:
        e.close()
    e = gpt_engine(engine_config("cpu", disk_dir, **INT8, **{"zero_optimization.sub_group_size": 1}))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the same sub-groups: nothing changes, nothing is said
            e.load_checkpoint(ck)
    finally:
        e.close()


def test_the_accelerator_path_checkpoints_through_decoded_slices(disk_dir, monkeypatch):
    """DeviceState off the host (as on an accelerator) exports and imports one parameter's slice at a time, from
    the group's decoded moments: a save and load there resumes bit for bit."""
    monkeypatch.setattr(DeviceState, "_on_host", lambda self: False)
    ck = str(disk_dir / "ck")
    saved, after = _save_after_two_steps(engine_config("none", disk_dir, **INT8), ck)
    e = gpt_engine(engine_config("none", disk_dir, **INT8))
    try:
        e.load_checkpoint(ck)
        assert all(torch.equal(a, b) for a, b in zip(_moments(e), saved))
        assert [train_step(e, s) for s in range(2, 4)] == after
    finally:
        e.close()


def test_state_bytes_are_exact_for_every_group_size():
    for n in (1, 255, 256, 257, 10_000):
        assert state_nbytes(n, EIGHT_BIT) == 4 * n + 2 * moments8.nbytes(n)
        assert state_nbytes(n, EIGHT_BIT) % 4 == 0


def test_offload_adamw_refuses_int8_and_says_what_to_use(tmp_path):
    p = torch.nn.Parameter(torch.zeros(4))
    with pytest.raises(ValueError, match=r"moments_dtype='int8' is for the ZeRO engine .* use "
                                         r"moments_dtype='bf16' here"):
        OffloadAdamW([p], offload="cpu", moments_dtype="int8")
