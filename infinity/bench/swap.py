"""`infinity bench swap`: an optimizer step with its state on NVMe, against the I/O lower bound.

It writes the fp32 master weights and both Adam moments of --numel
parameters to swap files (sub-groups of --sub-group parameters), then times
--steps steps of the pipelined optimizer swapper. In the same run fio
measures the disk's read and write bandwidth at the same block size and
queue depth, giving the I/O lower bound: bytes read / fio read GB/s + bytes
written / fio write GB/s. The same step all in RAM is timed for reference.
Peak RSS is sampled from /proc during the NVMe steps.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time

import torch

from infinity.bench.fio import fio_available, run_fio
from infinity.io import AsyncIO
from infinity.memory_stats import PeakSampler, rss_bytes
from infinity.optim import cpu_adam_step
from infinity.swap import BufferPool, TensorSwapper
from infinity.swap.optimizer import OptimizerSwapper
from infinity.swap.telemetry import Trace
from infinity.units import parse_count, parse_size


def add_arguments(p) -> None:
    p.add_argument("--dir", required=True, action="append",
                   help="directory on the disk that holds the swap files; once per disk for several")
    p.add_argument("--numel", default="250M", help="parameters (K/M/G = 1e3/1e6/1e9)")
    p.add_argument("--sub-group", default="25M", help="parameters per sub-group (one read + one write each)")
    p.add_argument("--buffer-count", type=int, default=3, help="pool buffers of 12 B x sub-group each")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--backend", default="auto")
    p.add_argument("--block-size", default="1MiB")
    p.add_argument("--queue-depth", type=int, default=32)
    p.add_argument("--no-checksums", action="store_true")
    p.add_argument("--no-inram", action="store_true", help="skip the in-RAM reference step")
    p.add_argument("--trace", default=None, help="write a Chrome trace of the last step here")
    p.add_argument("--json", action="store_true")


def run(args) -> int:
    numel, group = parse_count(args.numel, name="--numel"), parse_count(args.sub_group, name="--sub-group")
    if numel < 1 or group < 1:
        raise SystemExit("bench swap: --numel and --sub-group must be >= 1")
    for d in args.dir:
        if not os.path.isdir(d):
            raise SystemExit(f"bench swap: --dir {d} is not a directory")
    block = parse_size(args.block_size, name="--block-size")
    numels = [min(group, numel - lo) for lo in range(0, numel, group)]
    baseline = rss_bytes()
    pool = BufferPool(args.buffer_count, 12 * max(numels))
    aios = [AsyncIO(backend=args.backend, block_size=block, queue_depth=args.queue_depth) for _ in args.dir]
    aio = aios[0]
    grad = torch.randn(max(numels)).to(torch.bfloat16)  # one shared gradient buffer: the bench times the state
    trace = Trace()
    if not args.json:
        print(f"# bench swap: numel={numel} groups={len(numels)} x {max(numels)} pool={args.buffer_count} x "
              f"{pool.size / 1e6:.0f} MB backend={aio.backend} block={block} qd={args.queue_depth} "
              f"checksums={not args.no_checksums} disks={len(args.dir)}", flush=True)
    with TensorSwapper(args.dir, pool, aios, checksums=not args.no_checksums) as sw:
        opt = OptimizerSwapper(sw, numels, trace=trace)
        g = torch.Generator().manual_seed(0)
        for i, n in enumerate(numels):
            opt.initialize(i, torch.randn(n, generator=g))
        times, stats = [], None
        with PeakSampler() as rss:
            for step in range(1, args.steps + 1):
                trace.spans.clear()
                stats = opt.step([grad[:n] for n in numels], step=step, lr=1e-4, weight_decay=0.01)
                times.append(stats.wall_s)
        step_s = statistics.median(times)
        io_bytes = stats.bytes_read + stats.bytes_written
        if args.trace:
            trace.export(args.trace)
    for a in aios:
        a.close()
    bound, fio_r, fio_w = _io_bound(args, stats.bytes_read, stats.bytes_written, block)
    inram = None if args.no_inram else _inram_step(numels, grad)
    row = {"numel": numel, "step_s": step_s, "io_bytes": io_bytes, "io_bound_s": bound,
           "ratio": step_s / bound if bound else None, "inram_step_s": inram, "peak_rss_bytes": rss.peak,
           "pool_bytes": pool.nbytes, "baseline_rss_bytes": baseline, "grad_bytes": grad.numel() * 2,
           "exposed_io_s": stats.io_wait_s, "compute_s": stats.compute_s, "fio_read_gbps": fio_r,
           "fio_write_gbps": fio_w, "steps": times, "disks": len(args.dir),
           "io_gbps": io_bytes / step_s / 1e9}
    if args.json:
        print(json.dumps(row))
        return 0
    over = rss.peak - baseline - pool.nbytes - row["grad_bytes"]
    print(f"step {step_s:.3f} s (median of {len(times)}: {', '.join(f'{t:.3f}' for t in times)}); "
          f"moved {io_bytes / 1e9:.2f} GB; exposed I/O {stats.io_wait_s:.3f} s, Adam {stats.compute_s:.3f} s")
    if bound:
        print(f"I/O lower bound {bound:.3f} s (fio read {fio_r:.2f} GB/s, write {fio_w:.2f} GB/s): "
              f"ratio {step_s / bound:.2f} (target <= 1.15)")
    if inram is not None:
        print(f"all in RAM: {inram:.3f} s per step")
    print(f"peak RSS {rss.peak / 2**20:.0f} MiB = baseline {baseline / 2**20:.0f} + pool {pool.nbytes / 2**20:.0f} "
          f"+ grads {row['grad_bytes'] / 2**20:.0f} + other {over / 2**20:.0f} MiB "
          f"({100 * over / pool.nbytes:.1f} % of the pool; target <= 10 %)")
    return 0


def _io_bound(args, read_bytes, write_bytes, block):
    if not fio_available():
        return None, None, None
    backend = args.backend if args.backend in ("libaio", "io_uring", "threads") else "libaio"
    size = 1 << 30
    with tempfile.TemporaryDirectory(dir=args.dir[0]) as tmp:  # the first disk's bandwidth
        path = os.path.join(tmp, "fio.dat")
        kw = dict(path=path, size=size, backend=backend, block_size=block, queue_depth=args.queue_depth,
                  threads=1, direct=True)
        run_fio(op="write", **kw)  # lay out
        w = statistics.median(run_fio(op="write", **kw) for _ in range(3)) / 1e9
        r = statistics.median(run_fio(op="read", **kw) for _ in range(3)) / 1e9
    return read_bytes / 1e9 / r + write_bytes / 1e9 / w, r, w


def _inram_step(numels, grad) -> float:
    state = [(torch.randn(n), torch.zeros(n), torch.zeros(n)) for n in numels]
    times = []
    for step in (1, 2, 3):
        t0 = time.perf_counter()
        for (p, m, v), n in zip(state, numels):
            cpu_adam_step(p, grad[:n], m, v, step=step, lr=1e-4, weight_decay=0.01, check_finite=False)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)
