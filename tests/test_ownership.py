"""Runs that cannot clobber or lose each other (probe findings 1-3 of the issue "Engine assembled from one typed
plan"): a save directory is owned by one live run ([Note: directories are owned through flock] in
infinity/dirlock.py), a checkpoint records the run it belongs to, `--resume` without `latest` finds the newest
complete checkpoint or raises, and a failed write of the manifest or of `latest` names its file."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import time

import pytest
import torch

from infinity.dirlock import DirectoryInUse, DirLock, probe
from infinity.engine import initialize
from infinity.testing.parity import engine_config

INFINITY = [sys.executable, "-m", "infinity"]


def train(*args, timeout=300):
    return subprocess.run(INFINITY + ["train", *args], capture_output=True, text=True, timeout=timeout)


def train_here(capsys, *args) -> tuple[int, str, str]:
    """`infinity train` in this process (no interpreter start-up): its exit code, stdout and stderr."""
    from infinity.tools.cli import main

    capsys.readouterr()
    rc = main(["train", *args])
    out, err = capsys.readouterr()
    return rc, out, err


def metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _engine(tmp_path):
    torch.manual_seed(0)
    return initialize(torch.nn.Linear(8, 8), engine_config("cpu", str(tmp_path)))


def _step(e):
    loss = e(torch.randn(2, 8)).square().mean()
    e.backward(loss)
    e.step()


@pytest.mark.slow
def test_a_save_directory_is_one_live_process_s(tmp_path):
    """Another process saving checkpoints into a directory holds it: a save there is refused by name and writes
    nothing; once that process is killed (no close, no cleanup), the directory can be taken."""
    ck = tmp_path / "ck"
    code = ("import sys, torch; from infinity.engine import initialize; "
            "from infinity.testing.parity import engine_config; "
            f"e = initialize(torch.nn.Linear(8, 8), engine_config('cpu', {str(tmp_path)!r})); "
            f"e.save_checkpoint({str(ck)!r}, tag='theirs'); print('saved', flush=True); sys.stdin.read()")
    holder = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "saved"
        with _engine(tmp_path) as e:
            _step(e)
            with pytest.raises(DirectoryInUse, match=rf"the checkpoint directory {ck} is in use by running process "
                                                     rf"{holder.pid}; another run saves its checkpoints there"):
                e.save_checkpoint(str(ck), tag="mine")
            assert sorted(os.listdir(ck)) == ["latest", "owner.pid", "theirs"], "nothing of ours was written"
            assert (ck / "latest").read_text().strip() == "theirs"
    finally:
        holder.kill()
        holder.wait()
    with _engine(tmp_path) as e:  # the kernel dropped the dead holder's lock
        _step(e)
        e.save_checkpoint(str(ck), tag="mine")
        assert probe(ck) is True
        # Engines of one process may save into one directory one after another: the owner is the process.
        with _engine(tmp_path) as again:
            _step(again)
            again.save_checkpoint(str(ck), tag="again")
        assert probe(ck) is True, "still held by the first engine"
    assert not (ck / "owner.pid").exists() and probe(ck) is None, "released and removed at close"
    assert (ck / "latest").read_text().strip() == "again"


def test_a_lock_is_not_the_childs_after_fork_and_a_release_removes_only_its_own_file(tmp_path):
    """A forked child inherits the fd, not the ownership: its release leaves the parent's lock and file, and
    its own claim is refused. And a release never unlinks an owner.pid that is not its own."""
    d = tmp_path / "d"
    lock = DirLock(d, what="test", fix="fix it", reentrant=True)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report, then leave without atexit
        ok = True
        try:
            DirLock(d, what="test", fix="fix it", reentrant=True)
            ok = False
        except DirectoryInUse:
            pass
        lock.release()
        ok = ok and (d / "owner.pid").exists()
        os.write(w, b"1" if ok else b"0")
        os._exit(0)
    os.waitpid(pid, 0)
    assert os.read(r, 1) == b"1", "the child could claim it, or its release removed the parent's lock file"
    assert probe(d) is True and lock.held
    lock.release()
    assert not (d / "owner.pid").exists()
    a = DirLock(d, what="test", fix="")
    os.unlink(d / "owner.pid")
    b = DirLock(d, what="test", fix="")  # a newer owner (a's file was removed under it)
    a.release()
    assert (d / "owner.pid").exists() and probe(d) is True, "a's release left b's file alone"
    b.release()


def test_a_lock_whose_file_the_owner_removed_is_taken_on_a_fresh_file(tmp_path):
    """The owner may remove the directory while it holds the lock (a swapper's close): a claimer that opened the
    old owner.pid locks a dead file, sees it, and claims a new one."""
    d = tmp_path / "d"
    first = DirLock(d, what="test", fix="")
    stale_fd = os.open(d / "owner.pid", os.O_RDONLY)
    first.release()
    second = DirLock(d, what="test", fix="")
    assert (d / "owner.pid").exists() and os.fstat(stale_fd).st_nlink == 0
    assert int((d / "owner.pid").read_text()) == os.getpid()
    os.close(stale_fd)
    second.release()


@pytest.mark.slow
def test_two_runs_cannot_save_into_one_directory(tmp_path, disk_dir):
    """Probe finding 1: two runs with different seeds and lrs saving to one --save-dir both exited 0, and every
    checkpoint was the second's. The second now stops before its first step with one line."""
    ck = tmp_path / "ck"
    first = subprocess.Popen(INFINITY + ["train", "--model", "gpt-tiny", "--steps", "400", "--save-dir", str(ck),
                                         "--save-every", "100", "--nvme-path", str(disk_dir / "a"),
                                         "--out", str(tmp_path / "a")],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 120
        while probe(ck) is not True and time.time() < deadline and first.poll() is None:
            time.sleep(0.1)
        assert probe(ck) is True, "the first run holds its --save-dir from the start"
        second = train("--model", "gpt-tiny", "--steps", "2", "--seed", "1", "--lr", "1e-3", "--save-dir", str(ck),
                       "--nvme-path", str(disk_dir / "b"), "--out", str(tmp_path / "b"))
        assert second.returncode == 2, second.stderr[-2000:]
        assert second.stderr.strip().splitlines() == [
            f"infinity train: the checkpoint directory {ck} is in use by running process {first.pid}; another run "
            "saves its checkpoints there; give each run its own save directory (--save-dir)"]
        assert not (tmp_path / "b" / "metrics.jsonl").exists(), "refused before training"
    finally:
        first.kill()
        first.communicate()


from tests.conftest import SAVED_RUN as COMMON  # the saved_run fixture's arguments


def _copy(saved_run, tmp_path):
    import shutil

    shutil.copytree(saved_run / "ck", tmp_path / "ck")
    return tmp_path / "ck"


@pytest.mark.slow
def test_resume_without_latest_takes_the_newest_complete_checkpoint(saved_run, tmp_path, disk_dir, capsys):
    """Probe finding 3: with `latest` gone (ENOSPC while writing it, a crash between rename and write) --resume
    retrained from step 0 over complete checkpoints."""
    ck = _copy(saved_run, tmp_path)
    (ck / "latest").unlink()
    (ck / "latest.tmp").write_text("global_st")  # what a write cut short leaves
    rc, out, err = train_here(capsys, *COMMON, "--steps", "4", "--save-dir", str(ck), "--resume", "--nvme-path",
                              str(disk_dir), "--out", str(tmp_path / "b"))
    assert rc == 0, err
    assert (f"--resume: {ck} has no 'latest' file (a save killed or out of space while writing it, or the file "
            "removed); resuming from the newest complete checkpoint, global_step2") in out
    assert "resumed from" in out and "at step 2" in out
    losses = [r["loss"] for r in metrics(saved_run / "a") + metrics(tmp_path / "b")]
    assert losses == [r["loss"] for r in metrics(saved_run / "full")]


def test_resume_over_only_broken_checkpoints_raises_and_never_restarts(tmp_path, disk_dir, capsys):
    """A checkpoint that is there but unusable raises, naming it; interrupted saves (never resumable) and
    directories that are not checkpoints start at step 0, saying so."""
    ck = tmp_path / "ck"
    (ck / ".global_step3.partial").mkdir(parents=True)
    (ck / ".ipynb_checkpoints").mkdir()
    (ck / "global_step2").mkdir()
    (ck / "global_step2" / "zarr.json").write_text("{")  # damaged
    rc, out, err = train_here(capsys, "--model", "gpt-tiny", "--steps", "2", "--save-dir", str(ck), "--resume",
                              "--nvme-path", str(disk_dir), "--out", str(tmp_path / "b"))
    assert rc == 2
    assert (f"--resume: {ck} has no usable checkpoint to resume from: global_step2 (checkpoint {ck}/global_step2 "
            "is corrupted") in err
    assert not (tmp_path / "b" / "metrics.jsonl").exists()
    (ck / "global_step2" / "zarr.json").unlink()
    (ck / "global_step2").rmdir()
    rc, out, err = train_here(capsys, "--model", "gpt-tiny", "--steps", "1", "--save-dir", str(ck), "--resume",
                              "--nvme-path", str(disk_dir), "--out", str(tmp_path / "c"))
    assert rc == 0, err
    assert (f"--resume: no checkpoint in {ck} yet (only interrupted saves, .global_step3.partial, which the next "
            "save removes); starting at step 0") in out


def test_resume_refuses_another_runs_checkpoint_unless_told(saved_run, tmp_path, disk_dir, capsys):
    """A checkpoint records its run (--lr, --warmup, the config's bytes): --resume with others is refused,
    naming them, and --resume-changed continues it."""
    ck = _copy(saved_run, tmp_path)
    other = [a if a != "1e-3" else "3e-4" for a in COMMON] + ["--nvme-path", str(disk_dir)]
    rc, out, err = train_here(capsys, *other, "--steps", "4", "--save-dir", str(ck), "--resume", "--out",
                              str(tmp_path / "b"))
    assert rc == 2
    assert (f"--resume: {ck}/global_step2 belongs to another run: it was saved with lr 0.001 (now 0.0003); resume "
            "with the same settings, or pass --resume-changed to continue it with these") in err
    rc, out, err = train_here(capsys, *other, "--steps", "3", "--save-dir", str(ck), "--resume", "--resume-changed",
                              "--out", str(tmp_path / "c"))
    assert rc == 0, err
    assert "at step 2" in out and metrics(tmp_path / "c")[0]["lr"] != metrics(saved_run / "a")[-1]["lr"]


def test_a_failed_write_of_latest_names_it_and_leaves_the_previous_one(tiny_fs):
    from infinity.checkpoint.layout import write_json, write_latest

    write_latest(str(tiny_fs), "global_step1")
    fd = os.open(tiny_fs / "filler", os.O_WRONLY | os.O_CREAT)  # fill the filesystem to the last block
    try:
        for size in (1 << 16, 4096, 512, 1):
            try:
                while True:
                    os.write(fd, b"\0" * size)
                    os.fsync(fd)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC
    finally:
        os.close(fd)
    with pytest.raises(OSError) as err:
        write_latest(str(tiny_fs), "global_step2" + "x" * 8000)  # more than the blocks left
    assert err.value.errno == errno.ENOSPC and err.value.filename == str(tiny_fs / "latest.tmp")
    assert f"writing {tiny_fs / 'latest.tmp'}" in str(err.value)
    assert (tiny_fs / "latest").read_text().strip() == "global_step1" and not (tiny_fs / "latest.tmp").exists()
    with pytest.raises(OSError) as err:
        write_json(str(tiny_fs / "zarr.json"), {"x": "y" * 100_000})
    assert err.value.filename == str(tiny_fs / "zarr.json")
