"""Stand-ins for the optimizer a ParamStore is attached to, for tests of the store alone."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(kw_only=True)
class GradientRecorder:
    """An OptimizerLink (engine/params.py) that takes gradients and lends nothing: `grad_for(mp)` gives the
    tensor the store adds mp's gradient into, `grad_ready(mp)` hears that it was added."""

    grad_for: Callable
    grad_ready: Callable = lambda mp: None
    pending: object = None

    def lend(self, mp, *, backward: bool):
        return None

    def need(self, mp) -> None:
        pass

    def advance(self) -> None:
        pass
