"""The `infinity` command: info and a tiny-size smoke run of `bench io`."""

import json
import shutil
import subprocess
import sys

import pytest

from infinity.io import available_backends

INFINITY = [sys.executable, "-m", "infinity"]


def run(*args):
    out = subprocess.run(INFINITY + list(args), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return out.stdout


@pytest.mark.slow
def test_info(tmp_path):
    text = run("info", "--dir", str(tmp_path))
    assert text.startswith("infinity 0.1.0")
    for label in ("I/O backends:", "CPU SIMD level:", "page size:", "O_DIRECT align:", "free space:"):
        assert label in text
    data = json.loads(run("info", "--dir", str(tmp_path), "--json"))
    assert data["backends"]["python"] == "ok"
    assert data["free_bytes"] > 0 and data["page_size"] >= 4096


def test_info_bad_dir(tmp_path):
    out = subprocess.run(INFINITY + ["info", "--dir", str(tmp_path / "nope")], capture_output=True, text=True)
    assert out.returncode != 0 and f"info: --dir {tmp_path / 'nope'} is not a directory" in out.stderr


@pytest.mark.slow
@pytest.mark.parametrize("ring", [False, True], ids=["whole-file", "ring"])
def test_bench_io_smoke_json(tmp_path, ring):
    backend = available_backends()[0]
    args = ["bench", "io", "--dir", str(tmp_path), "--size", "4MiB", "--block-size", "256KiB",
            "--queue-depth", "4", "--repeats", "2", "--backend", backend, "--json"] + (["--ring"] if ring else [])
    if shutil.which("fio") and backend != "python":
        args.append("--vs-fio")
    rows = [json.loads(line) for line in run(*args).splitlines()]
    assert [r["op"] for r in rows] == ["write", "read"]
    for r in rows:
        assert r["backend"] == backend and r["block_size"] == 256 << 10 and r["queue_depth"] == 4
        assert r["threads"] == 1 and r["gbps"] > 0 and r["ring"] is ring
        if "--vs-fio" in args:
            assert r["fio_gbps"] > 0 and r["ratio"] == pytest.approx(r["gbps"] / r["fio_gbps"])
    assert list(tmp_path.iterdir()) == [], "the benchmark file must be removed"


@pytest.mark.slow
def test_bench_io_sweep_table_and_plot(tmp_path):
    pytest.importorskip("matplotlib", reason="--plot needs matplotlib")
    png = tmp_path / "heat.png"
    data = tmp_path / "d"
    data.mkdir()
    text = run("bench", "io", "--dir", str(data), "--size", "1MiB", "--repeats", "1", "--sweep",
               "--backend", "threads" if "threads" in available_backends() else "python", "--plot", str(png))
    lines = text.splitlines()
    assert lines[0].startswith("# bench io:") and lines[1].split()[:5] == ["op", "backend", "block", "qd", "thr"]
    assert len(lines) == 2 + 2 * 3 * 4 * 2  # ops x block sizes x queue depths x threads
    assert png.stat().st_size > 1000


@pytest.mark.slow
def test_bench_io_bad_size(tmp_path):
    out = subprocess.run(INFINITY + ["bench", "io", "--dir", str(tmp_path), "--size", "12 parsecs"],
                         capture_output=True, text=True)
    assert out.returncode != 0
    assert "--size: cannot read '12 parsecs' as a size; write e.g. 4096, 64KiB, 1MiB or 1GiB" in out.stderr


@pytest.mark.slow
def test_bench_adam_smoke_json():
    from infinity._native_loader import native

    if native is None:
        pytest.skip("bench adam needs the native extension")
    rows = [json.loads(line) for line in run("bench", "adam", "--sizes", "100K", "--repeats", "2",
                                             "--json").splitlines()]
    impls = {(r["impl"], r["lowp"]) for r in rows}
    level = native.cpu_simd_level()
    for need in [(f"infinity/{level}", None), (f"infinity/{level}", "bf16"), ("torch/fused", None),
                 ("torch/foreach", "bf16"), ("torch/fused/amp", "bf16"), (f"infinity/{level}/amp", "bf16"),
                 ("roofline", None), ("roofline", "bf16"), (f"infinity/{level}/bf16-moments", None),
                 (f"infinity/{level}/bf16-moments-sr", "bf16"), (f"infinity/{level}/int8-moments", None),
                 (f"infinity/{level}/int8-moments-sr", "bf16")]:
        assert need in impls, need
    for r in rows:
        assert r["numel"] == 100_000 and r["params_per_s"] > 0
        if "-moments" in r["impl"]:  # bf16/int8: no roofline applies (it moves fp32 moments); bit-checked instead
            assert r["roofline_frac"] is None and r["bitexact_vs_scalar"] is True
        elif r["impl"].startswith("infinity/"):
            assert 0 < r["roofline_frac"]
        if r["impl"] == "torch/fused":
            assert r["vs_torch_fused"] == 1.0


def test_bench_adam_bad_sizes():
    out = subprocess.run(INFINITY + ["bench", "adam", "--sizes", "ten"], capture_output=True, text=True)
    assert out.returncode == 2
    assert "--sizes: cannot read 'TEN' as a parameter count; write e.g. 10M or 1000000" in out.stderr


@pytest.mark.slow
def test_bench_swap_smoke_json(tmp_path):
    row = json.loads(run("bench", "swap", "--dir", str(tmp_path), "--numel", "200K", "--sub-group", "50K",
                         "--steps", "2", "--json").strip().splitlines()[-1])
    assert row["numel"] == 200_000 and row["io_bytes"] == 2 * 12 * 200_000
    assert row["step_s"] > 0 and row["inram_step_s"] > 0 and row["pool_bytes"] >= 3 * 12 * 50_000
    assert row["peak_rss_bytes"] > row["pool_bytes"]
    if shutil.which("fio"):
        assert row["io_bound_s"] > 0 and row["ratio"] == pytest.approx(row["step_s"] / row["io_bound_s"])
    assert not (tmp_path / "infinity-swap").exists(), "a clean close removes the swap files"


def test_bench_adam_compares_within_rounds():
    # A round where the machine was slow for both sides must not count against either: the ratio is taken
    # per round, then the median; the ratio of the two medians would be 4/3 here.
    from infinity.bench.adam import paired_ratio

    assert paired_ratio([2.0, 4.0, 6.0], [1.0, 4.0, 3.0]) == 2.0
    with pytest.raises(ValueError):
        paired_ratio([1.0, 2.0], [1.0])
