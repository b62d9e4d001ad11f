"""OffloadPlan: where each kind of training state lives, decided once per `initialize`.

[Note: one plan for the placement]
`initialize` decides, from the config, the model's trained shards and the world size, where everything goes:
the parameters' tier (the store's, made under zero_init or here), the optimizer's tier and each sub-group's (a
ratio below 1 keeps the last ones on the device), the compute and moment dtypes, where a trained shard is read
from between uses (its own home, or the optimizer's NVMe file: ShardSource), whether a shard larger than a
sub-group is split, the sub-groups themselves, and the optimizer pool's buffers (fitted to the model where the
config does not write them: [Note: sizes fitted to the model] below). Before this plan, the optimizer, the
sizing and the engine each derived these again from the config; now `plan_offload` derives them and the others
read the plan. Two things are decided outside it, because they come before it: the parameter store's own pool
(built under zero_init, before the model exists), and the swap files' room, checked on every rank before any
shard is written (both build.py's). The plan keeps what that check found (`disk`), with the optimizer's bytes
made exact from its sub-groups.

[Note: sizes fitted to the model]
The NVMe optimizer's pool holds `offload_optimizer.buffer_count` buffers, each
one sub-group's whole state: 12 B per parameter (8 with bf16 moments), plus
the compute-dtype tail in alias mode. DeepSpeed's `sub_group_size` default is
1e9 and the shipped configs carried 1e8, so for a 125M model each buffer held
about 100M parameters' state (1.4 GB) and four of them were more than the
model's whole training state. A buffer must hold the largest sub-group;
more than that buys nothing but fewer, longer reads. So, for the keys the
config does not write (`Config.given`; a Config built in Python wrote them
all):
- `sub_group_size` becomes the largest trained shard on this rank (capped at
  TARGET where large shards can be split, see below), and at least FLOOR
  elements (1M: 12 MB reads, large enough to run at the disk's
  rate, without thousands of sub-groups for a model of small tensors). The
  default `infinity train` run (gpt-small's 3.3M parameters, largest shard
  262,144) measured both: 22 sub-groups of at most 262,144 gave 2,850
  tokens/s at 390 MiB peak RSS, 4 of at most 1M gave 3,100 tokens/s at
  430 MiB; the floor takes the speed;
- `offload_optimizer.buffer_count` (4, DeepSpeed's default) is capped at the
  number of sub-groups: a buffer no sub-group can use is only memory;
- `offload_param.buffer_size` becomes the largest parameter shard (see
  [Note: the parameter pool fits the model] in build.py); under zero_init the
  store comes before the model, so `infinity train` and InfinityTrainer
  measure the model on the meta device first and fit it then.
A value the config writes always stands; one that makes the pool larger
than the whole state it swaps is said once, with what leaving it out gives.
What was chosen, and why, is logged once (`infinity train` prints it).
Only the NVMe optimizer is fitted: on the CPU tier the sub-group count also
decides what `offload_optimizer.ratio` keeps on the device, as in DeepSpeed,
so its `sub_group_size` keeps the config's (or DeepSpeed's) meaning.
Where the shards live in the optimizer's files (parameters and optimizer
both on NVMe) or in RAM under ZeRO-3, a shard larger than sub_group_size is
split over sub-groups of its own ([Note: a large shard is split over
sub-groups of its own] in optimizer.py, `can_split` below), so there the fit is the
largest shard capped at TARGET (8M): gpt-125m's tied 38.6M embedding becomes
five pieces and its pool 448 MiB instead of 2.0 GiB for 1.6 GiB of state.
Elsewhere (shards in NVMe files of their own) a buffer must still hold the
largest shard's state.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
from dataclasses import dataclass

import torch

from infinity.config import Config
from infinity.config.tier import Tier
from infinity.swap.state import MOMENT_DTYPES, state_nbytes

log = logging.getLogger("infinity")

FLOOR = 1 << 20
TARGET = 1 << 23
"""The fitted sub_group_size where large shards can be split: 8M parameters, 112 MB buffers with a bf16 tail."""
SUB_GROUP = "zero_optimization.sub_group_size"
BUFFERS = "zero_optimization.offload_optimizer.buffer_count"
PARAM_BUFFER = "zero_optimization.offload_param.buffer_size"


SPLIT_ALIGN = 1 << 12
"""Pieces of a split shard start at multiples of this many elements (4 KiB-aligned in fp32 and in bf16 tails)."""


class ShardSource(enum.Enum):
    """Where a trained parameter's shard is read from between uses."""

    HOME = "its own home"
    """The store's home for it: device or host memory, or a swap file of its own."""
    OPTIMIZER_FILE = "the optimizer's file"
    """Its sub-group's NVMe optimizer file (alias.py): the fp32 master itself, or the compute-dtype copy kept
    after the state ([Note: fp32 shards live in the optimizer file], [Note: compute-dtype shards in the
    optimizer file])."""


