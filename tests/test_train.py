"""`infinity train` (the main job) and a tiny-size smoke run of `infinity bench train`."""

import json
import math
import subprocess
import sys

import pytest

INFINITY = [sys.executable, "-m", "infinity"]
FIELDS = {"step", "loss", "step_s", "io_read_bytes", "io_write_bytes", "exposed_io_s", "prefetch_hit_rate",
          "param_fetches", "param_critical_reads", "param_stall_s",
          "peak_rss_bytes", "comm_s", "tokens_per_s"}


def train(*args, timeout=300, cwd=None):
    return subprocess.run(INFINITY + ["train", *args], capture_output=True, text=True, timeout=timeout, cwd=cwd)


def read_metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_train_writes_metrics_and_a_plot_and_the_loss_falls(tmp_path, disk_dir):
    out = train("--model", "gpt-tiny", "--steps", "12", "--lr", "3e-3", "--out", str(tmp_path / "run"),
                "--nvme-path", str(disk_dir))
    assert out.returncode == 0, out.stderr
    rows = read_metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == list(range(1, 13))
    assert all(FIELDS <= set(r) for r in rows)
    assert all(math.isfinite(r["loss"]) for r in rows)
    assert sum(r["loss"] for r in rows[-3:]) / 3 < rows[0]["loss"] - 0.3
    assert all(r["io_read_bytes"] > 0 and r["io_write_bytes"] > 0 for r in rows), "parameters and optimizer on NVMe"
    assert min(r["prefetch_hit_rate"] for r in rows[1:]) >= 0.95
    assert (tmp_path / "run" / "metrics.png").stat().st_size > 10_000
    assert not (disk_dir / "infinity-swap").exists(), "swap files are removed at the end"


def test_train_places_swap_files_across_two_disks_given_twice(tmp_path, disk_dir):
    """--nvme-path once per disk: the run swaps through both directories (their bytes are in run.json) and
    removes its files from both at the end."""
    a, b = disk_dir / "a", disk_dir / "b"
    out = train("--model", "gpt-tiny", "--steps", "2", "--out", str(tmp_path / "run"),
                "--nvme-path", str(a), "--nvme-path", str(b))
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"swap files in {a}, {b}" in out.stdout
    run = json.loads((tmp_path / "run" / "run.json").read_text())
    assert run["swap_bytes_by_path"][str(a)] > 0 and run["swap_bytes_by_path"][str(b)] > 0
    assert not (a / "infinity-swap").exists() and not (b / "infinity-swap").exists()


@pytest.mark.slow
def test_train_on_two_ranks_through_torchrun(tmp_path, disk_dir):
    out = train("--model", "gpt-tiny", "--steps", "3", "--nproc", "2", "--out", str(tmp_path / "run"),
                "--nvme-path", str(disk_dir))
    assert out.returncode == 0, out.stderr[-3000:]
    assert "2 rank(s)" in out.stdout
    assert len(read_metrics(tmp_path / "run")) == 3


def test_train_saves_and_resumes_bit_exactly(saved_run, tmp_path, disk_dir, capsys):
    """Killed after its step-2 checkpoint (simulated: --steps 2), a run resumed with --resume continues the
    uninterrupted 4-step curve exactly, lr warmup included (the resumes run in this process)."""
    import shutil

    from infinity.tools.cli import main
    from tests.conftest import SAVED_RUN

    assert (saved_run / "ck" / "latest").read_text().strip() == "global_step2"
    assert (saved_run / "ck" / "global_step1").is_dir()
    shutil.copytree(saved_run / "ck", tmp_path / "ck")
    common = [*SAVED_RUN, "--nvme-path", str(disk_dir)]
    capsys.readouterr()
    assert main(["train", *common, "--steps", "4", "--save-dir", str(tmp_path / "ck"), "--resume",
                 "--out", str(tmp_path / "b")]) == 0
    out = capsys.readouterr().out
    assert "resumed from" in out and "at step 2" in out
    losses = [r["loss"] for r in read_metrics(saved_run / "a") + read_metrics(tmp_path / "b")]
    assert losses == [r["loss"] for r in read_metrics(saved_run / "full")]
    assert main(["train", *common, "--steps", "6", "--seq", "16", "--save-dir", str(tmp_path / "ck"), "--resume",
                 "--out", str(tmp_path / "c")]) == 2
    err = capsys.readouterr().err
    assert "was saved by a run with --model gpt-tiny and --seq" in err and "--seq 16" in err


