"""SwapContext: the third layer. It owns the buffer pool, the I/O handle and the swapper of one kind of state.

It exists so that the engine builds all three from a config in one place,
and closes them in the right order (swapper first: it waits for pending
writes that use the handle and the pool). One rank has up to two: the
parameter shards (`for_params`) and the optimizer state (`for_optimizer`),
each with its own pool, so neither can starve the other.
"""

from __future__ import annotations

import torch

from infinity.config import Config
from infinity.errors import ConfigError
from infinity.io import AsyncIO
from infinity.swap.pool import BufferPool
from infinity.swap.state import MOMENT_DTYPES, state_nbytes
from infinity.swap.swapper import TensorSwapper
from infinity.swap.tier import Tier


class SwapContext:
    """Pool + AsyncIO + TensorSwapper: `count` buffers of `size` bytes, files under `directory` (or several)."""

    def __init__(self, *, directory, count: int, size: int, cfg: Config, pin: bool, rank: int = 0, kind: str = "",
                 world: int | None = None, sized: bool = False):
        """`directory`: one, or a tuple of one per disk, each with an I/O handle of its own ([Note: several
        NVMe paths] in swapper.py)."""
        directories = directory if isinstance(directory, tuple) else (directory,)
        self.ios = []
        try:
            for _ in directories:
                self.ios.append(AsyncIO.from_config(cfg))
            self.io = self.ios[0]
            # pin_memory page-locks the pool for device copies, which only means something when CUDA is there.
            self.pool = BufferPool(count, size, pin=pin and torch.cuda.is_available(), sized=sized)
            self.swapper = TensorSwapper(list(directories), self.pool, self.ios, rank=rank, kind=kind, world=world,
                                         checksums=cfg.infinity.checksums, leftovers=cfg.infinity.leftovers)
        except BaseException:
            for io in self.ios:
                io.close()
            raise

    @classmethod
    def for_optimizer(cls, cfg: Config, *, rank: int = 0, largest_group_numel: int | None = None,
                      tail_bytes: int = 0, master: bool = True, world: int | None = None) -> "SwapContext":
        """One buffer holds a whole sub-group's [param | exp_avg | exp_avg_sq] (12 B per parameter; 8 with bf16
        moments, about 6 with 8-bit ones: state_nbytes), and `tail_bytes` per parameter after it: the weights' compute-dtype copy (2 with bf16/fp16
        shards kept in the state, see [Note: compute-dtype shards in the optimizer file] in engine/alias.py).
        `master=False`: the groups hold the moments only (NvmeState(master=False))."""
        off = cfg.zero_optimization.offload_optimizer
        if off.tier is not Tier.NVME:
            raise ValueError('SwapContext: zero_optimization.offload_optimizer.device is not "nvme"; nothing to swap')
        group = cfg.zero_optimization.sub_group_size if largest_group_numel is None else largest_group_numel
        if group < 1:
            raise ValueError(f"SwapContext: largest_group_numel must be >= 1, got {group}")
        size = state_nbytes(group, MOMENT_DTYPES[off.moments_dtype], master=master) + tail_bytes * group
        pool_bytes = off.buffer_count * size
        budget = cfg.infinity.memory_budget
        if budget is not None and pool_bytes > budget:
            raise ConfigError("zero_optimization.offload_optimizer.buffer_count",
                              f"{off.buffer_count} buffers x {size:,} B ({group:,} parameters' state) = "
                              f"{pool_bytes / 2**30:.2f} GiB "
                              f"exceeds infinity.memory_budget ({budget / 2**30:.2f} GiB); lower buffer_count or "
                              "zero_optimization.sub_group_size")
        return cls(directory=off.paths, count=off.buffer_count, size=size, cfg=cfg, pin=off.pin_memory,
                   rank=rank, world=world)

    @classmethod
    def for_params(cls, cfg: Config, *, rank: int = 0, largest_shard_numel: int | None = None,
                   world: int | None = None) -> "SwapContext":
        """Parameter shards: slots of buffer_size elements of fp32 (shards start as fp32; see ParamStore), each
        shard's buffer just its size ([Note: a pool of full-size slots lends smaller buffers] in pool.py)."""
        off = cfg.zero_optimization.offload_param
        if off.tier is not Tier.NVME:
            raise ValueError('SwapContext: zero_optimization.offload_param.device is not "nvme"; nothing to swap')
        numel = off.buffer_size if largest_shard_numel is None else largest_shard_numel
        return cls(directory=off.paths, count=off.buffer_count, size=4 * numel, cfg=cfg, pin=off.pin_memory,
                   rank=rank, kind="param", world=world, sized=True)

    def close(self) -> None:
        self.swapper.close()
        for io in self.ios:
            io.close()

    def __enter__(self) -> "SwapContext":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
