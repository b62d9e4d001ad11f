"""Bad input: each gives a clear error, and neither the engine nor the checkpoints on disk change."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys

import pytest
import torch

from infinity.checkpoint import CheckpointCorruptionError, CheckpointError
from infinity.checkpoint.export import export, info
from infinity.engine import initialize, zero_init
from infinity.models import GPT, GPTConfig
from infinity.testing.parity import MODEL, batch, engine_config


def _engine(model=MODEL, **over):
    cfg = engine_config("none", **over)
    torch.manual_seed(0)
    with zero_init(cfg):
        m = GPT(model)
    return initialize(m, cfg)


def _step(e, s=0):
    x, y = batch(s)
    e.backward(e(x, y))
    e.step()


def _snapshot(e) -> dict:
    g = e.optimizer.groups
    return {"state": [getattr(grp.state.views, k).clone() for grp in g for k in ("param", "exp_avg", "exp_avg_sq")],
            "steps": (e.global_steps, e.micro_steps, e.optimizer.step_count, e.optimizer.param_groups[0]["lr"])}


def _assert_unchanged(e, snap) -> None:
    after = _snapshot(e)
    assert after["steps"] == snap["steps"]
    assert all(torch.equal(a, b) for a, b in zip(after["state"], snap["state"]))


@pytest.fixture
def saved(tmp_path):
    """An engine that has saved global_step1 and then trained a step further (so a load would change it)."""
    e = _engine()
    _step(e)
    e.save_checkpoint(tmp_path / "ck")
    _step(e, 1)
    yield e, tmp_path / "ck"
    e.close()


def _files(root) -> dict:
    out = {}
    for d, _, fs in os.walk(root):
        for f in fs:
            p = os.path.join(d, f)
            out[p] = open(p, "rb").read()
    return out


def test_missing_checkpoint(saved, tmp_path):
    e, ck = saved
    snap = _snapshot(e)
    # No tag and nothing to load: DeepSpeed's (None, None), said once, so a script's first run starts fresh.
    with pytest.warns(UserWarning, match="found nothing to load, so the engine is unchanged: no checkpoint at .*"
                                         "nowhere: no such directory"):
        assert e.load_checkpoint(tmp_path / "nowhere") == (None, None)
    with pytest.raises(CheckpointError, match="no such directory"):
        e.load_checkpoint(tmp_path / "nowhere", "global_step1")
    (tmp_path / "empty").mkdir()
    with pytest.warns(UserWarning, match="has no 'latest' file"):
        assert e.load_checkpoint(tmp_path / "empty") == (None, None)
    with pytest.raises(CheckpointError, match=r"'global_step9' not found .* complete checkpoints there: \['global_step1'\]"):
        e.load_checkpoint(ck, "global_step9")
    with pytest.raises(ValueError, match="tag '../x' is not usable"):
        e.load_checkpoint(ck, "../x")
    _assert_unchanged(e, snap)


def test_corrupted_chunk_is_found_before_anything_changes(saved):
    e, ck = saved
    snap = _snapshot(e)
    name = e.store.params[3].name
    chunk = ck / "global_step1" / "exp_avg" / name / "c.0"
    data = bytearray(chunk.read_bytes())
    data[len(data) // 2] ^= 0x10
    chunk.write_bytes(bytes(data))
    before = _files(ck)
    with pytest.raises(CheckpointCorruptionError, match=f"exp_avg of parameter {name} is corrupted") as info_:
        e.load_checkpoint(ck)
    assert info_.value.errno == errno.EIO and info_.value.filename == str(chunk)
    _assert_unchanged(e, snap)
    assert _files(ck) == before
    with pytest.raises(CheckpointCorruptionError):
        info(ck, verify=True)


def test_corrupted_manifest(saved):
    e, ck = saved
    snap = _snapshot(e)
    meta = ck / "global_step1" / "zarr.json"
    text = meta.read_text()
    meta.write_text(text.replace('"global_steps": 1', '"global_steps": 7'))
    with pytest.raises(CheckpointError, match="its manifest .* does not match the CRC-32C stored with it"):
        e.load_checkpoint(ck)
    meta.write_text(text)
    rng = ck / "global_step1" / "ranks" / "0" / "zarr.json"
    rng.write_text(rng.read_text().replace('"python": [\n', '"python": [\n 4,', 1).replace('"python": [', '"python": [4,', 1))
    with pytest.raises(CheckpointError, match="ranks/0/zarr.json does not match the CRC-32C"):
        e.load_checkpoint(ck)
    (ck / "latest").write_bytes(b"\xff\x00garbage/..")
    with pytest.raises(CheckpointError, match="latest is corrupted"):
        e.load_checkpoint(ck)
    (ck / "latest").write_text("global_step1\n")
    (ck / "global_step1" / "zarr.json").write_text('{"zarr_format": 3, "node_')
    with pytest.raises(CheckpointError, match="is corrupted: .*zarr.json is not valid JSON"):
        e.load_checkpoint(ck)
    (ck / "global_step1" / "zarr.json").write_text('{"zarr_format": 3, "node_type": "group", "attributes": {}}')
    with pytest.raises(CheckpointError, match="is not an infinity checkpoint"):
        e.load_checkpoint(ck)
    _assert_unchanged(e, snap)


@pytest.mark.parametrize("damage", ["missing chunk", "truncated chunk", "no manifest", "interrupted save",
                                    "missing rank group"])
def test_partial_checkpoint(saved, damage):
    e, ck = saved
    snap = _snapshot(e)
    root = ck / "global_step1"
    chunk = root / "master" / e.store.params[-1].name / "c.0"
    if damage == "missing chunk":
        chunk.unlink()
        pattern = "partial: chunk file .*c.0 of master of parameter .* is missing"
    elif damage == "truncated chunk":
        os.truncate(chunk, chunk.stat().st_size // 2)
        pattern = "partial: chunk file .* has \\d+ bytes, expected"
    elif damage == "no manifest":
        (root / "zarr.json").unlink()
        pattern = "is partial: it has no zarr.json"
    elif damage == "interrupted save":
        root.rename(ck / ".global_step1.partial")
        pattern = "'global_step1' .* is partial: its save was interrupted"
    else:
        shutil.rmtree(root / "ranks" / "0")
        pattern = "is partial: .*ranks/0/zarr.json is missing"
    with pytest.raises(CheckpointError, match=pattern):
        e.load_checkpoint(ck)
    _assert_unchanged(e, snap)


def test_incompatible_model_names_the_parameter(saved, tmp_path):
    e, ck = saved
    other = _engine(GPTConfig(vocab=MODEL.vocab + 8, seq=MODEL.seq, layers=MODEL.layers, dim=MODEL.dim,
                              heads=MODEL.heads))
    deeper = _engine(GPTConfig(vocab=MODEL.vocab, seq=MODEL.seq, layers=MODEL.layers + 1, dim=MODEL.dim,
                               heads=MODEL.heads))
    try:
        snap = _snapshot(other)
        with pytest.raises(CheckpointError, match=r"does not fit this model: parameter wte\.weight: the checkpoint has "
                                                  r"shape \(256, 64\), the model \(264, 64\)"):
            other.load_checkpoint(ck)
        _assert_unchanged(other, snap)
        with pytest.raises(CheckpointError, match=r"parameter blocks\.2\.[\w.]+ is not in the checkpoint"):
            deeper.load_checkpoint(ck)
    finally:
        other.close()
        deeper.close()


def test_save_refuses_bad_arguments_and_keeps_the_previous_checkpoint(saved, tmp_path):
    e, ck = saved
    before = _files(ck)
    (tmp_path / "afile").write_text("x")
    with pytest.raises(NotADirectoryError, match="exists and is not a directory"):
        e.save_checkpoint(tmp_path / "afile")
    with pytest.raises(ValueError, match="tag 'latest' is not usable"):
        e.save_checkpoint(ck, "latest")
    with pytest.raises(TypeError, match="client_state must be picklable"):
        e.save_checkpoint(ck, client_state={"loader": lambda: 0})
    assert _files(ck) == before


def test_save_in_the_middle_of_gradient_accumulation_is_refused(tmp_path):
    e = _engine(gradient_accumulation_steps=2)
    try:
        x, y = batch(0)
        e.backward(e(x, y))
        with pytest.raises(RuntimeError, match="after 1 of 2 micro-batches of gradient accumulation"):
            e.save_checkpoint(tmp_path / "ck")
        assert not (tmp_path / "ck").exists()
    finally:
        e.close()


def test_full_disk_leaves_the_previous_checkpoint(tiny_fs):
    """A save that runs out of space fails with ENOSPC, removes its partial directory, and latest still names
    the previous checkpoint, which loads."""
    e = _engine()
    try:
        _step(e)
        ck = tiny_fs / "ck"
        e.save_checkpoint(ck, "first")
        before = _files(ck)
        with pytest.raises(OSError) as exc:
            for i in range(10):  # the filesystem holds about two of these
                e.save_checkpoint(ck, f"more{i}")
        assert exc.value.errno == errno.ENOSPC
        assert not [p for p in os.listdir(ck) if p.startswith(".")]
        assert all(_files(ck)[p] == data for p, data in before.items() if "latest" not in p)
        latest = (ck / "latest").read_text().strip()
        assert info(ck, verify=True)["tag"] == latest
        e.load_checkpoint(ck)
    finally:
        e.close()


def test_export_errors_leave_no_output(saved, tmp_path):
    e, ck = saved
    with pytest.raises(ValueError, match="must end in .safetensors, .pt or .pth"):
        export(ck, tmp_path / "out.bin")
    chunk = ck / "global_step1" / "master" / e.store.params[0].name / "c.0"
    data = bytearray(chunk.read_bytes())
    data[0] ^= 1
    chunk.write_bytes(bytes(data))
    r = subprocess.run([sys.executable, "-m", "infinity", "checkpoint", "export", str(ck),
                        str(tmp_path / "out.safetensors")], capture_output=True, text=True)
    assert r.returncode == 2 and "is corrupted" in r.stderr and "Traceback" not in r.stderr
    assert not [p for p in os.listdir(tmp_path) if p.startswith("out")]


@pytest.mark.slow
def test_a_rank_dying_mid_save_fails_the_others_and_keeps_the_previous_checkpoint(disk_dir, tmp_path):
    from infinity.testing.ckpt import save_with_a_dying_rank

    os.makedirs(disk_dir / "swap", exist_ok=True)
    cfg = engine_config("nvme", str(disk_dir / "swap"))
    ck = tmp_path / "ck"
    record = save_with_a_dying_rank(cfg, str(ck), str(tmp_path / "record.json"))
    assert not record["hung"]
    assert record["error"] == "RankFailure", record
    assert record["seconds"] < 30
    assert (ck / "latest").read_text().strip() == "s1"
    assert not (ck / "s2").exists() and not (ck / ".s2.partial").exists()  # rank 0 removed the partial save
    assert info(ck, verify=True)["world_size"] == 2
    e = _engine()
    try:
        e.load_checkpoint(ck)  # 2 ranks -> 1
        assert e.global_steps == 1
    finally:
        e.close()


def test_save_between_backward_and_step_is_refused(tmp_path):
    e = _engine()
    try:
        x, y = batch(0)
        e.backward(e(x, y))
        with pytest.raises(RuntimeError, match="between engine.backward\\(\\) and engine.step\\(\\)"):
            e.save_checkpoint(tmp_path / "ck")
        e.step()
        e.save_checkpoint(tmp_path / "ck")
    finally:
        e.close()


def test_a_scheduler_that_does_not_fit_changes_nothing(tmp_path):
    cfg = engine_config("none")
    ck = tmp_path / "ck"
    src = initialize(GPT(MODEL), cfg, lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0))
    _step(src)
    src.save_checkpoint(ck)
    src.close()
    torch.manual_seed(0)
    e = initialize(GPT(MODEL), cfg, lr_scheduler=lambda opt: torch.optim.lr_scheduler.CyclicLR(
        opt, 1e-4, 1e-3, cycle_momentum=False))
    try:
        _step(e)
        snap = _snapshot(e)
        sched = e.lr_scheduler.state_dict()
        with pytest.raises(CheckpointError, match="its lr scheduler state is a LambdaLR's, it does not fit this engine's CyclicLR"):
            e.load_checkpoint(ck)
        _assert_unchanged(e, snap)
        assert e.lr_scheduler.state_dict() == sched
        e.load_checkpoint(ck, load_lr_scheduler_states=False)
        assert e.global_steps == 1
    finally:
        e.close()


def test_leftovers_of_killed_saves_are_removed_by_the_next_save(saved):
    e, ck = saved
    (ck / ".global_step5.partial" / "master").mkdir(parents=True)
    (ck / ".other.partial").mkdir()
    e.save_checkpoint(ck, "next")
    assert sorted(os.listdir(ck)) == ["global_step1", "latest", "next", "owner.pid"]  # the open engine's lock


def _rewrite_manifest(root, change):
    """Edit a checkpoint's manifest and store its matching CRC, as a writer with other ideas would."""
    import json

    from infinity.checkpoint.layout import crc_of

    path = root / "zarr.json"
    meta = json.loads(path.read_text())
    change(meta["attributes"]["infinity_checkpoint"])
    meta["attributes"]["infinity_checkpoint_crc32c"] = crc_of(meta["attributes"]["infinity_checkpoint"])
    path.write_text(json.dumps(meta))


