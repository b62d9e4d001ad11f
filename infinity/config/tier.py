"""Tier: where a piece of training state lives between uses: the parse of an offload section's `device`."""

from __future__ import annotations

import enum


class Tier(enum.Enum):
    """Where a parameter shard or a sub-group's optimizer state lives between uses, and what that costs.

    The values are the config's spellings (`offload_param.device`, `offload_optimizer.device`); the config's
    sections parse them once, as their `.tier`.
    """

    DEVICE = "none"
    """Not offloaded: in the compute device's memory (the GPU's, or host RAM on a CPU-only machine)."""
    CPU = "cpu"
    """Host RAM, outside any pool: its full size in host memory, no I/O."""
    NVME = "nvme"
    """A swap file under nvme_path: no memory between uses; one pool buffer while read, used or written."""

    def __str__(self) -> str:
        return self.value
