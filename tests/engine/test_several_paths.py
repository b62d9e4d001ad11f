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

from infinity.config import ConfigError
from infinity.testing.parity import engine_config, engine_losses, gpt_engine, train_step

BF16 = {"bf16.enabled": True, "zero_optimization.sub_group_size": 8192}


def _with_paths(cfg: dict, paths: list) -> dict:
    for section in ("offload_param", "offload_optimizer"):
        cfg["zero_optimization"][section]["nvme_path"] = [str(p) for p in paths]
    return cfg


def _swp(root) -> dict:
    return {str(p): p.stat().st_size for p in Path(root).rglob("*.swp")}


def test_two_directories_train_bit_for_bit_as_one_and_share_the_files(tmp_path):
    one = engine_losses(engine_config("nvme", tmp_path / "one", **BF16), 4)
    a, b = tmp_path / "a", tmp_path / "b"
    e = gpt_engine(_with_paths(engine_config("nvme", tmp_path, **BF16), [a, b]))
    try:
        two = [train_step(e, s) for s in range(4)]
        e.optimizer.settle()
        groups = e.plan.sub_groups
        on_a = [f for f in _swp(a) if "/optim_" in f]
        on_b = [f for f in _swp(b) if "/optim_" in f]
        assert len(groups) > 4 and len(on_a) + len(on_b) == len(groups)
        assert abs(len(on_a) - len(on_b)) <= 1, (len(on_a), len(on_b))  # placed in turn
        assert (a / "infinity-swap" / "rank0" / "owner.pid").exists() and (b / "infinity-swap" / "rank0").is_dir()
    finally:
        e.close()
    assert two == one
    assert not _swp(a) and not _swp(b) and not (a / "infinity-swap").exists(), "close removes both directories"


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm: a second filesystem is needed")
def test_the_plan_holds_each_filesystems_bytes_exactly(tmp_path):
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
