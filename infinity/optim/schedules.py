"""DeepSpeed's five lr schedules, from a config's "scheduler" section, with DeepSpeed 0.19.8's formulas.

[Note: DeepSpeed lr schedules]
Each schedule keeps one counter, t = `last_batch_iteration`, which starts at
-1; `step()` advances it and writes the lr (and, for OneCycle with Adam, the
first beta) of every parameter group. The engine steps it once after each
optimizer step that was not skipped, so optimizer step k (from 0) runs at
lr(t = k - 1), and lr(-1) is what the constructor sets. A scalar parameter
applies to every group; a list gives one value per group. `state_dict()` is
{"last_batch_iteration": t}, as in DeepSpeed, so checkpoints carry the
position and the lr follows from it. The formulas (W = max(2,
warmup_num_steps), T = total_num_steps; "log" warmup reaches its top at
t = W - 1, "linear" at t = W):
- WarmupLR: min + (max - min) * g(t), g = ln(t + 1) / ln W (log) or t / W
  (linear) while t < W, then 1. Without warmup_max_lr, max is each group's lr.
- WarmupDecayLR: the same warmup, then g = (T - t) / max(1, T - W), down to
  0 at t = T and held there: the lr ends at warmup_min_lr.
- WarmupCosineLR: a ratio r of each group's lr: 0 at t = -1, then
  warmup_min_ratio + g * (1 - warmup_min_ratio) while t < W, then
  cos_min_ratio + (1 - cos_min_ratio) * (1 + cos(pi * p)) / 2 with
  p = min(1, (t - W + 1) / max(1, T - W)).
- OneCycle: a triangle from cycle_min_lr up to cycle_max_lr in
  cycle_first_step_size steps and back in cycle_second_step_size (optionally
  in stairs), then min / (1 + decay_lr_rate * d / decay_step_size) for the
  d-th step after the cycle. With cycle_momentum and an Adam optimizer, beta1
  moves opposite to the lr between cycle_max_mom and cycle_min_mom, then
  grows by (1 + decay_mom_rate * d / decay_step_size); beta2 is set to 0.99,
  as DeepSpeed sets it.
- LRRangeTest: min_lr * (1 + step_rate * (t + 1) / step_size), the fraction
  floored with staircase.
"""

from __future__ import annotations

import math

from infinity.errors import ConfigError

_PARAMS = {
    "WarmupLR": {"warmup_min_lr": 0.0, "warmup_max_lr": None, "warmup_num_steps": 1000, "warmup_type": "log"},
    "WarmupDecayLR": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.001, "warmup_num_steps": 1000,
                      "warmup_type": "log", "total_num_steps": None},
    "WarmupCosineLR": {"total_num_steps": None, "warmup_min_ratio": 0.0, "warmup_num_steps": 1000,
                       "cos_min_ratio": 0.0001, "warmup_type": "log"},
    "OneCycle": {"cycle_min_lr": None, "cycle_max_lr": None, "decay_lr_rate": 0.0, "cycle_first_step_size": 2000,
                 "cycle_second_step_size": None, "cycle_first_stair_count": 0, "cycle_second_stair_count": None,
                 "decay_step_size": 0, "cycle_momentum": True, "cycle_min_mom": 0.8, "cycle_max_mom": 0.9,
                 "decay_mom_rate": 0.0},
    "LRRangeTest": {"lr_range_test_min_lr": 1e-3, "lr_range_test_step_size": 2000, "lr_range_test_step_rate": 1.0,
                    "lr_range_test_staircase": False},
}
_REQUIRED = {"WarmupDecayLR": ("total_num_steps",), "WarmupCosineLR": ("total_num_steps",),
             "OneCycle": ("cycle_min_lr", "cycle_max_lr")}


