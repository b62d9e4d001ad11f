"""Several nvme_paths ([Note: several NVMe paths] in infinity/swap/swapper.py): the swap files are placed across
the directories, training is bit-for-bit that of one directory, the plan's room per filesystem is what the files
take, and a full disk among them is refused by name."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections import namedtuple
from pathlib import Path

import pytest

import infinity
import infinity.swap.swapper as swapper_module
from infinity.config import ConfigError
from infinity.testing.parity import engine_config, engine_losses, gpt_engine, train_step
from infinity.testing.files import flip_bit

BF16 = {"bf16.enabled": True, "zero_optimization.sub_group_size": 8192}


@pytest.fixture(params=["whole files", "striped"])
def striped(request, monkeypatch):
    """Both layouts on this test's small model: files placed whole in turn, or striped (MIN_STRIPE lowered to
    4 KiB so that the sub-groups' ~115 KB files are cut into a chunk per disk)."""
    if request.param == "striped":
        monkeypatch.setattr(swapper_module, "MIN_STRIPE", 4096)
    return request.param == "striped"


def _with_paths(cfg: dict, paths: list) -> dict:
    for section in ("offload_param", "offload_optimizer"):
        cfg["zero_optimization"][section]["nvme_path"] = [str(p) for p in paths]
    return cfg


def _swp(root) -> dict:
    return {str(p): p.stat().st_size for p in Path(root).rglob("*.swp")}


def test_two_directories_train_bit_for_bit_as_one_and_share_the_files(tmp_path, striped):
    one = engine_losses(engine_config("nvme", tmp_path / "one", **BF16), 4)
    a, b = tmp_path / "a", tmp_path / "b"
    e = gpt_engine(_with_paths(engine_config("nvme", tmp_path, **BF16), [a, b]))
    try:
        two = [train_step(e, s) for s in range(4)]
        e.optimizer.settle()
        groups = e.plan.sub_groups
        on_a = [f for f in _swp(a) if "/optim_" in f]
        on_b = [f for f in _swp(b) if "/optim_" in f]
        assert len(groups) > 4
        if striped:  # a group of at least 2 x MIN_STRIPE bytes (14 B a parameter) is a chunk on each disk
            cut = sum(1 for g in groups if g.numel * 14 >= 2 * 4096)
            assert cut > len(groups) // 2 and len([f for f in on_a + on_b if f.endswith(".1.swp")]) == cut
            assert len(on_a) + len(on_b) == len(groups) + cut and abs(len(on_a) - len(on_b)) <= 1
        else:  # placed in turn
            assert len(on_a) + len(on_b) == len(groups) and abs(len(on_a) - len(on_b)) <= 1, (on_a, on_b)
        assert (a / "infinity-swap" / "rank0" / "owner.pid").exists() and (b / "infinity-swap" / "rank0").is_dir()
    finally:
        e.close()
    assert two == one
    assert not _swp(a) and not _swp(b) and not (a / "infinity-swap").exists(), "close removes both directories"


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm: a second filesystem is needed")
def test_the_plan_holds_each_filesystems_bytes_exactly(tmp_path, striped):
    """One directory on the test's disk, one on tmpfs (direct I/O off: tmpfs has no O_DIRECT): two
    filesystems, each with the bytes of the optimizer files placed on it, to the byte."""
    shm = Path(tempfile.mkdtemp(dir="/dev/shm"))
    try:
        cfg = _with_paths(engine_config("nvme", tmp_path, **BF16, **{"infinity.direct_io": False}),
                          [tmp_path / "disk", shm])
        e = gpt_engine(cfg)
        try:
            for s in range(2):
                train_step(e, s)
            e.optimizer.settle()
            by_path = {need.path: need for need in e.plan.disk}
            assert set(by_path) == {str(tmp_path / "disk"), str(shm)}
            for root, need in by_path.items():
                files = _swp(root)
                assert sum(n for f, n in files.items() if "/optim_" in f) == need.optimizer_bytes > 0, root
        finally:
            e.close()
    finally:
        shutil.rmtree(shm, ignore_errors=True)


def test_a_corrupted_byte_in_a_later_chunk_is_caught(tmp_path, monkeypatch):
    """Striped: a byte flipped in a chunk other than the header's is caught by the combined checksum of the
    read (the group's own, or a shard's read by forward)."""
    monkeypatch.setattr(swapper_module, "MIN_STRIPE", 4096)
    a, b = tmp_path / "a", tmp_path / "b"
    e = gpt_engine(_with_paths(engine_config("nvme", tmp_path, **BF16), [a, b]))
    try:
        train_step(e, 0)
        e.optimizer.settle()
        chunk = sorted(f for f in {**_swp(a), **_swp(b)} if f.endswith(".1.swp") and "/optim_" in f)[0]
        flip_bit(chunk, swapper_module.HEADER + 100)
        with pytest.raises(infinity.SwapCorruptionError, match="is corrupted"):
            for s in range(1, 4):
                train_step(e, s)
    finally:
        e.close()


def test_a_full_disk_among_the_paths_is_refused_by_name(tmp_path, monkeypatch):
    full, roomy = tmp_path / "full", tmp_path / "roomy"
    full.mkdir()
    roomy.mkdir()
    real = shutil.disk_usage
    usage = namedtuple("usage", "total used free")

    def disk_usage(path):
        return usage(10**9, 10**9 - 100, 100) if str(path).startswith(str(full)) else real(path)

    # Same filesystem for both here, so tell them apart by st_dev as the check does.
    real_stat = os.stat

    def stat(path, *args, **kw):
        st = real_stat(path, *args, **kw)
        if str(path).startswith(str(full)):
            return os.stat_result((st.st_mode, st.st_ino, st.st_dev + 1, *tuple(st)[3:]))
        return st

    monkeypatch.setattr(shutil, "disk_usage", disk_usage)
    monkeypatch.setattr(os, "stat", stat)
    with pytest.raises(ConfigError, match=rf"{full} has 100 bytes free, but the swap files of this host's ranks "
                                          r"need [\d,]+ \(.* for the optimizer\)"):
        gpt_engine(_with_paths(engine_config("nvme", tmp_path, **BF16), [roomy, full]))
    assert not _swp(tmp_path), "nothing was written"


@pytest.mark.parametrize("value, message", [
    ([], "must be a directory or a non-empty list of directories"),
    (["/tmp/x", "/tmp/x/"], "lists /tmp/x, /tmp/x/ more than once"),
    (["/tmp/x", ""], "must be a directory or a non-empty list of directories"),
])
def test_a_bad_list_of_paths_is_refused_by_name(value, message):
    from infinity.config import load_config

    cfg = {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": value}}}
    with pytest.raises(ConfigError, match="zero_optimization.offload_optimizer.nvme_path: " + message):
        load_config(cfg)


def test_a_single_path_is_one_directory_as_before(tmp_path):
    from infinity.config import load_config

    off = load_config({"zero_optimization": {"stage": 3, "offload_optimizer": {
        "device": "nvme", "nvme_path": str(tmp_path)}}}).zero_optimization.offload_optimizer
    assert off.paths == (str(tmp_path),) and off.nvme_path == str(tmp_path) and off.nvme_path_list == ()
