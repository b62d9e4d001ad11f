"""`infinity bench io`: read/write GB/s of our backends, side by side with fio.

Each configuration writes a file once to lay it out, then times `repeats`
overwrites and `repeats` reads of the whole file through one AsyncIO request
(cut into block_size pieces, queue_depth deep, across threads). With
--vs-fio, fio runs right after each of our passes on the same file with the
same engine, block size, queue depth, job count and direct flag. Reads are
honest: O_DIRECT, or (python backend) the file's page cache dropped first.

[Note: the memory a read lands in]
fio moves the file through its io_u buffers: queue depth x block size bytes
per job (32 MiB at 1 MiB x QD32), reused. Our default pass reads the whole
file into one buffer of its size, as the engine reads a sub-group into a
pool buffer. On the reference VM (a guest whose disk is virtio) the buffer
alone moved reads by up to 1.7x: in one process, O_DIRECT libaio reads of
the same 1 GiB file ran at 1.5-1.7 GB/s into the first 1 GiB buffer
allocated and at 2.35-2.7 GB/s into two allocated after it and into a reused
32 MiB one (alternating, three rounds; which buffer was slow followed the
allocation, not the write that laid the file out). `--ring` moves the file
through a buffer of fio's footprint instead, as consecutive requests of that
size submitted at once (the handle keeps queue_depth pieces in flight; pieces
of different requests land in the same bytes, whose contents a benchmark
does not need). It did not close the gap to fio in the run that tried it, so
the gap is not the footprint alone. The round-trip check uses the whole-file
buffer either way.
"""

from __future__ import annotations

import itertools
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field

from infinity.bench.fio import FIO_ENGINE, fio_available, run_fio
from infinity.io import AsyncIO, aligned_empty, available_backends
from infinity.units import format_size, parse_size

SWEEP_BLOCK_SIZES = (256 << 10, 1 << 20, 4 << 20)
SWEEP_QUEUE_DEPTHS = (4, 16, 32, 64)
SWEEP_THREADS = (1, 2)


@dataclass(kw_only=True, slots=True)
class IoCase:
    """One configuration to measure."""

    backend: str
    block_size: int
    queue_depth: int
    threads: int


@dataclass(kw_only=True, slots=True)
class IoResult:
    """Median GB/s (1e9 B/s) of one op in one configuration, and fio's at the same settings."""

    op: str
    backend: str
    block_size: int
    queue_depth: int
    threads: int
    gbps: float
    gbps_stdev: float
    size: int
    repeats: int
    direct: bool
    ring: bool = False
    """The file moved through a buffer of fio's footprint (see [Note: the memory a read lands in])."""
    fio_gbps: float | None = None
    ratio: float | None = None
    samples: list = field(default_factory=list)


def _drop_cache(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _time_pass(h: AsyncIO, op: str, buf, path: str) -> float:
    if op == "read" and not h.direct:
        _drop_cache(path)
    t0 = time.perf_counter()
    (h.write if op == "write" else h.read)(buf, path)
    return time.perf_counter() - t0


def _ring_pass(h: AsyncIO, op: str, ring, path: str, size: int) -> float:
    if op == "read" and not h.direct:
        _drop_cache(path)
    step = ring.numel()
    go = h.pwrite if op == "write" else h.pread
    t0 = time.perf_counter()
    futures = [go(ring, path, off, nbytes=min(step, size - off)) for off in range(0, size, step)]
    for f in futures:
        f.wait()
    return time.perf_counter() - t0


def measure(case: IoCase, *, path: str, size: int, repeats: int, direct: bool, vs_fio: bool,
            ring: bool = False) -> list[IoResult]:
    buf = aligned_empty(size, pin=False)
    buf.copy_(_fill(size))
    ring_buf = None
    if ring:
        ring_buf = aligned_empty(min(size, case.queue_depth * case.block_size * case.threads), pin=False)
        ring_buf.copy_(buf[:ring_buf.numel()])
    results = []
    with AsyncIO(backend=case.backend, block_size=case.block_size, queue_depth=case.queue_depth,
                 threads=case.threads, direct=direct) as h:
        h.write(buf, path)  # lay the file out once: timed writes overwrite, as fio's do
        for op in ("write", "read"):
            ours, peer = [], []
            for rep in range(repeats):
                # Alternate who goes first so that drift in the disk (burst
                # credits, background flush) does not favour either side.
                turns = ("ours", "fio") if rep % 2 == 0 else ("fio", "ours")
                for who in turns:
                    if who == "ours":
                        t = _ring_pass(h, op, ring_buf, path, size) if ring else _time_pass(h, op, buf, path)
                        ours.append(size / t / 1e9)
                    elif vs_fio:
                        peer.append(run_fio(op=op, path=path, size=size, backend=case.backend,
                                            block_size=case.block_size, queue_depth=case.queue_depth,
                                            threads=case.threads, direct=h.direct) / 1e9)
            r = IoResult(op=op, **asdict(case), gbps=statistics.median(ours),
                         gbps_stdev=statistics.stdev(ours) if len(ours) > 1 else 0.0,
                         size=size, repeats=repeats, direct=h.direct, ring=ring, samples=ours)
            if peer:
                r.fio_gbps = statistics.median(peer)
                r.ratio = r.gbps / r.fio_gbps
            results.append(r)
        _verify(h, buf, path)
    return results


def _verify(h: AsyncIO, buf, path: str) -> None:
    """Our bytes must survive the round trip (fio's passes overwrite the file, so write again)."""
    h.write(buf, path)
    n = min(buf.numel(), 1 << 20)
    back = aligned_empty(n, pin=False)
    for off in sorted({0, buf.numel() - n}):
        h.read(back, path, off)
        if not bool(back.eq(buf[off:off + n]).all()):
            raise RuntimeError(f"bench io: the bytes read back from {path} at offset {off} differ "
                               f"from those written ({h!r})")


def _fill(n: int):
    import torch

    return torch.arange(n, dtype=torch.int32).remainder_(253).to(torch.uint8)


def cases(args) -> list[IoCase]:
    backends = [args.backend] if args.backend else [b for b in available_backends() if b != "python"]
    if args.sweep:
        grid = itertools.product(backends, SWEEP_BLOCK_SIZES, SWEEP_QUEUE_DEPTHS, SWEEP_THREADS)
    else:
        grid = itertools.product(backends, [args.block_size], [args.queue_depth], [args.threads])
    return [IoCase(backend=b, block_size=bs, queue_depth=qd, threads=t) for b, bs, qd, t in grid]


def add_arguments(p) -> None:
    p.add_argument("--dir", required=True, help="directory on the disk to measure (a file is created and removed)")
    p.add_argument("--size", default="1GiB", help="file size (default 1GiB)")
    p.add_argument("--backend", default=None, help="one backend (default: every native backend available)")
    p.add_argument("--block-size", default="1MiB")
    p.add_argument("--queue-depth", type=int, default=32)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3, help="timed passes per op; the median is reported")
    p.add_argument("--buffered", action="store_true", help="no O_DIRECT (reads drop the page cache first)")
    p.add_argument("--sweep", action="store_true", help="backends x block sizes x queue depths x threads")
    p.add_argument("--vs-fio", action="store_true", help="run fio at the same settings and print the ratio")
    p.add_argument("--ring", action="store_true",
                   help="move the file through a buffer of queue depth x block size x threads bytes (fio's "
                        "footprint) instead of one buffer of the file's size")
    p.add_argument("--json", action="store_true", help="one JSON object per line instead of a table")
    p.add_argument("--plot", default=None, help="write a heatmap PNG (block size x queue depth per backend/op)")


