"""Train the repo's small GPT with plain PyTorch or with the engine, and return the loss curve.

Used by the parity tests (fp32 engine vs torch.optim.AdamW, 1 rank vs 2),
and by `python -m infinity.testing.parity` (bench/gpu_check.sh) on CUDA.
The data is a deterministic function of the step, so every run, and every
rank, sees the same global batch.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import socket
import sys

import torch

from infinity.models import GPT, GPTConfig

MODEL = GPTConfig(vocab=256, seq=32, layers=2, dim=64, heads=4)
LR, WD, CLIP = 1e-3, 0.01, 0.0


def batch(step: int, size: int = 4, model: GPTConfig = MODEL):
    """A global batch of `size` sequences from a repeating pattern (learnable, so the loss falls)."""
    g = torch.Generator().manual_seed(1000 + step)
    start = torch.randint(0, model.vocab, (size, 1), generator=g)
    stride = torch.randint(1, 7, (size, 1), generator=g)
    seq = (start + stride * torch.arange(model.seq + 1)) % model.vocab
    return seq[:, :-1], seq[:, 1:]


def engine_config(tier: str = "none", nvme_path=None, *, largest: int | None = None, **over) -> dict:
    """A stage-3 config with every parameter partitioned (persistence 0) and small buffers. `largest`: the
    model's largest parameter, in elements; the NVMe parameter pool's buffers hold it and the prefetch bucket
    two of it. `over`: dotted keys ("zero_optimization.sub_group_size") set last."""
    cfg = {"train_micro_batch_size_per_gpu": 4,
           "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD}},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, "sub_group_size": 40_000,
                                 "stage3_prefetch_bucket_size": 60_000, "stage3_max_reuse_distance": 20_000,
                                 "offload_param": {"device": tier}, "offload_optimizer": {"device": tier}}}
    if tier == "nvme":
        path = [str(p) for p in nvme_path] if isinstance(nvme_path, (list, tuple)) else \
            (None if nvme_path is None else str(nvme_path))
        cfg["zero_optimization"]["offload_param"].update(nvme_path=path, buffer_count=4,
                                                          buffer_size=largest or 20_000)
        cfg["zero_optimization"]["offload_optimizer"].update(nvme_path=path, buffer_count=3)
    if largest is not None:
        cfg["zero_optimization"]["stage3_prefetch_bucket_size"] = 2 * largest
    for key, value in over.items():
        node = cfg
        *path, last = key.split(".")
        for p in path:
            node = node.setdefault(p, {})
        node[last] = value
    return cfg


def train_losses(net, batches, steps: int, *, optimizer=None, clip: float = 0.0) -> list[float]:
    """The training loop of the parity tests: `batches(s)` gives step s's (args, kwargs); the loss is the output
    or its .loss (a Hugging Face output). With `optimizer`, plain torch: backward, clip, step, zero_grad.
    Without, `net` is an Engine: backward and step (its config clips)."""
    out = []
    for s in range(steps):
        args, kwargs = batches(s)
        loss = net(*args, **kwargs)
        loss = loss if isinstance(loss, torch.Tensor) else loss.loss
        if optimizer is None:
            net.backward(loss)
            net.step()
        else:
            loss.backward()
            if clip:
                torch.nn.utils.clip_grad_norm_(net.parameters(), clip)
            optimizer.step()
            optimizer.zero_grad()
        out.append(loss.item())
    return out


def torch_losses(steps: int, *, model: GPTConfig = MODEL, clip: float = CLIP, device="cpu") -> list[float]:
    torch.manual_seed(0)
    m = GPT(model).to(device)
    opt = torch.optim.AdamW(m.parameters(), lr=LR, weight_decay=WD)
    return train_losses(m, lambda s: (tuple(t.to(device) for t in batch(s, model=model)), {}), steps,
                        optimizer=opt, clip=clip)


def gpt_engine(cfg: dict, *, model: GPTConfig = MODEL, use_zero_init: bool = True):
    """The parity GPT from seed 0, built under zero_init(cfg) (or plainly) and initialized with a copy of cfg."""
    from infinity.engine import initialize, zero_init

    cfg = copy.deepcopy(cfg)
    torch.manual_seed(0)
    if use_zero_init:
        with zero_init(cfg):
            m = GPT(model)
    else:
        m = GPT(model)
    return initialize(m, cfg)


def engine_losses(cfg: dict, steps: int, *, model: GPTConfig = MODEL, use_zero_init: bool = True,
                  gas: int = 1, overflow_at: int | None = None, reports: list | None = None) -> list[float]:
    """Train with the engine; each rank takes its slice of the global batch. Returns the global mean losses."""
    engine = gpt_engine({**cfg, "gradient_accumulation_steps": gas}, model=model, use_zero_init=use_zero_init)
    out = []
    try:
        for s in range(steps):
            out.append(train_step(engine, s, model=model, gas=gas, overflow=overflow_at == s))
            if reports is not None:
                reports.append(engine.last_report)
    finally:
        engine.close()
    return out


def train_step(engine, s: int, *, model: GPTConfig = MODEL, gas: int = 1, overflow: bool = False) -> float:
    """Optimizer step s on the global batch(s), each rank on its slice of each micro-batch; the global mean loss."""
    rank, world = engine.rank, engine.world_size
    x, y = batch(s, model=model)
    per = x.shape[0] // (world * gas)
    total = 0.0
    for micro in range(gas):
        lo = (micro * world + rank) * per
        loss = engine(x[lo:lo + per], y[lo:lo + per])
        if overflow:
            loss = loss * float("inf")
        engine.backward(loss)
        total += loss.item() / gas
    engine.step()
    t = torch.tensor([total])
    engine.comm.all_reduce_(t)
    return t.item() / world


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def gloo_rank(rank: int, world: int, port: int):
    """Run the block as rank `rank` of `world` (the environment torchrun would set; 127.0.0.1, gloo), one
    thread for torch; the process group, if the block made one, is destroyed after."""
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    ok = False
    try:
        yield
        ok = True
    finally:
        if dist.is_initialized():
            if ok:
                # Every rank done before any tears its connections down: a gloo rank whose peer closed first can
                # abort in a background thread at exit ("terminate called without an active exception").
                dist.barrier()
            dist.destroy_process_group()


def _rank_main(rank: int, world: int, port: int, cfg: dict, steps: int, out_path: str, kwargs: dict) -> None:
    with gloo_rank(rank, world, port):
        losses = engine_losses(cfg, steps, **kwargs)
        if rank == 0:
            with open(out_path, "w") as f:
                json.dump(losses, f)
    # The work is done and written, and the group is gone. Leave without the interpreter's teardown: a rank of
    # a 2-rank gloo run used to abort at exit now and then ("terminate called without an active exception").
    # The likely cause, a group that destroy_process_group could not free, is fixed (see [Note: a process group
    # that outlives destroy_process_group] in infinity/engine/comm.py); this stays as a second guard.
    sys.stderr.flush()
    os._exit(0)


def spawn_losses(world: int, cfg: dict, steps: int, out_path: str, **kwargs) -> list[float]:
    """engine_losses on `world` gloo ranks over 127.0.0.1 (torch.multiprocessing), rank 0's result."""
    import torch.multiprocessing as mp

    mp.spawn(_rank_main, args=(world, free_port(), cfg, steps, out_path, kwargs), nprocs=world, join=True)
    with open(out_path) as f:
        return json.load(f)


