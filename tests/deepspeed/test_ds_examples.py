"""DeepSpeedExamples-style scripts with only their import changed: a BERT masked LM that saves and resumes
(ds_bert_mlm.py, HelloDeepSpeed's shape) and a CIFAR CNN in fp16 (ds_cifar.py, cifar10_deepspeed.py's shape).
Each runs on none, cpu and nvme, one case on 2 gloo ranks."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers", reason="transformers is not installed (make deps installs it)")

from infinity.testing.parity import free_port  # noqa: E402

HERE = os.path.dirname(__file__)


def run(script, args, nproc=1, timeout=300):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        env.pop(k, None)
    path = os.path.join(HERE, script)
    cmd = [sys.executable, path, *args] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_addr", "127.0.0.1",
        "--master_port", str(free_port()), path, *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


def no_swap_files_under(path):
    left = [os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs] if os.path.exists(path) else []
    assert not left, f"the script exited and left swap files: {left}"


@pytest.mark.slow
@pytest.mark.parametrize("first,then,nproc", [(("cpu", 1), ("nvme", 3), 1), (("none", 2), ("cpu", 3), 2)])
def test_bert_mlm_resumes_where_it_saved_on_another_tier(first, then, nproc, tmp_path):
    """The uninterrupted run saves at steps 4 and 8 of 10. Pointing `latest` back at step 4 (as a user
    rewinding does) and running again with --load_checkpoint_dir, under another ZeRO stage and offload tier,
    resumes at step 5 from client_state: its losses for steps 5..10 and its final 16-bit weights are the
    uninterrupted run's, bit for bit (dropout on: the checkpoint carries the RNG). Between them the two cases
    run the script on none, cpu and nvme, and on 2 ranks."""
    exp, nvme = tmp_path / "exp", tmp_path / "nvme"

    def args(tier, stage):
        return ["--zero_stage", str(stage), "--offload", tier, "--nvme_path", str(nvme), "--num_iterations", "10",
                "--checkpoint_every", "4", "--dropout", "0.1"]

    run("ds_bert_mlm.py", [*args(*first), "--checkpoint_dir", str(exp), "--out", str(tmp_path / "a.json")], nproc)
    whole = json.loads((tmp_path / "a.json").read_text())
    assert whole["world"] == nproc and whole["start_step"] == 1
    assert sorted(p.name for p in exp.iterdir()) == ["final", "global_step4", "global_step8", "latest"]
    shutil.copy(exp / "final" / "pytorch_model.bin", tmp_path / "whole.bin")
    no_swap_files_under(nvme)
    (exp / "latest").write_text("global_step4")
    run("ds_bert_mlm.py", [*args(*then), "--load_checkpoint_dir", str(exp), "--out", str(tmp_path / "b.json")],
        nproc)
    resumed = json.loads((tmp_path / "b.json").read_text())
    assert resumed["start_step"] == 5, "client_state['checkpoint_step'] came back"
    assert resumed["losses"] == {k: v for k, v in whole["losses"].items() if int(k) >= 5}
    a, b = torch.load(tmp_path / "whole.bin"), torch.load(exp / "final" / "pytorch_model.bin")
    assert set(a) == set(b) and len(a) > 30
    for k in a:
        assert torch.isfinite(a[k].float()).all(), f"{k} was saved with NaN"
        assert torch.equal(a[k], b[k]), k
    # the engine's parameters() are the model's, full size (ds_numel), on every stage
    assert resumed["ds_params"] == whole["ds_params"] > 80_000
    no_swap_files_under(nvme)


@pytest.mark.slow
@pytest.mark.parametrize("offload,stage,nproc", [("none", 0, 1), ("cpu", 2, 1), ("nvme", 3, 2)])
def test_cifar_cnn_trains_in_fp16_from_train_batch_size_alone(offload, stage, nproc, tmp_path):
    nvme = tmp_path / "nvme"
    run("ds_cifar.py", ["--stage", str(stage), "--offload", offload, "--nvme_path", str(nvme), "--out",
                        str(tmp_path / "r.json")], nproc)
    rec = json.loads((tmp_path / "r.json").read_text())
    assert rec["fp16"] and not rec["bf16"]
    assert (rec["micro"], rec["gas"], rec["world"]) == (16 // nproc, 1, nproc), \
        "train_batch_size alone: the micro batch is it over the world size"
    assert rec["steps"] == 2 * 384 // 16 and rec["skipped"] == 0
    # WarmupLR's default log warmup over 1000 steps, from DeepSpeed 0.19.8's iteration count (see
    # test_losses_vs_reference.warmup_decay): 0, 0, then 1e-3 * log(k) / log(1000) at step k + 1.
    want = [0.0, 0.0] + [1e-3 * math.log(k) / math.log(1000) for k in range(2, rec["steps"])]
    assert rec["lrs"] == pytest.approx(want, rel=1e-9, abs=1e-15)
    assert all(math.isfinite(v) for v in rec["losses"])
    first, last = sum(rec["losses"][:8]) / 8, sum(rec["losses"][-8:]) / 8
    assert last < first - 0.1, (first, last)
    assert rec["acc_after"] > max(0.3, rec["acc_before"] + 0.2), (rec["acc_before"], rec["acc_after"])
    no_swap_files_under(nvme)
