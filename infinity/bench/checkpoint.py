"""`infinity bench checkpoint`: save and load GB/s of an NVMe-offloaded model, beside fio on the same disk.

One engine (the repo's GPT, parameters and optimizer on NVMe, or in RAM
with --offload ram) takes a training step, then for --rounds rounds: fio's
sequential writes (to a new file, then overwriting) and read of a 1 GiB
file (O_DIRECT, the config's block size and queue depth), our save (a new
tag each round; the previous round's checkpoint is removed untimed), and
our load with and without the verification pass (see [Note: verify before
load]). fio and ours alternate which goes first. The median of each
is reported as GB/s of checkpoint bytes (12 per parameter plus CRCs and
metadata), and against fio as time / bound, the bound being the time fio's
read and write rates need for every byte the operation moved: a save also
reads the optimizer's swap files, a load also writes them (and, in bf16,
the parameter shards), and a verified load reads the checkpoint twice. A
save creates its files, so its writes are held to fio writing a new file
(--fallocate=none: blocks allocated as it goes); the swap writes of a load
overwrite, as fio's default write does. RSS is sampled every 5 ms: the growth
during a save or load, over the RSS before it, is what a checkpoint costs
in memory beyond the swap pools the engine already holds.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import tempfile
import time
from types import SimpleNamespace

from infinity.bench.fio import fio_available, run_fio
from infinity.memory_stats import PeakSampler, rss_bytes


def add_arguments(p) -> None:
    p.add_argument("--dir", default=None, help="directory for swap files and checkpoints (default: a temp dir "
                                               "under /var/tmp)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--dim", type=int, default=768)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--precision", choices=("fp32", "bf16"), default="bf16")
    p.add_argument("--offload", choices=("nvme", "ram"), default="nvme",
                   help="where parameters and optimizer live (ram: a save is only the checkpoint's writes)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--no-fio", action="store_true", help="skip the fio peer")
    p.add_argument("--json", action="store_true")


def trained_engine(work: str, *, layers: int, dim: int, vocab: int, precision: str, offload: str, seq: int = 128):
    """The bench's GPT (bench train's config: parameters and optimizer on NVMe under `work`, or in RAM) after one
    training step, so that Adam's moments are real."""
    import torch

    from infinity.bench.train import config
    from infinity.engine import initialize, zero_init
    from infinity.models import GPT
    from infinity.testing.parity import batch

    shape = SimpleNamespace(vocab=vocab, seq=seq, layers=layers, dim=dim, heads=8, batch=2, precision=precision)
    model_cfg, cfg = config(shape, offload, work)
    if offload == "ram":
        for k in ("offload_param", "offload_optimizer"):
            cfg["zero_optimization"][k] = {"device": "cpu"}
    torch.manual_seed(0)
    with zero_init(cfg):
        model = GPT(model_cfg)
    engine = initialize(model, cfg)
    try:
        x, y = batch(0, size=2, model=model_cfg)
        engine.backward(engine(x, y))
        engine.step()
    except BaseException:
        engine.close()
        raise
    return engine