def main(argv=None) -> int:
    """GPU check: fp32 parity of the engine (offload none, cpu, nvme) against torch on the current device. NVMe
    shards reach the device from page-locked pool buffers (see [Note: gathered from the buffer] in params.py)."""
    import tempfile

    steps = 20
    device = "cuda" if torch.cuda.is_available() else "cpu"
    ref = torch_losses(steps, device=device)
    worst = 0.0
    with tempfile.TemporaryDirectory(prefix="infinity-gpu-check.", dir="/var/tmp" if os.path.isdir("/var/tmp")
                                     else None) as swap_dir:
        for tier in ("none", "cpu", "nvme"):
            got = engine_losses(engine_config(tier, swap_dir if tier == "nvme" else None), steps)
            err = max(abs(a - b) / abs(a) for a, b in zip(ref, got))
            worst = max(worst, err)
            print(f"{device} offload={tier}: first {got[0]:.6f} last {got[-1]:.6f} max rel err vs torch {err:.2e}")
    print("PASS" if worst <= 1e-5 else "FAIL")
    return 0 if worst <= 1e-5 else 1


def _dying_rank_main(rank: int, world: int, port: int, cfg: dict, die_at: int, out_path: str, how: str) -> None:
    """Rank `world - 1` dies (os._exit) or hangs mid-run at step `die_at`; rank 0 records how it ended."""
    import time

    from infinity.engine import initialize

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    torch.manual_seed(0)
    engine = initialize(GPT(MODEL), cfg)
    t0 = None
    try:
        for s in range(die_at + 5):
            x, y = batch(s)
            if s == die_at:
                if rank == world - 1:
                    if how == "hang":
                        time.sleep(3600)  # alive but stuck: only the timeout can tell
                    os._exit(3)  # no cleanup at all, like a SIGKILL or an OOM kill
                t0 = time.monotonic()
            loss = engine(x[rank::world], y[rank::world])
            engine.backward(loss)
            engine.step()
        result = {"error": None}
    except Exception as exc:  # noqa: BLE001 - recorded for the test to judge
        result = {"error": type(exc).__name__, "message": str(exc),
                  "seconds": None if t0 is None else time.monotonic() - t0}
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(result, f)
    os._exit(0)


