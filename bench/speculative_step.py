"""The speculative step against the step after backward, side by side (bench/RESULTS.md, "The speculative
step").

Both variants run the shipped `nvme_offload.json` (parameters and optimizer on NVMe) with the same
`gradient_clipping` (--clip), one with `infinity.speculative_step` off (the step after backward, finished in
the next forward) and one with it on ([Note: the speculative step] in infinity/engine/optimizer.py); with
--exact, a third runs without clipping (the exact step during backward: what a bet that always holds can at
best reach). Each run is a fresh `infinity train --model M --steps N` process, and the variants alternate (A B
A B, --repeat times) so that the disk's drift falls on both. Reported per run: the median step time after the
first step (which records the prefetch trace and cannot bet), the median prefetch hit rate and exposed I/O
after it, and how many steps bet and how many of those bets were rolled back; the ratio is against the step
after backward of the same pair.

    python bench/speculative_step.py --nvme-path /var/tmp/spec --models gpt-125m,gpt-350m --steps 6
        [--clip 1.0] [--repeat 2] [--exact] [--data FILE --model-dir DIR]

With --clip 1.0 (the shipped value) on a model trained from random weights the global norm stays above 1
for a long while, so no step bets; --clip 1e9 stands for a run whose steps do not clip (a fine-tune at a
small learning rate, or later in pretraining), where every bet holds.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def config(scratch: Path, clip: float, speculate: bool) -> Path:
    from infinity.config.shipped import shipped_config

    cfg = json.loads(Path(shipped_config("nvme_offload.json")).read_text())
    cfg["gradient_clipping"] = clip
    cfg.setdefault("infinity", {})["speculative_step"] = speculate
    path = scratch / f"clip{clip}-{'bet' if speculate else 'after'}.json"
    path.write_text(json.dumps(cfg))
    return path


def one(model: str, cfg: Path, args, scratch: Path) -> dict:
    out = scratch / "run"
    nvme = Path(args.nvme_path) / "speculative-bench"
    shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(nvme, ignore_errors=True)
    nvme.mkdir(parents=True)
    cmd = [sys.executable, "-m", "infinity", "train", "--model", model, "--config", str(cfg),
           "--steps", str(args.steps), "--nvme-path", str(nvme), "--out", str(out)]
    if args.data:
        cmd += ["--data", args.data]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    finally:
        shutil.rmtree(nvme, ignore_errors=True)
    if proc.returncode != 0:
        raise SystemExit(f"bench speculative: {' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    later = rows[1:]
    bets = [r["speculation"] for r in rows if r.get("speculation")]
    return {"step_s": statistics.median(r["step_s"] for r in later),
            "hit_rate": statistics.median(r["prefetch_hit_rate"] for r in later),
            "exposed_io_s": statistics.median(r["exposed_io_s"] for r in later),
            "bets": len(bets), "lost": bets.count("redone"), "norms": [r["grad_norm"] for r in rows],
            "losses": [r["loss"] for r in rows]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nvme-path", required=True, help="a directory on the disk to swap to")
    p.add_argument("--models", default="gpt-125m,gpt-350m")
    p.add_argument("--model-dir", default=None, help="a Hugging Face model directory, run instead of --models")
    p.add_argument("--data", default=None, help="a text file to train on (default: the built-in synthetic data)")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--exact", action="store_true", help="also run without clipping")
    p.add_argument("--timeout", type=float, default=3600)
    args = p.parse_args(argv)
    if args.steps < 3:
        p.error("--steps must be >= 3 (the first step records the prefetch trace and cannot bet)")
    scratch = Path(tempfile.mkdtemp(prefix="infinity-bench-speculative."))
    try:
        variants = {"after backward": config(scratch, args.clip, False), "bet": config(scratch, args.clip, True)}
        if args.exact:
            variants["no clipping"] = config(scratch, 0.0, False)
        print(f"# bench speculative: nvme_offload.json, gradient_clipping {args.clip}, {args.steps} steps each, "
              f"figures after step 1, swap files in {args.nvme_path}")
        print("| model | pair | variant | step | vs after backward | prefetch hit | exposed I/O | bets (lost) | "
              "losses equal |")
        print("|---|---|---|---|---|---|---|---|---|")
        for model in ([args.model_dir] if args.model_dir else args.models.split(",")):
            for k in range(args.repeat):
                after = None
                for label, cfg in variants.items():
                    r = one(model, cfg, args, scratch)
                    after = after or r
                    equal = "-" if label == "no clipping" else "yes" if r["losses"] == after["losses"] else "NO"
                    print(f"| {Path(model).name} | {k + 1} | {label} | {r['step_s']:.2f} s | "
                          f"{r['step_s'] / after['step_s']:.2f}x | {100 * r['hit_rate']:.0f} % | "
                          f"{r['exposed_io_s']:.2f} s | {r['bets']} ({r['lost']}) | {equal} |", flush=True)
                print(f"<!-- {Path(model).name} global norms: {[round(n, 3) for n in after['norms']]} -->")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    raise SystemExit(main())
