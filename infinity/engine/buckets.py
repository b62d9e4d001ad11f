"""GradientBuckets: the full gradients backward makes, taken to the ranks that own their shards. Owned by the
optimizer (ShardedAdam), which the store's post-accumulate-grad hook hands each gradient to.

[Note: gradient buckets]
With several ranks, full gradients are collected in a bucket of up to
`reduce_bucket_size` elements, packed rank-major (row r holds every shard
rank r owns), and reduce-scattered as one collective: NCCL's reduce-scatter,
or gloo's all-reduce and a slice. A bucket's collective runs asynchronously
while backward produces the next bucket, and lands (is added to the owners'
fp32 gradients) when the next bucket is sent or backward ends. Every rank
fills its buckets in the same order, because its graph is the same. With one
rank a gradient is added to its shard's gradient at once.
"""

from __future__ import annotations

from typing import Protocol

import torch

from infinity.engine.comm import Comm


class GradientSink(Protocol):
    """Where landed gradients go: the optimizer's fp32 gradient shards."""

    def grad_for(self, mp) -> torch.Tensor:
        """mp's fp32 gradient shard, to add this backward's gradient into."""

    def grad_ready(self, mp) -> None:
        """mp's gradient of this backward has been added."""


class GradientBuckets:
    """Full gradients in, this rank's fp32 shard of their mean over ranks out (see [Note: gradient buckets])."""

    def __init__(self, comm: Comm, sink: GradientSink, reduce_bucket: int):
        self.comm = comm
        self.sink = sink
        self.reduce_bucket = reduce_bucket
        """Elements a bucket collects before it is sent (reduce_bucket_size)."""
        self._bucket: list = []  # (mp, its full gradient padded to part x world, in fp32)
        self._elements = 0
        self._in_flight = None  # (the pending reduce-scatter, its parameters)

    def add(self, mp, grad: torch.Tensor) -> None:
        """mp's full gradient of this backward (any dtype and shape)."""
        flat = grad.reshape(-1).to(torch.float32)
        if self.comm.world == 1:  # [:numel]: a zero-size parameter still has a one-element shard
            dst = self.sink.grad_for(mp)
            dst[:mp.numel].add_(flat.to(dst.device))
            self.sink.grad_ready(mp)
            return
        pad = mp.part * self.comm.world - mp.numel
        if pad:
            flat = torch.nn.functional.pad(flat, (0, pad))
        self._bucket.append((mp, flat))
        self._elements += flat.numel()
        if self._elements >= self.reduce_bucket:
            self.flush(final=False)

    def flush(self, *, final: bool = True) -> None:
        """Reduce-scatter the bucket; with final, also wait for it (end of backward)."""
        if self._bucket:
            items, self._bucket, self._elements = self._bucket, [], 0
            world = self.comm.world
            parts = sum(mp.part for mp, _ in items)
            packed = torch.empty(world, parts, dtype=torch.float32, device=items[0][1].device)
            off = 0
            for mp, flat in items:  # rank-major: row r is every shard rank r owns, in bucket order
                packed[:, off:off + mp.part].copy_(flat.view(world, mp.part))
                off += mp.part
            previous, self._in_flight = self._in_flight, (self.comm.reduce_scatter_mean_async(packed.view(-1)),
                                                          [mp for mp, _ in items])
            self._land(previous)
        if final:
            previous, self._in_flight = self._in_flight, None
            self._land(previous)

    def discard(self, *, wait: bool = True) -> None:
        """Forget what a backward left unfinished (its state was replaced, or it failed): the open bucket is
        dropped, and a reduce-scatter in flight lands nowhere; it is waited for (every rank started it) unless
        `wait` is False (the process group has failed)."""
        self._bucket, self._elements = [], 0
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is not None and wait:
            in_flight[0].wait()

    def _land(self, in_flight) -> None:
        if in_flight is None:
            return
        pending, mps = in_flight
        mine = pending.wait()
        off = 0
        for mp in mps:
            grad = self.sink.grad_for(mp)
            grad.add_(mine[off:off + mp.part].to(grad.device))
            off += mp.part
            self.sink.grad_ready(mp)