@dataclass(frozen=True, kw_only=True, slots=True)
class DiskNeed:
    """The swap files' room on one filesystem, as checked before anything was written (check_disk_room in
    build.py)."""

    path: str
    """The nvme_path on it (the optimizer's when both are)."""
    param_bytes: int
    """This rank's parameter files at their largest during setup, less what zero_init had already written."""
    optimizer_bytes: int
    """This rank's optimizer state files, each with its header (and the compute-dtype tail when the shards
    live there): the check's estimate (a header per trained shard), made exact by the plan from its NVMe
    sub-groups."""
    ranks: int
    """Ranks on this host (LOCAL_WORLD_SIZE), each needing as much."""
    free: int
    """Bytes free on the filesystem when it was checked."""
    optimizer_slots: tuple[int, ...] = ()
    """Which of offload_optimizer's paths (their indices) are on this filesystem."""

    @property
    def room_for_second_copy(self) -> bool:
        """The filesystem also holds a second copy of the optimizer's files: what the speculative step writes to
        ([Note: the speculative step] in optimizer.py)."""
        return self.free >= self.ranks * (self.param_bytes + 2 * self.optimizer_bytes)


@dataclass(frozen=True, kw_only=True, slots=True)
class SubGroupPlan:
    """One optimizer sub-group: the unit the optimizer's state moves and steps in."""

    index: int
    """Its place in the optimizer's walk (and the name of its swap file, optim/g<index>)."""
    params: tuple
    """The ManagedParams whose shards (or, split, a piece of one shard) it holds."""
    param_group: int
    """Index into the optimizer's param_groups: whose lr, betas, eps and weight decay it uses."""
    span: tuple[int, int] | None
    """A piece of a split shard: its elements [lo, hi); None for whole shards."""
    tier: Tier
    """Where its state lives between steps."""

    @property
    def numel(self) -> int:
        if self.span is not None:
            return self.span[1] - self.span[0]
        return sum(mp.part for mp in self.params)