@pytest.mark.parametrize("change,pattern", [
    (lambda m: m.update(version=99), "has format version 99; this infinity reads up to 1: upgrade infinity"),
    (lambda m: m.update(complete=False), "is partial: its manifest is not marked complete"),
    (lambda m: m["engine"].pop("global_steps"), "is corrupted: its manifest's engine state is unusable"),
    (lambda m: m["engine"]["loss_scaler"].update(bogus=1), r"unknown loss scaler fields \['bogus'\]"),
    (lambda m: m["params"][2].update(part=0), r"its manifest's params\[2\]\.part is unusable \(0 is below 1\)"),
    (lambda m: m["params"][0].pop("shape"), r"its manifest's params\[0\]\.shape is unusable \(missing\)"),
    (lambda m: m.update(world_size="2"), r"its manifest's world_size is unusable \(str where int was expected\)"),
])
def test_manifests_that_cannot_be_used(saved, change, pattern):
    e, ck = saved
    snap = _snapshot(e)
    _rewrite_manifest(ck / "global_step1", change)
    with pytest.raises(CheckpointError, match=pattern):
        e.load_checkpoint(ck)
    _assert_unchanged(e, snap)


def test_more_argument_errors(saved, tmp_path):
    e, ck = saved
    (tmp_path / "afile").write_text("x")
    with pytest.raises(CheckpointError, match="no checkpoint at .*afile: it is not a directory"):
        e.load_checkpoint(tmp_path / "afile")
    # DeepSpeed's rule: any picklable client_state, given back as it was (int keys stay int keys)
    e.save_checkpoint(tmp_path / "pickled", client_state={1: "int keys", "t": (1, 2)})
    assert e.load_checkpoint(tmp_path / "pickled")[1] == {1: "int keys", "t": (1, 2)}
    with pytest.raises(FileNotFoundError, match="the directory of .*out.pt does not exist"):
        export(ck, tmp_path / "missing" / "out.pt")


