"""The offload planner: what lives where, from the model's size, the memory budget and measured speeds.

`infinity plan --model gpt-1b --memory-budget 8GiB --nvme-path /nvme` (and
`infinity train --memory-budget ...`, which plans first) decides:

  * where the parameters live (in RAM, or NVMe behind a pool of buffers);
  * where the optimizer state lives (RAM with the SIMD CPU Adam, or NVMe);
  * the buffer counts and sizes, the optimizer sub-group size and the prefetch size;

and predicts the peak host memory and the step time.

[Note: what the memory budget covers]
The budget is the host memory the training may add to the process's
baseline: the interpreter, torch and the model's code, measured at start
(about 300 MiB here, and printed). It covers the state kept in RAM, the
swap buffers, gradients, activations and an allowance for the allocator.
Counting the baseline in would make a small budget meaningless and is
the same for every plan. With N local ranks each rank gets budget / N.

[Note: the cost model]
Placement tries the fastest layout first and takes the first that fits:
  1. parameters and optimizer state in RAM;
  2. parameters in RAM, optimizer state on NVMe;
  3. both on NVMe.
Pools get what the budget leaves after the fixed costs, up to what helps
(5 optimizer buffers to overlap read, Adam and write, which bench swap
showed meets its target where 3 do not; parameter buffers for two layers
of prefetch).

The step time is predicted from rates measured in a few seconds at plan
time: one real layer's forward + backward at the run's batch and dtype
(FLOPs at the measured matmul speed for what is not in the layers, or
for models whose layer cannot run alone), CPU Adam parameters/s, memcpy
and CRC-32C bytes/s, and the disk's read and write bytes/s through our
AsyncIO with the config's aio settings:

  cpu  = layers x layer time (x 4/3 when checkpointed) + per-module hook cost
         + Adam + pool copies and checksums + per-parameter engine work
  io   = bytes read / read rate + bytes written / write rate
  step = max(cpu, io) + OVERLAP_LEAK x min(cpu, io)

The engine overlaps I/O with compute (prefetch, stepping during backward,
the pipelined optimizer swapper), so the longer of the two sets the pace;
OVERLAP_LEAK is the share of the shorter one that still shows: 0.1 when
the disk sets the pace, 0.5 when compute does (on 2 cores the I/O threads
need the CPU too). OVERLAP_LEAK, PER_MODULE_S and PER_PARAM_S are the
constants not measured in the run: they were fitted on the reference VM
(2 cores) to `infinity bench plan` runs of gpt-small to gpt-2b and a
profile of gpt-100m, so elsewhere the prediction is only as good as they
transfer.

Peak memory is the larger of two phases: setup (the fp32 state being
built) and training (state in RAM, buffers, activations, gathered
parameters, gradients in flight). See [Note: what the memory budget covers].
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import tempfile
import time
from dataclasses import dataclass

from infinity.units import parse_size

MODEL_EFFICIENCY = 0.6
PER_MODULE_S = {"nvme": 1.5e-3, "none": 0.3e-3}  # hooks, pool bookkeeping and futures per module gather
PER_PARAM_S = 5e-9                # gradient zeroing/accumulation, conversions, norms, copies (profiled)
# The share of the shorter of compute and I/O that still shows: small when the disk sets the pace (compute
# runs in its shadow on the other core), larger when compute does (I/O needs the cores too).
OVERLAP_LEAK = {"io_bound": 0.1, "cpu_bound": 0.5}
ALLOCATOR_SLACK = 1.1            # fragmentation and autograd bookkeeping, on the variable part
FIXED_OVERHEAD = 8 << 20         # threads, handles, Python objects of the engine, glibc arenas
OPT_BUFFERS = (5, 4, 3)          # preferred optimizer buffer counts, best first (3 is the least that overlaps)
MIN_PARAM_BUFFERS = 3
MARGIN = 0.1                     # of what is left after the fixed costs, kept free for the model's error


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelShape:
    """What the planner needs to know of a model, read off a meta-device build."""

    name: str
    numel: int                 # unique parameters
    largest: int               # elements of the largest parameter
    layers: int
    dim: int
    vocab: int
    seq: int
    checkpoint: bool           # activation checkpointing per layer
    largest_module: int        # most parameter elements one module owns directly (gathered at once)
    modules: int               # modules that own parameters (each is gathered and released, twice a step)
    block: object = None       # one repeated layer, on the meta device, for timing (None if none was found)


@dataclass(frozen=True, kw_only=True, slots=True)
class Rates:
    """Measured speeds (bytes/s, FLOP/s, parameters/s)."""

    flops: float
    adam_params_s: float
    memcpy_bytes_s: float
    disk_read_bytes_s: float | None
    disk_write_bytes_s: float | None
    layer_s: float | None = None  # one layer's forward + backward at the run's batch (None: not measurable)
    crc_bytes_s: float | None = None  # CRC-32C of swapped bytes (checksums on)

    def describe(self) -> str:
        disk = "no disk" if self.disk_read_bytes_s is None else (
            f"disk read {self.disk_read_bytes_s / 1e9:.2f} GB/s, write {self.disk_write_bytes_s / 1e9:.2f} GB/s")
        layer = "" if self.layer_s is None else f"one layer fwd+bwd {self.layer_s * 1e3:.1f} ms, "
        return (f"{layer}matmul {self.flops / 1e9:.0f} GFLOP/s, CPU Adam {self.adam_params_s / 1e6:.0f}M params/s, "
                f"memcpy {self.memcpy_bytes_s / 1e9:.1f} GB/s, {disk}")


@dataclass(frozen=True, kw_only=True, slots=True)
class Plan:
    param_tier: str            # none | nvme
    optimizer_tier: str        # cpu | nvme
    param_buffer_count: int
    param_buffer_size: int     # elements
    optimizer_buffer_count: int
    sub_group_size: int        # elements
    prefetch_bucket: int       # elements
    memory: dict               # bytes over baseline, by item, in the phase with the higher peak
    peak_phase: str            # "training" or "setup" (building the fp32 state)
    predicted_peak_bytes: int  # over baseline
    predicted_step_s: float
    time: dict                 # seconds, by item
    io_read_bytes: int
    io_write_bytes: int
    config: dict               # the complete swap config (DeepSpeed keys + infinity)


def model_shape(name: str, seq: int | None = None) -> ModelShape:
    """Build the model on the meta device (no memory, no init) and read its shape."""
    import torch

    from infinity.train import build_model

    with torch.device("meta"):
        model, vocab, model_seq, _ = build_model(name)
    seen, numel, largest = set(), 0, 0
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        numel += p.numel()
        largest = max(largest, p.numel())
    owned = [sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules()]
    largest_module = max(owned)
    cfg = getattr(model, "cfg", None) or getattr(model, "config", None)
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m)]
    block = max(lists, key=lambda m: sum(p.numel() for p in m.parameters()))[0] if lists else None
    layers = _attr(cfg, "layers", "n_layer", "num_hidden_layers")
    dim = _attr(cfg, "dim", "n_embd", "hidden_size")
    checkpoint = bool(getattr(cfg, "checkpoint", False))
    return ModelShape(name=name, numel=numel, largest=largest, layers=layers, dim=dim, vocab=vocab,
                      seq=min(seq or model_seq, model_seq, 256), checkpoint=checkpoint,
                      largest_module=largest_module, modules=sum(1 for n in owned if n), block=block)


def _attr(obj, *names) -> int:
    for n in names:
        v = getattr(obj, n, None)
        if isinstance(v, int):
            return v
    raise ValueError(f"the planner cannot read {' / '.join(names)} from the model's config")


# ---------------------------------------------------------------- measuring


def measure_layer(block, *, micro: int, seq: int, dim: int, dtype) -> float | None:
    """Seconds for one forward + backward of one layer at the run's batch, in the compute dtype.

    The layer is materialised from its meta-device copy with small random weights. None when its forward
    does not take a bare (batch, seq, dim) tensor (some Hugging Face layers need masks or rotary tables);
    the planner then falls back to counting FLOPs.
    """
    import copy

    import torch

    if block is None:
        return None
    try:
        layer = copy.deepcopy(block).to_empty(device="cpu").to(dtype)
        with torch.no_grad():
            for p in layer.parameters():
                p.normal_(0.0, 0.02)
        x = torch.randn(micro, seq, dim, dtype=dtype, requires_grad=True)
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            y = layer(x)
            y = y[0] if isinstance(y, tuple) else y
            y.float().sum().backward()
            best = min(best, time.perf_counter() - t0)
        return best
    except Exception:  # any layer that cannot run alone: use the FLOPs estimate
        return None


def measure_rates(*, dim: int, tokens: int, dtype, nvme_path: str | None, aio: dict | None = None,
                  disk_bytes: int = 256 << 20, shape: "ModelShape | None" = None, micro: int = 1,
                  direct: bool = True) -> Rates:
    """A few seconds of measurement: matmul, one layer, CPU Adam, memcpy, and a write and read pass on the disk."""
    import torch

    from infinity._native_loader import native
    from infinity.optim import cpu_adam_step

    a = torch.randn(max(tokens, 64), dim).to(dtype)
    b = torch.randn(dim, 4 * dim).to(dtype)
    torch.mm(a, b)
    reps, t0 = 0, time.perf_counter()
    while reps < 3 or time.perf_counter() - t0 < 0.3:
        torch.mm(a, b)
        reps += 1
    flops = 2 * a.shape[0] * dim * 4 * dim * reps / (time.perf_counter() - t0)

    n = 1 << 22
    p, g, m, v = (torch.randn(n) for _ in range(4))
    v.abs_()
    adam = n / _best_of(4, lambda: cpu_adam_step(p, g, m, v, step=2, lr=1e-3))

    # CPU rates are the best of a few passes: on a shared machine noise only ever slows a pass down.
    src = torch.empty(64 << 20, dtype=torch.uint8).fill_(1)
    dst = torch.empty_like(src)
    memcpy = src.numel() / _best_of(4, lambda: dst.copy_(src))
    crc = None
    if native is not None:  # the pure-Python CRC would take minutes here; without the extension, no checksum term
        crc = src.numel() / _best_of(4, lambda: native.crc32c(src.data_ptr(), src.numel()))

    read = write = None
    if nvme_path is not None:
        read, write = measure_disk(nvme_path, aio or {}, disk_bytes, direct=direct)
    layer = None if shape is None else measure_layer(shape.block, micro=micro, seq=shape.seq, dim=shape.dim,
                                                      dtype=dtype)
    return Rates(flops=flops, adam_params_s=adam, memcpy_bytes_s=memcpy, disk_read_bytes_s=read,
                 disk_write_bytes_s=write, layer_s=layer, crc_bytes_s=crc)


def _best_of(n: int, fn) -> float:
    """The fastest of n timed calls (after one untimed warm-up call)."""
    fn()
    best = float("inf")
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measure_disk(path: str, aio: dict, nbytes: int, direct: bool = True) -> tuple[float, float]:
    """(read, write) bytes/s of one pass each through AsyncIO with these aio settings; the file is removed."""
    from infinity.io import AsyncIO, aligned_empty

    f = os.path.join(path, f"infinity-plan-{os.getpid()}.dat")
    buf = aligned_empty(nbytes, pin=False)
    buf.fill_(7)
    backend = aio.get("backend", "auto")
    try:
        with AsyncIO(backend=backend if backend != "python" else "auto",
                     block_size=aio.get("block_size", 1 << 20), queue_depth=aio.get("queue_depth", 32),
                     threads=aio.get("intra_op_parallelism", aio.get("thread_count", 1)), direct=direct,
                     single_submit=aio.get("single_submit", False),
                     overlap_events=aio.get("overlap_events", True)) as h:
            h.write(buf, f)  # lay out
            t0 = time.perf_counter()
            h.write(buf, f)
            write = nbytes / (time.perf_counter() - t0)
            t0 = time.perf_counter()
            h.read(buf, f)
            read = nbytes / (time.perf_counter() - t0)
    finally:
        if os.path.exists(f):
            os.unlink(f)
    return read, write


# ---------------------------------------------------------------- planning


def lowp_bytes(precision: str) -> int:
    return 4 if precision == "fp32" else 2


def activation_bytes(shape: ModelShape, micro: int, precision: str) -> int:
    """Peak activation memory of one micro-batch's forward + backward.

    Per layer a transformer keeps about 17 values per (token, width) element
    (attention inputs and outputs, the 4x MLP, norms, residuals; CPU SDPA does
    not keep the t x t scores). With checkpointing only each layer's input is
    kept, plus one layer's full set while it is recomputed. The loss keeps the
    logits, their fp32 copy and its gradient.
    """
    e = lowp_bytes(precision)
    tokens = micro * shape.seq
    per_layer = 17 * tokens * shape.dim * e
    if shape.checkpoint:
        layers = shape.layers * tokens * shape.dim * e + per_layer
    else:
        layers = shape.layers * per_layer
    logits = tokens * shape.vocab * (e + 4 + 4)
    return layers + logits


def plan(shape: ModelShape, budget: int, rates: Rates, *, precision: str = "bf16", micro: int = 1,
         world: int = 1, nvme_path: str | None = None, base: dict | None = None, clipping: bool = False,
         grad_accum: int = 1) -> Plan:
    """The fastest placement that fits `budget` bytes over the baseline (per rank: budget is per host)."""
    per_rank = budget // world
    shard = math.ceil(shape.numel / world)
    largest_shard = math.ceil(shape.largest / world)
    e = lowp_bytes(precision)
    full_grads = clipping or grad_accum > 1 or precision == "fp16"  # then every gradient waits in RAM
    act = activation_bytes(shape, micro, precision)
    # Gathered at once: the biggest module's full parameters and their gradients, in the compute dtype.
    gathered = 2 * shape.largest_module * e
    reduce_bucket = max(shape.largest_module, min(1 << 22, shard // 8))
    # The bucket being filled can pass reduce_bucket by up to one parameter, and while one is packed and
    # reduced the previous may still be in flight: three buckets' worth of fp32.
    buckets = 3 * 4 * (reduce_bucket + shape.largest_module) if world > 1 else 0
    # (params, optimizer, state in RAM while training, state in RAM during setup, pools).
    # Parameters kept in RAM are built in fp32 (their initial values become the fp32 master weights), and each
    # optimizer sub-group turns its parameters into the compute dtype once its master exists: setup holds
    # 4 B/param of them, training e B/param.
    candidates = [
        ("none", "cpu", shard * (12 + e), shard * (12 + e), None),  # master + m + v beside the parameters
        ("none", "nvme", shard * e, shard * 4, "opt"),
        ("nvme", "nvme", 0, 0, "both"),
    ]
    if nvme_path is None:
        candidates = candidates[:1]
    reasons = []
    for ptier, otier, state, setup_state, pools in candidates:
        transient = {"activations": act, "gathered_params": gathered, "gradients": 4 * shard if full_grads else 0,
                     "comm_buckets": buckets}
        mem = {"state_in_ram": state, **{k: int(ALLOCATOR_SLACK * v) for k, v in transient.items()},
               "fixed": FIXED_OVERHEAD}
        need = max(sum(mem.values()), setup_state + FIXED_OVERHEAD)
        left = per_rank - need
        if left < 0:
            reasons.append(f"params {_tier(ptier)} + optimizer {_tier(otier)} needs {format_size_h(need)} "
                           f"before any swap buffer")
            continue
        sizing = _size_pools(pools, left, shape, shard, largest_shard, full_grads)
        if sizing is None:
            reasons.append(f"params {_tier(ptier)} + optimizer {_tier(otier)}: the {format_size_h(left)} left "
                           f"cannot hold the smallest working set of buffers")
            continue
        pbufs, psize, obufs, group, prefetch, pool_bytes, inflight_grads = sizing
        mem["swap_buffers"] = pool_bytes
        mem["gradients"] += inflight_grads
        # Setup: the state above, the pools, and one sub-group's master being built.
        setup = {"state_in_ram": setup_state, "swap_buffers": pool_bytes, "master_being_built": 4 * group,
                 "fixed": FIXED_OVERHEAD}
        phase = "training" if sum(mem.values()) >= sum(setup.values()) else "setup"
        if phase == "setup":
            mem = setup
        peak = sum(mem.values())
        if peak > per_rank:
            reasons.append(f"params {_tier(ptier)} + optimizer {_tier(otier)}: needs {format_size_h(peak)} "
                           f"with its buffers")
            continue
        reads, writes = io_bytes(ptier, otier, shard, precision)
        t = step_time(shape, rates, micro=micro, shard=shard, reads=reads, writes=writes, param_tier=ptier,
                      checksums=bool((base or {}).get("infinity", {}).get("checksums", True)), world=world)
        cfg = _config(base, ptier, otier, nvme_path, pbufs, psize, obufs, group, prefetch, budget, precision,
                      micro, reduce_bucket)
        return Plan(param_tier=ptier, optimizer_tier=otier, param_buffer_count=pbufs, param_buffer_size=psize,
                    optimizer_buffer_count=obufs, sub_group_size=group, prefetch_bucket=prefetch, memory=mem,
                    peak_phase=phase, predicted_peak_bytes=peak, predicted_step_s=t["step"], time=t,
                    io_read_bytes=reads, io_write_bytes=writes, config=cfg)
    hint = "" if nvme_path is not None else "; with --nvme-path the state can go to disk"
    raise ValueError(f"--memory-budget {format_size_h(budget)}: no placement of {shape.name} "
                     f"({shape.numel / 1e6:.1f}M params, {world} rank(s)) fits: " + "; ".join(reasons) + hint)


def _tier(t: str) -> str:
    return {"none": "in RAM", "cpu": "in RAM", "nvme": "on NVMe"}[t]


def format_size_h(n: float) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def _size_pools(pools, left: int, shape: ModelShape, shard: int, largest_shard: int, full_grads: bool):
    """(param buffers, param buffer elements, optimizer buffers, sub-group elements, prefetch elements,
    pool bytes, bytes of fp32 gradients in flight), or None when nothing workable fits in `left` bytes.

    Without full gradients, a sub-group's fp32 gradients live from its first gradient to its step, so about
    two sub-groups' worth are in flight; they count against the budget like the buffers.
    """
    grads = 0 if full_grads else 2 * 4 * ALLOCATOR_SLACK
    left = int(left * (1 - MARGIN))
    if pools is None:  # optimizer in RAM: sub-groups bound the gradients in flight and the master being built
        group = max(largest_shard, min(shard, 1 << 24, int(left // (grads + 4))))
        return 1, largest_shard, 1, group, 0, 0, int(min(grads * group, grads / 2 * shard))
    # Parameter buffers hold fp32 shards (4 B/element) and must hold the largest one.
    psize = largest_shard
    layer = max(math.ceil(shape.numel / max(shape.layers, 1) / max(math.ceil(shape.numel / shard), 1)), 1)
    pbufs = pbytes = 0
    min_opt = int((min(OPT_BUFFERS) * 12 + grads) * max(largest_shard, 1))
    if pools == "both":
        # The least that works first (MIN_PARAM_BUFFERS, and 3 optimizer buffers of the largest shard); then
        # up to two layers of prefetch, from at most a third of what remains beyond that.
        pbufs = MIN_PARAM_BUFFERS
        spare = left - pbufs * 4 * psize - min_opt
        if spare < 0:
            return None
        want = max(MIN_PARAM_BUFFERS, math.ceil(2 * layer / psize) + 1)
        pbufs += min(want - MIN_PARAM_BUFFERS, (spare // 3) // (4 * psize))
        pbytes = pbufs * 4 * psize
    elif left < min_opt:
        return None
    rest = left - pbytes
    # Optimizer sub-groups: as large as the rest allows with the most buffers, never smaller than the largest
    # shard (sub-groups do not split a parameter) and never beyond 64M elements or the whole shard.
    for obufs in OPT_BUFFERS:
        group = min(int(rest // (12 * obufs + grads)), 1 << 26, shard)
        if group >= max(largest_shard, 1):
            break
    else:
        return None
    group = int(group)
    prefetch = max(psize, (pbufs - 1) * psize) if pools == "both" else 0
    inflight = int(min(grads * group, grads / 2 * shard))  # two sub-groups, or the whole shard if smaller
    return pbufs or 1, psize, obufs, group, int(prefetch), pbytes + obufs * 12 * group, inflight


def io_bytes(ptier: str, otier: str, shard: int, precision: str) -> tuple[int, int]:
    """Bytes read and written per step per rank (see issue 5's I/O volume: 32 B/param fp32, 30 bf16)."""
    e = lowp_bytes(precision)
    reads = writes = 0
    if otier == "nvme":
        reads += 12 * shard     # master, m, v
        writes += 12 * shard
    if ptier == "nvme":
        reads += 2 * e * shard  # forward and backward (fp32: slices of the optimizer's files)
        if precision != "fp32":
            writes += e * shard  # the new low-precision copy
    return reads, writes


def step_time(shape: ModelShape, rates: Rates, *, micro: int, shard: int, reads: int, writes: int,
              param_tier: str, checksums: bool = True, world: int = 1) -> dict:
    tokens = micro * shape.seq
    passes = 8 if shape.checkpoint else 6  # forward 2, backward 4, recompute 2 FLOPs per param per token
    flops = passes * shape.numel * tokens + passes * shape.layers * shape.seq * shape.seq * shape.dim * micro
    if rates.layer_s is not None:
        # Measured layers (a checkpointed layer runs its forward twice: + 1/3), FLOPs for the rest (embeddings,
        # the LM head, the loss).
        in_layers = shape.layers * sum(p.numel() for p in shape.block.parameters())  # layer_s implies a block
        rest = max(shape.numel - in_layers, 0)
        compute = shape.layers * rates.layer_s * (4 / 3 if shape.checkpoint else 1.0)
        compute += 6 * rest * tokens / (rates.flops * MODEL_EFFICIENCY)
    else:
        compute = flops / (rates.flops * MODEL_EFFICIENCY)
    adam = shard / rates.adam_params_s
    copies = (reads + writes) / rates.memcpy_bytes_s
    if checksums and rates.crc_bytes_s:
        copies += (reads + writes) / rates.crc_bytes_s
    io = 0.0
    if reads or writes:
        # The ranks on this host share its disk (and its cores, below): each waits for all of them.
        io = world * (reads / rates.disk_read_bytes_s + writes / rates.disk_write_bytes_s)
    # Each module with parameters is gathered and released in forward and in backward (and again when a
    # checkpointed layer is recomputed): hooks, pool bookkeeping, futures.
    hooks = (3 if shape.checkpoint else 2) * shape.modules * PER_MODULE_S[param_tier]
    compute += hooks
    # Per-parameter engine work every step: zeroing and accumulating fp32 gradients, dtype conversions,
    # norms, copies of gathered shards.
    engine = shard * PER_PARAM_S
    cpu = compute + adam + copies + engine
    if not _cuda():  # CPU training: the local ranks share this host's cores
        cpu *= world
    step = io + OVERLAP_LEAK["io_bound"] * cpu if io >= cpu else cpu + OVERLAP_LEAK["cpu_bound"] * io
    return {"step": step, "compute": compute, "adam": adam, "copies": copies, "engine": engine, "io": io}


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _config(base, ptier, otier, nvme_path, pbufs, psize, obufs, group, prefetch, budget, precision, micro,
            reduce_bucket) -> dict:
    """A complete swap config with DeepSpeed's keys; `base` (a config dict) supplies everything not planned."""
    cfg = json.loads(json.dumps(base or {}))
    cfg["train_micro_batch_size_per_gpu"] = micro
    cfg["bf16"] = {"enabled": precision == "bf16"}
    cfg["fp16"] = dict(cfg.get("fp16", {}), enabled=precision == "fp16")
    zero = cfg.setdefault("zero_optimization", {})
    zero["stage"] = 3
    # Only the placement and the sizes are planned; the base's other choices (pin_memory, pipelining) stay.
    keep = ("pin_memory", "pipeline_read", "pipeline_write")
    zero["offload_param"] = {"device": ptier, **{k: v for k, v in zero.get("offload_param", {}).items() if k in keep}}
    zero["offload_optimizer"] = {"device": otier,
                                 **{k: v for k, v in zero.get("offload_optimizer", {}).items() if k in keep}}
    if ptier == "nvme":
        zero["offload_param"].update(nvme_path=nvme_path, buffer_count=pbufs, buffer_size=psize)
        zero["stage3_prefetch_bucket_size"] = prefetch
        zero["stage3_max_reuse_distance"] = 0
    if otier == "nvme":
        zero["offload_optimizer"].update(nvme_path=nvme_path, buffer_count=obufs)
    zero["sub_group_size"] = group
    zero["reduce_bucket_size"] = reduce_bucket
    cfg.setdefault("infinity", {})["memory_budget"] = budget
    return cfg


# ---------------------------------------------------------------- the command


def add_arguments(p) -> None:
    p.add_argument("--model", required=True, help="a preset (gpt-small, gpt-1b, ...) or a Hugging Face config.json")
    p.add_argument("--memory-budget", required=True,
                   help="host memory the training may add over the process baseline, e.g. 8GiB")
    p.add_argument("--nvme-path", default=None, help="directory for swap files (without it, all must fit in RAM)")
    p.add_argument("--config", default=None, help="a config to start from (its optimizer, aio, clipping ...)")
    p.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default=None,
                   help="default: the --config's, else bf16")
    p.add_argument("--micro-batch", type=int, default=None, help="samples per rank per step (default: the "
                   "--config's train_micro_batch_size_per_gpu, else 1)")
    p.add_argument("--seq", type=int, default=None, help="tokens per sequence (default: the model's, at most 256)")
    p.add_argument("--nproc", type=int, default=1, help="ranks on this host (the budget is shared)")
    p.add_argument("--write", default=None, metavar="CONFIG", help="write the planned config here")
    p.add_argument("--json", action="store_true", help="print the plan as one JSON object")


