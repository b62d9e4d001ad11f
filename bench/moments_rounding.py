"""How bf16 Adam moments change training: `infinity train` three ways, one after another, on one model.

    python bench/moments_rounding.py --model gpt-small --steps 300
    python bench/moments_rounding.py --model gpt-25m --steps 300 --seq 64

Runs the model with fp32 moments, then bf16 moments rounded to nearest even,
then bf16 moments rounded stochastically, all from the same seed and data,
and prints each bf16 run's largest per-step loss difference from the fp32
run and the difference of the final loss (the mean of the last 10 steps,
as `infinity train` reports it). The optimizer state is kept in host RAM
(offload_optimizer cpu): the moments' numerics are the same on every tier
(tests/engine/test_bf16_moments.py asserts equal losses on none, cpu and
nvme), and RAM keeps a 300-step run short. Everything else is the config's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_CONFIG = os.path.join(HERE, "..", "swap_configs", "nvme_offload.json")
VARIANTS = (("fp32", None), ("bf16-nearest", "nearest"), ("bf16-stochastic", "stochastic"))


def _config(base: dict, rounding: str | None) -> dict:
    cfg = json.loads(json.dumps(base))
    zero = cfg.setdefault("zero_optimization", {})
    zero["offload_param"] = {"device": "cpu"}
    off = zero["offload_optimizer"] = {"device": "cpu"}
    if rounding is not None:
        off.update(moments_dtype="bf16", moments_rounding=rounding)
    return cfg


def _losses(run_dir: str) -> list[float]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line)["loss"] for line in f if line.strip()]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gpt-small")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--seq", type=int, default=None, help="tokens per sequence (default: infinity train's)")
    p.add_argument("--config", default=DEFAULT_CONFIG, help="base config (default: the shipped nvme_offload.json)")
    p.add_argument("--out", default=None, help="where the three run directories go (default: a temp dir)")
    args = p.parse_args(argv)
    with open(args.config) as f:
        base = json.load(f)
    out = args.out or tempfile.mkdtemp(prefix="moments-")
    os.makedirs(out, exist_ok=True)
    curves = {}
    for name, rounding in VARIANTS:
        cfg_path = os.path.join(out, f"{name}.json")
        with open(cfg_path, "w") as f:
            json.dump(_config(base, rounding), f)
        run_dir = os.path.join(out, name)
        cmd = [sys.executable, "-m", "infinity", "train", "--config", cfg_path, "--model", args.model,
               "--steps", str(args.steps), "--out", run_dir]
        if args.seq:
            cmd += ["--seq", str(args.seq)]
        print("#", " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        curves[name] = _losses(run_dir)
    ref = curves["fp32"]
    tail = min(10, len(ref))
    final_ref = sum(ref[-tail:]) / tail
    print(f"model {args.model}, {args.steps} steps, config {os.path.basename(args.config)} (state in RAM); "
          f"fp32 moments: loss {ref[0]:.4f} -> {final_ref:.4f} (mean of the last {tail})")
    for name, _ in VARIANTS[1:]:
        c = curves[name]
        diffs = [abs(a - b) for a, b in zip(c, ref)]
        final = sum(c[-tail:]) / tail
        worst = max(range(len(diffs)), key=diffs.__getitem__)
        print(f"{name:16} final {final:.4f} ({final - final_ref:+.4f}, {100 * (final - final_ref) / final_ref:+.2f} %)"
              f"  max |loss diff| {diffs[worst]:.4f} at step {worst + 1}")
    print(json.dumps({"model": args.model, "steps": args.steps, "losses": curves}), file=open(
        os.path.join(out, "curves.json"), "w"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
