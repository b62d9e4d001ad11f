"""A save killed with SIGKILL, at each commit point and at random moments, leaves the previous checkpoint
loadable and bit-exact (see [Note: atomic checkpoint])."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest

from infinity.checkpoint.export import info
from infinity.checkpoint.save import CRASH_POINTS
from infinity.testing.ckpt import train
from infinity.testing.parity import engine_config

STEPS = 4
_FULL: dict = {}


def _cfg(root) -> dict:
    os.makedirs(root / "swap", exist_ok=True)
    return engine_config("nvme", str(root / "swap"))


def _child(cfg, ck, steps, point=None, **popen):
    path = ck.parent / "cfg.json"
    path.write_text(json.dumps(cfg))
    args = [sys.executable, "-m", "infinity.testing.ckpt", "crash", str(path), str(ck), str(steps)]
    return subprocess.Popen(args + ([point] if point else []), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, **popen)


def _check_resume(cfg, ck, root) -> int:
    """latest must name a complete checkpoint whose every chunk verifies, and resuming from it must continue
    the uninterrupted curve exactly. Returns the step it resumed from."""
    if "full" not in _FULL:
        _FULL["full"] = train(cfg, STEPS)
    full = _FULL["full"]
    summary = info(ck, verify=True)
    start = summary["client_state"]["next_step"]
    assert summary["global_steps"] == start
    rest = train(cfg, STEPS - start, start=start, load=str(ck))
    assert rest["losses"] == full["losses"][start:]
    return start


@pytest.mark.slow
@pytest.mark.parametrize("point", CRASH_POINTS)
def test_sigkill_at_each_commit_point(disk_dir, point):
    cfg = _cfg(disk_dir)
    ck = disk_dir / "ck"
    proc = _child(cfg, ck, 3, point)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == -signal.SIGKILL, err
    # s1 and s2 were complete; s3 was being saved.
    assert (ck / "latest").read_text().strip() == "s2"
    assert _check_resume(cfg, ck, disk_dir) == 2
    assert (ck / "s3").exists() == (point == "renamed")  # renamed: complete, but latest not yet moved
    if point == "renamed":
        assert info(ck, "s3", verify=True)["global_steps"] == 3
    # The next save of that tag clears the leftover and completes.
    train(cfg, 1, start=2, load=str(ck), save=str(ck), save_tag="s3")
    assert (ck / "latest").read_text().strip() == "s3"
    assert info(ck, verify=True)["global_steps"] == 3
    assert not [p for p in os.listdir(ck) if p.startswith(".")]


@pytest.mark.slow
def test_sigkill_at_random_moments(disk_dir):
    """Kill a run that saves after every step at random times; whatever latest names must resume exactly."""
    cfg = _cfg(disk_dir)
    rng = random.Random(20261203)
    starts = []
    for i in range(2):
        ck = disk_dir / f"ck{i}"
        proc = _child(cfg, ck, STEPS)
        # Wait for the first checkpoint, then kill within the next stretch of steps and saves.
        deadline = time.monotonic() + 60
        while not (ck / "latest").exists():
            assert proc.poll() is None, proc.communicate()[1]
            assert time.monotonic() < deadline, "the child never saved"
            time.sleep(0.005)
        time.sleep(rng.uniform(0.0, 0.4))
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=60)
        starts.append(_check_resume(cfg, ck, disk_dir))
    assert all(1 <= s <= STEPS for s in starts)