@dataclass(frozen=True, kw_only=True, slots=True)
class OffloadPlan:
    """Where each kind of training state lives, for one engine (see [Note: one plan for the placement])."""

    param_tier: Tier
    """The parameters' shards between uses (offload_param at stage 3; the device below it)."""
    optimizer_tier: Tier
    """The offloaded sub-groups' master weights and moments (offload_optimizer)."""
    compute_dtype: torch.dtype
    """Gathered parameters, and after setup the shards (fp32, bf16 or fp16)."""
    moments_dtype: torch.dtype
    """exp_avg and exp_avg_sq on every tier (offload_optimizer.moments_dtype)."""
    shard_source: ShardSource
    """Where the trained shards are read from between uses."""
    shard_dtype: torch.dtype | None
    """With ShardSource.OPTIMIZER_FILE, the dtype the shards are read in (fp32: the master; else the compute
    dtype's copy after the state); None with HOME."""
    split: bool
    """A shard larger than sub_group_size is split over sub-groups of its own ([Note: a large shard is split
    over sub-groups of its own] in optimizer.py)."""
    sub_groups: tuple[SubGroupPlan, ...]
    """Every sub-group, in walk order."""
    optimizer_buffers: int
    """Buffers of the NVMe optimizer pool (0 when nothing is on NVMe); each holds the largest sub-group's state
    and tail (SwapContext.for_optimizer sizes it from largest_sub_group and tail_bytes)."""
    fitted: str
    """What was fitted to the model and why (logged once), or "" when the config wrote every size."""
    disk: tuple[DiskNeed, ...] = ()
    """The swap files' room on each filesystem they go to (none without NVMe), checked on every rank."""

    @property
    def tail_bytes(self) -> int:
        """Bytes per parameter of the compute-dtype copy kept after a sub-group's state (0 without one)."""
        return 0 if self.shard_dtype in (None, torch.float32) else self.shard_dtype.itemsize

    @property
    def largest_sub_group(self) -> int:
        return max((g.numel for g in self.sub_groups), default=1)


