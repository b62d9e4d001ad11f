"""`infinity tune`: a short real sweep, its output as config, and bad input."""

import json
import subprocess
import sys
import time

import pytest

from infinity.config import load_config
from infinity.io import available_backends
from infinity.tools.tune import parse_duration, write_aio_section

INFINITY = [sys.executable, "-m", "infinity", "tune"]
NATIVE = [b for b in available_backends() if b != "python"]
needs_native = pytest.mark.skipif(not NATIVE, reason="tune measures the native backends; none is built here")
# DeepSpeed's aio keys (runtime/swap_tensor/aio_config.py reads these and ignores others, such as our `backend`).
DEEPSPEED_AIO = {"block_size": int, "queue_depth": int, "intra_op_parallelism": int, "single_submit": bool,
                 "overlap_events": bool}


def tune(*args, timeout=120):
    return subprocess.run(INFINITY + list(args), capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
@needs_native
def test_sweep_prints_a_table_and_the_best_section_last(disk_dir, tmp_path):
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "aio": {"block_size": 4096},
                               "zero_optimization": {"stage": 3}}))
    data = disk_dir / "data"
    data.mkdir()
    t0 = time.perf_counter()
    out = tune("--nvme-path", str(data), "--budget", "4s", "--size", "16MiB", "--write", str(cfg))
    wall = time.perf_counter() - t0
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert lines[0].startswith("# infinity tune:") and lines[1].split()[:3] == ["stage", "backend", "block"]
    rows = [ln.split() for ln in lines if ln.startswith(("search", "confirm"))]
    assert len([r for r in rows if r[0] == "search"]) >= 3, "a 4 s budget covers several settings"
    assert {r[1] for r in rows} <= set(NATIVE)
    for r in rows:
        read, write, score = map(float, r[7:10])
        assert read > 0 and write > 0 and score == pytest.approx(2 / (1 / read + 1 / write), rel=2e-3)
    # The budget bounds the sweep (interpreter start, the file's layout and the last case are extra).
    assert wall < 4 + 25
    section = json.loads(lines[-1])
    # DeepSpeed's names and JSON booleans: the raw text says false/true, not "false" or 0.
    assert '"single_submit": ' + ("true" if section["single_submit"] else "false") in lines[-1]
    for key, kind in DEEPSPEED_AIO.items():
        assert type(section[key]) is kind, key
    assert set(section) == set(DEEPSPEED_AIO) | {"backend"}
    assert load_config({"aio": section}).aio.backend == section["backend"]
    # The best is one of the confirmed finalists, printed on a "confirm" row.
    best = [r for r in rows if r[0] == "confirm"][0]
    assert best[1] == section["backend"] and int(best[3]) == section["queue_depth"]
    written = json.loads(cfg.read_text())
    assert written["aio"] == section
    assert written["train_micro_batch_size_per_gpu"] == 2 and written["zero_optimization"] == {"stage": 3}
    assert list(data.iterdir()) == [], "the test file must be removed"


@pytest.mark.slow
@needs_native
def test_plot(disk_dir, tmp_path):
    pytest.importorskip("matplotlib", reason="--plot needs matplotlib")
    png = tmp_path / "tune.png"
    out = tune("--nvme-path", str(disk_dir), "--budget", "2s", "--size", "16MiB", "--backend", NATIVE[0],
               "--plot", str(png))
    assert out.returncode == 0, out.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("args,message", [
    (["--budget", "soon"], "--budget: cannot read 'soon' as a duration"),
    (["--budget", "0s"], "--budget must be > 0"),
    (["--size", "1MiB"], "--size must be a multiple of 4096 and at least 16MiB"),
    (["--backend", "floppy"], "--backend floppy: not usable here"),
])
@needs_native
def test_bad_arguments(disk_dir, args, message):
    out = tune("--nvme-path", str(disk_dir), *args)
    assert out.returncode == 2 and message in out.stderr, out.stderr
    assert list(disk_dir.iterdir()) == []


def test_missing_directory(tmp_path):
    out = tune("--nvme-path", str(tmp_path / "nope"))
    assert out.returncode == 2 and f"--nvme-path {tmp_path / 'nope'}: not a directory" in out.stderr


@needs_native
def test_a_broken_config_to_write_fails_before_the_sweep(disk_dir, tmp_path):
    cfg = tmp_path / "cfg.json"
    cfg.write_text('{"aio": {"block_size": 4096,}}')
    t0 = time.perf_counter()
    out = tune("--nvme-path", str(disk_dir), "--budget", "60s", "--write", str(cfg))
    assert out.returncode == 2 and "not valid JSON (line 1, column 29" in out.stderr, out.stderr
    assert time.perf_counter() - t0 < 30, "the error comes before a 60 s sweep"
    assert cfg.read_text() == '{"aio": {"block_size": 4096,}}', "nothing is modified"


def test_write_aio_section_replaces_only_aio(tmp_path):
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"bf16": {"enabled": True}, "aio": {"queue_depth": 4}}))
    section = {"block_size": 1 << 20, "queue_depth": 64, "intra_op_parallelism": 2, "single_submit": False,
               "overlap_events": True, "backend": "threads"}
    write_aio_section(str(cfg), section)
    assert json.loads(cfg.read_text()) == {"bf16": {"enabled": True}, "aio": section}
    assert [p.name for p in tmp_path.iterdir()] == ["c.json"], "no temp file is left"
    with pytest.raises(Exception, match="aio.queue_depth"):
        write_aio_section(str(cfg), dict(section, queue_depth=0))
    assert json.loads(cfg.read_text())["aio"] == section, "a rejected section changes nothing"


@pytest.mark.parametrize("text,seconds", [("60s", 60), ("90", 90), ("2m", 120), ("1.5min", 90)])
def test_parse_duration(text, seconds):
    assert parse_duration(text) == seconds
