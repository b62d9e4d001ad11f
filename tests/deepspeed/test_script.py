"""A DeepSpeed-style training script (ds_train.py) runs with only its import changed, on every tier and on
2 gloo ranks, with a config written the way DeepSpeed's docs write them."""

import json
import os
import subprocess
import sys

import pytest
import torch

from infinity.testing.parity import free_port

SCRIPT = os.path.join(os.path.dirname(__file__), "ds_train.py")


def ds_config(tier, nvme):
    """DeepSpeed's ZeRO-3 offload config shape (docs' config-json page), with a WarmupDecayLR schedule."""
    offload = {"device": tier}
    if tier == "nvme":
        offload.update(nvme_path=nvme, pin_memory=True, buffer_count=4, buffer_size=1e5)
    cfg = {
        "train_batch_size": 16,
        "train_micro_batch_size_per_gpu": 4,
        "steps_per_print": 10,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8,
                                                  "weight_decay": 0.01}},
        "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 1e-3,
                                                          "warmup_num_steps": 3, "total_num_steps": 8,
                                                          "warmup_type": "linear"}},
        "zero_optimization": {"stage": 3, "offload_param": dict(offload),
                              "offload_optimizer": {k: v for k, v in offload.items() if k != "buffer_size"},
                              "overlap_comm": True, "contiguous_gradients": True, "sub_group_size": 1e9,
                              "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                              "stage3_param_persistence_threshold": "auto",
                              "stage3_gather_16bit_weights_on_model_save": True},
    }
    if tier == "none":
        cfg["zero_optimization"].pop("offload_param")
        cfg["zero_optimization"].pop("offload_optimizer")
    return cfg


def run_script(tmp_path, tier, nproc=1):
    cfg_path = tmp_path / "ds_config.json"
    cfg_path.write_text(json.dumps(ds_config(tier, str(tmp_path / "nvme"))))
    out = tmp_path / "record.json"
    args = ["--deepspeed", "--deepspeed_config", str(cfg_path), "--save_dir", str(tmp_path / "ckpt"),
            "--out", str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if nproc == 1:
        cmd = [sys.executable, SCRIPT, *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_addr",
               "127.0.0.1", "--master_port", str(free_port()), SCRIPT, *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads(out.read_text()), tmp_path / "ckpt"


def warmup_decay(t, lo=0.0, hi=1e-3, w=3, total=8):
    """DeepSpeed's WarmupDecayLR, linear warmup, at counter t."""
    if t < w:
        return lo + (hi - lo) * t / w
    return lo + (hi - lo) * max(0.0, (total - t) / max(1, total - w))


def check(record, ckpt, world):
    assert record["micro"] == 4 and record["train_batch_size"] == 16
    assert record["gas"] == 16 // (4 * world), "accumulation derived from the batch sizes, as DeepSpeed derives it"
    assert record["eval_loaded"] == record["eval_saved"], "the loaded model must give exactly the saved model's loss"
    assert record["eval_end"] != record["eval_saved"]
    assert record["client_state"] == repr({"step": 4, "seen": (1, 2)})
    assert record["global_steps_loaded"] == 4 and record["global_samples_loaded"] == 4 * 16
    for k, lrs in enumerate(record["lrs"], start=1):
        want = warmup_decay(k - 1)
        assert all(abs(lr - want) <= 1e-9 * max(want, 1e-12) for lr in lrs), (k, lrs, want)
    assert record["losses"][-1] < record["losses"][0]
    assert all(n is not None and n > 0 for n in record["grad_norms"])
    assert record["saved_16bit"] is True
    state = torch.load(ckpt / "model16.bin", weights_only=True)
    assert set(state) >= {"embed.weight", "head.weight", "blocks.0.fc1.weight"}
    assert state["head.weight"].dtype == torch.bfloat16 and state["head.weight"].shape == (64, 32)
    assert abs(float(state["head.weight"].float().norm()) - record["head_norm"]) <= 1e-6 * record["head_norm"]


@pytest.mark.slow
@pytest.mark.parametrize("tier", ["none", "cpu", "nvme"])
def test_deepspeed_style_script_runs_with_only_the_import_changed(tier, tmp_path):
    record, ckpt = run_script(tmp_path, tier)
    check(record, ckpt, world=1)


@pytest.mark.slow
def test_deepspeed_style_script_on_two_gloo_ranks(tmp_path):
    record, ckpt = run_script(tmp_path, "nvme", nproc=2)
    check(record, ckpt, world=2)