def check_scheduler(kind, params: dict, where: str = "scheduler") -> tuple[str, dict]:
    """(type, params with DeepSpeed's defaults filled) or a ConfigError naming the key, the value and the fix."""
    if kind not in _PARAMS:
        raise ConfigError(f"{where}.type", f"must be one of {', '.join(_PARAMS)}, got {kind!r}")
    known = _PARAMS[kind]
    for key, value in params.items():
        if key not in known:
            raise ConfigError(f"{where}.params.{key}", f"is not a parameter of {kind}; its parameters are "
                                                       f"{', '.join(known)}")
    out = dict(known, **params)
    for key in _REQUIRED.get(kind, ()):
        if out[key] is None:
            raise ConfigError(f"{where}.params.{key}", f"{kind} needs it; give a value")
    for key, value in out.items():
        if value is None or isinstance(value, str):
            continue
        values = value if isinstance(value, list) else [value]
        for v in values:
            if isinstance(v, bool) and not key.endswith(("staircase", "momentum")):
                raise ConfigError(f"{where}.params.{key}", f"must be a number, got {v}")
            if not isinstance(v, (int, float)) or (isinstance(v, float) and not math.isfinite(v)):
                raise ConfigError(f"{where}.params.{key}", f"must be a number, got {v!r}")
            if v < 0 and not key.endswith("stair_count"):
                raise ConfigError(f"{where}.params.{key}", f"must be >= 0, got {v}")
    for key in ("warmup_num_steps", "lr_range_test_step_size"):
        if key in out and (not isinstance(out[key], int) or isinstance(out[key], bool) or out[key] < 1):
            raise ConfigError(f"{where}.params.{key}", f"must be a whole number >= 1, got {out[key]!r}")
    if "warmup_type" in out and out["warmup_type"] not in ("log", "linear"):
        raise ConfigError(f"{where}.params.warmup_type", f'must be "log" or "linear", got {out["warmup_type"]!r}')
    if kind == "OneCycle" and not out["cycle_first_step_size"] > 0:
        raise ConfigError(f"{where}.params.cycle_first_step_size", f"must be > 0, got {out['cycle_first_step_size']}")
    return kind, out


def build_scheduler(section, optimizer):
    """The schedule a config's scheduler section describes, over `optimizer` (torch's param_groups)."""
    return _CLASSES[section.type](optimizer, **section.params)


class _Schedule:
    """The counter, the per-group values and the state shared by the five (see [Note: DeepSpeed lr schedules])."""

    def __init__(self, optimizer, last_batch_iteration: int = -1):
        self.optimizer = optimizer
        self.last_batch_iteration = last_batch_iteration
        self._last_lr = None

    def _per_group(self, value, name: str) -> list:
        groups = len(self.optimizer.param_groups)
        if isinstance(value, (list, tuple)):
            if len(value) != groups:
                raise ValueError(f"{type(self).__name__}: {name} has {len(value)} values for {groups} parameter "
                                 "groups; give one value, or one per group")
            return [float(v) for v in value]
        return [float(value)] * groups

    def lr_at(self, t: int) -> list[float]:
        raise NotImplementedError

    def get_lr(self) -> list[float]:
        return self.lr_at(self.last_batch_iteration)

    def get_last_lr(self) -> list[float]:
        if self._last_lr is None:
            raise RuntimeError(f"{type(self).__name__}.get_last_lr: no step yet")
        return self._last_lr

    def _apply(self) -> None:
        lrs = self.get_lr()
        for group, lr in zip(self.optimizer.param_groups, lrs):
            group["lr"] = lr
        self._last_lr = lrs

    def step(self, last_batch_iteration: int | None = None) -> None:
        self.last_batch_iteration = (self.last_batch_iteration + 1 if last_batch_iteration is None
                                     else last_batch_iteration)
        self._apply()

    def state_dict(self) -> dict:
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state: dict) -> None:
        self.last_batch_iteration = state["last_batch_iteration"]


def _warmup_fraction(t: int, w: int, kind: str) -> float:
    """g(t) of the warmup: 0 at t = 0, 1 from t = W (log reaches it at W - 1)."""
    if t >= w:
        return 1.0
    if kind == "linear":
        return t / w
    return (1.0 / math.log(w)) * math.log(t + 1)


