"""The optimizer's swap sizes, fitted to the model when the config does not give them.

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
sub-groups of its own] in optimizer.py, `can_split` in plan.py), so there the fit is the
largest shard capped at TARGET (8M): gpt-125m's tied 38.6M embedding becomes
five pieces and its pool 448 MiB instead of 2.0 GiB for 1.6 GiB of state.
Elsewhere (shards in NVMe files of their own) a buffer must still hold the
largest shard's state.
"""

from __future__ import annotations

import dataclasses
import logging

from infinity.config import Config
from infinity.swap.state import MOMENT_DTYPES, state_bytes

log = logging.getLogger("infinity")

FLOOR = 1 << 20
TARGET = 1 << 23
"""The fitted sub_group_size where large shards can be split: 8M parameters, 112 MB buffers with a bf16 tail."""
SUB_GROUP = "zero_optimization.sub_group_size"
BUFFERS = "zero_optimization.offload_optimizer.buffer_count"
PARAM_BUFFER = "zero_optimization.offload_param.buffer_size"


def written(cfg: Config, key: str) -> bool:
    """Whether the config wrote `key` (a Config built in Python, not loaded, wrote all of its values)."""
    return cfg.given is None or key in cfg.given


def fit_optimizer(cfg: Config, by_group: list[list], plan, tail_bytes, *, split: bool = False,
                  say: bool = True) -> tuple[Config, str, list]:
    """cfg with the NVMe optimizer's sub_group_size and buffer_count fitted to the trained shards (`by_group`:
    each parameter group's ManagedParams), for the keys the config does not write, and the line saying what
    was chosen and why ("" when the config wrote both). `plan(by_group, sub_group_size)` packs the sub-groups;
    `tail_bytes(sub_groups)` is the compute-dtype tail per parameter kept in the state (0 without one); the
    sub-groups planned with the fitted size come back third. `say`:
    this rank says an oversized written pool (rank 0 only, so it is said once)."""
    zero = cfg.zero_optimization
    off = zero.offload_optimizer
    shards = [mp.part for params in by_group for mp in params]
    largest = max(shards, default=1)
    fitted = min(max(largest, FLOOR), TARGET) if split else max(largest, FLOOR)
    sub_group = zero.sub_group_size if written(cfg, SUB_GROUP) else fitted
    groups = plan(by_group, sub_group)
    count = off.buffer_count if written(cfg, BUFFERS) else max(1, min(off.buffer_count, len(groups)))
    per = state_bytes(MOMENT_DTYPES[off.moments_dtype]) + tail_bytes(groups)
    group_numel = max((g.numel for g in groups), default=1)
    pool, state = count * group_numel * per, sum(shards) * per
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