def make_plan(*, model: str, memory_budget, nvme_path: str | None, config: str | None = None,
              precision: str | None = None, micro: int | None = None, seq: int | None = None, nproc: int = 1,
              rates: Rates | None = None) -> tuple[Plan, ModelShape, Rates]:
    """Parse, measure and plan: what `infinity plan` and `infinity train --memory-budget` share."""
    import torch

    from infinity.config import load_config

    budget = parse_size(memory_budget, name="--memory-budget")
    if budget < (1 << 20):
        raise ValueError(f"--memory-budget must be at least 1MiB, got {memory_budget!r}")
    if micro is not None and micro < 1:
        raise ValueError(f"--micro-batch must be >= 1, got {micro}")
    if seq is not None and seq < 1:
        raise ValueError(f"--seq must be >= 1, got {seq}")
    if nproc < 1:
        raise ValueError(f"--nproc must be >= 1, got {nproc}")
    if nvme_path is not None and not os.path.isdir(nvme_path):
        raise ValueError(f"--nvme-path {nvme_path}: not a directory")
    base = {}
    if config is not None:
        # Validated as a whole first, naming any bad key; its nvme_path is replaced by the plan's, so a
        # placeholder such as DeepSpeed's "/local_nvme" must not fail here.
        load_config(config, nvme_path=nvme_path or tempfile.gettempdir())
        with open(config) as f:
            base = json.load(f)
    if precision is None:
        precision = "bf16" if base.get("bf16", {}).get("enabled") or not base else (
            "fp16" if base.get("fp16", {}).get("enabled") else "fp32")
    if micro is None:
        micro = int(base.get("train_micro_batch_size_per_gpu") or 1)
    shape = model_shape(model, seq)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    if rates is None:
        rates = measure_rates(dim=shape.dim, tokens=micro * shape.seq, dtype=dtype, nvme_path=nvme_path,
                              aio=base.get("aio"), shape=shape, micro=micro,
                              direct=bool(base.get("infinity", {}).get("direct_io", True)))
    p = plan(shape, budget, rates, precision=precision, micro=micro, world=nproc, nvme_path=nvme_path, base=base,
             clipping=float(base.get("gradient_clipping", 0) or 0) > 0,
             grad_accum=int(base.get("gradient_accumulation_steps", 1)))
    load_config(p.config)  # the planned config must load as it is
    return p, shape, rates