class WarmupLR(_Schedule):
    def __init__(self, optimizer, warmup_min_lr=0.0, warmup_max_lr=None, warmup_num_steps: int = 1000,
                 warmup_type: str = "log", last_batch_iteration: int = -1):
        super().__init__(optimizer, last_batch_iteration)
        self.min_lrs = self._per_group(warmup_min_lr, "warmup_min_lr")
        self.max_lrs = (self._per_group(warmup_max_lr, "warmup_max_lr") if warmup_max_lr is not None
                        else [float(g["lr"]) for g in optimizer.param_groups])
        self.warmup_num_steps = max(2, int(warmup_num_steps))
        self.warmup_type = warmup_type
        if last_batch_iteration == -1:
            self._apply()

    def _gamma(self, t: int) -> float:
        return _warmup_fraction(t, self.warmup_num_steps, self.warmup_type)

    def lr_at(self, t: int) -> list[float]:
        if t < 0:
            return list(self.min_lrs)
        g = self._gamma(t)
        return [lo + (hi - lo) * g for lo, hi in zip(self.min_lrs, self.max_lrs)]


class WarmupDecayLR(WarmupLR):
    def __init__(self, optimizer, total_num_steps: int, warmup_min_lr=0.0, warmup_max_lr=0.001,
                 warmup_num_steps: int = 1000, warmup_type: str = "log", last_batch_iteration: int = -1):
        self.total_num_steps = int(total_num_steps)
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type,
                         last_batch_iteration)

    def _gamma(self, t: int) -> float:
        if t < self.warmup_num_steps:
            return _warmup_fraction(t, self.warmup_num_steps, self.warmup_type)
        return max(0.0, float(self.total_num_steps - t) / float(max(1.0, self.total_num_steps - self.warmup_num_steps)))


class WarmupCosineLR(_Schedule):
    def __init__(self, optimizer, total_num_steps: int, warmup_min_ratio: float = 0.0, warmup_num_steps: int = 1000,
                 cos_min_ratio: float = 0.0001, warmup_type: str = "log", last_batch_iteration: int = -1):
        super().__init__(optimizer, last_batch_iteration)
        self.total_num_steps = int(total_num_steps)
        self.warmup_min_ratio = float(warmup_min_ratio)
        self.warmup_num_steps = max(2, int(warmup_num_steps))
        self.cos_min_ratio = float(cos_min_ratio)
        self.warmup_type = warmup_type
        self.base_lrs = [float(g["lr"]) for g in optimizer.param_groups]
        if last_batch_iteration == -1:
            self._apply()

    def ratio(self, t: int) -> float:
        if t < 0:
            return 0.0
        w = self.warmup_num_steps
        if t < w:
            return self.warmup_min_ratio + _warmup_fraction(t, w, self.warmup_type) * (1.0 - self.warmup_min_ratio)
        progress = min(1.0, (t - w + 1) / max(1, self.total_num_steps - w))
        cosine = (1.0 + math.cos(math.pi * progress)) / 2.0
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)

    def lr_at(self, t: int) -> list[float]:
        r = self.ratio(t)
        return [base * r for base in self.base_lrs]