def _dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def run(args) -> int:
    if args.rounds < 1:
        raise ValueError(f"bench checkpoint: --rounds must be >= 1, got {args.rounds}")
    base = args.dir or "/var/tmp"
    if not os.path.isdir(base):
        raise FileNotFoundError(f"bench checkpoint: --dir {base} does not exist")
    work = tempfile.mkdtemp(prefix="infinity-bench-ckpt-", dir=base)
    try:
        engine = trained_engine(work, layers=args.layers, dim=args.dim, vocab=args.vocab, precision=args.precision,
                                offload=args.offload)
        try:
            numel = sum(mp.numel for mp in engine.store.params)
            aio = engine.config.aio
            from infinity.checkpoint.stream import open_io

            with open_io(engine.config, work) as probe:  # the backend a checkpoint's I/O runs on
                backend = probe.backend if probe.backend in ("libaio", "io_uring", "threads") else "libaio"
            rows = []
            ck = os.path.join(work, "ck")
            for r in range(args.rounds):
                row = {}
                order = ("fio", "ours") if r % 2 == 0 else ("ours", "fio")
                for who in order:
                    if who == "fio" and not args.no_fio and fio_available():
                        path = os.path.join(work, "fio.dat")
                        kw = dict(path=path, size=1 << 30, backend=backend, block_size=aio.block_size, queue_depth=aio.queue_depth, threads=1, direct=True)
                        # A checkpoint writes new files: fio's peer of that is a write that allocates as it goes.
                        row["fio_write_new_gbps"] = run_fio(op="write", **kw, extra=("--fallocate=none",)) / 1e9
                        row["fio_write_gbps"] = run_fio(op="write", **kw) / 1e9  # overwriting, as swap writes do
                        row["fio_read_gbps"] = run_fio(op="read", **kw) / 1e9
                        os.unlink(path)
                    elif who == "ours":
                        row.update(_ours(engine, ck, f"round{r}"))
                        shutil.rmtree(os.path.join(ck, f"round{r - 1}"), ignore_errors=True)
                rows.append(row)
                print(json.dumps({"round": r, **{k: round(v, 4) for k, v in row.items()}}), flush=True)
            pools = sum(c.pool.nbytes for c in (engine.optimizer.swap, engine.store.swap) if c is not None)
        finally:
            engine.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    out = {"parameters": numel, "pool_bytes": pools, "rounds": args.rounds, "precision": args.precision, **med,
           "save_rss_growth": max(r["save_rss_growth"] for r in rows),
           "load_rss_growth": max(r["load_rss_growth"] for r in rows)}
    ck_bytes = med["checkpoint_bytes"]
    ops = ("save", "load", "load_unverified")
    for op in ops:
        out[f"{op}_gbps"] = ck_bytes / med[f"{op}_s"] / 1e9
        if "fio_write_gbps" in med:  # the time fio's rates need for the bytes this operation moved
            write_rate = med["fio_write_new_gbps"] if op == "save" else med["fio_write_gbps"]
            bound = (med[f"{op}_read_bytes"] / med["fio_read_gbps"] + med[f"{op}_write_bytes"] / write_rate) / 1e9
            out[f"{op}_io_bound_s"] = bound
            out[f"{op}_vs_bound"] = med[f"{op}_s"] / bound
    if args.json:
        print(json.dumps(out))
        return 0
    where = "NVMe" if args.offload == "nvme" else "RAM"
    print(f"{numel / 1e6:.1f}M parameters ({args.precision}, parameters and optimizer in {where}), checkpoint "
          f"{ck_bytes / 1e9:.2f} GB, median of {args.rounds} rounds"
          + (f"; fio: write {med['fio_write_new_gbps']:.2f} GB/s to a new file, {med['fio_write_gbps']:.2f} "
             f"overwriting, read {med['fio_read_gbps']:.2f} GB/s"
             if "fio_write_gbps" in med else ""))
    print(f"{'':18} {'GB/s':>6} {'time s':>7} {'disk read GB':>12} {'disk write GB':>13} {'fio bound s':>11} "
          f"{'time/bound':>10}")
    for op, label in zip(ops, ("save", "load (verified)", "load (unverified)")):
        bound = (f" {out[f'{op}_io_bound_s']:>11.2f} {out[f'{op}_vs_bound']:>10.2f}"
                 if f"{op}_io_bound_s" in out else "")
        print(f"{label:18} {out[f'{op}_gbps']:>6.2f} {med[f'{op}_s']:>7.2f} {med[f'{op}_read_bytes'] / 1e9:>12.2f} "
              f"{med[f'{op}_write_bytes'] / 1e9:>13.2f}{bound}")
    print(f"RSS growth: save {out['save_rss_growth'] / 2**20:.0f} MiB, load {out['load_rss_growth'] / 2**20:.0f} MiB "
          f"(beyond the swap pools the engine already holds: {pools / 2**20:.0f} MiB)")
    return 0


def _swap_bytes(engine) -> tuple[int, int]:
    """(read, written) bytes of the engine's swap files so far (optimizer and parameter swappers)."""
    sws = [c.swapper for c in (engine.optimizer.swap, engine.store.swap) if c is not None]
    return sum(s.bytes_read for s in sws), sum(s.bytes_written for s in sws)


def _ours(engine, ck: str, tag: str) -> dict:
    """Save, verified load, unverified load of `tag`; times, RSS growth, and the bytes each moved on disk."""
    out = {}
    for c in (engine.optimizer.swap, engine.store.swap):  # the pools are held memory, not the save's growth
        if c is not None:
            c.pool.prefault()
    r0, w0 = _swap_bytes(engine)
    before = rss_bytes()
    with PeakSampler() as rss:
        t0 = time.perf_counter()
        path = engine.save_checkpoint(ck, tag)
        out["save_s"] = time.perf_counter() - t0
    out["save_rss_growth"] = max(0, rss.peak - before)
    ck_bytes = _dir_bytes(path)
    r1, w1 = _swap_bytes(engine)
    out["save_read_bytes"], out["save_write_bytes"] = r1 - r0, ck_bytes
    before = rss_bytes()
    with PeakSampler() as rss:
        t0 = time.perf_counter()
        engine.load_checkpoint(ck, tag)
        out["load_s"] = time.perf_counter() - t0
    out["load_rss_growth"] = max(0, rss.peak - before)
    r2, w2 = _swap_bytes(engine)
    out["load_read_bytes"], out["load_write_bytes"] = 2 * ck_bytes + (r2 - r1), w2 - w1
    t0 = time.perf_counter()
    engine.load_checkpoint(ck, tag, verify=False)
    out["load_unverified_s"] = time.perf_counter() - t0
    r3, w3 = _swap_bytes(engine)
    out["load_unverified_read_bytes"], out["load_unverified_write_bytes"] = ck_bytes + (r3 - r2), w3 - w2
    out["checkpoint_bytes"] = ck_bytes
    return out