def describe(p: Plan, shape: ModelShape, rates: Rates, baseline: int | None = None) -> str:
    lines = [f"# infinity plan: {shape.name}, {shape.numel / 1e6:.1f}M params, seq {shape.seq}",
             f"# measured: {rates.describe()}",
             f"parameters: {_tier(p.param_tier)}"
             + (f" ({p.param_buffer_count} buffers x {p.param_buffer_size / 1e6:.2f}M elements, prefetch "
                f"{p.prefetch_bucket / 1e6:.2f}M)" if p.param_tier == "nvme" else ""),
             f"optimizer:  {_tier(p.optimizer_tier)}"
             + (f" ({p.optimizer_buffer_count} buffers x sub-group {p.sub_group_size / 1e6:.2f}M elements)"
                if p.optimizer_tier == "nvme" else "")]
    lines.append(f"predicted peak memory over baseline: {format_size_h(p.predicted_peak_bytes)}, in {p.peak_phase} ("
                 + ", ".join(f"{k.replace('_', ' ')} {format_size_h(v)}" for k, v in p.memory.items() if v) + ")")
    if baseline is not None:
        lines.append(f"predicted peak RSS: {format_size_h(baseline + p.predicted_peak_bytes)} "
                     f"(baseline {format_size_h(baseline)})")
    t = p.time
    lines.append(f"predicted step time: {p.predicted_step_s:.2f} s (compute {t['compute']:.2f}, Adam {t['adam']:.2f}, "
                 f"copies {t['copies']:.2f}, engine {t['engine']:.2f}, disk {t['io']:.2f}; I/O {p.io_read_bytes / 1e9:.2f} GB read + "
                 f"{p.io_write_bytes / 1e9:.2f} GB written per step)")
    return "\n".join(lines)


