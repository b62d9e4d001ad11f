"""The shipped configs without a budget, at common sizes: peak RSS, step time and prefetch hit rate for
everything in RAM, the optimizer on NVMe, and both on NVMe (bench/RESULTS.md, "Memory-saving
defaults").

Each (model, config) pair is a fresh `infinity train --model M --config C --steps N` process; the figures
are its own: the peak RSS of the run (`peak_rss_bytes`, sampled), the median step time after the first step
(the first records the prefetch trace), the median prefetch hit rate after it, and the median share of
parameter fetches that read their shard from disk on the critical path (a miss that took a stepped shard's
staged copy reads nothing: it waited, if at all, for the deferred step). The ratios are against the
all-in-RAM run of the same model in the same invocation. Before each run, `infinity plan --model M --config C`
(no budget: the config's run as written, [Note: predicting a config's run] in infinity/tools/plan/cost.py)
predicts its peak RSS over the baseline and its step time; the last columns are measured / predicted.

    python bench/defaults.py --nvme-path /var/tmp/defaults [--models gpt-125m,gpt-350m,gpt-1b,llama-300m]
        [--steps 4] [--json]

`llama-300m` is a Hugging Face LlamaConfig (hidden 1024, 20 layers, intermediate 2816, vocab 32000; 322M
parameters, untied head) written to a temp directory and trained from its config.json (random init).
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

CONFIGS = {"RAM": "cpu_offload.json", "optimizer on NVMe": "nvme_optimizer_only.json",
           "both on NVMe": "nvme_offload.json"}


def llama_300m(where: Path) -> str:
    from transformers import LlamaConfig

    cfg = LlamaConfig(hidden_size=1024, num_hidden_layers=20, intermediate_size=2816, num_attention_heads=16,
                      num_key_value_heads=16, vocab_size=32000, max_position_embeddings=1024, tie_word_embeddings=False)
    d = where / "llama-300m"
    d.mkdir(parents=True, exist_ok=True)
    cfg.to_json_file(str(d / "config.json"))
    return str(d)


def one(model: str, config: str, args, scratch: Path) -> dict:
    from infinity.config.shipped import shipped_config

    out = scratch / "run"
    nvme = Path(args.nvme_path) / "defaults-bench"
    shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(nvme, ignore_errors=True)
    nvme.mkdir(parents=True)
    planned = [sys.executable, "-m", "infinity", "plan", "--model", model, "--config", str(shipped_config(config)),
               "--nvme-path", str(nvme), "--json"]
    cmd = [sys.executable, "-m", "infinity", "train", "--model", model, "--config", str(shipped_config(config)),
           "--steps", str(args.steps), "--nvme-path", str(nvme), "--out", str(out)]
    try:
        pred = subprocess.run(planned, capture_output=True, text=True, timeout=args.timeout)
        if pred.returncode != 0:
            raise SystemExit(f"bench defaults: {' '.join(planned)} failed ({pred.returncode}):\n{pred.stderr[-3000:]}")
        pred = json.loads(pred.stdout.strip().splitlines()[-1])
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    finally:
        shutil.rmtree(nvme, ignore_errors=True)
    if proc.returncode != 0:
        raise SystemExit(f"bench defaults: {' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    later = rows[1:] or rows
    swapped = json.loads((out / "run.json").read_text())["param_tier"] == "nvme"  # else nothing is prefetched
    hits = [r["prefetch_hit_rate"] for r in later if swapped and r.get("prefetch_hit_rate") is not None]
    # Fetches that read from disk on the critical path (misses not served from a staged copy or lent weights).
    critical = [r["param_critical_reads"] / r["param_fetches"] for r in later
                if swapped and r.get("param_fetches")]
    peak = max(r["peak_rss_bytes"] for r in rows)
    return {"peak_rss_bytes": peak, "peak_over_baseline_bytes": peak - rows[0]["baseline_rss_bytes"],
            "step_s": statistics.median(r["step_s"] for r in later),
            "hit_rate": statistics.median(hits) if hits else None,
            "critical_read_rate": statistics.median(critical) if critical else None,
            "losses": [r["loss"] for r in rows], "predicted_peak_over_baseline_bytes": pred["predicted_peak_bytes"],
            "predicted_step_s": pred["predicted_step_s"], "predicted_memory": pred["memory"],
            "predicted_time": pred["time"], "rates": pred["rates"]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nvme-path", required=True, help="a directory on the disk to swap to")
    p.add_argument("--models", default="gpt-125m,gpt-350m,gpt-1b,llama-300m")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--timeout", type=float, default=3600)
    p.add_argument("--json", action="store_true", help="one JSON object per run")
    args = p.parse_args(argv)
    if args.steps < 2:
        p.error("--steps must be >= 2 (the first step records the prefetch trace)")
    scratch = Path(tempfile.mkdtemp(prefix="infinity-bench-defaults."))
    try:
        if not args.json:
            print(f"# bench defaults: {args.steps} steps each, figures after step 1, swap files in {args.nvme_path}")
            print("| model | config | peak RSS | vs RAM | step | vs RAM | prefetch hit | read on the critical path | "
                  "peak over baseline, measured / predicted | step, measured / predicted |")
            print("|---|---|---|---|---|---|---|---|---|---|")
        for name in args.models.split(","):
            model = llama_300m(scratch) if name == "llama-300m" else name
            ram = None
            for label, config in CONFIGS.items():
                r = one(model, config, args, scratch)
                ram = ram or r
                if args.json:
                    print(json.dumps({"model": name, "config": config, **r}), flush=True)
                    continue
                hit = "-" if r["hit_rate"] is None else f"{100 * r['hit_rate']:.0f} %"
                critical = "-" if r["critical_read_rate"] is None else f"{100 * r['critical_read_rate']:.0f} %"
                print(f"| {name} | `{config}` ({label}) | {r['peak_rss_bytes'] / 2**30:.2f} GiB | "
                      f"{r['peak_rss_bytes'] / ram['peak_rss_bytes']:.2f}x | {r['step_s']:.2f} s | "
                      f"{r['step_s'] / ram['step_s']:.2f}x | {hit} | {critical} | "
                      f"{r['peak_over_baseline_bytes'] / r['predicted_peak_over_baseline_bytes']:.2f} | "
                      f"{r['step_s'] / r['predicted_step_s']:.2f} |", flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    raise SystemExit(main())
