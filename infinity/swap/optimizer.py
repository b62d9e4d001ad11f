"""OptimizerSwapper: Adam state of NVMe-resident sub-groups, stepped as read(i+1) || Adam(i) || write(i-1).

Each sub-group is one partition of 3n fp32 values, [param | exp_avg |
exp_avg_sq], so a group moves in one read and one write and fits one pool
buffer (12 bytes per parameter). The step thread prefetches the next group
with a non-blocking acquire, runs the CPU Adam kernel on the current one in
its buffer, and hands that buffer to the write; the swapper's reaper
returns it when the write lands (see [Note: who releases a swap-out buffer]).
"""

from __future__ import annotations

import time

import torch

from infinity.optim import cpu_adam_step, grads_finite
from infinity.swap.swapper import TensorSwapper, wait_all
from infinity.swap.telemetry import StepStats, Trace


class OptimizerSwapper:
    def __init__(self, swapper: TensorSwapper, numels: list[int], *, name: str = "opt", trace: Trace | None = None):
        need = 12 * max(numels)
        if need > swapper.pool.size:
            raise ValueError(f"OptimizerSwapper: the largest sub-group ({max(numels)} parameters) needs {need} B "
                             f"per pool buffer, the pool has {swapper.pool.size} B; raise the buffer size or lower "
                             "zero_optimization.sub_group_size")
        self.swapper = swapper
        self.numels = list(numels)
        self.ids = [f"{name}/g{i}" for i in range(len(numels))]
        self.trace = trace
        self._reads: dict = {}  # step_group's prefetched reads
        self._writes: list = []  # step_group's writes in flight

    def initialize(self, index: int, param: torch.Tensor) -> None:
        """Write a group's starting state: the fp32 weights and zero moments."""
        n = self.numels[index]
        if param.numel() != n:
            raise ValueError(f"OptimizerSwapper.initialize: group {index} has {n} parameters, got {param.numel()}")
        buf = self.swapper.pool.acquire(f"init {self.ids[index]}")
        state = buf.view(torch.float32, 3 * n)
        state[:n].copy_(param.reshape(-1))
        state[n:].zero_()
        self.swapper.swap_out_buffer(self.ids[index], buf, torch.float32, 3 * n).wait()

    def read_state(self, index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Copies of (param, exp_avg, exp_avg_sq) of one group (for checkpoints and tests)."""
        n = self.numels[index]
        view = self.swapper.swap_in(self.ids[index]).wait()
        out = view[:n].clone(), view[n:2 * n].clone(), view[2 * n:].clone()
        self.swapper.release(self.ids[index])
        return out

    def step(self, grads: list[torch.Tensor], *, step: int, lr: float, betas=(0.9, 0.999), eps: float = 1e-8,
             weight_decay: float = 0.0, adamw: bool = True, bias_correction: bool = True, grad_scale: float = 1.0,
             out_lowp: list[torch.Tensor] | None = None, check_finite: bool = True,
             on_updated=None, per_group: list[dict] | None = None) -> StepStats:
        """One Adam step over every group. With check_finite, an inf/nan in any gradient skips all groups.

        `on_updated(i, param)` is called with each group's new fp32 weights
        (a view into its buffer, valid only during the call) before they are
        written back: this is how the parameter store gets its copy in the
        same pass over the state. `per_group[i]`, when given, overrides the
        hyper-parameters for group i (parameter groups with their own lr).

        If anything raises mid-step, every buffer goes back to the pool and
        every group is left ON_DISK: groups already written hold the new
        state, the others the old one (the exception says which failed).
        """
        if len(grads) != len(self.numels):
            raise ValueError(f"OptimizerSwapper.step: {len(self.numels)} groups but {len(grads)} gradients")
        stats = StepStats()
        t_start = time.perf_counter()
        if check_finite and not grads_finite(grads, grad_scale):
            # The skip must be global: no group may step if any overflowed.
            stats.skipped = True
            return stats
        hyper = dict(step=step, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, adamw=adamw,
                     bias_correction=bias_correction, grad_scale=grad_scale, check_finite=False)
        sw = self.swapper
        reads: dict = {}
        writes: list = []
        try:
            reads[0] = sw.swap_in(self.ids[0])
            for i, n in enumerate(self.numels):
                if i + 1 < len(self.numels) and i + 1 not in reads:
                    ahead = sw.swap_in(self.ids[i + 1], prefetch=True)  # never blocks: see BufferPool
                    if ahead is not None:
                        reads[i + 1] = ahead
                t0 = time.perf_counter()
                fut = reads.pop(i)
                try:
                    state = fut.wait()
                except BaseException:
                    reads[i] = fut  # so that _abandon sees it
                    raise
                t1 = time.perf_counter()
                stats.io_wait_s += t1 - t0
                self._adam(i, state, grads[i], None if out_lowp is None else out_lowp[i], on_updated,
                           hyper if per_group is None else dict(per_group[i], check_finite=False))
                t2 = time.perf_counter()
                stats.compute_s += t2 - t1
                writes.append(sw.swap_out(self.ids[i], state))
                self._span(fut, "io", 1)
                self._span_at(f"adam {self.ids[i]}", "compute", t1, t2, 0)
                if i + 1 < len(self.numels) and i + 1 not in reads:
                    reads[i + 1] = sw.swap_in(self.ids[i + 1])  # holds nothing now, so it may wait
        except BaseException:
            self._abandon(reads, writes)
            raise
        t0 = time.perf_counter()
        for w in writes:
            w.wait()
            self._span(w, "io", 2)
        stats.io_wait_s += time.perf_counter() - t0
        stats.bytes_read = stats.bytes_written = 12 * sum(self.numels)
        stats.wall_s = time.perf_counter() - t_start
        return stats

    def _adam(self, index: int, state: torch.Tensor, grad, out_lowp, on_updated, hyper: dict) -> None:
        """Adam in place on a group's [param | exp_avg | exp_avg_sq] buffer; on error the buffer goes back
        to the pool unwritten, so the group's file still holds the state from before this step."""
        n = self.numels[index]
        try:
            cpu_adam_step(state[:n], grad, state[n:2 * n], state[2 * n:], out_lowp=out_lowp, **hyper)
            if on_updated is not None:
                on_updated(index, state[:n])
        except BaseException:
            self.swapper.release(self.ids[index])
            raise

    # ------------------------------------------------ one group at a time

    def prefetch_group(self, index: int) -> None:
        """Start reading a group's state if a buffer is free (never waits); step_group picks it up."""
        if index in self._reads:
            return
        fut = self.swapper.swap_in(self.ids[index], prefetch=True, reserve=1)
        if fut is not None:
            self._reads[index] = fut

    def step_group(self, index: int, grad: torch.Tensor, stats: StepStats, *, out_lowp=None, on_updated=None,
                   **hyper) -> None:
        """Adam on one group now (reading its state if no prefetch did); its write is waited for by finish_groups.

        This is the path of a step that runs during backward, group by group as
        their gradients become final (see infinity.engine.optimizer).
        """
        n = self.numels[index]
        sw = self.swapper
        t0 = time.perf_counter()
        fut = self._reads.pop(index, None) or sw.swap_in(self.ids[index])
        state = fut.wait()
        t1 = time.perf_counter()
        self._adam(index, state, grad, out_lowp, on_updated, dict(hyper, check_finite=False))
        t2 = time.perf_counter()
        self._writes.append(sw.swap_out(self.ids[index], state))
        stats.io_wait_s += t1 - t0
        stats.compute_s += t2 - t1
        stats.bytes_read += 12 * n
        stats.bytes_written += 12 * n

    def finish_groups(self, stats: StepStats) -> None:
        """Wait for the writes step_group started, and drop reads nobody stepped; raise the first error."""
        t0 = time.perf_counter()
        writes, self._writes = self._writes, []
        reads, self._reads = self._reads, {}
        self._abandon(reads, [])
        try:
            wait_all(writes)
        finally:
            stats.io_wait_s += time.perf_counter() - t0

    def _abandon(self, reads: dict, writes: list) -> None:
        """After a failure: let in-flight swaps finish and hand every buffer back."""
        sw = self.swapper
        for w in writes:
            try:
                w.wait()
            except BaseException:  # noqa: BLE001 - the first error is the one being raised
                pass
        for i, fut in reads.items():
            try:
                fut.wait()
                sw.release(self.ids[i])
            except BaseException:  # noqa: BLE001
                pass

    def _span(self, fut, cat, track):
        if self.trace is not None and fut.t_done is not None:
            self.trace.add(fut.label, cat, fut.t_submit, fut.t_done, track)

    def _span_at(self, name, cat, start, end, track):
        if self.trace is not None:
            self.trace.add(name, cat, start, end, track)
