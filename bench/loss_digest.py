"""Print the exact loss curves of the parity configurations, to show that a refactor changed no number.

Run it at two commits and compare the outputs; every loss is printed as a
hex float, so equal text means bit-identical losses:

    git stash; python bench/loss_digest.py > /tmp/before.txt; git stash pop
    python bench/loss_digest.py > /tmp/after.txt && cmp /tmp/before.txt /tmp/after.txt

The cases cover each optimizer tier, each compute dtype, the step during
backward and the step after it (clipping, fp16), gradient accumulation,
and two gloo ranks.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import tempfile

import torch

from infinity.testing.parity import engine_config, engine_losses, spawn_losses

STEPS = 4


def cases(nvme: str) -> dict[str, tuple[dict, dict]]:
    """name -> (engine config, engine_losses keyword arguments)."""
    out = {}
    for tier in ("none", "cpu", "nvme"):
        out[f"fp32 {tier}"] = (engine_config(tier, nvme), {})
    out["fp32 nvme clip"] = (engine_config("nvme", nvme, gradient_clipping=0.5), {})
    out["fp32 cpu gas2"] = (engine_config("cpu", nvme), {"gas": 2})
    out["fp32 nvme gas2"] = (engine_config("nvme", nvme), {"gas": 2})
    out["bf16 nvme"] = (engine_config("nvme", nvme, **{"bf16.enabled": True}), {})
    out["bf16 cpu"] = (engine_config("cpu", nvme, **{"bf16.enabled": True}), {})
    out["fp16 cpu"] = (engine_config("cpu", nvme, **{"fp16.enabled": True, "fp16.initial_scale_power": 8}), {})
    mixed = engine_config("nvme", nvme)
    mixed["zero_optimization"]["offload_param"] = {"device": "cpu"}
    out["params cpu, optimizer nvme"] = (mixed, {})
    stage2 = {"zero_optimization.stage": 2, "zero_optimization.offload_optimizer.device": "cpu"}
    out["stage 2, optimizer cpu"] = (engine_config("none", nvme, **stage2), {})
    # What the offload plan decides (engine/plan.py): partial offload, split shards, bf16 moments.
    out["fp32 cpu ratio 0.5"] = (engine_config("cpu", nvme, **{"zero_optimization.offload_optimizer.ratio": 0.5}), {})
    small = {"zero_optimization.sub_group_size": 8192}
    out["fp32 nvme split"] = (engine_config("nvme", nvme, **small), {})
    out["bf16 nvme split"] = (engine_config("nvme", nvme, **small, **{"bf16.enabled": True}), {})
    split_ram = copy.deepcopy(mixed)
    split_ram["zero_optimization"]["sub_group_size"] = 8192
    out["params cpu, optimizer nvme, split"] = (split_ram, {})
    out["bf16 nvme, bf16 moments"] = (engine_config("nvme", nvme, **{"bf16.enabled": True,
                                                                  "zero_optimization.offload_optimizer.moments_dtype":
                                                                  "bf16"}), {})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=STEPS)
    ap.add_argument("--no-ranks", action="store_true", help="skip the 2-rank case (it spawns processes)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="infinity-digest-") as tmp:
        for name, (cfg, kw) in cases(tmp).items():
            losses = engine_losses(copy.deepcopy(cfg), args.steps, **kw)
            print(f"{name}: " + " ".join(float(x).hex() for x in losses), flush=True)
        if not args.no_ranks:
            cfg = engine_config("nvme", tmp)
            losses = spawn_losses(2, cfg, args.steps, os.path.join(tmp, "ranks.json"))
            print("fp32 nvme 2 ranks: " + " ".join(float(x).hex() for x in losses), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
