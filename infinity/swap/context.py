"""SwapContext: the third layer. It owns the buffer pool, the I/O handle and the swapper of one rank.

It exists so that the engine builds all three from a config in one place,
and closes them in the right order (swapper first: it waits for pending
writes that use the handle and the pool).
"""

from __future__ import annotations

import torch

from infinity.config import Config
from infinity.errors import ConfigError
from infinity.io import AsyncIO
from infinity.swap.pool import BufferPool
from infinity.swap.swapper import TensorSwapper


class SwapContext:
    """Pool + AsyncIO + TensorSwapper for the optimizer state of one rank, sized from the config."""

    def __init__(self, cfg: Config, *, rank: int = 0, largest_group_numel: int | None = None):
        off = cfg.zero_optimization.offload_optimizer
        if off.device != "nvme":
            raise ValueError('SwapContext: zero_optimization.offload_optimizer.device is not "nvme"; nothing to swap')
        group = cfg.zero_optimization.sub_group_size if largest_group_numel is None else largest_group_numel
        if group < 1:
            raise ValueError(f"SwapContext: largest_group_numel must be >= 1, got {group}")
        pool_bytes = off.buffer_count * 12 * group
        budget = cfg.infinity.memory_budget
        if budget is not None and pool_bytes > budget:
            raise ConfigError("zero_optimization.offload_optimizer.buffer_count",
                              f"{off.buffer_count} buffers x 12 B x {group} parameters = {pool_bytes / 2**30:.2f} GiB "
                              f"exceeds infinity.memory_budget ({budget / 2**30:.2f} GiB); lower buffer_count or "
                              "zero_optimization.sub_group_size")
        aio = cfg.aio
        self.io = AsyncIO(backend=aio.backend, block_size=aio.block_size, queue_depth=aio.queue_depth,
                          threads=aio.intra_op_parallelism, direct=cfg.infinity.direct_io)
        try:
            # One buffer holds a whole sub-group's [param | exp_avg | exp_avg_sq] in fp32. pin_memory
            # page-locks it for device copies, which only means something when CUDA is there.
            self.pool = BufferPool(off.buffer_count, 12 * group, pin=off.pin_memory and torch.cuda.is_available())
            self.swapper = TensorSwapper(off.nvme_path, self.pool, self.io, rank=rank,
                                         checksums=cfg.infinity.checksums, leftovers=cfg.infinity.leftovers)
        except BaseException:
            self.io.close()
            raise

    def close(self) -> None:
        self.swapper.close()
        self.io.close()

    def __enter__(self) -> "SwapContext":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
