"""The recipes in examples/, run as a user runs them, on a tiny model made here (nothing is downloaded)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="transformers is not installed (make deps installs it)")
pytest.importorskip("datasets", reason="datasets is not installed (make deps installs it)")

from infinity.testing.tiny_hf import make_model_dir, write_corpus  # noqa: E402

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("ex")
    return make_model_dir(str(root / "model"), "llama"), write_corpus(str(root / "train.jsonl"))


def run_example(script: str, tiny, tmp_path, disk_dir, steps: int):
    """examples/<script> on the tiny model and corpus, writing tmp_path/out, as a user runs it."""
    model, data = tiny
    out = subprocess.run([sys.executable, str(EXAMPLES / script), "--model", model, "--data", data, "--out",
                          str(tmp_path / "out"), "--steps", str(steps), "--seq", "64", "--nvme-path", str(disk_dir)],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    return out


@pytest.mark.slow
def test_python_loop_example_writes_a_model_that_loads(tiny, tmp_path, disk_dir):
    import transformers

    out = run_example("finetune.py", tiny, tmp_path, disk_dir, steps=3)
    assert "step 3 loss" in out.stdout
    transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert not any(disk_dir.rglob("*.swp"))


@pytest.mark.slow
def test_cli_example_trains_and_generates(tiny, tmp_path, disk_dir):
    """With LoRA (the script's full fine-tuning path is the same command without --lora, which
    tests/finetune/test_train_hf.py runs)."""
    extra = ["--lora", "r=8,targets=q_proj,v_proj"]
    model, data = tiny
    out = subprocess.run(["bash", str(EXAMPLES / "finetune_cli.sh"), model, data, str(tmp_path / "run"), "--steps",
                          "3", "--seq", "64", "--nvme-path", str(disk_dir), *extra],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path,
                         env=dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]))
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"model written to {tmp_path / 'run' / 'final'}" in out.stdout
    assert out.stdout.strip().splitlines()[-1].strip(), "a generated line"


@pytest.mark.slow
def test_trainer_example_trains_checkpoints_and_saves_a_model_that_loads(tiny, tmp_path, disk_dir):
    import transformers

    out = run_example("trainer.py", tiny, tmp_path, disk_dir, steps=2)
    assert f"model written to {tmp_path / 'out'}" in out.stdout
    assert (tmp_path / "out" / "checkpoint-2" / "infinity").is_dir(), "the Trainer's checkpoint holds the engine's"
    transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    assert not any(disk_dir.rglob("*.swp"))


@pytest.mark.slow
def test_bench_finetune_smoke(tmp_path):
    import json

    out = subprocess.run([sys.executable, "-m", "infinity", "bench", "finetune", "--dir", str(tmp_path), "--corpus-mb",
                          "1", "--layers", "1", "--hidden", "64", "--steps", "2", "--seq", "64", "--json"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["stream"]["windows"] > 0 and r["stream"]["tokens"] == r["stream"]["windows"] // 8 * 8 * 64
    assert r["train"]["checkpoint_bytes"] > 0 and 0 <= r["train"]["data_share"] < 1
