"""`infinity bench train`: a training step with parameters and optimizer on NVMe, against the same model in RAM.

Both variants run the repo's GPT at stage 3 with the same data, each in a
child process of its own so that each peak RSS is its own. The first
--warmup steps (trace recording, page cache, allocator warm-up) are left
out of the steady state. Reported per variant: median step time, prefetch
hit rate, exposed I/O, NVMe bytes per parameter per step and peak RSS; and
the ratio of the NVMe step time to the in-RAM one.

Shared 2-core machines are noisy (another tenant can double a step), so the
variants alternate for --rounds rounds and each is represented by its
fastest steady-state step (the least disturbed); medians are printed too.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time


DEFAULT_MODEL = dict(vocab=8192, seq=256, layers=6, dim=512, heads=8)


def add_arguments(p) -> None:
    p.add_argument("--dir", default=None, help="directory for the swap files (default: a temp dir under /var/tmp)")
    p.add_argument("--layers", type=int, default=DEFAULT_MODEL["layers"])
    p.add_argument("--dim", type=int, default=DEFAULT_MODEL["dim"])
    p.add_argument("--vocab", type=int, default=DEFAULT_MODEL["vocab"])
    p.add_argument("--seq", type=int, default=DEFAULT_MODEL["seq"])
    p.add_argument("--heads", type=int, default=DEFAULT_MODEL["heads"])
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2, help="alternate RAM and NVMe runs this many times")
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--moments", choices=("fp32", "bf16", "int8"), default="fp32",
                   help="offload_optimizer.moments_dtype for both variants")
    p.add_argument("--mmap-threshold", default="64KiB",
                   help="infinity.mmap_threshold for both variants (e.g. 32MiB: faster steps, more host memory)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--child", choices=("ram", "nvme"), help=argparse_hidden())


def argparse_hidden():
    import argparse

    return argparse.SUPPRESS


def config(args, variant: str, directory: str, *, moments: str = "fp32") -> dict:
    """The model and config of one variant; `moments`: offload_optimizer.moments_dtype of both."""
    from infinity.models import GPTConfig

    model = GPTConfig(vocab=args.vocab, seq=args.seq, layers=args.layers, dim=args.dim, heads=args.heads)
    # Pools sized to the model: parameter buffers hold the largest parameter, optimizer sub-groups are that size.
    largest = max(args.vocab * args.dim, 4 * args.dim * args.dim)
    cfg = {"train_micro_batch_size_per_gpu": args.batch,
           "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "weight_decay": 0.01}},
           "bf16": {"enabled": args.precision == "bf16"},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                 "sub_group_size": largest,
                                 "stage3_prefetch_bucket_size": 2 * largest,
                                 "stage3_max_reuse_distance": 0,
                                 "offload_param": {"device": "none"}, "offload_optimizer": {"device": "none"}}}
    if variant == "nvme":
        zero = cfg["zero_optimization"]
        zero["offload_param"] = {"device": "nvme", "nvme_path": directory, "buffer_count": 6,
                                 "buffer_size": largest}
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": directory, "buffer_count": 4}
    cfg["zero_optimization"]["offload_optimizer"]["moments_dtype"] = moments
    return model, cfg


def _proc_io() -> int:
    """Bytes this process (all its threads) had storage read and write for it: /proc/self/io, the kernel's count,
    beside the engine's own counters."""
    try:
        with open("/proc/self/io") as f:
            fields = dict(line.split(":") for line in f if ":" in line)
        return int(fields["read_bytes"]) + int(fields["write_bytes"])
    except (OSError, KeyError, ValueError):
        return -1


def child(args) -> int:
    import torch

    from infinity.engine import initialize, zero_init
    from infinity.memory_stats import peak_rss_bytes
    from infinity.models import GPT
    from infinity.testing.parity import batch

    directory = args.dir
    model_cfg, cfg = config(args, args.child, directory, moments=args.moments)
    cfg["infinity"] = {"mmap_threshold": args.mmap_threshold}
    baseline = peak_rss_bytes()  # the process's peak so far: interpreter, torch, the engine's imports
    torch.manual_seed(0)
    with zero_init(cfg):
        model = GPT(model_cfg)
    engine = initialize(model, cfg)
    numel = sum(mp.numel for mp in engine.store.params)
    steps = []
    try:
        for s in range(args.steps):
            x, y = batch(s, size=args.batch, model=model_cfg)
            io0 = _proc_io()
            t0 = time.perf_counter()
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            r = engine.last_report
            steps.append({"step": s, "loss": loss.item(), "step_s": time.perf_counter() - t0,
                          "hit_rate": r.prefetch_hit_rate, "exposed_io_s": r.exposed_io_s,
                          "io_bytes": r.io_read_bytes + r.io_write_bytes, "optimizer_s": r.optimizer_s,
                          "proc_io_bytes": _proc_io() - io0 if io0 >= 0 else None})
    finally:
        engine.close()
    peak = peak_rss_bytes()
    print(json.dumps({"variant": args.child, "numel": numel, "steps": steps, "peak_rss_bytes": peak,
                      "baseline_rss_bytes": baseline}))
    return 0