def run(args) -> int:
    size = parse_size(args.size, name="--size")
    args.block_size = parse_size(args.block_size, name="--block-size")
    if size < 4096 or size % 4096:
        raise SystemExit(f"bench io: --size must be a positive multiple of 4096, got {size}")
    if not os.path.isdir(args.dir):
        raise SystemExit(f"bench io: --dir {args.dir} is not a directory")
    if args.vs_fio and not fio_available():
        raise SystemExit("bench io: --vs-fio needs fio on PATH (apt-get install fio)")
    if args.backend == "python" and args.vs_fio:
        raise SystemExit("bench io: fio has no peer for the python backend; drop --vs-fio")
    todo = cases(args)
    path = os.path.join(args.dir, f"infinity-bench-io-{os.getpid()}.dat")
    if not args.json:
        print(f"# bench io: dir={args.dir} size={format_size(size)} direct={not args.buffered} "
              f"repeats={args.repeats} vs_fio={args.vs_fio} buffer={'ring' if args.ring else 'whole file'} "
              f"configs={len(todo)}", flush=True)
        print(f"{'op':5} {'backend':8} {'block':>6} {'qd':>3} {'thr':>3} {'GB/s':>7} {'±':>5}"
              + (f" {'fio GB/s':>8} {'ratio':>6}" if args.vs_fio else ""), flush=True)
    results = []
    try:
        for case in todo:
            for r in measure(case, path=path, size=size, repeats=args.repeats, direct=not args.buffered,
                             vs_fio=args.vs_fio and case.backend in FIO_ENGINE, ring=args.ring):
                results.append(r)
                _print(r, args)
    finally:
        if os.path.exists(path):
            os.unlink(path)
    if args.plot:
        plot_heatmap(results, args.plot)
    return 0


def _print(r: IoResult, args) -> None:
    if args.json:
        d = asdict(r)
        d.pop("samples")
        print(json.dumps(d), flush=True)
        return
    line = (f"{r.op:5} {r.backend:8} {format_size(r.block_size):>6} {r.queue_depth:>3} {r.threads:>3} "
            f"{r.gbps:7.3f} {r.gbps_stdev:5.2f}")
    if r.fio_gbps is not None:
        line += f" {r.fio_gbps:8.3f} {r.ratio:6.3f}"
    print(line, flush=True)


def plot_heatmap(results: list[IoResult], out: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("bench io: --plot needs matplotlib (pip install matplotlib)", file=sys.stderr)
        raise SystemExit(2)
    panels = sorted({(r.backend, r.op) for r in results})
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.5), squeeze=False)
    for ax, (backend, op) in zip(axes[0], panels):
        rows = [r for r in results if r.backend == backend and r.op == op and r.threads == min(
            x.threads for x in results)]
        bss = sorted({r.block_size for r in rows})
        qds = sorted({r.queue_depth for r in rows})
        grid = [[next((r.gbps for r in rows if r.block_size == b and r.queue_depth == q), float("nan"))
                 for q in qds] for b in bss]
        im = ax.imshow(grid, cmap="viridis", aspect="auto")
        ax.set_xticks(range(len(qds)), [str(q) for q in qds])
        ax.set_yticks(range(len(bss)), [format_size(b) for b in bss])
        ax.set_xlabel("queue depth")
        ax.set_ylabel("block size")
        ax.set_title(f"{backend} {op} GB/s")
        for i, row in enumerate(grid):
            for j, v in enumerate(row):
                ax.text(j, i, f"{v:.2f}", ha="center", va="center", color="w", fontsize=8)
        fig.colorbar(im, ax=ax)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    print(f"# heatmap written to {out}", file=sys.stderr)
