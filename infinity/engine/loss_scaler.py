"""Loss scaling for fp16: a fixed scale, or DeepSpeed's dynamic scheme.

Dynamic: the scale starts at 2**initial_scale_power. A step whose gradients
overflow (inf/nan on any rank) is skipped; each overflow uses up one of
`hysteresis` tolerated overflows, and when none is left the scale halves
(never below `min_loss_scale`). After `loss_scale_window` clean steps in a
row the scale doubles and the tolerance is restored.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(kw_only=True, slots=True)
class LossScaler:
    scale: float = 1.0
    dynamic: bool = False
    window: int = 1000
    hysteresis: int = 2
    min_scale: float = 1.0
    clean_steps: int = 0
    tolerance: int = 2
    skipped: int = 0

    @classmethod
    def from_config(cls, fp16) -> "LossScaler":
        if not fp16.enabled:
            return cls()
        if fp16.loss_scale > 0:
            return cls(scale=float(fp16.loss_scale))
        return cls(scale=float(2 ** fp16.initial_scale_power), dynamic=True, window=fp16.loss_scale_window,
                   hysteresis=fp16.hysteresis, tolerance=fp16.hysteresis, min_scale=float(fp16.min_loss_scale))

    def update(self, overflow: bool) -> None:
        """Call once per optimizer step, after the (global) overflow check."""
        if overflow:
            self.skipped += 1
            self.clean_steps = 0
            if self.dynamic:
                self.tolerance -= 1
                if self.tolerance <= 0:
                    self.scale = max(self.scale / 2, self.min_scale)
                    self.tolerance = self.hysteresis
            return
        self.clean_steps += 1
        if self.dynamic and self.clean_steps % self.window == 0:
            self.scale *= 2
            self.tolerance = self.hysteresis

    def state_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__slots__}

    def load_state_dict(self, state: dict) -> None:
        for k, v in state.items():
            setattr(self, k, v)