def baseline_rss() -> int:
    """RSS now, after the imports and torch's one-time optimizer import (see [Note: what the memory budget covers])."""
    import gc

    import torch

    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)  # imports torch._dynamo once per process
    gc.collect()
    try:  # the peak (VmHWM) restarts here, so that the planner's own measurements are not in it
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    return proc_status("VmRSS") or 0


def proc_status(key: str) -> int | None:
    """A byte count from /proc/self/status (VmRSS, VmHWM), or None where there is no such file."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def run(args) -> int:
    p, shape, rates = make_plan(model=args.model, memory_budget=args.memory_budget, nvme_path=args.nvme_path,
                                config=args.config, precision=args.precision, micro=args.micro_batch, seq=args.seq,
                                nproc=args.nproc)
    base = baseline_rss()
    if args.write:
        tmp = f"{args.write}.tmp-{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(p.config, f, indent=2)
            f.write("\n")
        os.replace(tmp, args.write)
    if args.json:
        d = dataclasses.asdict(p)
        model = {f.name: getattr(shape, f.name) for f in dataclasses.fields(shape) if f.name != "block"}
        d.update(model=model, rates=dataclasses.asdict(rates), baseline_rss_bytes=base)
        print(json.dumps(d))
    else:
        print(describe(p, shape, rates, base))
        if args.write:
            print(f"# config written to {args.write}")
        else:
            print(json.dumps(p.config, indent=2))
    return 0
