"""Engine: what `infinity.initialize` returns. Forward, backward and step of a ZeRO-partitioned model.

The data path of one optimizer step:
  engine(batch)        module pre-hooks gather parameters (scheduler reads NVMe shards ahead), post-hooks release
  engine.backward(l)   saved-tensor hooks re-gather what backward needs; grad hooks reduce-scatter to owners
  engine.step()        at an accumulation boundary: overflow check, global clip, CPU Adam per sub-group
                       (RAM or NVMe), new weights written to the parameter store in the compute dtype
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import warnings
from dataclasses import dataclass

import torch

from infinity.config import Config, ConfigError
from infinity.config.resolve import resolve_auto, resolve_batch
from infinity.engine import lifetime
from infinity.engine.build import as_config, build_store, pool_shard_numel
from infinity.engine.comm import init_distributed, together
from infinity.engine.hooks import ParamHooks
from infinity.engine.loss_scaler import LossScaler
from infinity.engine.memory import CONSTRUCTION, set_mmap_threshold
from infinity.engine.module_surface import ModuleSurface
from infinity.engine.optimizer import ShardedAdam, can_split, shards_in_state
from infinity.engine.params import ParamStore, managed
from infinity.engine.sizing import fit_optimizer
from infinity.engine.zero_init import current_store
from infinity.swap.state import MOMENT_DTYPES, state_bytes
from infinity.swap.telemetry import Trace
from infinity.swap.tier import Tier


log = logging.getLogger("infinity")


@dataclass(kw_only=True, slots=True)
class StepReport:
    """What one optimizer step did (engine.last_report; one line of `infinity train`'s metrics.jsonl)."""

    step: int
    skipped: bool
    loss_scale: float
    grad_norm: float
    step_s: float
    """From the end of the previous step to the end of this one (forward, backward and optimizer)."""
    optimizer_s: float
    param_fetches: int
    prefetch_hits: int
    param_lent: int
    """Fetches served from the optimizer's master weights instead of a read (see [Note: backward reads from
    the state] in optimizer.py)."""
    param_staged: int
    """Fetches served from a copy the step finished in forward staged (see [Note: stepped shards are staged] in
    deferred.py)."""
    param_stall_s: float
    """Exposed parameter I/O: time forward/backward waited on shard reads."""
    optimizer_io_wait_s: float
    """Exposed optimizer I/O."""
    param_read_bytes: int
    optimizer_read_bytes: int
    optimizer_write_bytes: int
    param_write_bytes: int
    peak_live_elements: int
    comm_s: float = 0.0
    """Time in blocking collectives (gathers, gradient reduce-scatters, norms) since the previous step."""
    gathered_bytes: int = 0
    """Full parameters materialised (forward and backward), from any tier: the CPU/device tier's traffic."""

    @property
    def prefetch_hit_rate(self) -> float:
        return self.prefetch_hits / self.param_fetches if self.param_fetches else 1.0

    @property
    def exposed_io_s(self) -> float:
        return self.param_stall_s + self.optimizer_io_wait_s

    @property
    def io_read_bytes(self) -> int:
        return self.param_read_bytes + self.optimizer_read_bytes

    @property
    def io_write_bytes(self) -> int:
        return self.optimizer_write_bytes + self.param_write_bytes


class Engine(ModuleSurface):
    """A model whose parameters, gradients and optimizer state are partitioned and offloaded per the config."""

    def __init__(self, model: torch.nn.Module, cfg: Config, store: ParamStore, optimizer: ShardedAdam,
                 hooks: ParamHooks, lr_scheduler=None, batch=None, fitted: str = ""):
        self.module = model
        self.config = cfg
        self.fitted = fitted
        """What initialize fitted to the model and why (see [Note: sizes fitted to the model]), or ""."""
        self.store = store
        self.comm = store.comm
        self.optimizer = optimizer
        self.hooks = hooks
        self.scaler = LossScaler.from_config(cfg.fp16)
        self.lr_scheduler = _lr_scheduler(cfg, optimizer, lr_scheduler)
        self.batch = batch or resolve_batch(cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu,
                                            cfg.gradient_accumulation_steps, self.comm.world)
        """The three batch sizes for this world size (see [Note: batch sizes] in config/resolve.py)."""
        self.gas = self.batch.gradient_accumulation_steps
        self.micro_steps = 0
        self.micro_steps_at_last_step = 0  # save_checkpoint refuses while a backward's gradients are pending
        self.global_steps = 0
        self.skipped_steps = 0
        self.reports: list[StepReport] = []
        self._t_last = time.perf_counter()
        self._fetch_stats = []
        self._overlapped = None  # the result of a step taken during backward, for step() to report
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
        self.optimizer.expect_step(torch.is_grad_enabled() and self._can_step_during_backward()
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
        (the loss is not kept). Returns the loss, as DeepSpeed's does."""
        self._check_open()
        if loss.numel() != 1:
            raise ValueError(f"Engine.backward: loss must be a scalar, got shape {tuple(loss.shape)}")
        if not allreduce_gradients:
            raise ValueError("Engine.backward(allreduce_gradients=False): each gradient is reduce-scattered to its "
                             "owner rank as backward produces it, so the reduction cannot be skipped; drop it")
        self.optimizer.settle()  # the last step's groups not yet needed by a forward
        scaled = loss.float() * (self.scaler.scale / (self.gas if scale_wrt_gas else 1))
        overlap = self._can_step_during_backward() and self._next_is_boundary() and not retain_graph
        if overlap:
            self.optimizer.begin_overlapped_step()
        else:
            self.optimizer.expect_step(False)
            if self._next_is_boundary():
                self.optimizer.read_ahead_for_step(defer=self._can_defer_step())
        if self.store.scheduler is not None:
            self.store.scheduler.backward_begins()
        try:
            with self._span("backward"), self.hooks.saved_tensors():
                scaled.backward(retain_graph=retain_graph)
            self.store.flush_grads()
            if overlap:
                self._overlapped = self.optimizer.end_overlapped_step()
        except BaseException:
            if not overlap:
                self.optimizer.expect_step(False)  # the reads read_ahead_for_step started go back
            raise
        finally:
            if overlap:
                self.optimizer.cancel_overlapped_step()  # a no-op after end_overlapped_step
        self.micro_steps += 1
        if self.store.scheduler is not None:
            self._fetch_stats.append(self.store.scheduler.drain())
        return loss

    def _can_step_during_backward(self) -> bool:
        """See [Note: stepping during backward] in optimizer.py."""
        return (self.config.infinity.step_during_backward and self.config.gradient_clipping == 0
                and not self.config.fp16.enabled)

    def _can_defer_step(self) -> bool:
        """See [Note: the step finishes in the next forward] in deferred.py: ZeRO-3 (every parameter a shard read
        through the store) with optimizer state on NVMe, and shards that are either the optimizer files' (alias
        mode) or in memory."""
        store = self.store
        return (self.config.infinity.step_during_forward and store.stage == 3
                and any(g.state.io_bytes for g in self.optimizer.groups)
                and (store.alias is not None or store.tier is not Tier.NVME))

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

    # ------------------------------------------------------ DeepSpeed's getters

    def train_batch_size(self) -> int | None:
        return self.batch.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int | None:
        return self.batch.micro_batch_per_rank

    def gradient_accumulation_steps(self) -> int:
        return self.gas

    def get_lr(self) -> list[float]:
        return [float(g["lr"]) for g in self.optimizer.param_groups]

    def get_global_grad_norm(self) -> float | None:
        """The global gradient norm of the last optimizer step (None before the first)."""
        return self.last_report.grad_norm if self.last_report is not None else None

    def zero_optimization_stage(self) -> int:
        return self.config.zero_optimization.stage

    def fp16_enabled(self) -> bool:
        return self.config.fp16.enabled

    def bfloat16_enabled(self) -> bool:
        return self.config.bf16.enabled

    @property
    def global_rank(self) -> int:
        return self.comm.rank

    @property
    def local_rank(self) -> int:
        return int(os.environ.get("LOCAL_RANK", "0"))

    @property
    def device(self) -> torch.device:
        return self.store.device

    @property
    def global_samples(self) -> int:
        """Samples consumed so far: train_batch_size per accumulation boundary, skipped (fp16 overflow) steps
        included, as DeepSpeed counts them."""
        per_step = self.batch.train_batch_size or 0
        return (self.global_steps + self.skipped_steps) * per_step

    def train(self, mode: bool = True) -> "Engine":
        self.module.train(mode)
        return self

    def eval(self) -> "Engine":
        self.module.eval()
        return self

    @contextlib.contextmanager
    def no_sync(self):
        """DeepSpeed's no_sync: refused with ZeRO stage 2 or 3 (as DeepSpeed refuses it); below that, gradients
        are still reduced every micro-batch, which gives the same sum (said once)."""
        if self.config.zero_optimization.stage >= 2:
            raise RuntimeError("Engine.no_sync: gradients are partitioned at ZeRO stage 2 and 3 and go to their "
                               "owner ranks as they are produced, so they cannot be held back (DeepSpeed refuses "
                               "this too); accumulate with gradient_accumulation_steps instead")
        if not self._said_no_sync:
            self._said_no_sync = True
            log.info("infinity: no_sync still reduces gradients every micro-batch; the accumulated sum is the same")
        yield

    def step(self) -> bool:
        """Step the optimizer at an accumulation boundary (a no-op in between). True when a step was taken."""
        self._check_open()
        if not self.is_gradient_accumulation_boundary():
            return False
        self.micro_steps_at_last_step = self.micro_steps
        t0 = time.perf_counter()
        if self._overlapped is not None:
            overflow, norm, stats = self._overlapped
            self._overlapped = None
        else:
            with self._span("optimizer step"):
                overflow, norm, stats = self.optimizer.step(loss_scale=self.scaler.scale,
                                                            max_norm=self.config.gradient_clipping,
                                                            defer=self._can_defer_step())
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
        self.reports.append(StepReport(
            step=self.global_steps + self.skipped_steps, skipped=overflow, loss_scale=self.scaler.scale,
            grad_norm=norm, step_s=t1 - self._t_last, optimizer_s=t1 - t0,
            param_fetches=sum(s.fetches for s in fs), prefetch_hits=sum(s.hits for s in fs),
            param_lent=sum(s.lent for s in fs), param_staged=sum(s.staged for s in fs), param_stall_s=sum(s.stall_s for s in fs),
            optimizer_io_wait_s=stats.io_wait_s + self.optimizer.deferred_wait_s - self._deferred_mark,
            param_read_bytes=sum(s.bytes_read for s in fs), optimizer_read_bytes=stats.bytes_read,
            optimizer_write_bytes=stats.bytes_written,
            param_write_bytes=self._param_bytes_written() - self._param_written_mark,
            peak_live_elements=self.store.peak_live_elements,
            gathered_bytes=self.store.bytes_gathered - self._gathered_mark,
            comm_s=self.comm.time_s - self._comm_mark))
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

    def own_save_dir(self, directory) -> None:
        """Hold `directory` as this run's checkpoint directory until close() ([Note: directories are owned
        through flock] in infinity/dirlock.py): rank 0 holds it for the run, and another live process saving
        there raises DirectoryInUse instead of overwriting this run's checkpoints (or having its own
        overwritten). save_checkpoint does it at its first save; `infinity train` at start. Local to the rank,
        no collective: a caller on every rank wraps it in one."""
        if self.comm.rank != 0:
            return
        from infinity.dirlock import own_checkpoint_dir

        key = os.path.realpath(os.fspath(directory))
        if key not in self._save_dirs:
            self._save_dirs[key] = own_checkpoint_dir(key)

    def save_checkpoint(self, save_dir, tag: str | None = None, client_state=None, save_latest: bool = True,
                        exclude_frozen_parameters: bool = False, *, own_dir: bool = True) -> str:
        """Write every rank's fp32 master weights, Adam moments, frozen weights, the step counters, loss scaler,
        lr scheduler, RNG states, buffers and `client_state` as the zarr store save_dir/<tag> (default tag
        global_step<N>), then (save_latest) point save_dir/latest at it. Call it on every rank, after
        engine.step(). Atomic: see [Note: atomic checkpoint] in infinity/checkpoint/layout.py.

        client_state is any picklable object (DeepSpeed's rule); it is kept as JSON when that round-trips
        exactly, else pickled, and load_checkpoint unpickles it as torch.load(weights_only=False) would: load
        only checkpoints you trust. exclude_frozen_parameters leaves the frozen (requires_grad=False) weights
        out, as DeepSpeed's does for PEFT: a load keeps the model's own values for them, so build the model
        from the same base weights before loading. own_dir (default) holds save_dir for this engine until close
        (own_save_dir), so that another run saving there is refused instead of mixing its checkpoints with
        these; InfinityTrainer passes False for the checkpoint-N folders, which are the Trainer's to manage
        and upload. Returns the checkpoint's path."""
        self._check_open()
        from infinity.checkpoint.save import save

        return save(self, save_dir, tag, client_state, save_latest=save_latest,
                    exclude_frozen=exclude_frozen_parameters, own_dir=own_dir)

    def load_checkpoint(self, load_dir, tag: str | None = None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False, *, verify: bool = True, custom_load_fn=None):
        """Resume from load_dir/<tag> (default: the tag load_dir/latest names), saved by any number of ranks
        under any offload config. Returns (path, client_state), as DeepSpeed's does.

        load_module_only loads the weights alone (fine-tuning from a checkpoint): Adam's moments and step
        count start from zero; the engine's step counters, lr, loss scaler and RNG keep their current values.
        load_optimizer_states=False loads the weights and everything else but Adam's moments, which start from
        zero. load_lr_scheduler_states=False keeps the engine's lr scheduler as it is. load_module_strict=False
        allows names on one side only, as torch's load_state_dict(strict=False): the model's parameters and
        buffers the checkpoint lacks keep their current values (and Adam moments, which then continue under the
        checkpoint's step count), and the checkpoint's extra ones are ignored; shapes must still match. custom_load_fn is refused (not supported). verify=False skips the
        checksum pass of [Note: verify before load]: faster, but corrupted bytes then go undetected.

        With no tag and no load_dir/latest file, it warns and returns (None, None), as DeepSpeed's does, so a
        script's first run starts from scratch; every other unusable checkpoint raises CheckpointError.
        """
        self._check_open()
        if custom_load_fn is not None:
            raise ValueError("load_checkpoint(custom_load_fn=...) is not supported; load the state yourself inside "
                             "infinity.gathered_parameters(..., modifier_rank=0) before initialize")
        from infinity.checkpoint.load import NoLatest, load

        try:
            return load(self, load_dir, tag, verify=verify, module_only=load_module_only,
                        lr_scheduler=load_lr_scheduler_states, optimizer_states=load_optimizer_states,
                        strict=load_module_strict)
        except NoLatest as exc:
            warnings.warn(f"infinity: load_checkpoint found nothing to load, so the engine is unchanged: {exc}",
                          stacklevel=2)
            return None, None

    def save_16bit_model(self, save_dir, save_filename: str = "pytorch_model.bin",
                         exclude_frozen_parameters: bool = False) -> bool:
        """The model's consolidated weights in the compute dtype (bf16/fp16; fp32 without either), gathered one
        parameter at a time and streamed by rank 0 into save_dir/save_filename (.safetensors, or a torch.save
        file for any other name). At stage 3 it needs zero_optimization.stage3_gather_16bit_weights_on_model_save,
        as DeepSpeed does, and returns False (saving nothing) without it. Call it on every rank."""
        self._check_open()
        from infinity.checkpoint.sixteen import save_16bit

        return save_16bit(self, save_dir, save_filename, exclude_frozen=exclude_frozen_parameters)

    def save_pretrained(self, save_directory, *, tokenizer=None, max_shard_size="5GB", merge_lora: bool = False,
                        adapter_name: str = "default") -> list[str]:
        """A Hugging Face directory that `from_pretrained` loads: config, generation config, safetensors shards
        of at most max_shard_size and, when given, the tokenizer's files. A peft model writes its adapter, or
        with merge_lora the base model with the adapter merged as peft's merge_and_unload() does. Values are in
        the compute dtype (fp32 without bf16/fp16: the master weights exactly), gathered one parameter at a time,
        so the whole model never exists in memory ([Note: streamed save_pretrained]). Call it on every rank;
        returns the names of the files written."""
        self._check_open()
        if self.gradients_pending():
            raise RuntimeError("save_pretrained between backward() and step(): the weights are about to change; "
                               "call it after step()")
        from infinity.checkpoint.save_pretrained import save_pretrained

        return save_pretrained(self, save_directory, tokenizer=tokenizer, max_shard_size=max_shard_size,
                               merge_lora=merge_lora, adapter_name=adapter_name)

    def consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False) -> dict:
        """The whole state_dict in the compute dtype, on the host: on rank 0, and an empty dict on the others
        (DeepSpeed's engine._zero3_consolidated_16bit_state_dict, which Hugging Face Accelerate calls).
        Gathered one parameter at a time; call it on every rank. Rank 0 holds the whole model in host memory
        while the dict lives: save_16bit_model streams to a file instead."""
        self._check_open()
        from infinity.checkpoint.sixteen import consolidated_state_dict

        return consolidated_state_dict(self, exclude_frozen=exclude_frozen_parameters)

    _zero3_consolidated_16bit_state_dict = consolidated_16bit_state_dict  # the name DeepSpeed's callers use

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        """zero_optimization.stage3_gather_16bit_weights_on_model_save, as DeepSpeed's engine reports it."""
        return self.config.zero_optimization.stage3_gather_16bit_weights_on_model_save

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


def _lr_scheduler(cfg: Config, optimizer, client):
    """A scheduler passed in wins over the config's scheduler section, as in DeepSpeed 0.19 (said once when both
    are given); a callable is called with the optimizer; a scheduler built over another optimizer (a torch
    optimizer that deepspeed.initialize turned into this one) is moved onto this one."""
    if client is None:
        if cfg.scheduler is None:
            return None
        from infinity.optim.schedules import build_scheduler

        return build_scheduler(cfg.scheduler, optimizer)
    if cfg.scheduler is not None:
        warnings.warn(f"infinity: the lr_scheduler passed to initialize is used and the config's scheduler section "
                      f"({cfg.scheduler.type}) is not, as in DeepSpeed; remove one of them", stacklevel=3)
    if callable(client) and not hasattr(client, "step"):
        return client(optimizer)
    bound = getattr(client, "optimizer", None)
    if bound is not None and bound is not optimizer and hasattr(client, "get_last_lr"):
        if len(bound.param_groups) != len(optimizer.param_groups):
            raise ValueError(f"infinity: the lr_scheduler is bound to an optimizer with {len(bound.param_groups)} "
                             f"parameter groups, the engine's has {len(optimizer.param_groups)}")
        for mine, theirs in zip(optimizer.param_groups, bound.param_groups):
            if "initial_lr" in theirs:
                mine["initial_lr"] = theirs["initial_lr"]
        client.optimizer = optimizer
        for group, lr in zip(optimizer.param_groups, client.get_last_lr()):
            group["lr"] = lr
    return client


def _cast_floats(obj, dtype, device):
    if isinstance(obj, torch.Tensor):
        obj = obj.to(device)
        return obj.to(dtype) if obj.is_floating_point() else obj
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cast_floats(o, dtype, device) for o in obj)
    if isinstance(obj, dict):
        return {k: _cast_floats(v, dtype, device) for k, v in obj.items()}
    return obj


