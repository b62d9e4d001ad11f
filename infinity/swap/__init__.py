"""The swap service: where every partition lives, and the bounded pool that moves it.

Layers (see shared/STYLE.md):
- one partition: `registry.Partition`, its residency, moved by `swapper.TensorSwapper`;
- a group moved together: `state.GroupState`, one class per `tier.Tier`
  (a sub-group's Adam state in device memory, host RAM or an NVMe file),
  driven by the one read-ahead / work / write-behind `pipeline.StatePipeline`;
- a context that owns the buffer pool, the I/O handle and the swapper
  (`context.SwapContext`).
"""

from infinity.swap.pool import BufferPool, PoolBuffer, PoolExhausted
from infinity.swap.registry import Partition, Registry, Residency
from infinity.swap.tier import Tier
from infinity.swap.swapper import SwapFuture, TensorSwapper
from infinity.swap.context import SwapContext  # noqa: E402 - after the swapper it builds

__all__ = ["BufferPool", "PoolBuffer", "PoolExhausted", "Partition", "Registry", "Residency", "Tier",
           "SwapFuture", "TensorSwapper", "SwapContext"]
