"""DeepSpeed-Chat-style SFT (ds_sft.py) with only its imports changed, and the deepspeed.* surface it needs.

The script uses: a world-1 process group (torch.distributed.get_rank() without a launcher), get_accelerator,
zero.Init around from_pretrained, its own LoRA layers (compression.helper), a client DeepSpeedCPUAdam (or
FusedAdam) over weight-decay groups, an HF get_scheduler schedule, training_data with a collate_fn, the
hybrid_engine key, and its ZeRO-3 save, which gathers when hasattr(p, "ds_id"). The saved weights must be
the engine's, with no NaN, on none, cpu, nvme and 2 ranks.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is not installed (make deps installs it)")

from infinity.testing.parity import free_port  # noqa: E402
from infinity.testing.tiny_hf import make_model_dir  # noqa: E402

SCRIPT = os.path.join(os.path.dirname(__file__), "ds_sft.py")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(str(tmp_path_factory.mktemp("sft") / "llama"), "llama")


def run_sft(model_dir, tmp_path, *extra, nproc=1):
    args = ["--model_name_or_path", model_dir, "--output_dir", str(tmp_path / "out"), "--out",
            str(tmp_path / "record.json"), "--lora_dim", "32", "--only_optimize_lora", "--persistence_threshold", "0", *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("WORLD_SIZE", None)
    cmd = [sys.executable, SCRIPT, *args] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_addr", "127.0.0.1",
        "--master_port", str(free_port()), SCRIPT, *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads((tmp_path / "record.json").read_text()), proc


@pytest.mark.slow
@pytest.mark.parametrize("offload,nproc", [(None, 1), ("nvme", 1), ("cpu", 2)])  # cpu: on 2 ranks
def test_deepspeed_chat_style_sft_saves_the_engines_weights(offload, nproc, model_dir, tmp_path):
    extra = [] if offload is None else ["--offload", "--offload_device", offload]
    if offload == "nvme":
        extra += ["--nvme_path", str(tmp_path / "nvme")]
    rec, proc = run_sft(model_dir, tmp_path, *extra, nproc=nproc)
    assert rec["world"] == nproc
    assert "hybrid_engine (it is off" in proc.stderr, "the key is accepted and said to have no effect"
    assert all(torch.isfinite(torch.tensor(rec["losses"])))
    assert rec["global_steps"] == len(rec["losses"]) // 2
    # HF's cosine schedule with 1 warmup step, stepped once per optimizer step by the engine.
    total = rec["global_steps"]
    want = [1e-3 * (s / 1 if s < 1 else 0.5 * (1 + __import__("math").cos(__import__("math").pi * (s - 1) /
                                                                          (total - 1))))
            for s in range(1, total + 1)]
    got = rec["lrs"][1::2]
    assert got == pytest.approx(want, rel=1e-9, abs=1e-12)
    saved = torch.load(tmp_path / "out" / "pytorch_model.bin")
    truth = torch.load(tmp_path / "out" / "truth.bin")
    assert set(saved) == set(truth)
    assert rec["partitioned"] >= 10, "the weights were partitioned when it saved: its hasattr(p, 'ds_id') gathered"
    for k, v in saved.items():
        assert torch.isfinite(v).all(), f"{k} was saved with NaN: a placeholder"
        assert torch.equal(v, truth[k]), k


def test_a_world_one_process_group_exists_after_init_distributed(tmp_path):
    code = ("import torch, infinity.deepspeed as deepspeed\n"
            "deepspeed.init_distributed()\n"
            "import torch.distributed as dist\n"
            "dist.barrier(); t = torch.ones(2); dist.all_reduce(t)\n"
            "import infinity.deepspeed.comm as dscomm\n"
            "print(dist.get_rank(), dist.get_world_size(), dscomm.get_rank(), dscomm.get_local_rank(), t.tolist(),"
            " dist.get_backend())\n")
    env = dict(os.environ)
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
    assert out.stdout.split("\n")[0] == f"0 1 0 0 [1.0, 1.0] {backend}"
