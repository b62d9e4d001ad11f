"""`infinity train`: train a decoder-only transformer with the ZeRO engine, on a built-in dataset.

The data is English-like text generated from a fixed seed by a small
grammar (`infinity.data`), one token per byte: the same bytes everywhere,
with real structure, so the loss really falls.

Writes `metrics.jsonl` (one object per optimizer step) and `metrics.png`
(loss, and the step time split into compute, exposed I/O and
communication) into --out.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def add_arguments(p) -> None:
    p.add_argument("--config", default=None,
                   help="swap config (default: the shipped nvme_offload.json: parameters and optimizer on NVMe)")
    p.add_argument("--model", default="gpt-small",
                   help="a preset (gpt-tiny, gpt-small, gpt-25m, gpt-57m, gpt-100m, gpt-125m, gpt-350m, gpt-1b, gpt-2b, gpt-4b, gpt-6b) or a Hugging Face "
                        "config.json (no download)")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--seq", type=int, default=None, help="tokens per sequence (default: the model's, at most 256)")
    p.add_argument("--nvme-path", default=None, help="directory for swap files (default: a temp dir, removed after)")
    p.add_argument("--nproc", type=int, default=1, help="ranks to launch through torchrun (gloo on CPU)")
    p.add_argument("--memory-budget", default=None,
                   help="plan the placement and buffers for this much host memory over the baseline (e.g. 8GiB); "
                        "the config then supplies only what the planner does not decide")
    p.add_argument("--out", default=None, help="run directory (default: runs/<timestamp>/)")
    p.add_argument("--lr", type=float, default=None, help="learning rate (default: the config's optimizer.params.lr)")
    p.add_argument("--warmup", type=int, default=0, help="steps of linear learning-rate warmup (default 0)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save-dir", default=None, help="write checkpoints (zarr) here: every --save-every steps and at "
                                                    "the end")
    p.add_argument("--save-every", type=int, default=0, help="steps between checkpoints (default: only at the end)")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --save-dir (if it "
                                                         "has one), bit-exactly")


def run(args) -> int:
    if args.config is None:
        from infinity.config.shipped import shipped_config

        args.config = str(shipped_config("nvme_offload.json"))
    if args.steps < 1:
        raise ValueError(f"--steps must be >= 1, got {args.steps}")
    if args.seq is not None and args.seq < 1:
        raise ValueError(f"--seq must be >= 1, got {args.seq}")
    if args.warmup < 0:
        raise ValueError(f"--warmup must be >= 0, got {args.warmup}")
    if args.nproc < 1:
        raise ValueError(f"--nproc must be >= 1, got {args.nproc}")
    if args.save_every < 0:
        raise ValueError(f"--save-every must be >= 0, got {args.save_every}")
    if (args.resume or args.save_every) and not args.save_dir:
        raise ValueError("--resume and --save-every need --save-dir (where the checkpoints are)")
    out = Path(args.out or Path("runs") / time.strftime("%Y%m%d-%H%M%S"))
    if args.nproc > 1 and "LOCAL_RANK" not in os.environ:
        return _launch(args, out)
    own_nvme = args.nvme_path is None
    nvme = args.nvme_path or tempfile.mkdtemp(prefix="infinity-train.", dir=os.environ.get("TMPDIR", "/var/tmp"))
    try:
        return _train(args, out, nvme)
    finally:
        if own_nvme:
            shutil.rmtree(nvme, ignore_errors=True)


def _launch(args, out: Path) -> int:
    """Re-run this command under torchrun with --nproc ranks."""
    argv, skip = [], False
    for a in sys.argv[1:]:  # the ranks get the same command without --nproc (torchrun's parser trips on it)
        if skip or a == "--nproc" or a.startswith("--nproc="):
            skip = a == "--nproc"
            continue
        argv.append(a)
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={args.nproc}", "--master_addr=127.0.0.1",
           f"--master_port={_free_port()}", "-m", "infinity", *argv, "--out", str(out)]
    return subprocess.call(cmd)


def _free_port() -> int:
    from infinity.testing.parity import free_port

    return free_port()


def _sized_config(args, nvme: str, largest: int, micro: int):
    """The swap config, with nvme_path set and buffers no bigger than this model needs."""
    import dataclasses

    from infinity.config import load_config

    cfg = load_config(args.config, nvme_path=nvme)
    zero = cfg.zero_optimization
    param = dataclasses.replace(zero.offload_param, buffer_size=min(zero.offload_param.buffer_size, largest))
    zero = dataclasses.replace(zero, offload_param=param, sub_group_size=min(zero.sub_group_size, max(largest, 1)))
    cfg = dataclasses.replace(cfg, zero_optimization=zero, train_micro_batch_size_per_gpu=micro)
    return _with_lr(args, cfg)


def _with_lr(args, cfg):
    import dataclasses

    if args.lr is None:
        return cfg
    if not (args.lr > 0 and math.isfinite(args.lr)):
        raise ValueError(f"--lr must be a finite number > 0, got {args.lr}")
    opt = cfg.optimizer
    return dataclasses.replace(cfg, optimizer=dataclasses.replace(opt, params=dataclasses.replace(opt.params,
                                                                                                 lr=args.lr)))


def _train(args, out: Path, nvme: str) -> int:
    import torch

    from infinity.engine import initialize, zero_init
    from infinity.engine.comm import init_distributed
    from infinity.models import build_model

    torch.manual_seed(args.seed)
    with torch.device("meta"):
        meta, vocab, seq, _ = build_model(args.model)
    largest = max(p.numel() for p in meta.parameters())
    del meta
    seq = min(args.seq or seq, seq, 256)
    from infinity.config import load_config

    micro = load_config(args.config, nvme_path=nvme).train_micro_batch_size_per_gpu or 4
    planned = None
    if args.memory_budget is not None:
        from infinity.tools.plan import describe, make_plan

        world_env = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        planned, shape, rates = make_plan(model=args.model, memory_budget=args.memory_budget, nvme_path=nvme,
                                          config=args.config, micro=micro, seq=seq, nproc=world_env)
        cfg = _with_lr(args, load_config(planned.config))
    else:
        cfg = _sized_config(args, nvme, largest, micro)
    comm = init_distributed(cfg.infinity.comm_timeout_s)
    rank, world = comm.rank, comm.world
    baseline = baseline_rss()
    if planned is not None and rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        print(describe(planned, shape, rates, baseline), flush=True)
        with open(out / "plan.json", "w") as f:
            json.dump({"predicted_step_s": planned.predicted_step_s, "predicted_peak_bytes": planned.predicted_peak_bytes,
                       "peak_phase": planned.peak_phase, "memory": planned.memory, "time": planned.time,
                       "rates": dataclasses.asdict(rates), "baseline_rss_bytes": baseline,
                       "memory_budget": planned.config["infinity"]["memory_budget"], "config": planned.config}, f,
                      indent=2)
    torch.manual_seed(args.seed)
    with zero_init(cfg):
        model, vocab, _, forward = build_model(args.model)
    warmup = args.warmup
    schedule = None if not warmup else (
        lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup)))
    engine = initialize(model, cfg, lr_scheduler=schedule)
    numel = sum(mp.numel for mp in engine.store.params)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        print(f"infinity train: {args.model} ({numel / 1e6:.1f}M params), {world} rank(s), batch "
              f"{micro * world} x {seq}, bf16={cfg.bf16.enabled} fp16={cfg.fp16.enabled}, params on "
              f"{engine.store.tier}, optimizer on {engine.optimizer.tier}, swap files in {nvme}; writing {out}",
              flush=True)
    if rank == 0:
        with open(out / "run.json", "w") as f:
            json.dump({"model": args.model, "numel": numel, "world": world, "micro_batch": micro, "seq": seq,
                       "steps": args.steps, "param_tier": str(engine.store.tier), "optimizer_tier": str(engine.optimizer.tier),
                       "baseline_rss_bytes": baseline, "swap_bytes_after_setup": _dir_bytes(nvme)}, f, indent=2)
    start = 0
    if args.resume and os.path.exists(os.path.join(args.save_dir, "latest")):
        path, state = engine.load_checkpoint(args.save_dir)
        state = state if isinstance(state, dict) else {}
        if state.get("seq") != seq or state.get("model") != args.model or "next_step" not in state:
            raise ValueError(f"--resume: {path} was saved by a run with --model {state.get('model')} and --seq "
                             f"{state.get('seq')}; this run has --model {args.model} and --seq {seq}")
        start = state["next_step"]
        if rank == 0:
            print(f"resumed from {path} at step {start}", flush=True)
    elif args.resume and rank == 0:
        print(f"--resume: no checkpoint in {args.save_dir} yet; starting at step 0", flush=True)
    metrics = open(out / "metrics.jsonl", "w") if rank == 0 else None
    rows = []
    try:
        for step in range(start, args.steps):
            x, y = _batch(step, micro * world, seq, vocab)
            x, y = x[rank * micro:(rank + 1) * micro], y[rank * micro:(rank + 1) * micro]
            t0 = time.perf_counter()
            loss = forward(engine, x, y)
            engine.backward(loss)
            engine.step()
            step_s = time.perf_counter() - t0
            loss_t = torch.tensor([loss.item()])
            engine.comm.all_reduce_(loss_t)
            r = engine.last_report
            row = {"step": step + 1, "loss": loss_t.item() / world, "step_s": step_s,
                   "tokens_per_s": micro * world * seq / step_s, "io_read_bytes": r.io_read_bytes,
                   "io_write_bytes": r.io_write_bytes, "exposed_io_s": r.exposed_io_s, "comm_s": r.comm_s,
                   "prefetch_hit_rate": r.prefetch_hit_rate, "peak_rss_bytes": _peak_rss(),
                   "baseline_rss_bytes": baseline, "skipped": r.skipped, "loss_scale": r.loss_scale}
            rows.append(row)
            if metrics is not None:
                metrics.write(json.dumps(row) + "\n")
                metrics.flush()
                _progress(row, args.steps)
            if args.save_dir and ((args.save_every and (step + 1) % args.save_every == 0) or step + 1 == args.steps):
                t0 = time.perf_counter()
                path = engine.save_checkpoint(args.save_dir, client_state={"next_step": step + 1, "model": args.model,
                                                                           "seq": seq})
                if rank == 0:
                    print(f"\nsaved {path} in {time.perf_counter() - t0:.1f} s", flush=True)
    finally:
        engine.close()
        if metrics is not None:
            metrics.close()
    if rank == 0 and not rows:
        print(f"nothing to train: the checkpoint is already at step {start} of --steps {args.steps}")
    elif rank == 0:
        plotted = _plot(rows, out / "metrics.png", args.model)
        first, last = rows[0]["loss"], sum(r["loss"] for r in rows[-5:]) / len(rows[-5:])
        print(f"\nloss {first:.3f} -> {last:.3f} (mean of the last 5 steps); metrics in {out}/metrics.jsonl, " + (
              f"plot in {out}/metrics.png" if plotted else "no plot (matplotlib is not installed: "
              "pip install matplotlib)"))
    return 0


def _batch(step: int, size: int, seq: int, vocab: int):
    from infinity.data import batch

    return batch(step, size, seq, vocab)


def baseline_rss() -> int:
    from infinity.tools.plan import baseline_rss as measure

    return measure()


def _dir_bytes(path: str) -> int:
    """Bytes of the files under `path` (this rank's and the others' swap files)."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.stat(os.path.join(root, name)).st_blocks * 512
            except OSError:
                pass  # removed while walking
    return total