def initialize(model: torch.nn.Module, config=None, model_parameters=None, lr_scheduler=None) -> Engine:
    """Partition `model` (if zero_init has not), build the optimizer, install the hooks; returns the Engine.

    `model_parameters` is what torch.optim takes: an iterable of the model's
    parameters, or of group dicts (`params`, and optionally `lr`,
    `weight_decay`, `betas`, `eps`) whose hyper-parameters override the
    config's optimizer section. Only those parameters are trained (see
    [Note: parameter groups] in optimizer.py); None means every parameter
    that requires grad. `lr_scheduler` is a torch lr scheduler or a function
    optimizer -> scheduler.
    """
    from infinity.swap import SwapContext

    cfg = resolve_auto(as_config(config), model)
    set_mmap_threshold(CONSTRUCTION)  # setup stays memory-bounded; the steps get cfg's: [Note: glibc's mmap threshold]
    comm = init_distributed(cfg.infinity.comm_timeout_s)
    batch = resolve_batch(cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps,
                          comm.world)  # before anything is built: an inconsistent set fails here
    store = next((managed(p).store for p in model.parameters() if managed(p) is not None), None)
    if store is None:
        store = current_store() or build_store(cfg, comm,
                                               largest_shard_numel=pool_shard_numel(cfg, model, comm.world))
    store.set_buckets(reduce_bucket=cfg.zero_optimization.reduce_bucket_size,  # "auto" may be the model's now
                      prefetch_bucket=cfg.zero_optimization.stage3_prefetch_bucket_size)
    if not cfg.optimizer_given:
        hp = cfg.optimizer.params
        log.warning("infinity: the config has no optimizer section: training with %s lr %g, betas %s, eps %g, "
                    "weight_decay %g (add an optimizer section to choose)", cfg.optimizer.type, hp.lr,
                    tuple(hp.betas), hp.eps, hp.weight_decay)
    groups = param_groups(model, model_parameters)
    trained = {id(p) for g in groups for p in g["params"]}
    def failed():
        if store is not current_store():
            store.close()  # what zero_init wrote goes too: nothing of a failed setup stays on disk

    together(comm, "the disk-room check", lambda: check_disk_room(cfg, store, model, trained, comm.world), failed)
    for name, p in reversed(list(model.named_parameters())):  # full names in messages from here on
        if managed(p) is not None:
            managed(p).name = name
    # Construction is over: what user code left staged or reassigned becomes shards, persistent parameters'
    # shards catch up with their full values, and the access mode ends (see [Note: partitioned access]).
    try:  # a failure here (a shard too big for the pool's buffers, ...) leaves no open store or files
        store.settle_staged()
        store.adopt_reassigned(store.params)
        store.sync_persistent()
        store.end_access()
        names = {}
        for name, p in model.named_parameters():
            names.setdefault(id(p), name)
            if managed(p) is None:
                if id(p) in trained or p.is_floating_point():  # frozen ones too: partitioned, in the compute dtype
                    store.adopt(p, name)
            else:
                managed(p).name = name
        store.retain({id(p) for p in model.parameters()})
        for mp in store.params:
            if id(mp.param) not in trained:
                store.freeze(mp)
        for module in model.modules():  # buffers go to the compute device; parameters stay placeholders
            for key, b in module._buffers.items():
                if b is not None:
                    module._buffers[key] = b.to(store.device)
    except BaseException:
        failed()
        raise
    opt_swap = None
    fitted = ""
    try:
        if cfg.zero_optimization.offload_optimizer.tier is Tier.NVME:
            by_group = [[managed(p) for p in g["params"]] for g in groups]
            ratio = cfg.zero_optimization.offload_optimizer.ratio
            # [Note: a large shard is split over sub-groups of its own]: where the shards live in its files or in RAM
            split = can_split(store, by_group, Tier.NVME, ratio)

            def tail_bytes(plan) -> int:
                in_state = shards_in_state(store, [g.params for g in plan], Tier.NVME, ratio)
                return 0 if in_state in (None, torch.float32) else in_state.itemsize

            def packed(by_group, size):
                return ShardedAdam._plan(by_group, size, split=split)

            cfg, fitted, plan = fit_optimizer(cfg, by_group, packed, tail_bytes, split=split, say=comm.rank == 0)
            if fitted and comm.rank == 0:
                log.info("infinity: %s", fitted)
            opt_swap = SwapContext.for_optimizer(cfg, rank=comm.rank, largest_group_numel=max(
                (g.numel for g in plan), default=1), tail_bytes=tail_bytes(plan))
            # The engine may be collected before exit without close() (a script's main() returns): its
            # optimizer files go at exit all the same; [Note: swap files die with the process]. The swapper is
            # what is tracked: its reaper threads keep it alive until it is closed, whoever else lets go of it.
            lifetime.track(opt_swap.swapper, remove_at_exit=cfg.infinity.remove_swap_at_exit)
        optimizer = ShardedAdam(store, cfg, comm, swap=opt_swap, param_groups=groups,
                                trace=Trace() if cfg.infinity.trace_path else None)
    except BaseException:
        if opt_swap is not None:
            opt_swap.close()
        failed()
        raise
    store.finish_setup()
    hooks = ParamHooks(store)
    hooks.install(model)
    hooks.guard_state_dict(model)
    try:
        engine = Engine(model, cfg, store, optimizer, hooks, lr_scheduler, batch, fitted)
    except BaseException:  # e.g. a scheduler that does not fit the groups: nothing of this setup may stay behind
        hooks.remove()
        optimizer.close()
        store.close()
        raise
    set_mmap_threshold(cfg.infinity.mmap_threshold)
    return engine