@pytest.mark.parametrize("args,message", [
    (["--model", "gpt-huge"], "--model 'gpt-huge': not a preset (gpt-tiny, gpt-small, gpt-25m, gpt-57m, gpt-125m, "
                              "gpt-100m, gpt-350m, gpt-1b, gpt-2b, gpt-4b, gpt-6b), a Hugging Face model directory, nor a "
                              "config.json file"),
    (["--lr", "-1e-3"], "--lr must be a finite number > 0, got -0.001"),
    (["--merge-lora"], "--merge-lora merges the adapter that --lora trains, and there is no --lora"),
    (["--data", "x.txt"], "--data, --eval-data, --tokenizer and --lora need a Hugging Face model directory"),
    (["--eval-fraction", "0.1"], "--eval-fraction holds out part of --data, and there is no --data"),
    (["--eval-fraction", "1.5", "--data", "x"], "--eval-fraction must be in (0, 1), got 1.5"),
    (["--micro-batch", "0"], "--micro-batch must be >= 1, got 0"),
    (["--steps", "0"], "--steps must be >= 1, got 0"),
    (["--lr", "-1"], "--lr must be a finite number > 0, got -1.0"),
    (["--memory-budget", "1MiB"], "--memory-budget 1.00 MiB: no placement of gpt-small"),
    (["--memory-budget", "plenty"], "--memory-budget: cannot read 'plenty' as a size"),
    (["--warmup", "-1"], "--warmup must be >= 0, got -1"),
    (["--seq", "0"], "--seq must be >= 1, got 0"),
    (["--config", "/nonexistent.json"], "/nonexistent.json"),
    (["--resume"], "--resume and --save-every need --save-dir"),
    (["--save-every", "-1", "--save-dir", "x"], "--save-every must be >= 0, got -1"),
])
def test_train_bad_input_is_one_clear_line(tmp_path, args, message, monkeypatch, capsys):
    """In this process (an exception that escaped the CLI's one-line handling would fail the test here)."""
    from infinity.tools.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(["train", *args, "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


@pytest.mark.slow
def test_bench_train_smoke_json():
    out = subprocess.run(INFINITY + ["bench", "train", "--layers", "1", "--dim", "64", "--vocab", "256", "--seq",
                                     "32", "--heads", "4", "--steps", "3", "--warmup", "1", "--rounds", "1",
                                     "--mmap-threshold", "32MiB", "--json"], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["mmap_threshold"] == "32MiB"
    assert result["ratio"] > 0 and result["nvme"]["hit_rate"] >= 0.95
    # 32 with fp32; the tied embedding is read three times (embedding, head, head's backward): +1 here
    assert 25 <= result["nvme"]["bytes_per_param"] <= 34


def test_without_matplotlib_train_says_there_is_no_plot(tmp_path, monkeypatch, capsys):
    from infinity.tools.cli import main

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    assert main(["train", "--model", "gpt-tiny", "--steps", "2", "--seq", "32", "--out", str(tmp_path)]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert "no plot (matplotlib is not installed: pip install matplotlib)" in last and "metrics.png" not in last
    assert not (tmp_path / "metrics.png").exists() and (tmp_path / "metrics.jsonl").exists()


def test_out_naming_a_file_says_so(tmp_path):
    (tmp_path / "f").write_text("")
    out = train("--out", str(tmp_path / "f"))
    assert out.returncode == 2
    assert f"--out {tmp_path / 'f'} is a file; --out names the run directory" in out.stderr


@pytest.mark.slow
def test_seq_beyond_the_model_says_what_it_did(tmp_path, disk_dir):
    out = train("--model", "gpt-tiny", "--steps", "1", "--seq", "100000", "--out", str(tmp_path / "run"),
                "--nvme-path", str(disk_dir))
    assert out.returncode == 0, out.stderr
    assert "--seq 100000 is beyond the model's 64 positions; using --seq 64" in out.stdout
    assert json.loads((tmp_path / "run" / "run.json").read_text())["seq"] == 64


def test_batch_sizes_follow_the_configs_keys_as_deepspeed_resolves_them():
    from argparse import Namespace

    from infinity.config import load_config
    from infinity.tools.train import _batch_sizes

    none = Namespace(micro_batch=None, grad_accum=None, config="user.json")
    assert _batch_sizes(none, load_config({"train_batch_size": 8, "gradient_accumulation_steps": 2})) == (4, 2, False)
    assert _batch_sizes(none, load_config({"train_batch_size": 6})) == (6, 1, False)
    # No batch key anywhere, or only the shipped default config's: a default that --memory-budget may split.
    assert _batch_sizes(none, load_config({})) == (4, 1, True)
    assert _batch_sizes(Namespace(micro_batch=None, grad_accum=None, config=None),
                        load_config({"train_micro_batch_size_per_gpu": 4})) == (4, 1, True)
    assert _batch_sizes(Namespace(micro_batch=2, grad_accum=None, config=None),
                        load_config({"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 3})) == (
                            2, 3, False)


def test_the_default_swap_dirs_of_killed_runs_are_reclaimed(tmp_path):
    import os
    import time

    from infinity.tools.train import _reclaim_dead_runs

    from infinity.dirlock import DirLock

    mine = tmp_path / "infinity-train.live" / "infinity-swap" / "param-rank0"
    gone = tmp_path / "infinity-train.dead" / "infinity-swap" / "param-rank0"
    for d in (mine, gone):
        d.mkdir(parents=True)
        (d / "x.swp").write_bytes(b"x" * 4096)
    live = DirLock(mine, what="test", fix="")  # a live run holds its lock; a killed one's owner.pid is unlocked
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (gone / "owner.pid").write_text(str(dead.pid))
    # Unlocked but naming a live process: the moment between a claimer's open and its flock, or a run of a
    # version that wrote no lock. Kept.
    claiming = tmp_path / "infinity-train.claiming" / "infinity-swap" / "rank0"
    claiming.mkdir(parents=True)
    (claiming / "owner.pid").write_text(str(os.getpid()))
    empty_old = tmp_path / "infinity-train.early"
    empty_old.mkdir()
    os.utime(empty_old, (time.time() - 7200, time.time() - 7200))
    (tmp_path / "infinity-train.fresh").mkdir()
    other = tmp_path / "someone-else"
    other.mkdir()
    _reclaim_dead_runs(str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["infinity-train.claiming", "infinity-train.fresh",
                                                          "infinity-train.live", "someone-else"]
    assert (mine / "x.swp").exists(), "a live run's swap files are untouched"
    live.release()


@pytest.mark.slow
def test_a_configs_nvme_path_that_the_run_does_not_use_is_named(tmp_path):
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({"zero_optimization": {"stage": 3, "offload_param": {
        "device": "nvme", "nvme_path": "/local_nvme"}, "offload_optimizer": {"device": "nvme",
                                                                             "nvme_path": "/local_nvme"}}}))
    out = train("--model", "gpt-tiny", "--steps", "1", "--seq", "32", "--config", str(cfg), "--out",
                str(tmp_path / "run"))
    assert out.returncode == 0, out.stderr[-2000:]
    assert "(removed at the end), not the config's nvme_path /local_nvme; pass --nvme-path DIR to choose" in out.stdout


@pytest.mark.slow
def test_ranks_die_with_a_launcher_killed_with_sigkill(tmp_path, disk_dir):
    """Probe finding 8: a kill -9 of the --nproc launcher left its ranks training and saving. Now they stop in
    order ([Note: ranks die with their launcher]): swap files removed, and the --save-dir free for the next run."""
    import os
    import signal
    import time

    from infinity.dirlock import probe

    out, ck, nvme = tmp_path / "run", tmp_path / "ck", disk_dir / "swap"
    launcher = subprocess.Popen(INFINITY + ["train", "--model", "gpt-tiny", "--steps", "100000", "--nproc", "2",
                                            "--save-dir", str(ck), "--save-every", "100000", "--nvme-path", str(nvme),
                                            "--out", str(out)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    metrics = out / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and not (metrics.exists() and metrics.read_text()):
        time.sleep(0.2)
    assert probe(ck) is True and any(nvme.rglob("*.swp")), "training, holding its --save-dir"

    def ranks():
        found = []
        for pid in os.listdir("/proc"):
            try:
                cmd = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
            except OSError:
                continue
            if pid.isdigit() and int(pid) != launcher.pid and str(out).encode() in cmd:
                found.append(int(pid))
        return found

    assert len(ranks()) == 2
    launcher.send_signal(signal.SIGKILL)
    launcher.wait(30)
    try:
        deadline = time.time() + 60
        while time.time() < deadline and ranks():
            time.sleep(0.2)
        assert ranks() == [], "the ranks outlived their launcher"
    finally:
        for pid in ranks():
            os.kill(pid, signal.SIGKILL)
        launcher.communicate(timeout=30)
    assert not any(nvme.rglob("*.swp")), "they stopped in order: swap files removed"
    assert probe(ck) is None, "and let go of the --save-dir"
