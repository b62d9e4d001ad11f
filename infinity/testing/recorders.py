"""Stand-ins for the optimizer a ParamStore is attached to, for tests of the store alone."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from infinity.engine.buckets import GradientBuckets
from infinity.engine.comm import Comm


@dataclass(kw_only=True)
class GradientRecorder:
    """An OptimizerLink (engine/params.py) that takes gradients through real GradientBuckets over `comm`
    (default: one process, reduce_bucket elements a bucket) and lends nothing: `grad_for(mp)` gives the tensor
    mp's gradient lands in, `grad_ready(mp)` hears that it landed."""

    grad_for: Callable
    grad_ready: Callable = lambda mp: None
    comm: Comm | None = None
    reduce_bucket: int = 1 << 62
    pending: object = None
    buckets: GradientBuckets = field(init=False)

    def __post_init__(self):
        self.buckets = GradientBuckets(self.comm or Comm(), self, self.reduce_bucket)

    def take_grad(self, mp, grad) -> None:
        self.buckets.add(mp, grad)

    def flush_grads(self) -> None:
        self.buckets.flush(final=True)

    def lend(self, mp, *, backward: bool):
        return None

    def need(self, mp) -> None:
        pass

    def advance(self) -> None:
        pass