def check_disk_room(cfg: Config, store, model, trained: set, world: int) -> None:
    """Before initialize writes anything: do the nvme_path filesystems have room for this rank's swap files?
    Raises ConfigError naming the path, the bytes needed (parameters and optimizer) and the bytes free."""
    import math
    import shutil

    zero = cfg.zero_optimization
    params = {id(p): p for p in model.parameters()}
    part = {k: math.ceil(p.numel() / world) for k, p in params.items()}
    # [Note: swap files during setup] While the optimizer writes its first state, each sub-group's fp32
    # parameter files (from zero_init, or adopted now) are removed as the group's compute-dtype copies are
    # written (their own files; or, with the copies in the optimizer file's tail, as soon as the group has
    # read them): the fp32 files and the copies never coexist beyond one sub-group. So a filesystem holding
    # both needs the larger of "every fp32 file" and "every copy plus the optimizer state", less what the
    # files already written under zero_init take now (free space excludes them). With the copies in the
    # tail (bf16/fp16, both on NVMe, no max_in_cpu, ratio 1: [Note: compute-dtype shards in the optimizer
    # file]) the trained ones are on the optimizer's filesystem.
    fp32_files = existing = final = opt_bytes = 0
    off_o = zero.offload_optimizer
    tail = (store.tier is Tier.NVME and store.dtype != torch.float32 and off_o.tier is Tier.NVME
            and zero.offload_param.max_in_cpu == 0 and off_o.ratio >= 1)
    if store.tier is Tier.NVME:
        compute = torch.empty((), dtype=store.dtype).element_size()
        for k, p in params.items():
            mp = managed(p)
            if mp is None:
                if k in trained or p.is_floating_point():
                    fp32_files += 4 * part[k]  # adopted now, in fp32
            elif mp.home is store.nvme and not mp.unwritten:
                fp32_files += 4 * part[k]
                existing += 4 * part[k]
        # fp32 compute keeps the fp32 files (with alias mode they are removed once the optimizer file holds
        # the shards: counting them is conservative).
        final = sum(compute * part[k] for k in params if not (tail and k in trained)) if compute != 4 \
            else fp32_files
    if off_o.tier is Tier.NVME:
        per = state_bytes(MOMENT_DTYPES[off_o.moments_dtype]) + (store.dtype.itemsize if tail else 0)
        opt_bytes = per * sum(part[k] for k in trained)
    need: dict = {}  # filesystem -> [a path on it, bytes for parameters, bytes for the optimizer]
    from infinity.config.load import existing_ancestor  # an nvme_path is made when its swapper starts

    p_dev = os.stat(existing_ancestor(zero.offload_param.nvme_path)).st_dev if fp32_files else None
    o_dev = os.stat(existing_ancestor(zero.offload_optimizer.nvme_path)).st_dev if opt_bytes else None
    if o_dev is not None:
        need[o_dev] = [zero.offload_optimizer.nvme_path, 0, opt_bytes]
    if p_dev is not None:
        entry = need.setdefault(p_dev, [zero.offload_param.nvme_path, 0, 0])
        together = entry[2]  # the optimizer's bytes, when it shares the filesystem
        entry[1] = max(0, max(fp32_files, final + together) - together - existing)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))  # ranks on this host share its disks
    for path, p_bytes, o_bytes in need.values():
        p_bytes, o_bytes = p_bytes * local, o_bytes * local
        free = shutil.disk_usage(existing_ancestor(path)).free
        if free < p_bytes + o_bytes:
            raise ConfigError("zero_optimization.offload_param.nvme_path" if p_bytes else
                              "zero_optimization.offload_optimizer.nvme_path",
                              f"{path} has {free:,} bytes free, but the swap files of this host's ranks need "
                              f"{p_bytes + o_bytes:,} ({p_bytes:,} for parameters, {o_bytes:,} for the optimizer); "
                              "free space there or point nvme_path at a bigger disk")


