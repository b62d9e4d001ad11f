import os
import shutil
import subprocess
import tempfile
import time

import pytest

from infinity._native_loader import native
from infinity.io import available_backends

# `datasets`' cache (Arrow conversions, prepared training windows) goes to a temp dir of this session, inherited
# by every `infinity train` the tests start, and removed at the end: not the user's ~/.cache.
_HF_CACHE = None
if "HF_DATASETS_CACHE" not in os.environ:
    _HF_CACHE = os.environ["HF_DATASETS_CACHE"] = tempfile.mkdtemp(prefix="infinity-tests-datasets.")


def pytest_sessionfinish(session, exitstatus):
    if _HF_CACHE is not None:
        shutil.rmtree(_HF_CACHE, ignore_errors=True)


BACKENDS = available_backends()
NATIVE_BACKENDS = [b for b in BACKENDS if b != "python"]


@pytest.fixture(params=BACKENDS)
def backend(request):
    return request.param


@pytest.fixture(params=NATIVE_BACKENDS or [pytest.param("none", marks=pytest.mark.skip(
    reason="native extension not built: no native backend to test"))])
def native_backend(request):
    return request.param


@pytest.fixture
def needs_native():
    if native is None:
        pytest.skip("native extension not built")
    return native


@pytest.fixture(autouse=True)
def _no_leftover_fault():
    yield
    if native is not None:
        native.clear_fault()


@pytest.fixture
def disk_dir(tmp_path):
    """A directory on a filesystem with O_DIRECT (tmp_path unless it is tmpfs without it)."""
    if native is not None and native.direct_alignment(str(tmp_path)) == 0:
        pytest.skip(f"{tmp_path} does not support O_DIRECT; set TMPDIR to a disk-backed directory")
    return tmp_path


def pytest_report_header(config):
    return f"infinity backends: {BACKENDS}; native: {'yes' if native else 'no'}; pid {os.getpid()}"


@pytest.fixture
def tiny_fs(tmp_path):
    """A 4 MiB ext4 filesystem on a loop device, so that ENOSPC is real."""
    if os.geteuid() != 0:
        pytest.skip("ENOSPC test needs root to loop-mount a small ext4 image")
    if not shutil.which("mkfs.ext4"):
        pytest.skip("ENOSPC test needs mkfs.ext4 (e2fsprogs)")
    img, mnt = tmp_path / "fs.img", tmp_path / "mnt"
    mnt.mkdir()
    with open(img, "wb") as f:
        f.truncate(4 << 20)
    subprocess.run(["mkfs.ext4", "-q", "-F", str(img)], check=True, capture_output=True)
    mounted = subprocess.run(["mount", "-o", "loop", str(img), str(mnt)], capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot loop-mount an ext4 image here: {mounted.stderr.strip()}")
    try:
        yield mnt
    finally:
        # io_uring tears rings down asynchronously and may hold file
        # references for a moment after close, so umount can say EBUSY.
        for _ in range(50):
            if subprocess.run(["umount", str(mnt)], capture_output=True).returncode == 0:
                break
            time.sleep(0.1)
        else:
            subprocess.run(["umount", "-l", str(mnt)], check=False)


SAVED_RUN = ["--model", "gpt-tiny", "--warmup", "3", "--lr", "1e-3"]


@pytest.fixture(scope="session")
def saved_run(tmp_path_factory):
    """`infinity train` with SAVED_RUN: 4 uninterrupted steps (DIR/full), and 2 steps saving a checkpoint at
    each (DIR/a, checkpoints in DIR/ck), for the resume tests to share. Read it; copy DIR/ck to change it."""
    import sys

    base = tmp_path_factory.mktemp("saved-run")
    run = [sys.executable, "-m", "infinity", "train", *SAVED_RUN, "--nvme-path", str(base)]
    full = subprocess.run(run + ["--steps", "4", "--out", str(base / "full")], capture_output=True, text=True,
                          timeout=300)
    assert full.returncode == 0, full.stderr
    first = subprocess.run(run + ["--steps", "2", "--save-dir", str(base / "ck"), "--save-every", "1", "--out",
                                  str(base / "a")], capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr
    return base