def run_with_a_dying_rank(cfg: dict, out_path: str, *, world: int = 2, die_at: int = 2, timeout_s: float = 120,
                          how: str = "exit"):
    """Start `world` ranks as separate processes; the last dies (or hangs) at step `die_at`. Rank 0's record."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=_dying_rank_main, args=(r, world, port, cfg, die_at, out_path, how)) for r in range(world)]
    for p in procs:
        p.start()
    procs[0].join(timeout_s)
    for p in procs[1:]:
        p.join(1 if how == "hang" else timeout_s)
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.kill()
        p.join()
    with open(out_path) as f:
        record = json.load(f)
    record["hung"] = procs[0] in alive
    return record


def memory_run(nvme_path: str, steps: int = 3, layers: int = 16) -> dict:
    """Train a model whose fp32 state is several times the swap buffers, all on NVMe; measure peak RSS.

    Returns the state and pool sizes and the peak RSS over the RSS before the model existed.
    """
    from infinity.engine import initialize, zero_init
    from infinity.memory_stats import peak_rss_bytes, reset_peak, rss_bytes

    model = GPTConfig(vocab=1024, seq=64, layers=layers, dim=256, heads=4)
    largest = 4 * model.dim * model.dim
    cfg = engine_config("nvme", nvme_path, **{
        "zero_optimization.sub_group_size": largest, "zero_optimization.stage3_prefetch_bucket_size": 2 * largest,
        "zero_optimization.stage3_max_reuse_distance": 0, "zero_optimization.offload_param.buffer_size": largest,
        "zero_optimization.offload_param.buffer_count": 4, "zero_optimization.offload_optimizer.buffer_count": 3})
    torch.manual_seed(0)
    x, y = batch(0, size=2, model=model)
    import gc

    # torch.optim.Optimizer's first construction imports torch._dynamo (~70 MB, once per process): that is
    # interpreter baseline, not the engine's, so it happens before the baseline is read.
    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    gc.collect()
    reset_peak()
    baseline = rss_bytes()
    with zero_init(cfg):
        m = GPT(model)
    engine = initialize(m, cfg)
    numel = sum(mp.numel for mp in engine.store.params)
    pool = engine.store.swap.pool.nbytes + engine.optimizer.swap.pool.nbytes
    losses = []
    try:
        for s in range(steps):
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    finally:
        engine.close()
    return {"numel": numel, "state_bytes": 16 * numel, "pool_bytes": pool, "baseline_rss": baseline,
            "peak_over_baseline": peak_rss_bytes() - baseline, "losses": losses}


def _memory_main(nvme_path: str, out_path: str) -> None:
    torch.set_num_threads(1)
    with open(out_path, "w") as f:
        json.dump(memory_run(nvme_path), f)


def memory_run_in_child(nvme_path: str, out_path: str) -> dict:
    """memory_run in a fresh process, so that no earlier test's memory is in its peak."""
    return run_in_child(_memory_main, (nvme_path, out_path), out_path, "memory_run")


def run_in_child(target, args: tuple, out_path: str, what: str, timeout_s: float = 300) -> dict:
    """target(*args) in a fresh (spawned) process that writes its JSON result to out_path; that result."""
    import multiprocessing

    p = multiprocessing.get_context("spawn").Process(target=target, args=args)
    p.start()
    p.join(timeout_s)
    if p.exitcode != 0:
        raise RuntimeError(f"{what} child exited with {p.exitcode}")
    with open(out_path) as f:
        return json.load(f)


if __name__ == "__main__":
    sys.exit(main())
