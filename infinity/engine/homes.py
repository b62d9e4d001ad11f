"""Shard homes: where a managed parameter's shard lives between uses, one class per tier.

ParamStore asks a parameter's home (`ManagedParam.home`) to keep, read,
write and forget its shard, and never asks which tier that is. A store has
one home per tier it uses: with `offload_param.device` nvme, the first
`offload_param.max_in_cpu` shard elements stay in host RAM (as in DeepSpeed)
and the rest go to NVMe, so one store can hold both.
"""

from __future__ import annotations

import abc

import torch

from infinity.engine.alias import slice_id
from infinity.engine.plan import ShardSource
from infinity.swap.tier import HOST, Tier


def _own(shard: torch.Tensor, owned: bool) -> torch.Tensor:
    """The shard as a tensor of its own."""
    return shard if owned else shard.clone()


class ShardHome(abc.ABC):
    """Keeps managed parameters' shards on one tier."""

    tier: Tier

    @abc.abstractmethod
    def keep(self, mp, shard: torch.Tensor) -> None:
        """The first value of mp's shard (`part` elements, in the dtype it was built in)."""

    @abc.abstractmethod
    def defer(self, mp, shard: torch.Tensor) -> None:
        """Like keep, but the values are about to be loaded: write nothing (see [Note: streamed from_pretrained])."""

    @abc.abstractmethod
    def dtype(self, mp) -> torch.dtype:
        """The dtype the shard is kept in now."""

    @abc.abstractmethod
    def read(self, mp, dtype: torch.dtype | None) -> torch.Tensor:
        """The shard as a tensor the caller may keep (RAM: the stored tensor itself when dtype matches)."""

    @abc.abstractmethod
    def gather(self, mp, dtype: torch.dtype, assemble, *, scheduled: bool) -> torch.Tensor:
        """assemble(shard, owned) applied to the shard in `dtype` while the memory it is in is held; its result.

        `owned`: the shard is a tensor of its own, which the result may alias;
        otherwise it is a pool buffer's view, the optimizer's state or the
        stored shard, released or rewritten once assemble returns, so the
        result must not alias it (see [Note: gathered from the buffer] in params.py).
        """

    @abc.abstractmethod
    def write(self, mp, values: torch.Tensor, dtype: torch.dtype):
        """Replace the shard with `values`, kept in `dtype`; returns a future to wait for, or None."""

    def forget(self, mp) -> None:
        """The store forgets mp: free what its shard holds."""

    def flush(self) -> None:
        """Wait until every write started so far has landed."""


class RamHome(ShardHome):
    """offload_param none (the compute device's memory) or cpu (host RAM): the shard is a tensor, no I/O."""

    def __init__(self, tier: Tier, device: torch.device):
        self.tier = tier
        self.device = device

    def keep(self, mp, shard: torch.Tensor) -> None:
        mp.shard = shard.to(self.device)

    def defer(self, mp, shard: torch.Tensor) -> None:
        mp.shard = torch.zeros_like(shard, device=self.device)

    def dtype(self, mp) -> torch.dtype:
        return mp.shard.dtype

    def read(self, mp, dtype) -> torch.Tensor:
        return mp.shard if dtype is None else mp.shard.to(dtype)

    def gather(self, mp, dtype, assemble, *, scheduled: bool) -> torch.Tensor:
        shard = mp.shard.to(dtype)
        return assemble(shard, shard is not mp.shard)

    def write(self, mp, values: torch.Tensor, dtype: torch.dtype):
        if mp.shard.dtype != dtype:
            mp.shard = torch.empty(mp.part, dtype=dtype, device=mp.shard.device)
        mp.shard.copy_(values)
        return None

    def write_piece(self, mp, lo: int, values: torch.Tensor, dtype: torch.dtype) -> None:
        """Elements [lo, lo + len(values)) of mp's shard: a piece of a split shard, written in order from the
        first (which takes the new dtype, as `write` would)."""
        if mp.shard.dtype != dtype:
            if lo:
                raise AssertionError(f"a later piece of {mp.name} changes its shard's dtype")
            mp.shard = torch.empty(mp.part, dtype=dtype, device=mp.shard.device)
        mp.shard[lo:lo + values.numel()].copy_(values)


class NvmeHome(ShardHome):
    """offload_param nvme: each shard is a swap file, read through the prefetch scheduler in forward/backward.

    In alias mode a trainable parameter's shard is read from its slice of the
    optimizer's group file instead (the fp32 master, or the compute-dtype tail:
    see [Note: fp32 shards live in the optimizer file] and [Note: compute-dtype
    shards in the optimizer file] in alias.py), and only the optimizer writes it.
    """

    tier = Tier.NVME

    def __init__(self, store):
        self.store = store

    @property
    def swapper(self):
        return self.store.swap.swapper

    def in_optimizer_file(self, mp) -> bool:
        """mp's shard is read from its slice of the optimizer's file (ShardSource.OPTIMIZER_FILE, trained)."""
        return self.store.shard_source is ShardSource.OPTIMIZER_FILE and mp.trainable

    def reader_of(self, mp):
        """What reads mp's shard: the optimizer-slice reader (alias.py), or the parameter swapper."""
        return self.store.alias if self.in_optimizer_file(mp) else self.swapper

    def swap_id(self, mp, dtype: torch.dtype | None = None) -> str:
        """The id of mp's shard in its reader (the partition, of `dtype`, default the current one)."""
        if self.in_optimizer_file(mp):
            return slice_id(mp)
        return f"param/{mp.index}/{str(dtype or mp.swap_dtype).replace('torch.', '')}"

    def keep(self, mp, shard: torch.Tensor) -> None:
        self.swapper.swap_out(self.swap_id(mp, shard.dtype), shard).wait()
        mp.shard = None
        mp.swap_dtype = shard.dtype

    def defer(self, mp, shard: torch.Tensor) -> None:
        mp.shard = None
        mp.swap_dtype = shard.dtype

    def dtype(self, mp) -> torch.dtype:
        return mp.swap_dtype

    def read(self, mp, dtype) -> torch.Tensor:
        return self.gather(mp, dtype or mp.swap_dtype, _own, scheduled=False)

    def gather(self, mp, dtype, assemble, *, scheduled: bool) -> torch.Tensor:
        sid = self.swap_id(mp)
        store = self.store
        if store.scheduler is not None and scheduled:
            return store.scheduler.fetch(mp, sid, dtype, assemble)
        reader = self.reader_of(mp)
        view = reader.swap_in(sid).wait()
        try:
            shard = view.to(dtype)
            return assemble(shard, shard is not view)
        finally:
            reader.release(sid)

    def write(self, mp, values: torch.Tensor, dtype: torch.dtype):
        if self.in_optimizer_file(mp):
            raise RuntimeError(f"{mp.name}: its shard lives in the optimizer's file (alias mode); "
                               "only the optimizer writes it")
        if mp.swap_dtype != dtype:
            self.swapper.remove(self.swap_id(mp))
            mp.swap_dtype = dtype
        # From an accelerator (a device-tier optimizer group's master) through host memory: swap files are
        # written from the host.
        return self.swapper.swap_out(self.swap_id(mp), values.to(HOST, dtype).contiguous())

    def forget(self, mp) -> None:
        sid = self.swap_id(mp)
        if not mp.unwritten and sid in self.swapper.registry:  # forgetting twice is a no-op
            self.swapper.remove(sid)

    def flush(self) -> None:
        self.swapper.flush()