class OneCycle(_Schedule):
    def __init__(self, optimizer, cycle_min_lr, cycle_max_lr, decay_lr_rate: float = 0.0,
                 cycle_first_step_size: int = 2000, cycle_second_step_size=None, cycle_first_stair_count: int = 0,
                 cycle_second_stair_count=None, decay_step_size: int = 0, cycle_momentum: bool = True,
                 cycle_min_mom: float = 0.8, cycle_max_mom: float = 0.9, decay_mom_rate: float = 0.0,
                 last_batch_iteration: int = -1):
        super().__init__(optimizer, last_batch_iteration)
        self.min_lrs = self._per_group(cycle_min_lr, "cycle_min_lr")
        self.max_lrs = self._per_group(cycle_max_lr, "cycle_max_lr")
        self.first = float(cycle_first_step_size)
        self.second = float(cycle_second_step_size) if cycle_second_step_size is not None else self.first
        if not self.first > 0 or self.second < 0:
            raise ValueError("OneCycle: cycle_first_step_size must be > 0 and cycle_second_step_size >= 0")
        self.total = self.first + self.second
        self.first_stairs = cycle_first_stair_count
        self.second_stairs = cycle_first_stair_count if cycle_second_stair_count is None else cycle_second_stair_count
        self.decay_lr_rate = float(decay_lr_rate)
        self.decay_step_size = decay_step_size
        self.momentum = bool(cycle_momentum) and "betas" in getattr(optimizer, "defaults", {})
        self.min_mom, self.max_mom, self.decay_mom_rate = float(cycle_min_mom), float(cycle_max_mom), float(
            decay_mom_rate)
        if last_batch_iteration == -1:
            for group, lr in zip(optimizer.param_groups, self.min_lrs):
                group["lr"] = lr
            if self.momentum:
                for group in optimizer.param_groups:
                    group["betas"] = (self.min_mom, 0.99)

    def _scale(self, t: int) -> float:
        """Where in the triangle step t is: 0 at the bottom, 1 at the top (the stairs floor it)."""
        b = t + 1
        within = b % self.total
        if within <= self.first:
            stairs, pos = self.first_stairs, within / self.first
        else:
            stairs, pos = self.second_stairs, (self.total - within) / self.second
        if stairs and stairs > 0:
            return math.floor(pos * stairs) / stairs
        return pos

    def _decay_steps(self, t: int) -> float:
        return t - self.total + 1

    def lr_at(self, t: int) -> list[float]:
        if t < self.total:
            s = self._scale(t)
            return [lo + (hi - lo) * s for lo, hi in zip(self.min_lrs, self.max_lrs)]
        if self.decay_step_size == 0 or self.decay_lr_rate == 0:
            return list(self.min_lrs)
        factor = 1.0 + self.decay_lr_rate * (self._decay_steps(t) / self.decay_step_size)
        return [lo / factor for lo in self.min_lrs]

    def mom_at(self, t: int) -> float:
        if t < self.total:
            return self.max_mom - (self.max_mom - self.min_mom) * self._scale(t)
        if self.decay_step_size == 0 or self.decay_mom_rate == 0:
            return self.max_mom
        return self.max_mom * (1.0 + self.decay_mom_rate * (self._decay_steps(t) / self.decay_step_size))

    def _apply(self) -> None:
        super()._apply()
        if self.momentum:
            beta1 = self.mom_at(self.last_batch_iteration)
            for group in self.optimizer.param_groups:
                group["betas"] = (beta1, 0.99)

    def get_mom(self):
        return [g["betas"] for g in self.optimizer.param_groups] if self.momentum else None


class LRRangeTest(_Schedule):
    def __init__(self, optimizer, lr_range_test_min_lr=1e-3, lr_range_test_step_size: int = 2000,
                 lr_range_test_step_rate: float = 1.0, lr_range_test_staircase: bool = False,
                 last_batch_iteration: int = -1):
        super().__init__(optimizer, last_batch_iteration)
        self.min_lrs = self._per_group(lr_range_test_min_lr, "lr_range_test_min_lr")
        self.step_size = int(lr_range_test_step_size)
        self.step_rate = float(lr_range_test_step_rate)
        self.staircase = bool(lr_range_test_staircase)
        if last_batch_iteration == -1:
            self._apply()

    def lr_at(self, t: int) -> list[float]:
        interval = (t + 1) / self.step_size
        if self.staircase:
            interval = math.floor(interval)
        return [lo * (1.0 + self.step_rate * interval) for lo in self.min_lrs]


_CLASSES = {c.__name__: c for c in (WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest)}