def test_info_verify_checks_every_arrays_zarr_json(saved):
    """Probe finding 8: with one array's zarr.json corrupted, `checkpoint info --verify` said OK while zarr-python
    could not read the array (our loader reads through the manifest alone)."""
    import json as _json

    import zarr

    from infinity.checkpoint.export import info

    e, ck = saved
    root = ck / "global_step1"
    assert info(ck, verify=True)["verified_arrays"] > 0
    meta = root / "exp_avg" / e.store.params[0].name / "zarr.json"
    good = meta.read_bytes()
    doc = _json.loads(good)
    doc["chunk_grid"]["configuration"]["chunk_shape"] = [7]
    meta.write_text(_json.dumps(doc))
    with pytest.raises(CheckpointError, match=rf"{meta} \(exp_avg of parameter {e.store.params[0].name}\) does not "
                                              r"describe the array the manifest records \(differs in chunk_grid\)"):
        info(ck, verify=True)
    meta.write_bytes(good[:-9])  # cut short
    with pytest.raises(CheckpointError, match=rf"{meta} .* is not valid JSON"):
        info(ck, verify=True)
    with pytest.raises(Exception):  # and indeed zarr-python cannot read it
        zarr.open_group(str(root), mode="r")["exp_avg"][e.store.params[0].name][:]
    meta.write_bytes(good)
    assert info(ck, verify=True)["global_steps"] == 1
