"""Engine: what `infinity.initialize` returns. Forward, backward and step of a ZeRO-partitioned model.

The data path of one optimizer step:
  engine(batch)        module pre-hooks gather parameters (scheduler reads NVMe shards ahead), post-hooks release
  engine.backward(l)   saved-tensor hooks re-gather what backward needs; grad hooks reduce-scatter to owners
  engine.step()        at an accumulation boundary: overflow check, global clip, CPU Adam per sub-group
                       (RAM or NVMe), new weights written to the parameter store in the compute dtype
It is assembled by engine/assemble.py; DeepSpeed's getters and the checkpoint methods are deepspeed_surface.py's.
"""

from __future__ import annotations

import contextlib
import logging
import time

import torch

from infinity.config import Config
from infinity.config.resolve import BatchSizes
from infinity.engine import lifetime
from infinity.engine.deepspeed_surface import DeepSpeedSurface
from infinity.engine.hooks import ParamHooks
from infinity.engine.loss_scaler import LossScaler
from infinity.engine.module_surface import ModuleSurface
from infinity.engine.optimizer import ShardedAdam, clip_coef
from infinity.engine.params import ParamStore
from infinity.engine.plan import OffloadPlan, ShardSource
from infinity.engine.report import StepReport
from infinity.swap.tier import Tier

log = logging.getLogger("infinity")