def pack(by_group: list[list], sub_group_size: int, *, split: bool, tier: Tier = Tier.DEVICE,
         ratio: float = 1.0) -> list[SubGroupPlan]:
    """Pack each parameter group's shards (`by_group`: each group's ManagedParams) into sub-groups of at most
    sub_group_size elements; with `split`, a larger shard becomes consecutive sub-groups of its own, else one
    sub-group. The first int(ratio x count) sub-groups are on `tier`, the rest on the device ([Note: partial
    offload] in optimizer.py)."""
    piece = max(SPLIT_ALIGN, sub_group_size // SPLIT_ALIGN * SPLIT_ALIGN)
    packed: list[tuple] = []  # (params, param group, span)
    for k, params in enumerate(by_group):
        cur, size = [], 0
        # Persistent parameters first, in groups of their own: a deferred step takes those at once ([Note: the
        # step finishes in the next forward] in deferred.py).
        for mp in sorted(params, key=lambda mp: (not mp.persistent, mp.index)):
            if split and mp.part > sub_group_size:
                if cur:
                    packed.append((cur, k, None))
                    cur, size = [], 0
                for lo in range(0, mp.part, piece):
                    packed.append(([mp], k, (lo, min(mp.part, lo + piece))))
                continue
            if cur and (size + mp.part > sub_group_size or cur[-1].persistent != mp.persistent):
                packed.append((cur, k, None))
                cur, size = [], 0
            cur.append(mp)
            size += mp.part
        if cur:
            packed.append((cur, k, None))
    offloaded = int(ratio * len(packed))
    return [SubGroupPlan(index=i, params=tuple(params), param_group=k, span=span,
                         tier=tier if i < offloaded else Tier.DEVICE)
            for i, (params, k, span) in enumerate(packed)]


def shards_in_state(store, groups: list[list], tier: Tier, ratio: float) -> torch.dtype | None:
    """Whether the trained parameters' shards live in the optimizer's NVMe files instead of files of their own,
    and in which dtype: the compute dtype (fp32: the master itself, see [Note: fp32 shards live in the optimizer
    file]; bf16/fp16: a tail of the state, [Note: compute-dtype shards in the optimizer file], both in alias.py),
    or None. They do when every sub-group (`groups`: each one's ManagedParams) is offloaded to NVMe and every
    trained shard's home is NVMe."""
    nvme = store.nvme
    if nvme is None or not groups or tier is not Tier.NVME or int(ratio * len(groups)) < len(groups):
        return None
    if any(mp.home is not nvme for params in groups for mp in params):
        return None
    return store.dtype


def can_split(store, groups: list[list], tier: Tier, ratio: float) -> bool:
    """Whether a shard larger than sub_group_size is split over sub-groups of its own ([Note: a large shard is
    split over sub-groups of its own]): every sub-group (`groups`: each one's ManagedParams) offloaded to NVMe,
    and every trained shard either in the optimizer's files (alias mode) or, under ZeRO-3, in host or device
    memory, whose home takes a piece at a time."""
    if shards_in_state(store, groups, tier, ratio) is not None:
        return True
    if store.stage != 3 or not groups or tier is not Tier.NVME or int(ratio * len(groups)) < len(groups):
        return False
    return all(mp.home is store.ram for params in groups for mp in params)


def written(cfg: Config, key: str) -> bool:
    """Whether the config wrote `key` (a Config built in Python, not loaded, wrote all of its values)."""
    return cfg.given is None or key in cfg.given


def fit_optimizer(cfg: Config, store, by_group: list[list], *, split: bool, say: bool) -> tuple[Config, str, list]:
    """cfg with the NVMe optimizer's sub_group_size and buffer_count fitted to the trained shards (`by_group`:
    each parameter group's ManagedParams), for the keys the config does not write, and the line saying what
    was chosen and why ("" when the config wrote both); the sub-groups packed with the fitted size come back
    third. `say`: this rank says an oversized written pool (rank 0 only, so it is said once)."""
    zero = cfg.zero_optimization
    off = zero.offload_optimizer
    shards = [mp.part for params in by_group for mp in params]
    largest = max(shards, default=1)
    fitted = min(max(largest, FLOOR), TARGET) if split else max(largest, FLOOR)
    sub_group = zero.sub_group_size if written(cfg, SUB_GROUP) else fitted
    groups = pack(by_group, sub_group, split=split, tier=off.tier, ratio=off.ratio)
    count = off.buffer_count if written(cfg, BUFFERS) else max(1, min(off.buffer_count, len(groups)))
    in_state = shards_in_state(store, [g.params for g in groups], off.tier, off.ratio)
    group_numel = max((g.numel for g in groups), default=1)
    nbytes = _state_file_bytes(off.moments_dtype, in_state)
    pool, state = count * nbytes(group_numel), nbytes(sum(shards))
    wrote = [k for k in (SUB_GROUP, BUFFERS) if cfg.given is not None and k in cfg.given]
    if wrote and pool > state and say:
        log.warning("infinity: %s make the NVMe optimizer's pool %d buffers of %s parameters' state, %.2f GiB: "
                    "more than the %.2f GiB of state it swaps; leave %s out of the config and the engine fits "
                    "them to the model", " and ".join(f"{k.rsplit('.', 1)[-1]} {_value(cfg, k):,}" for k in wrote),
                    count, f"{group_numel:,}", pool / 2**30, state / 2**30,
                    " and ".join(k.rsplit(".", 1)[-1] for k in wrote))
    parts = []
    if not written(cfg, SUB_GROUP) and split:
        parts.append(f"sub_group_size {sub_group:,} (the largest trained shard is {largest:,} parameters; at most "
                     f"{TARGET:,}, a larger shard split over sub-groups of its own; at least {FLOOR:,})")
    elif not written(cfg, SUB_GROUP):
        parts.append(f"sub_group_size {sub_group:,} (the largest trained shard is {largest:,} parameters and a "
                     f"sub-group holds whole shards here; at least {FLOOR:,})")
    if not written(cfg, BUFFERS):
        parts.append(f"buffer_count {count} (of at most {off.buffer_count}, for {len(groups)} sub-group(s))")
    line = ("NVMe optimizer sizes fitted to the model: " + "; ".join(parts)
            + f"; the pool holds {pool / 2**20:,.0f} MiB for {state / 2**20:,.0f} MiB of state") if parts else ""
    fitted = dataclasses.replace(zero, sub_group_size=sub_group,
                                 offload_optimizer=dataclasses.replace(off, buffer_count=count))
    return dataclasses.replace(cfg, zero_optimization=fitted), line, groups


def plan_offload(cfg: Config, store, by_group: list[list], *, disk: tuple = (),
                 say: bool) -> tuple[Config, OffloadPlan]:
    """The plan for the trained shards of `store` (`by_group`: each parameter group's ManagedParams), and the
    config with the sizes fitted to them where it wrote none (`say`: this rank logs what an oversized written
    pool costs; one rank says it). `disk`: the room the store's check found (DiskNeed per filesystem)."""
    zero = cfg.zero_optimization
    off = zero.offload_optimizer
    tier, ratio = off.tier, off.ratio
    split = can_split(store, by_group, tier, ratio)
    fitted = ""
    if tier is Tier.NVME:  # the sizes fitted to the model; the sub-groups come packed with them
        cfg, fitted, sub_groups = fit_optimizer(cfg, store, by_group, split=split, say=say)
        off = cfg.zero_optimization.offload_optimizer
    else:
        sub_groups = pack(by_group, zero.sub_group_size, split=split, tier=tier, ratio=ratio)
    in_state = shards_in_state(store, [g.params for g in sub_groups], tier, ratio)
    return cfg, OffloadPlan(
        param_tier=store.tier, optimizer_tier=tier, compute_dtype=store.dtype,
        moments_dtype=MOMENT_DTYPES[off.moments_dtype],
        shard_source=ShardSource.HOME if in_state is None else ShardSource.OPTIMIZER_FILE, shard_dtype=in_state,
        split=split, sub_groups=tuple(sub_groups),
        optimizer_buffers=off.buffer_count if any(g.tier is Tier.NVME for g in sub_groups) else 0, fitted=fitted,
        disk=_exact_state_files(disk, sub_groups, _state_file_bytes(off.moments_dtype, in_state), len(off.paths)))


def _state_file_bytes(moments_dtype: str, in_state):
    """numel -> the bytes of a sub-group's state file: its state (state_nbytes), and the compute-dtype copy of
    its shards when they live in it."""
    moments = MOMENT_DTYPES[moments_dtype]
    lowp = 0 if in_state in (None, torch.float32) else in_state.itemsize
    return lambda numel: state_nbytes(numel, moments) + lowp * numel


def _exact_state_files(disk: tuple, sub_groups: list, nbytes, paths: int) -> tuple:
    """`disk` with the optimizer's bytes those of the files the sub-groups on NVMe write: the j-th group's
    `nbytes(numel)`, first in turn j, in one file or striped over the paths, each file with its header's room
    (chunk_layout, [Note: several NVMe paths] in swap/swapper.py)."""
    from infinity.swap.swapper import HEADER, chunk_layout

    on = [0] * max(paths, 1)
    for j, g in enumerate(g for g in sub_groups if g.tier is Tier.NVME):
        for k, lo, hi in chunk_layout(nbytes(g.numel), max(paths, 1), j):
            on[k] += HEADER + hi - lo
    return tuple(dataclasses.replace(d, optimizer_bytes=sum(on[k] for k in d.optimizer_slots))
                 if d.optimizer_slots else d for d in disk)


def fit_param_buffer(cfg: Config, largest_shard: int) -> Config:
    """cfg with offload_param.buffer_size no larger than the largest parameter shard (see [Note: the parameter
    pool fits the model] in build.py): the shard itself when the config does not write it; a written value
    above it only costs memory, and one below keeps its meaning (and its error)."""
    off = cfg.zero_optimization.offload_param
    size = min(off.buffer_size, largest_shard) if written(cfg, PARAM_BUFFER) else largest_shard
    size = max(size, 1)
    if size == off.buffer_size:
        return cfg
    return dataclasses.replace(cfg, zero_optimization=dataclasses.replace(
        cfg.zero_optimization, offload_param=dataclasses.replace(off, buffer_size=size)))


def _value(cfg: Config, key: str):
    node = cfg
    for part in key.split("."):
        node = getattr(node, part)
    return node