def _run_child(args, variant: str, directory: str) -> dict:
    cmd = [sys.executable, "-m", "infinity", "bench", "train", "--child", variant, "--dir", directory]
    for k in ("layers", "dim", "vocab", "seq", "heads", "batch", "steps", "warmup", "precision", "moments",
              "mmap_threshold"):
        cmd += [f"--{k.replace('_', '-')}", str(getattr(args, k))]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"bench train: the {variant} run failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def summarise(runs: list[dict], warmup: int) -> dict:
    steady = [s for run in runs for s in (run["steps"][warmup:] or run["steps"][-1:])]
    run = runs[-1]
    return {"step_s": min(s["step_s"] for s in steady),
            "median_step_s": statistics.median(s["step_s"] for s in steady),
            "hit_rate": min(s["hit_rate"] for s in steady),
            "exposed_io_s": statistics.median(s["exposed_io_s"] for s in steady),
            "bytes_per_param": statistics.median(s["io_bytes"] for s in steady) / run["numel"],
            "proc_io_bytes_per_param": (statistics.median(s["proc_io_bytes"] for s in steady) / run["numel"]
                                        if all(s.get("proc_io_bytes") is not None for s in steady) else None),
            "peak_rss_bytes": max(r["peak_rss_bytes"] for r in runs), "loss_first": run["steps"][0]["loss"],
            "loss_last": run["steps"][-1]["loss"]}


def run(args) -> int:
    if args.child:
        return child(args)
    if args.steps <= args.warmup:
        raise ValueError(f"--steps ({args.steps}) must be larger than --warmup ({args.warmup})")
    own = args.dir is None
    directory = tempfile.mkdtemp(prefix="infinity-bench-train.", dir="/var/tmp") if own else args.dir
    ram, nvme = [], []
    try:
        for _ in range(args.rounds):
            ram.append(_run_child(args, "ram", directory))
            nvme.append(_run_child(args, "nvme", directory))
    finally:
        if own:
            import shutil

            shutil.rmtree(directory, ignore_errors=True)
    a, b = summarise(ram, args.warmup), summarise(nvme, args.warmup)
    result = {"numel": nvme[0]["numel"], "precision": args.precision, "moments": args.moments,
              "batch": args.batch, "seq": args.seq,
              "mmap_threshold": args.mmap_threshold,
              "ram": a, "nvme": b, "ratio": b["step_s"] / a["step_s"]}
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"bench train: GPT {result['numel'] / 1e6:.1f}M params, {args.precision}, {args.moments} moments, "
          f"batch {args.batch} x {args.seq}, "
          f"{args.rounds} x {args.steps} steps ({args.warmup} warm-up each), stage 3, mmap threshold "
          f"{args.mmap_threshold}, swap files in {directory}")
    print(f"{'variant':8} {'best step s':>11} {'median s':>9} {'hit rate':>9} {'exposed I/O s':>14} {'B/param':>8} "
          f"{'/proc B/param':>13} {'peak RSS':>10}")
    for name, s in (("in RAM", a), ("NVMe", b)):
        proc = f"{s['proc_io_bytes_per_param']:13.1f}" if s["proc_io_bytes_per_param"] is not None else " " * 13
        print(f"{name:8} {s['step_s']:11.3f} {s['median_step_s']:9.3f} {s['hit_rate']:9.3f} "
              f"{s['exposed_io_s']:14.3f} {s['bytes_per_param']:8.1f} {proc} {s['peak_rss_bytes'] / 2**20:8.0f} MiB")
    print(f"ratio NVMe / RAM: {result['ratio']:.2f} (target <= 1.25)")
    return 0