class Engine(ModuleSurface, DeepSpeedSurface):
    """A model whose parameters, gradients and optimizer state are partitioned and offloaded per the config."""

    def __init__(self, model: torch.nn.Module, cfg: Config, *, plan: OffloadPlan, store: ParamStore,
                 optimizer: ShardedAdam, hooks: ParamHooks, lr_scheduler, batch: BatchSizes):
        """Built by assemble.initialize: `lr_scheduler` is the resolved scheduler (or None), `batch` the
        config's batch sizes for this world size (see [Note: batch sizes] in config/resolve.py)."""
        self.module = model
        self.config = cfg
        self.plan = plan
        """Where everything lives ([Note: one plan for the placement] in plan.py)."""
        self.store = store
        self.comm = store.comm
        self.optimizer = optimizer
        self.hooks = hooks
        self.scaler = LossScaler.from_config(cfg.fp16)
        self.lr_scheduler = lr_scheduler
        self.batch = batch
        self.gas = self.batch.gradient_accumulation_steps
        self.micro_steps = 0
        self.micro_steps_at_last_step = 0  # save_checkpoint refuses while a backward's gradients are pending
        self.global_steps = 0
        self.skipped_steps = 0
        self.reports: list[StepReport] = []
        self._t_last = time.perf_counter()
        self._fetch_stats = []
        self._overlapped = None  # the result of a step taken during backward, for step() to report
        self._last_step_stood = False  # the last step neither clipped nor overflowed: the next may bet on it
        if (cfg.infinity.step_during_backward and cfg.infinity.speculative_step and not optimizer.can_speculate
                and (cfg.gradient_clipping > 0 or cfg.fp16.enabled) and self.comm.rank == 0):
            log.info("infinity: the step does not overlap backward as a bet (infinity.speculative_step): %s",
                     _why_no_bet(plan))
        self.trace = optimizer.trace
        """Spans of forward, backward, step and the optimizer's I/O and Adam (infinity.trace_path), written at close."""
        self._forced_boundary = None  # set_gradient_accumulation_boundary
        self._said_no_sync = False
        self._param_written_mark = self._param_bytes_written()
        self._gathered_mark = store.bytes_gathered
        self._comm_mark = self.comm.time_s
        self._deferred_mark = 0.0
        self._closed = False
        self._save_dirs: dict = {}  # realpath -> DirLock, rank 0's (own_save_dir)
        lifetime.track(self, remove_at_exit=cfg.infinity.remove_swap_at_exit)

    @property
    def fitted(self) -> str:
        """What initialize fitted to the model and why (see [Note: sizes fitted to the model]), or ""."""
        return self.plan.fitted

    @property
    def rank(self) -> int:
        return self.comm.rank

    @property
    def world_size(self) -> int:
        return self.comm.world

    @property
    def last_report(self) -> StepReport | None:
        return self.reports[-1] if self.reports else None

    def __call__(self, *args, **kwargs):
        self._check_open()
        # Whether the backward after this forward steps during it: its reads may start as forward ends.
        self.optimizer.expect_step(torch.is_grad_enabled() and self._overlap() is not None
                                   and self._next_is_boundary())
        if self.store.scheduler is not None:
            self.store.scheduler.begin_step()
        args, kwargs = _cast_floats((args, kwargs), self.store.dtype, self.store.device)
        with self._span("forward"), self.hooks.saved_tensors():
            return self.module(*args, **kwargs)

    forward = __call__

    def backward(self, loss: torch.Tensor, *, retain_graph: bool = False, scale_wrt_gas: bool = True,
                 allreduce_gradients: bool = True, release_loss: bool = False) -> torch.Tensor:
        """Backward of `loss`, scaled for fp16 and (scale_wrt_gas) divided by gradient_accumulation_steps.

        DeepSpeed's keywords: retain_graph keeps the graph; allreduce_gradients=False is refused (gradients
        go to their owner ranks as they are produced; that cannot be deferred); release_loss is accepted
        (the loss is not kept). Returns the loss, as DeepSpeed's does.

        A backward that raises part-way leaves, as torch's does, the gradients it had already accumulated:
        call zero_grad() before the next backward to drop them. What it had not yet sent to the ranks that
        own it (the open gradient bucket, a reduce-scatter in flight) is dropped, so the next backward
        carries nothing of it."""
        self._check_open()
        if loss.numel() != 1:
            raise ValueError(f"Engine.backward: loss must be a scalar, got shape {tuple(loss.shape)}")
        if not allreduce_gradients:
            raise ValueError("Engine.backward(allreduce_gradients=False): each gradient is reduce-scattered to its "
                             "owner rank as backward produces it, so the reduction cannot be skipped; drop it")
        self.optimizer.settle()  # the last step's groups not yet needed by a forward
        scaled = loss.float() * (self.scaler.scale / (self.gas if scale_wrt_gas else 1))
        overlap = self._overlap() if self._next_is_boundary() and not retain_graph else None
        if overlap:
            self.optimizer.begin_overlapped_step(speculative=overlap == "bet", loss_scale=self.scaler.scale)
        else:
            self.optimizer.expect_step(False)
            if self._next_is_boundary():
                self.optimizer.read_ahead_for_step(defer=self._can_defer_step())
        if self.store.scheduler is not None:
            self.store.scheduler.backward_begins()
        try:
            with self._span("backward"), self.hooks.saved_tensors():
                scaled.backward(retain_graph=retain_graph)
            self.optimizer.flush_grads()
            if overlap:
                self._overlapped = self.optimizer.end_overlapped_step(loss_scale=self.scaler.scale,
                                                                      max_norm=self.config.gradient_clipping)
        except BaseException as exc:
            try:
                if not overlap:
                    self.optimizer.expect_step(False)  # the reads read_ahead_for_step started go back
            finally:
                self.optimizer.backward_failed(exc)
            raise
        finally:
            if overlap:
                self.optimizer.cancel_overlapped_step()  # a no-op after end_overlapped_step
        self.micro_steps += 1
        if self.store.scheduler is not None:
            self._fetch_stats.append(self.store.scheduler.drain())
        return loss

    def _overlap(self) -> str | None:
        """How the step at the end of the coming backward overlaps it: "exact" (nothing needs every gradient
        first: [Note: stepping during backward] in optimizer.py), "bet" (clipping or fp16, and the last step
        neither clipped nor overflowed: [Note: the speculative step]), or None (the step runs after backward)."""
        cfg = self.config
        if not cfg.infinity.step_during_backward:
            return None
        if cfg.gradient_clipping == 0 and not cfg.fp16.enabled:
            return "exact"
        if cfg.infinity.speculative_step and self.optimizer.can_speculate and self._last_step_stood:
            return "bet"
        return None

    def _can_defer_step(self) -> bool:
        """See [Note: the step finishes in the next forward] in deferred.py: ZeRO-3 (every parameter a shard read
        through the store) with optimizer state on NVMe, and shards that are either the optimizer files' (alias
        mode) or in memory."""
        store = self.store
        return (self.config.infinity.step_during_forward and store.stage == 3
                and any(g.state.io_bytes for g in self.optimizer.groups)
                and (self.plan.shard_source is ShardSource.OPTIMIZER_FILE or self.plan.param_tier is not Tier.NVME))

    def _next_is_boundary(self) -> bool:
        """Will the backward about to run end an accumulation cycle?"""
        if self._forced_boundary is not None:
            return self._forced_boundary
        return (self.micro_steps + 1) % self.gas == 0

    def is_gradient_accumulation_boundary(self) -> bool:
        if self._forced_boundary is not None:
            return self._forced_boundary
        return self.micro_steps > 0 and self.micro_steps % self.gas == 0

    @property
    def boundary_forced(self) -> bool:
        """set_gradient_accumulation_boundary decides the steps (not the micro-batch count)."""
        return self._forced_boundary is not None

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """DeepSpeed's manual control: from now on, step() steps exactly when this says so (None: count
        micro-batches again)."""
        self._forced_boundary = None if is_boundary is None else bool(is_boundary)

    def step(self) -> bool:
        """Step the optimizer at an accumulation boundary (a no-op in between). True when a step was taken."""
        self._check_open()
        if not self.is_gradient_accumulation_boundary():
            return False
        self.micro_steps_at_last_step = self.micro_steps
        t0 = time.perf_counter()
        taken = None  # the step taken during backward, if it stands
        if self._overlapped is not None:
            taken, self._overlapped = self._overlapped, None
            if self.optimizer.commit_bet():  # a bet is rolled back if the lr changed since backward began
                self.optimizer.check_hyper_since_backward()
            else:
                taken = None
        if taken is not None:
            overflow, norm, stats = taken
        else:
            with self._span("optimizer step"):
                overflow, norm, stats = self.optimizer.step(loss_scale=self.scaler.scale,
                                                            max_norm=self.config.gradient_clipping,
                                                            defer=self._can_defer_step())
        self._last_step_stood = not overflow and clip_coef(norm, self.config.gradient_clipping) == 1.0
        self.scaler.update(overflow)
        if overflow:
            self.skipped_steps += 1
        else:
            self.global_steps += 1
            if self.lr_scheduler is not None:
                self.lr_scheduler.step()
        self.optimizer.zero_grad()
        t1 = time.perf_counter()
        fs = self._fetch_stats
        speculation, bet = self.optimizer.take_speculation()
        # A rolled-back bet's I/O: moved, and wasted, in this step.
        bet_read, bet_written = (bet.bytes_read, bet.bytes_written) if bet is not None else (0, 0)
        self.reports.append(StepReport(
            step=self.global_steps + self.skipped_steps, skipped=overflow, loss_scale=self.scaler.scale,
            grad_norm=norm, step_s=t1 - self._t_last, optimizer_s=t1 - t0,
            param_fetches=sum(s.fetches for s in fs), prefetch_hits=sum(s.hits for s in fs),
            param_lent=sum(s.lent for s in fs), param_staged=sum(s.staged for s in fs),
            param_critical_reads=sum(s.critical_reads for s in fs),
            param_stall_s=sum(s.stall_s for s in fs),
            optimizer_io_wait_s=stats.io_wait_s + self.optimizer.deferred_wait_s - self._deferred_mark,
            param_read_bytes=sum(s.bytes_read for s in fs), optimizer_read_bytes=stats.bytes_read + bet_read,
            optimizer_write_bytes=stats.bytes_written + bet_written,
            param_write_bytes=self._param_bytes_written() - self._param_written_mark,
            peak_live_elements=self.store.peak_live_elements,
            gathered_bytes=self.store.bytes_gathered - self._gathered_mark,
            comm_s=self.comm.time_s - self._comm_mark, speculation=speculation))
        self._comm_mark = self.comm.time_s
        self._deferred_mark = self.optimizer.deferred_wait_s
        self._gathered_mark = self.store.bytes_gathered
        self._fetch_stats = []
        self._param_written_mark = self._param_bytes_written()
        self.store.reset_peak()
        self._t_last = t1
        return not overflow

    def _param_bytes_written(self) -> int:
        swap = self.store.swap
        return swap.swapper.bytes_written if swap is not None else 0

    def zero_grad(self) -> None:
        self.optimizer.zero_grad()

    # ------------------------------------------------- for checkpoint code

    def gradients_pending(self) -> bool:
        """A backward has run since the last step: gradients (or a step taken during backward) are in flight."""
        return self.micro_steps != self.micro_steps_at_last_step

    def restore_counters(self, *, global_steps: int | None = None, skipped_steps: int | None = None,
                         micro_steps: int | None = None, optimizer_steps: int | None = None) -> None:
        """Set the step counters a checkpoint carries (those given); the optimizer's is Adam's step count."""
        if global_steps is not None:
            self.global_steps = global_steps
        if skipped_steps is not None:
            self.skipped_steps = skipped_steps
        if micro_steps is not None:
            self.micro_steps = self.micro_steps_at_last_step = micro_steps
        if optimizer_steps is not None:
            self.optimizer.restore_step_count(optimizer_steps)

    def forget_gradients(self) -> None:
        """Drop every gradient accumulated so far and any step taken during backward: they belong to the
        state a checkpoint load has just replaced."""
        self._overlapped = None
        self.micro_steps_at_last_step = self.micro_steps
        self.optimizer.forget_gradients()
        for mp in self.store.params:
            mp.param.grad = None

    def close(self) -> None:
        """Remove hooks, stop I/O and delete swap files. The model's parameters are left as placeholders."""
        if self._closed:
            return
        self._closed = True
        lifetime.forget(self)
        for lock in self._save_dirs.values():
            lock.release()
        self._save_dirs.clear()
        self.hooks.remove()
        self.optimizer.close()
        self.store.close()
        if self.trace is not None:
            path = self.config.infinity.trace_path
            self.trace.export(path if self.comm.world == 1 else f"{path}.rank{self.comm.rank}")

    @contextlib.contextmanager
    def _span(self, name: str):
        """A span of the Chrome trace (infinity.trace_path), when one is being kept."""
        if self.trace is None:
            yield
            return
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.trace.add(name, "engine", t0, time.perf_counter(), 0)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("Engine is closed")

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _why_no_bet(plan: OffloadPlan) -> str:
    """Why the optimizer cannot take the step during backward as a bet (can_speculate is false)."""
    if plan.shard_source is not ShardSource.OPTIMIZER_FILE:
        return ("it needs parameters and optimizer both on NVMe, the shards read from the optimizer's files "
                "(here they live elsewhere, and a rolled-back bet could not restore them)")
    short = [d.path for d in plan.disk if not d.room_for_second_copy]
    if short:
        return (f"no room on {', '.join(short)} (on some rank) for a second copy of the optimizer's files; the "
                "step runs after backward")
    return "another rank has no room for it, or could not reserve it (see that rank's log)"


def _cast_floats(obj, dtype, device):
    if isinstance(obj, torch.Tensor):
        obj = obj.to(device)
        return obj.to(dtype) if obj.is_floating_point() else obj
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cast_floats(o, dtype, device) for o in obj)
    if isinstance(obj, dict):
        return {k: _cast_floats(v, dtype, device) for k, v in obj.items()}
    return obj