_GROUP_KEYS = {"params", "lr", "weight_decay", "betas", "eps", "amsgrad", "initial_lr", "name"}


def param_groups(model: torch.nn.Module, model_parameters) -> list[dict]:
    """torch-style parameter groups of `model`'s parameters that require grad, checked.

    Parameters that do not require grad are dropped from the groups (torch's
    Adam never updates them either); a group left empty stays, so that group
    indices (and an lr scheduler's) keep meaning what the user wrote.
    """
    if model_parameters is None:
        model_parameters = [p for p in model.parameters() if p.requires_grad]
    if isinstance(model_parameters, torch.Tensor):
        raise TypeError("infinity.initialize: model_parameters must be an iterable of parameters or of group "
                        "dicts, got a single tensor; pass [tensor] or model.parameters()")
    items = list(model_parameters)
    raw = items if items and all(isinstance(g, dict) for g in items) else [{"params": items}]
    ids = {id(p) for p in model.parameters()}
    seen: set = set()
    out = []
    for k, g in enumerate(raw):
        if not isinstance(g, dict) or "params" not in g:
            raise TypeError(f"infinity.initialize: model_parameters[{k}] must be a dict with 'params' when any item is "
                            "a dict (torch's parameter-group form)")
        unknown = set(g) - _GROUP_KEYS
        if unknown:
            raise ValueError(f"infinity.initialize: parameter group {k} has keys {sorted(unknown)} that Adam does not "
                             f"take; the keys a group may set are {sorted(_GROUP_KEYS - {'initial_lr', 'name'})}")
        if g.get("amsgrad"):
            raise ValueError(f"infinity.initialize: parameter group {k} sets amsgrad=True; AMSGrad is not "
                             "supported, drop it")
        params = g["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        stray = [p for p in params if id(p) not in ids]
        if stray:
            raise ValueError(f"infinity.initialize: {len(stray)} of model_parameters are not parameters of the model")
        twice = [p for p in params if id(p) in seen]
        if twice:
            raise ValueError(f"infinity.initialize: {len(twice)} parameters appear in more than one parameter group "
                             "(or twice in one); each parameter may be in one group once")
        seen.update(id(p) for p in params)
        group = {key: v for key, v in g.items() if key not in ("params", "amsgrad")}
        group["params"] = [p for p in params if p.requires_grad]
        out.append(group)
    if not any(g["params"] for g in out):
        raise ValueError("infinity.initialize: no parameter to train (model_parameters is empty, or none of its "
                         "parameters requires grad)")
    return out
