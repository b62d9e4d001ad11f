"""The planner's cost model: the fastest placement that fits a memory budget, its buffers, and its predicted
peak memory and step time (from a ModelShape and measured Rates).

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

import json
import math
from dataclasses import dataclass

from infinity.engine.optimizer import SPLIT_ALIGN
from infinity.engine.sizing import FLOOR as SPLIT_FLOOR
from infinity.errors import NoPlacement  # noqa: F401 - raised here, defined there
from infinity.tools.plan.measure import Rates
from infinity.tools.plan.shape import ModelShape

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
class Plan:
    """What `plan` decided for one model and budget: placement, buffer sizes, the config, and the predictions."""

    param_tier: str            # none | nvme
    optimizer_tier: str        # cpu | nvme
    micro_batch: int           # samples per rank per forward
    grad_accum: int            # micro-batches per optimizer step
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


@dataclass(slots=True, frozen=True)
class Placement:
    """One candidate placement of the parameters and the optimizer state, and what it keeps in RAM per rank."""

    param_tier: str
    """Where the parameters live: "none" (in RAM) or "nvme"."""
    optimizer_tier: str
    """Where the optimizer state (fp32 master, m, v) lives: "cpu" (in RAM) or "nvme"."""
    state_bytes: int
    """Bytes of parameters and optimizer state kept in RAM while training."""
    setup_state_bytes: int
    """Bytes of them in RAM while the fp32 state is built (parameters kept in RAM are built in fp32)."""
    pools: str | None
    """The swap pools it needs: None, "opt" (the optimizer's) or "both" (the optimizer's and the parameters')."""


@dataclass(slots=True, frozen=True)
class PoolSizing:
    """The swap buffers and optimizer sub-groups sized for one placement in what the budget leaves."""

    param_buffer_count: int
    """Parameter swap buffers (1 when the parameters stay in RAM)."""
    param_buffer_size: int
    """Elements per parameter buffer: the largest parameter shard."""
    optimizer_buffer_count: int
    """Optimizer swap buffers (1 when the optimizer state stays in RAM)."""
    sub_group_size: int
    """Elements per optimizer sub-group."""
    prefetch_bucket: int
    """Elements of parameters prefetched ahead (0 when the parameters stay in RAM)."""
    pool_bytes: int
    """Bytes of all swap buffers together, in training."""
    setup_pool_bytes: int
    """The same while the model is built: parameter buffers hold fp32 shards until initialize shrinks them
    ([Note: the parameter pool shrinks after setup] in engine/params.py)."""
    inflight_grad_bytes: int
    """Bytes of fp32 gradients in flight (about two sub-groups' worth, or the whole shard if smaller)."""


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


def plan_batch(shape: ModelShape, budget: int, rates: Rates, *, micro: int, grad_accum: int = 1,
               split: bool = False, **kw) -> Plan:
    """[Note: the planner may split the batch]
    `plan` at the run's micro-batch; with `split` (the user wrote no micro-batch, so the one in use is a
    default), also at each smaller divisor of it, with the accumulation raised to keep the samples per optimizer
    step: the first, the largest micro-batch, that fits is taken. At 125M with a 50k vocabulary the logits of
    4 x 256 tokens (in bf16, their fp32 copy and its gradient) are about 0.5 GiB, a third of a 1.5 GiB budget;
    two micro-batches of 2 halve that. The mean loss over the step is the same mean (equal-sized micro-batches),
    summed in another order. A micro-batch the user wrote is never changed."""
    sizes = [m for m in range(micro, 0, -1) if micro % m == 0] if split else [micro]
    first = None
    for m in sizes:
        try:
            return plan(shape, budget, rates, micro=m, grad_accum=grad_accum * (micro // m), rate_micro=micro, **kw)
        except NoPlacement as e:
            first = first or e
    if len(sizes) > 1:
        raise NoPlacement(f"{first} (nor with the batch of {micro} split into micro-batches down to 1)")
    raise first


def plan(shape: ModelShape, budget: int, rates: Rates, *, precision: str = "bf16", micro: int = 1,
         world: int = 1, nvme_path: str | None = None, base: dict | None = None, clipping: bool = False,
         grad_accum: int = 1, rate_micro: int | None = None) -> Plan:
    """The fastest placement that fits `budget` bytes over the baseline (per rank: budget is per host).
    `rates` were measured at `rate_micro` samples (default `micro`); the step runs `grad_accum` micro-batches."""
    per_rank = budget // world
    shard = math.ceil(shape.numel / world)
    largest_shard = math.ceil(shape.largest / world)
    e = lowp_bytes(precision)
    sb = optimizer_state_bytes(base)
    full_grads = clipping or grad_accum > 1 or precision == "fp16"  # then every gradient waits in RAM
    act = activation_bytes(shape, micro, precision)
    # Gathered at once: the biggest module's full parameters and their gradients, in the compute dtype.
    gathered = 2 * shape.largest_module * e
    reduce_bucket = max(shape.largest_module, min(1 << 22, shard // 8))
    # The bucket being filled can pass reduce_bucket by up to one parameter, and while one is packed and
    # reduced the previous may still be in flight: three buckets' worth of fp32.
    buckets = 3 * 4 * (reduce_bucket + shape.largest_module) if world > 1 else 0
    # Parameters kept in RAM are built in fp32 (their initial values become the fp32 master weights), and each
    # optimizer sub-group turns its parameters into the compute dtype once its master exists: setup holds
    # 4 B/param of them, training e B/param.
    candidates = [
        # master + m + v beside the parameters
        Placement(param_tier="none", optimizer_tier="cpu", state_bytes=shard * (sb + e),
                  setup_state_bytes=shard * (sb + e), pools=None),
        Placement(param_tier="none", optimizer_tier="nvme", state_bytes=shard * e, setup_state_bytes=shard * 4,
                  pools="opt"),
        Placement(param_tier="nvme", optimizer_tier="nvme", state_bytes=0, setup_state_bytes=0, pools="both"),
    ]
    if nvme_path is None:
        candidates = candidates[:1]
    reasons = []
    for c in candidates:
        ptier, otier = c.param_tier, c.optimizer_tier
        transient = {"activations": act, "gathered_params": gathered, "gradients": 4 * shard if full_grads else 0,
                     "comm_buckets": buckets}
        mem = {"state_in_ram": c.state_bytes, **{k: int(ALLOCATOR_SLACK * v) for k, v in transient.items()},
               "fixed": FIXED_OVERHEAD}
        need = max(sum(mem.values()), c.setup_state_bytes + FIXED_OVERHEAD)
        left = per_rank - need
        if left < 0:
            reasons.append(f"params {_tier(ptier)} + optimizer {_tier(otier)} needs {format_size_h(need)} "
                           f"before any swap buffer")
            continue
        # With both on NVMe in bf16/fp16 an optimizer buffer also holds its sub-group's compute-dtype weights
        # ([Note: compute-dtype shards in the optimizer file] in engine/alias.py).
        ob = sb + (e if c.pools == "both" and e != 4 else 0)
        sizing = _size_pools(c.pools, left, shape, shard, largest_shard, full_grads, ob, e)
        if sizing is None:
            reasons.append(f"params {_tier(ptier)} + optimizer {_tier(otier)}: the {format_size_h(left)} left "
                           f"cannot hold the smallest working set of buffers")
            continue
        mem["swap_buffers"] = sizing.pool_bytes
        mem["gradients"] += sizing.inflight_grad_bytes
        # Setup: the state above, the pools, and one sub-group's master being built.
        setup = {"state_in_ram": c.setup_state_bytes, "swap_buffers": sizing.setup_pool_bytes,
                 "master_being_built": 4 * sizing.sub_group_size, "fixed": FIXED_OVERHEAD}
        phase = "training" if sum(mem.values()) >= sum(setup.values()) else "setup"
        if phase == "setup":
            mem = setup
        peak = sum(mem.values())
        if peak > per_rank:
            reasons.append(f"params {_tier(ptier)} + optimizer {_tier(otier)}: needs {format_size_h(peak)} "
                           f"with its buffers")
            continue
        reads, writes = io_bytes(ptier, otier, shard, precision, sb, step_in_backward=(
            precision != "fp16" and not (base or {}).get("gradient_clipping") and grad_accum == 1
            and (base or {}).get("infinity", {}).get("step_during_backward", True)), grad_accum=grad_accum)
        t = step_time(shape, rates, micro=micro, shard=shard, reads=reads, writes=writes, param_tier=ptier,
                      checksums=bool((base or {}).get("infinity", {}).get("checksums", True)), world=world,
                      grad_accum=grad_accum, rate_micro=rate_micro or micro)
        cfg = _config(base, c, sizing, nvme_path=nvme_path, budget=budget, precision=precision, micro=micro,
                      reduce_bucket=reduce_bucket, grad_accum=grad_accum)
        return Plan(param_tier=ptier, optimizer_tier=otier, micro_batch=micro, grad_accum=grad_accum,
                    param_buffer_count=sizing.param_buffer_count,
                    param_buffer_size=sizing.param_buffer_size, optimizer_buffer_count=sizing.optimizer_buffer_count,
                    sub_group_size=sizing.sub_group_size, prefetch_bucket=sizing.prefetch_bucket, memory=mem,
                    peak_phase=phase, predicted_peak_bytes=peak, predicted_step_s=t["step"], time=t,
                    io_read_bytes=reads, io_write_bytes=writes, config=cfg)
    hint = "" if nvme_path is not None else "; with --nvme-path the state can go to disk"
    raise NoPlacement(f"--memory-budget {format_size_h(budget)}: no placement of {shape.name} "
                     f"({shape.numel / 1e6:.1f}M params, {world} rank(s)) fits: " + "; ".join(reasons) + hint)


def _tier(t: str) -> str:
    return {"none": "in RAM", "cpu": "in RAM", "nvme": "on NVMe"}[t]


def format_size_h(n: float) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def _size_pools(pools: str | None, left: int, shape: ModelShape, shard: int, largest_shard: int,
                full_grads: bool, sb: int = 12, pe: int = 4) -> PoolSizing | None:
    """The buffers and sub-groups for a placement needing `pools` (Placement.pools), or None when nothing
    workable fits in `left` bytes.

    Without full gradients, a sub-group's fp32 gradients live from its first gradient to its step, so about
    two sub-groups' worth are in flight; they count against the budget like the buffers.
    """
    grads = 0 if full_grads else 2 * 4 * ALLOCATOR_SLACK
    left = int(left * (1 - MARGIN))
    if pools is None:  # optimizer in RAM: sub-groups bound the gradients in flight and the master being built
        group = max(largest_shard, min(shard, 1 << 24, int(left // (grads + 4))))
        return PoolSizing(param_buffer_count=1, param_buffer_size=largest_shard, optimizer_buffer_count=1,
                          sub_group_size=group, prefetch_bucket=0, pool_bytes=0, setup_pool_bytes=0,
                          inflight_grad_bytes=int(min(grads * group, grads / 2 * shard)))
    # Parameter buffers must hold the largest shard: in fp32 while the model is built, then in the compute dtype
    # (`pe` bytes an element) once initialize shrinks them; training, the phase sized here, sees pe.
    psize = largest_shard
    layer = max(math.ceil(shape.numel / max(shape.layers, 1) / max(math.ceil(shape.numel / shard), 1)), 1)
    pbufs = pbytes = 0
    # Both on NVMe the shards live in the optimizer's files, and with the optimizer alone on NVMe in RAM: either
    # way a larger one is split over sub-groups of its own ([Note: a large shard is split over sub-groups of its
    # own] in engine/optimizer.py), so a sub-group need not hold the largest shard, only as much as still reads
    # at the disk's rate (engine/sizing.py's FLOOR).
    split = pools in ("both", "opt")
    need = max(1, min(largest_shard, SPLIT_FLOOR) if split else largest_shard)
    min_opt = int((min(OPT_BUFFERS) * sb + grads) * need)
    if pools == "both":
        # The least that works first (MIN_PARAM_BUFFERS, and 3 optimizer buffers of the largest shard); then
        # up to two layers of prefetch, from at most a third of what remains beyond that.
        pbufs = MIN_PARAM_BUFFERS
        spare = left - pbufs * pe * psize - min_opt
        if spare < 0:
            return None
        want = max(MIN_PARAM_BUFFERS, math.ceil(2 * layer / psize) + 1)
        pbufs += min(want - MIN_PARAM_BUFFERS, (spare // 3) // (pe * psize))
        pbytes = pbufs * pe * psize
    elif left < min_opt:
        return None
    rest = left - pbytes
    # Optimizer sub-groups: as large as the rest allows with the most buffers, never smaller than the largest
    # shard unless it is split (then whole pieces of SPLIT_ALIGN elements), and never beyond 64M elements or the
    # whole shard.
    for obufs in OPT_BUFFERS:
        group = min(int(rest // (sb * obufs + grads)), 1 << 26, shard)
        if split and group < largest_shard:
            group = group // SPLIT_ALIGN * SPLIT_ALIGN
        if group >= need:
            break
    else:
        return None
    group = int(group)
    prefetch = max(psize, (pbufs - 1) * psize) if pools == "both" else 0
    inflight = int(min(grads * group, grads / 2 * shard))  # two sub-groups, or the whole shard if smaller
    return PoolSizing(param_buffer_count=pbufs or 1, param_buffer_size=psize, optimizer_buffer_count=obufs,
                      sub_group_size=group, prefetch_bucket=int(prefetch), pool_bytes=pbytes + obufs * sb * group,
                      setup_pool_bytes=pbufs * 4 * psize + obufs * sb * group, inflight_grad_bytes=inflight)


def optimizer_state_bytes(base: dict | None) -> int:
    """Optimizer state per parameter under config `base`: 12 B, or 8 with offload_optimizer.moments_dtype bf16."""
    moments = ((base or {}).get("zero_optimization", {}).get("offload_optimizer", {}) or {}).get("moments_dtype")
    return 8 if moments == "bf16" else 12


def io_bytes(ptier: str, otier: str, shard: int, precision: str, sb: int = 12, *,
             step_in_backward: bool = True, grad_accum: int = 1) -> tuple[int, int]:
    """Bytes read and written per step per rank: 28 B/param in fp32 and in bf16 with everything on NVMe and the
    step during backward, 32 and 30 with the step after it (clipping, fp16); sb 8 with bf16 moments. Shards are
    lent from the master where it is in host memory ([Note: backward reads from the state] in
    engine/optimizer.py): always with the optimizer on the CPU, in backward when its NVMe state is read then.
    Each of `grad_accum` micro-batches reads the shards again."""
    e = lowp_bytes(precision)
    reads = writes = 0
    if otier == "nvme":
        reads += sb * shard     # master, m, v
        writes += sb * shard
    if ptier == "nvme":
        if otier == "nvme":  # forward; backward too unless the step's read serves it (fp32: the files' slices)
            reads += ((1 if step_in_backward else 2) + 2 * (grad_accum - 1)) * e * shard
        elif otier != "cpu":
            reads += 2 * grad_accum * e * shard
        if precision != "fp32" or otier != "nvme":
            # The new shard: the low-precision copy, or fp32 weights whose file is not a slice of the state's.
            writes += e * shard
    return reads, writes


def step_time(shape: ModelShape, rates: Rates, *, micro: int, shard: int, reads: int, writes: int,
              param_tier: str, checksums: bool = True, world: int = 1, grad_accum: int = 1,
              rate_micro: int | None = None) -> dict:
    """Seconds per optimizer step, by item. `rates.layer_s` was measured at `rate_micro` samples (default
    `micro`) and is scaled to `micro`; compute and module hooks count once per micro-batch."""
    tokens = micro * shape.seq
    passes = 8 if shape.checkpoint else 6  # forward 2, backward 4, recompute 2 FLOPs per param per token
    flops = passes * shape.numel * tokens + passes * shape.layers * shape.seq * shape.seq * shape.dim * micro
    if rates.layer_s is not None:
        # Measured layers (a checkpointed layer runs its forward twice: + 1/3), FLOPs for the rest (embeddings,
        # the LM head, the loss).
        in_layers = shape.layers * sum(p.numel() for p in shape.block.parameters())  # layer_s implies a block
        rest = max(shape.numel - in_layers, 0)
        layer_s = rates.layer_s * micro / (rate_micro or micro)
        compute = shape.layers * layer_s * (4 / 3 if shape.checkpoint else 1.0)
        compute += 6 * rest * tokens / (rates.flops * MODEL_EFFICIENCY)
    else:
        compute = flops / (rates.flops * MODEL_EFFICIENCY)
    compute *= grad_accum
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
    hooks = (3 if shape.checkpoint else 2) * shape.modules * PER_MODULE_S[param_tier] * grad_accum
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


def _report_planned(replaced: list[str]) -> None:
    if replaced:
        import warnings

        warnings.warn(f"infinity plan: the plan sets {', '.join(replaced)} (--memory-budget decides placement and "
                      "buffer sizes; without it the config's own values apply)", stacklevel=3)


def _config(base: dict | None, placement: Placement, sizing: PoolSizing, *, nvme_path: str | None, budget: int,
            precision: str, micro: int, reduce_bucket: int, grad_accum: int = 1) -> dict:
    """A complete swap config with DeepSpeed's keys; `base` (a config dict) supplies everything not planned."""
    cfg = json.loads(json.dumps(base or {}))
    cfg["train_micro_batch_size_per_gpu"] = micro
    if grad_accum > 1:  # the run's accumulation: raised where the plan split a default batch, which it does only
        cfg["gradient_accumulation_steps"] = grad_accum  # when no batch key was written (train_batch_size stays)
    cfg["bf16"] = {"enabled": precision == "bf16"}
    cfg["fp16"] = dict(cfg.get("fp16", {}), enabled=precision == "fp16")
    zero = cfg.setdefault("zero_optimization", {})
    zero["stage"] = 3
    # The planner decides placement and sizes: the offload devices, their paths and buffers, max_in_cpu and
    # ratio (it models neither partial placement), the prefetch bucket, the reuse distance, the sub-group and
    # reduce-bucket sizes. Every other choice the base wrote (moments_dtype, pin_memory, pipelining, ...) stays
    # as written. A planned key the base set to some other value (not "auto") is named in one warning.
    ptier, otier = placement.param_tier, placement.optimizer_tier
    replaced: list[str] = []

    def put(node: dict, key: str, value, name: str) -> None:
        if key in node and node[key] != value and node[key] != "auto" and key != "nvme_path":
            replaced.append(f"{name}.{key} to {value!r}, not the config's {node[key]!r}")
        node[key] = value

    planned_param = {"device": ptier}
    if ptier == "nvme":
        planned_param.update(nvme_path=nvme_path, buffer_count=sizing.param_buffer_count,
                             buffer_size=sizing.param_buffer_size, max_in_cpu=0)
    planned_opt = {"device": otier}
    if otier == "nvme":
        planned_opt.update(nvme_path=nvme_path, buffer_count=sizing.optimizer_buffer_count)
    else:
        planned_opt["ratio"] = 1.0
    # Keys that mean nothing where the plan puts a tier are dropped there, not reported.
    idle = {"offload_param": ("nvme_path", "buffer_count", "buffer_size", "max_in_cpu"),
            "offload_optimizer": ("nvme_path", "buffer_count", "ratio")}
    for key, planned in (("offload_param", planned_param), ("offload_optimizer", planned_opt)):
        node = {k: v for k, v in (zero.get(key) or {}).items() if not (k in idle[key] and k not in planned)}
        for k, v in planned.items():
            put(node, k, v, f"zero_optimization.{key}")
        zero[key] = node
    if ptier == "nvme":
        put(zero, "stage3_prefetch_bucket_size", sizing.prefetch_bucket, "zero_optimization")
        put(zero, "stage3_max_reuse_distance", 0, "zero_optimization")
    put(zero, "sub_group_size", sizing.sub_group_size, "zero_optimization")
    put(zero, "reduce_bucket_size", reduce_bucket, "zero_optimization")
    cfg.setdefault("infinity", {})["memory_budget"] = budget
    _report_planned(replaced)
    return cfg

