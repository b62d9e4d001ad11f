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
AsyncIO with the config's aio settings. The step is cut into phases by
when its I/O can run (`io_phases`), because the optimizer step's I/O
overlaps only the compute of the phase it runs in (`step_phase`): during
backward (no clipping), in the next forward (the NVMe step finished as
forward needs each sub-group: clipping or fp16 make the step wait for
every gradient), or after backward, alone. Each phase is

  cpu  = its compute (forward: 2 of the 6, or 8 when checkpointed, FLOPs per
         parameter and token; hooks per module gather) + Adam if the step
         runs there + pool copies and checksums of its bytes
         (+ per-parameter engine work, in backward)
  disk = max(reads / read rate, writes / write rate)
         + DUPLEX_SHARE x the shorter of the two
  time = max(cpu, disk) + OVERLAP_LEAK x min(cpu, disk)

and the step is the sum of its phases. OVERLAP_LEAK is the share of the
shorter of compute and I/O that still shows (on 2 cores the I/O threads
need the CPU too); DUPLEX_SHARE how much reads and writes in flight
together slow each other. These two, PER_LOGIT_S (the loss beyond the LM
head's matmul), PER_MODULE_S and PER_PARAM_S are the constants not
measured in the run: they were fitted on the reference VM (2 cores) to
`bench/defaults.py` (125M-1B, the shipped configs as written) and
`infinity bench plan` runs, so elsewhere the prediction is only as good
as they transfer; the disk measured at plan time is one pass on a disk
that drifts by +-30 % within the hour.

Peak memory is the larger of two phases: setup (the fp32 state being
built) and training (state in RAM, buffers, activations, gathered
parameters, gradients in flight; with the step finished in the next
forward, the gradients waiting for it and the activations do not peak
together, and the larger counts). See [Note: what the memory budget
covers].
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass

from infinity.engine.plan import SPLIT_ALIGN
from infinity.engine.plan import FLOOR as SPLIT_FLOOR
from infinity.engine.plan import TARGET as SPLIT_TARGET
from infinity.errors import NoPlacement  # noqa: F401 - raised here, defined there
from infinity.swap.state import MOMENT_DTYPES, state_bytes
from infinity.tools.plan.measure import Rates
from infinity.tools.plan.shape import ModelShape

MODEL_EFFICIENCY = 0.6
PER_MODULE_S = {"nvme": 1.5e-3, "none": 0.3e-3}  # hooks, pool bookkeeping and futures per module gather
# The loss beyond the LM head's matmul (the logits' fp32 copy, softmax, their gradient), per logit per step.
PER_LOGIT_S = 10e-9
PER_PARAM_S = 5e-9                # gradient zeroing/accumulation, conversions, norms, copies (profiled)
# The share of the shorter of compute and I/O that still shows: small when the disk sets the pace (compute
# runs in its shadow on the other core), larger when compute does (I/O needs the cores too).
OVERLAP_LEAK = {"io_bound": 0.1, "cpu_bound": 0.3}
# Reads and writes in flight together (the optimizer's pipelined walk) share the disk only in part: a phase's
# disk time is the longer of its reads and its writes, plus this share of the shorter.
DUPLEX_SHARE = 0.15
ALLOCATOR_SLACK = 1.1            # fragmentation and autograd bookkeeping, on the variable part
INFLIGHT_GRAD_BYTES = 2 * 4 * ALLOCATOR_SLACK  # per sub-group element: two sub-groups' fp32 gradients in flight
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
    cache_bytes: int = 0
    """Bytes of gathered shards the prefetch's reuse cache may keep (a plan sets the reuse distance to 0)."""


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
    # Parameters kept in RAM are built in fp32 (their initial values become the fp32 master weights), and each
    # optimizer sub-group turns its parameters into the compute dtype once its master exists: setup holds
    # 4 B/param of them, training e B/param.
    candidates = [
        # master + m + v beside the parameters
        Placement(param_tier="none", optimizer_tier="cpu", state_bytes=math.ceil(shard * (sb + e)),
                  setup_state_bytes=math.ceil(shard * (sb + e)), pools=None),
        Placement(param_tier="none", optimizer_tier="nvme", state_bytes=shard * e, setup_state_bytes=shard * 4,
                  pools="opt"),
        Placement(param_tier="nvme", optimizer_tier="nvme", state_bytes=0, setup_state_bytes=0, pools="both"),
    ]
    if nvme_path is None:
        candidates = candidates[:1]
    reasons = []
    for c in candidates:
        ptier, otier = c.param_tier, c.optimizer_tier
        fixed = _fixed_memory(shape, c, micro=micro, precision=precision, world=world, full_grads=full_grads,
                              step=step_phase(base, precision=precision, optimizer_tier=otier, clipping=clipping),
                              grad_accum=grad_accum)
        need = max(sum(fixed.values()), c.setup_state_bytes + FIXED_OVERHEAD)
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
        p = _evaluate(shape, rates, c, sizing, fixed, base=base, precision=precision, micro=micro, world=world,
                      grad_accum=grad_accum, rate_micro=rate_micro, clipping=clipping, config=None)
        if p.predicted_peak_bytes > per_rank:
            reasons.append(f"params {_tier(ptier)} + optimizer {_tier(otier)}: needs "
                           f"{format_size_h(p.predicted_peak_bytes)} with its buffers")
            continue
        cfg = _config(base, c, sizing, nvme_path=nvme_path, budget=budget, precision=precision, micro=micro,
                      reduce_bucket=_reduce_bucket(shape, shard), grad_accum=grad_accum)
        return dataclasses.replace(p, config=cfg)
    hint = "" if nvme_path is not None else "; with --nvme-path the state can go to disk"
    raise NoPlacement(f"--memory-budget {format_size_h(budget)}: no placement of {shape.name} "
                     f"({shape.numel / 1e6:.1f}M params, {world} rank(s)) fits: " + "; ".join(reasons) + hint)


def _reduce_bucket(shape: ModelShape, shard: int) -> int:
    return max(shape.largest_module, min(1 << 22, shard // 8))


def _fixed_memory(shape: ModelShape, c: Placement, *, micro: int, precision: str, world: int, full_grads: bool,
                  step: str, grad_accum: int = 1) -> dict:
    """Training memory over the baseline before any swap buffer, by item (transients with the allocator's slack);
    `step`: when the optimizer step runs (step_phase)."""
    e = lowp_bytes(precision)
    shard = math.ceil(shape.numel / world)
    reduce_bucket = _reduce_bucket(shape, shard)
    # Activations, gathered parameters and buckets are many allocations (with the allocator's slack); the fp32
    # gradients are one buffer per sub-group, counted as they are.
    slack = {k: int(ALLOCATOR_SLACK * v) for k, v in {
        "activations": activation_bytes(shape, micro, precision),
        # Gathered at once: the biggest module's full parameters and their gradients, in the compute dtype.
        "gathered_params": 2 * shape.largest_module * e,
        # The bucket being filled can pass reduce_bucket by up to one parameter, and while one is packed and
        # reduced the previous may still be in flight: three buckets' worth of fp32.
        "comm_buckets": 3 * 4 * (reduce_bucket + shape.largest_module) if world > 1 else 0}.items()}
    mem = {"state_in_ram": c.state_bytes, **slack, "gradients": 4 * shard if full_grads else 0,
           "fixed": FIXED_OVERHEAD}
    if step == "forward" and mem["gradients"] and grad_accum == 1:
        # The step finished in the next forward frees each sub-group's gradients as that forward steps it, while
        # its activations grow; backward's activations shrink as its gradients grow. So the gradients waiting
        # for the step and the activations do not peak together: the larger of the two counts. (A step after
        # backward zeroes the gradients and keeps them; with accumulation the later micro-batches run forward
        # and backward beside every gradient so far.)
        mem["activations_then_gradients"] = max(mem.pop("activations"), mem["gradients"])
        mem["gradients"] = 0
    return mem


def _evaluate(shape: ModelShape, rates: Rates, c: Placement, sizing: PoolSizing, fixed: dict, *, base: dict | None,
              precision: str, micro: int, world: int, grad_accum: int, rate_micro: int | None, clipping: bool,
              config: dict | None) -> Plan:
    """The predicted peak memory (the larger phase) and step time of placement `c` with buffers `sizing`."""
    shard = math.ceil(shape.numel / world)
    when = step_phase(base, precision=precision, optimizer_tier=c.optimizer_tier, clipping=clipping)
    mem = dict(fixed)
    mem["swap_buffers"] = sizing.pool_bytes
    mem["gradients"] += sizing.inflight_grad_bytes
    if sizing.cache_bytes:
        mem["reuse_cache"] = sizing.cache_bytes
    # Setup: the state above, the pools, and one sub-group's master being built.
    setup = {"state_in_ram": c.setup_state_bytes, "swap_buffers": sizing.setup_pool_bytes,
             "master_being_built": 4 * sizing.sub_group_size, "fixed": FIXED_OVERHEAD}
    phase = "training" if sum(mem.values()) >= sum(setup.values()) else "setup"
    if phase == "setup":
        mem = setup
    sb = optimizer_state_bytes(base)
    by_phase = io_phases(c.param_tier, c.optimizer_tier, shard, precision, sb, step=when, grad_accum=grad_accum)
    t = step_time(shape, rates, micro=micro, shard=shard, io=by_phase, step=when, param_tier=c.param_tier,
                  checksums=bool((base or {}).get("infinity", {}).get("checksums", True)), world=world,
                  grad_accum=grad_accum, rate_micro=rate_micro or micro)
    reads = sum(r for r, _ in by_phase.values())
    writes = sum(w for _, w in by_phase.values())
    return Plan(param_tier=c.param_tier, optimizer_tier=c.optimizer_tier, micro_batch=micro, grad_accum=grad_accum,
                param_buffer_count=sizing.param_buffer_count, param_buffer_size=sizing.param_buffer_size,
                optimizer_buffer_count=sizing.optimizer_buffer_count, sub_group_size=sizing.sub_group_size,
                prefetch_bucket=sizing.prefetch_bucket, memory=mem, peak_phase=phase,
                predicted_peak_bytes=sum(mem.values()), predicted_step_s=t["step"], time=t, io_read_bytes=reads,
                io_write_bytes=writes, config=config or {})


def config_batch(cfg, world: int) -> tuple[int, int]:
    """(micro-batch, accumulation) of a config as `infinity train` runs it: DeepSpeed's rules (any two of
    train_batch_size, the micro batch and accumulation give the third), else 4 and 1."""
    from infinity.config.resolve import resolve_batch

    sizes = resolve_batch(cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps,
                          world)
    return sizes.micro_batch_per_rank or 4, sizes.gradient_accumulation_steps or 1


def predict(shape: ModelShape, rates: Rates, cfg, base: dict, *, world: int = 1,
            rate_micro: int | None = None) -> Plan:
    """[Note: predicting a config's run]
    `infinity plan` without --memory-budget: the peak memory and step time of the run a config gives as it is
    (`cfg` loaded, `base` its JSON), with the sizes the engine fits where the config writes none ([Note: sizes
    fitted to the model] in engine/plan.py), through the same terms as a plan. So a user can ask what a
    DeepSpeed config will cost here before running it, and `bench/defaults.py` holds the model to the shipped
    configs' runs. Placements the model does not cover (part of the optimizer kept on the device, shards kept
    in RAM from an NVMe tier) are refused by name rather than predicted as something else."""
    from infinity.engine.plan import BUFFERS, PARAM_BUFFER, SUB_GROUP, written

    zero = cfg.zero_optimization
    precision = "bf16" if cfg.bf16.enabled else "fp16" if cfg.fp16.enabled else "fp32"
    micro, accum = config_batch(cfg, world)
    e, sb = lowp_bytes(precision), optimizer_state_bytes(base)
    if zero.stage != 3:
        raise ValueError(f"infinity plan predicts ZeRO stage 3 runs; the config has stage {zero.stage}")
    ptier = "nvme" if zero.offload_param.device == "nvme" else "none"
    otier = "nvme" if zero.offload_optimizer.device == "nvme" else "cpu"
    if otier == "cpu" and zero.offload_optimizer.ratio < 1:
        raise ValueError("infinity plan cannot predict a partial optimizer offload (offload_optimizer.ratio "
                         f"{zero.offload_optimizer.ratio} keeps part of the state on the device); leave ratio at 1.0")
    if ptier == "nvme" and zero.offload_param.max_in_cpu:
        raise ValueError("infinity plan cannot predict shards kept in RAM from the NVMe tier "
                         f"(offload_param.max_in_cpu {zero.offload_param.max_in_cpu}); leave it at 0")
    shard = math.ceil(shape.numel / world)
    largest = math.ceil(shape.largest / world)
    pools = "both" if ptier == "nvme" and otier == "nvme" else "opt" if otier == "nvme" else None
    state = {("none", "cpu"): (shard * (sb + e), shard * (sb + e)), ("none", "nvme"): (shard * e, shard * 4),
             ("nvme", "nvme"): (0, 0), ("nvme", "cpu"): (shard * sb, shard * sb)}[ptier, otier]
    c = Placement(param_tier=ptier, optimizer_tier=otier, state_bytes=math.ceil(state[0]),
                  setup_state_bytes=math.ceil(state[1]), pools=pools)
    full_grads = cfg.gradient_clipping > 0 or accum > 1 or precision == "fp16"
    if otier == "nvme":
        # The engine's fit (sizing.fit_optimizer): the largest shard, within [FLOOR, TARGET] where a large shard
        # is split over sub-groups of its own (ZeRO-3), at least FLOOR where a sub-group holds whole shards.
        group = zero.sub_group_size if written(cfg, SUB_GROUP) else min(max(largest, SPLIT_FLOOR), SPLIT_TARGET)
        group = min(group, shard)
        count = zero.offload_optimizer.buffer_count
        if not written(cfg, BUFFERS):
            count = max(1, min(count, math.ceil(shard / group)))
        tail = e if pools == "both" and e != 4 else 0
        opt_bytes = math.ceil(count * group * (sb + tail))
    else:
        group, count, opt_bytes = min(shard, zero.sub_group_size), 1, 0
    pbufs, psize, bucket, cache = 1, largest, 0, 0
    if ptier == "nvme":
        pbufs = zero.offload_param.buffer_count
        psize = min(zero.offload_param.buffer_size, largest) if written(cfg, PARAM_BUFFER) else largest
        bucket = zero.stage3_prefetch_bucket_size
        if zero.stage3_max_reuse_distance:  # kept shards, within the bucket less the largest shard
            cache = max(min(bucket - psize, shard), 0) * e
    sizing = PoolSizing(param_buffer_count=pbufs, param_buffer_size=psize, optimizer_buffer_count=count,
                        sub_group_size=group, prefetch_bucket=bucket,
                        pool_bytes=(pbufs * psize * e if ptier == "nvme" else 0) + opt_bytes,
                        setup_pool_bytes=(pbufs * psize * 4 if ptier == "nvme" else 0) + opt_bytes,
                        inflight_grad_bytes=_inflight_grads(full_grads, group, shard), cache_bytes=cache)
    fixed = _fixed_memory(shape, c, micro=micro, precision=precision, world=world, full_grads=full_grads,
                          step=step_phase(base, precision=precision, optimizer_tier=otier,
                                          clipping=cfg.gradient_clipping > 0), grad_accum=accum)
    return _evaluate(shape, rates, c, sizing, fixed, base=base, precision=precision, micro=micro, world=world,
                     grad_accum=accum, rate_micro=rate_micro, clipping=cfg.gradient_clipping > 0, config=base)


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
    grads = 0 if full_grads else INFLIGHT_GRAD_BYTES  # per sub-group element
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
    # at the disk's rate (engine/plan.py's FLOOR).
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
    inflight = _inflight_grads(full_grads, group, shard)
    return PoolSizing(param_buffer_count=pbufs or 1, param_buffer_size=psize, optimizer_buffer_count=obufs,
                      sub_group_size=group, prefetch_bucket=int(prefetch),
                      pool_bytes=pbytes + math.ceil(obufs * sb * group),
                      setup_pool_bytes=pbufs * 4 * psize + math.ceil(obufs * sb * group), inflight_grad_bytes=inflight)


def _inflight_grads(full_grads: bool, group: int, shard: int) -> int:
    """Bytes of fp32 gradients in flight without full gradients (those are counted whole elsewhere): a
    sub-group's live from its first gradient to its step, so about two sub-groups' worth, or the whole shard if
    smaller, with the allocator's slack (they are allocated and freed as backward goes)."""
    if full_grads:
        return 0
    return int(INFLIGHT_GRAD_BYTES * min(group, shard / 2))


def optimizer_state_bytes(base: dict | None) -> float:
    """Optimizer state per parameter under config `base`: 12 B, 8 with offload_optimizer.moments_dtype bf16, about
    6 with int8 (state_bytes)."""
    moments = ((base or {}).get("zero_optimization", {}).get("offload_optimizer", {}) or {}).get("moments_dtype")
    return state_bytes(MOMENT_DTYPES[moments or "fp32"])


def step_phase(base: dict | None, *, precision: str, optimizer_tier: str, clipping: bool | None = None) -> str:
    """When the optimizer step's work runs, as the engine decides it: "backward" (stepping during backward: no
    clipping, no fp16), "forward" (the NVMe step finished in the next forward, [Note: the step finishes in the
    next forward] in engine/deferred.py) or "after" (after backward, alone)."""
    base = base or {}
    inf = base.get("infinity", {}) or {}
    if clipping is None:
        clipping = float(base.get("gradient_clipping", 0) or 0) > 0
    if precision != "fp16" and not clipping and inf.get("step_during_backward", True):
        return "backward"
    if optimizer_tier == "nvme" and inf.get("step_during_forward", True):
        return "forward"
    return "after"


def io_phases(ptier: str, otier: str, shard: int, precision: str, sb: int = 12, *, step: str = "backward",
              grad_accum: int = 1) -> dict:
    """Bytes (read, written) per step per rank in each phase: "forward" (the first micro-batch's forward),
    "rest" (the other forwards and every backward) and "after" (after the last backward). The parameter reads
    run in forward and backward; the optimizer's state (sb B/param each way) and the new shards move in the
    step's phase (`step`, see step_phase; "backward" puts them in "rest").

    28 B/param in fp32 and in bf16 with everything on NVMe and the step during backward, 32 and 30 with the step
    after it (clipping, fp16); sb 8 with bf16 moments. Shards are lent from the master where it is in host
    memory ([Note: backward reads from the state] in engine/optimizer.py): always with the optimizer on the CPU,
    in backward when its NVMe state is read then. Each of `grad_accum` micro-batches reads the shards again."""
    e = lowp_bytes(precision)
    lent_in_backward = step == "backward" and grad_accum == 1
    fwd = rest = 0
    if ptier == "nvme" and otier == "nvme":  # forward; backward too unless the step's read serves it
        fwd = e * shard
        rest = ((0 if lent_in_backward else 1) + 2 * (grad_accum - 1)) * e * shard
    step_r = step_w = 0
    if otier == "nvme":
        step_r += sb * shard     # master, m, v
        step_w += sb * shard
    if ptier == "nvme" and (precision != "fp32" or otier != "nvme"):
        # The new shard: the low-precision copy, or fp32 weights whose file is not a slice of the state's.
        step_w += e * shard
    phases = {"forward": [fwd, 0], "rest": [rest, 0], "after": [0, 0]}
    where = {"backward": "rest", "forward": "forward", "after": "after"}[step]
    phases[where][0] += step_r
    phases[where][1] += step_w
    return {k: tuple(v) for k, v in phases.items()}


def io_bytes(ptier: str, otier: str, shard: int, precision: str, sb: int = 12, *,
             step_in_backward: bool = True, grad_accum: int = 1) -> tuple[int, int]:
    """Bytes (read, written) per step per rank, all phases together (io_phases)."""
    phases = io_phases(ptier, otier, shard, precision, sb, step="backward" if step_in_backward else "after",
                       grad_accum=grad_accum)
    return sum(r for r, _ in phases.values()), sum(w for _, w in phases.values())


def _overlap(cpu: float, io: float) -> float:
    """One phase's time: the longer of its compute and its I/O, and the share of the shorter that still shows."""
    if io >= cpu:
        return io + OVERLAP_LEAK["io_bound"] * cpu
    return cpu + OVERLAP_LEAK["cpu_bound"] * io


def step_time(shape: ModelShape, rates: Rates, *, micro: int, shard: int, io: dict, step: str, param_tier: str,
              checksums: bool = True, world: int = 1, grad_accum: int = 1, rate_micro: int | None = None) -> dict:
    """Seconds per optimizer step, by item and by phase (io: io_phases' bytes; step: step_phase's answer).
    `rates.layer_s` was measured at `rate_micro` samples (default `micro`) and is scaled to `micro`; compute and
    module hooks count once per micro-batch."""
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
    compute += tokens * shape.vocab * PER_LOGIT_S
    # Each module with parameters is gathered and released in forward and in backward (and again when a
    # checkpointed layer is recomputed): hooks, pool bookkeeping, futures.
    gathers = 3 if shape.checkpoint else 2
    hooks = gathers * shape.modules * PER_MODULE_S[param_tier]
    # Forward is 2 of the `passes` FLOPs per parameter and token, and one of the gathers.
    forward = compute * 2 / passes + hooks / gathers
    per_micro = compute + hooks
    compute, hooks = per_micro * grad_accum, hooks * grad_accum
    adam = shard / rates.adam_params_s
    # Per-parameter engine work every step: zeroing and accumulating fp32 gradients, dtype conversions,
    # norms, copies of gathered shards (in backward).
    engine = shard * PER_PARAM_S
    cores = 1 if _cuda() else world  # CPU training: the local ranks share this host's cores
    per_byte = 1 / rates.memcpy_bytes_s + (1 / rates.crc_bytes_s if checksums and rates.crc_bytes_s else 0)
    where = {"backward": "rest", "forward": "forward", "after": "after"}[step]
    cpu = {"forward": forward, "rest": compute - forward + engine, "after": 0.0}
    cpu[where] += adam
    phases, disk, copies = {}, 0.0, 0.0
    for name, (r, w) in io.items():
        c = (cpu[name] + (r + w) * per_byte) * cores
        copies += (r + w) * per_byte
        # The ranks on this host share its disk: each waits for all of them.
        d = 0.0
        if r or w:
            rt, wt = r / rates.disk_read_bytes_s, w / rates.disk_write_bytes_s
            d = world * (max(rt, wt) + DUPLEX_SHARE * min(rt, wt))
        disk += d
        phases[name] = _overlap(c, d)
    return {"step": sum(phases.values()), "compute": compute, "adam": adam, "copies": copies, "engine": engine,
            "io": disk, "step_phase": step, **{f"{k}_s": v for k, v in phases.items()}}


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

