"""`infinity bench plan`: the planner's predictions held against real runs, and the cost per parameter.

For each model it runs `infinity train --memory-budget B` in a fresh
process (the planner picks placement and buffers, and writes plan.json),
then compares the predicted step time and peak memory over the baseline
with what the run measured: the median step time after the first step,
and the peak RSS since the baseline (`infinity.memory_stats`) minus the baseline. The same
rows make the cost-per-parameter table of bench/RESULTS.md ("Step time per parameter, 100M to 6B").
"""

from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from infinity.units import parse_size

TOLERANCE = 0.25


def add_arguments(p) -> None:
    p.add_argument("--models", default="gpt-100m,gpt-350m,gpt-1b",
                   help="comma-separated presets (default gpt-100m,gpt-350m,gpt-1b)")
    p.add_argument("--memory-budget", default="2GiB", help="the planner's budget for every model (default 2GiB)")
    p.add_argument("--nvme-path", required=True, help="directory for the swap files")
    p.add_argument("--config", default=None, help="base config (default: swap_configs/huge_2b.json)")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--lr", type=float, default=None)
    p.add_argument("--keep", default=None, metavar="DIR", help="keep each run's directory under DIR")
    p.add_argument("--json", action="store_true", help="one JSON object per model")
    p.add_argument("--timeout", type=float, default=4 * 3600, help="seconds one model's run may take (default 4 h)")


def run(args) -> int:
    from infinity.config.shipped import shipped_config

    parse_size(args.memory_budget, name="--memory-budget")
    if args.steps < 2:
        raise ValueError(f"--steps must be >= 2 (the first step records the trace), got {args.steps}")
    config = args.config or str(shipped_config("huge_2b.json"))
    keep = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="infinity-bench-plan."))
    try:
        return _run(args, config, keep)
    finally:
        if not args.keep:
            shutil.rmtree(keep, ignore_errors=True)


def _run(args, config: str, keep: Path) -> int:
    rows = []
    if not args.json:
        print(f"# bench plan: budget {args.memory_budget}, {args.steps} steps, seq {args.seq}, config {config}")
        print(f"{'model':10} {'params':>8} {'placement':>10} {'step pred':>9} {'step meas':>9} {'ratio':>6} "
              f"{'peak pred':>9} {'peak meas':>9} {'ratio':>6} {'ns/param':>8} {'peak RSS':>9} {'setup':>6}")
    for model in args.models.split(","):
        out = keep / model
        cmd = [sys.executable, "-m", "infinity", "train", "--model", model, "--config", config,
               "--memory-budget", args.memory_budget, "--steps", str(args.steps), "--seq", str(args.seq),
               "--nvme-path", args.nvme_path, "--out", str(out)]
        if args.lr is not None:
            cmd += ["--lr", str(args.lr)]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
        wall = time.perf_counter() - t0
        if proc.returncode != 0:
            print(f"{model}: infinity train failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}",
                  file=sys.stderr)
            return 1
        row = compare(out, wall)
        row["model"] = model
        rows.append(row)
        if args.json:
            print(json.dumps(row), flush=True)
        else:
            print(f"{model:10} {row['numel'] / 1e6:7.0f}M {row['placement']:>10} {row['predicted_step_s']:8.2f}s "
                  f"{row['step_s']:8.2f}s {row['step_ratio']:6.2f} {row['predicted_peak_bytes'] / 2**20:7.0f}Mi "
                  f"{row['peak_over_baseline_bytes'] / 2**20:7.0f}Mi {row['peak_ratio']:6.2f} "
                  f"{row['ns_per_param']:8.1f} {row['peak_rss_bytes'] / 2**30:7.2f}Gi {row['setup_s']:5.0f}s",
                  flush=True)
    missed = [r["model"] for r in rows if not r["within_tolerance"]]
    if not args.json:
        print(f"# predictions within {TOLERANCE:.0%}: {len(rows) - len(missed)}/{len(rows)}"
              + (f" (missed: {', '.join(missed)})" if missed else "")
              + (f"; runs in {keep}" if args.keep else "; pass --keep DIR to keep the runs"))
    return 0


def compare(out: Path, wall_s: float) -> dict:
    """Predicted against measured for one run directory of `infinity train --memory-budget`."""
    plan = json.loads((out / "plan.json").read_text())
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steady = [r["step_s"] for r in rows[1:]] or [rows[0]["step_s"]]
    step = statistics.median(steady)
    base = plan["baseline_rss_bytes"]
    peak = max(r["peak_rss_bytes"] for r in rows)
    zero = plan["config"]["zero_optimization"]
    numel = _numel(out)
    row = {"numel": numel, "placement": f"{_short(zero['offload_param']['device'])}/"
                                         f"{_short(zero['offload_optimizer']['device'])}",
           "predicted_step_s": plan["predicted_step_s"], "step_s": step,
           "step_ratio": step / plan["predicted_step_s"],
           "predicted_peak_bytes": plan["predicted_peak_bytes"], "peak_over_baseline_bytes": peak - base,
           "peak_ratio": (peak - base) / plan["predicted_peak_bytes"], "peak_rss_bytes": peak,
           "baseline_rss_bytes": base, "memory_budget": plan["memory_budget"],
           "ns_per_param": step / numel * 1e9 if numel else float("nan"),
           "io_bytes_per_step": rows[-1]["io_read_bytes"] + rows[-1]["io_write_bytes"],
           "losses": [r["loss"] for r in rows], "setup_s": wall_s - sum(r["step_s"] for r in rows)}
    row["within_tolerance"] = (abs(row["step_ratio"] - 1) <= TOLERANCE and abs(row["peak_ratio"] - 1) <= TOLERANCE)
    return row


def _short(tier: str) -> str:
    return {"none": "ram", "cpu": "ram", "nvme": "nvme"}[tier]


def _numel(out: Path) -> int:
    meta = out / "run.json"
    return json.loads(meta.read_text())["numel"] if meta.exists() else 0