def _peak_rss() -> int:
    """Peak RSS since the baseline was taken (VmHWM, reset then), or the process's ru_maxrss where /proc is missing."""
    from infinity.memory_stats import peak_rss_bytes

    return peak_rss_bytes()


def _progress(row: dict, steps: int) -> None:
    io_gbs = (row["io_read_bytes"] + row["io_write_bytes"]) / row["step_s"] / 1e9
    line = (f"step {row['step']:>5}/{steps}  loss {row['loss']:.4f}  {row['step_s']:.2f} s/step  "
            f"{row['tokens_per_s']:,.0f} tok/s  I/O {io_gbs:.2f} GB/s  hit {row['prefetch_hit_rate']:.0%}  "
            f"peak RSS {row['peak_rss_bytes'] / 2**20:,.0f} MiB")
    end = "\n" if not sys.stdout.isatty() or row["step"] == steps else "\r"
    print(line, end=end, flush=True)


def _plot(rows: list, path: Path, title: str) -> bool:
    """The loss and step-time plot; False (and nothing written) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    steps = [r["step"] for r in rows]
    io = [r["exposed_io_s"] for r in rows]
    comm = [r["comm_s"] for r in rows]
    compute = [max(0.0, r["step_s"] - a - b) for r, a, b in zip(rows, io, comm)]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    ax1.plot(steps, [r["loss"] for r in rows])
    ax1.set_ylabel("loss")
    ax1.set_title(f"infinity train: {title}")
    ax2.bar(steps, compute, label="compute")
    ax2.bar(steps, io, bottom=compute, label="exposed I/O")
    ax2.bar(steps, comm, bottom=[a + b for a, b in zip(compute, io)], label="communication")
    ax2.set_xlabel("step")
    ax2.set_ylabel("seconds")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True
