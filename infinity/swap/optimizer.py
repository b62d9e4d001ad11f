"""OptimizerSwapper: Adam over NVMe sub-groups, stepped as read(i+1) || Adam(i) || write(i-1).

The entry point for driving NVMe optimizer state without an engine
(`infinity bench swap`, the swap tests). Each sub-group is an `NvmeState`:
one partition [param | exp_avg | exp_avg_sq] (fp32 weights, fp32 or bf16
moments), so a group moves in one read and one write and fits one pool
buffer (12 bytes per parameter, or 8). The walk is `StatePipeline`'s, the same one the engine's
optimizer uses (see [Note: one pipeline]).
"""

from __future__ import annotations

import torch

from infinity.optim import grads_finite
from infinity.swap.pipeline import Mode, StatePipeline
from infinity.swap.state import NvmeState, decoded, state_nbytes
from infinity.swap.swapper import TensorSwapper
from infinity.swap.telemetry import StepStats, Trace


class OptimizerSwapper:
    def __init__(self, swapper: TensorSwapper, numels: list[int], *, name: str = "opt", trace: Trace | None = None,
                 moments: torch.dtype = torch.float32):
        need = state_nbytes(max(numels), moments)
        if need > swapper.pool.size:
            raise ValueError(f"OptimizerSwapper: the largest sub-group ({max(numels)} parameters) needs {need} B "
                             f"per pool buffer, the pool has {swapper.pool.size} B; raise the buffer size or lower "
                             "zero_optimization.sub_group_size")
        self.swapper = swapper
        self.numels = list(numels)
        self.states = [NvmeState(n, swapper, f"{name}/g{i}", moments=moments) for i, n in enumerate(numels)]
        self.trace = trace

    @property
    def ids(self) -> list[str]:
        return [s.id for s in self.states]

    def initialize(self, index: int, param: torch.Tensor) -> None:
        """Write a group's starting state: the fp32 weights and zero moments."""
        n = self.numels[index]
        if param.numel() != n:
            raise ValueError(f"OptimizerSwapper.initialize: group {index} has {n} parameters, got {param.numel()}")

        def first(_, views) -> None:
            views.param.copy_(param.reshape(-1))
            views.exp_avg.zero_()
            views.exp_avg_sq.zero_()

        StatePipeline(Mode.FILL).over([self.states[index]], first)

    def read_state(self, index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Copies of (param, exp_avg, exp_avg_sq) of one group (for checkpoints and tests); 8-bit moments
        decoded to their fp32 values."""
        out = []
        state = self.states[index]
        StatePipeline(Mode.READ).over([state], lambda _, v: out.extend(
            t.clone() for t in (v.param, *decoded(v, state.numel))))
        return tuple(out)

    def step(self, grads: list[torch.Tensor], *, step: int, lr: float, betas=(0.9, 0.999), eps: float = 1e-8,
             weight_decay: float = 0.0, adamw: bool = True, bias_correction: bool = True, grad_scale: float = 1.0,
             out_lowp: list[torch.Tensor] | None = None, check_finite: bool = True,
             on_updated=None, moment_rounding: str = "stochastic") -> StepStats:
        """One Adam step over every group. With check_finite, an inf/nan in any gradient skips all groups.

        `on_updated(i, param)` is called with each group's new fp32 weights
        (a view into its buffer, valid only during the call) before they are
        written back. With bf16 moments, `moment_rounding` says how they are
        rounded (a stochastic stream per step and group).

        If anything raises mid-step, every buffer goes back to the pool and
        every group is left ON_DISK: groups already written hold the new
        state, the others the old one (the exception says which failed).
        """
        if len(grads) != len(self.numels):
            raise ValueError(f"OptimizerSwapper.step: {len(self.numels)} groups but {len(grads)} gradients")
        if check_finite and not grads_finite(grads, grad_scale):
            return StepStats(skipped=True)  # the skip must be global: no group may step if any overflowed
        hyper = dict(step=step, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, adamw=adamw,
                     bias_correction=bias_correction, grad_scale=grad_scale)

        def adam(i: int, views) -> None:
            h = hyper
            if self.states[i].moments != torch.float32:
                h = dict(hyper, moment_rounding=moment_rounding,
                         moment_seed=(step * 0x9E3779B1 + i * 0x85EBCA77) & 0xFFFFFFFF)
            self.states[i].adam(views, grads[i], None if out_lowp is None else out_lowp[i], h)
            if on_updated is not None:
                on_updated(i, views.param)

        return StatePipeline(Mode.UPDATE, trace=self.trace).over(self.states, adam)
