"""The swap service: where every partition lives, and the bounded pool that moves it.

Layers (see shared/STYLE.md): one partition (`registry.Partition`), a group
moved together (the optimizer swapper, to come), and a context that owns the
buffer pool and the I/O handle (`pool.BufferPool`, `infinity.io.AsyncIO`).
"""

from infinity.swap.pool import BufferPool, PoolBuffer, PoolExhausted
from infinity.swap.registry import Partition, Registry, Residency, Tier
from infinity.swap.swapper import SwapFuture, TensorSwapper
from infinity.swap.context import SwapContext  # noqa: E402 - after the swapper it builds

__all__ = ["BufferPool", "PoolBuffer", "PoolExhausted", "Partition", "Registry", "Residency", "Tier",
           "SwapFuture", "TensorSwapper", "SwapContext"]
