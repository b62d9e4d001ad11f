"""initialize: the engine assembled from the config and the model, in the order each piece needs the last.

  config        "auto" resolved from the model, the batch sizes checked for this world size
  store         the zero_init block's, or built now with its pool fitted to the model (build.py)
  disk room     checked on every rank before anything is written
  adoption      construction ends; the model's parameters become shards, frozen ones frozen
  plan          where each kind of state lives, and the sub-groups (plan.py)
  optimizer     ShardedAdam over the plan, its NVMe pool if the plan has one
  hooks, Engine the store's hooks on the model; the lr scheduler; the Engine
A failure while the store adopts the model or the optimizer is built closes what this call built (a zero_init
block's store stays for its own exit), so a failed setup leaves no files behind; so does a failure of the Engine
(a scheduler that does not fit the groups).
"""

from __future__ import annotations

import logging
import os
import warnings

import torch

from infinity.config import Config, ConfigError
from infinity.config.resolve import resolve_auto, resolve_batch
from infinity.engine import lifetime
from infinity.engine.build import as_config, build_store, pool_shard_numel
from infinity.engine.comm import init_distributed, together
from infinity.engine.engine import Engine
from infinity.engine.hooks import ParamHooks
from infinity.engine.memory import CONSTRUCTION, set_mmap_threshold
from infinity.engine.optimizer import ShardedAdam
from infinity.engine.params import managed
from infinity.engine.plan import plan_offload
from infinity.engine.zero_init import current_store
from infinity.swap import SwapContext
from infinity.swap.state import MOMENT_DTYPES, state_bytes
from infinity.swap.telemetry import Trace
from infinity.swap.tier import Tier

log = logging.getLogger("infinity")


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
    cfg = resolve_auto(as_config(config), model)
    set_mmap_threshold(CONSTRUCTION)  # setup stays memory-bounded; the steps get cfg's: [Note: glibc's mmap threshold]
    comm = init_distributed(cfg.infinity.comm_timeout_s)
    batch = resolve_batch(cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps,
                          comm.world)  # before anything is built: an inconsistent set fails here
    groups = param_groups(model, model_parameters)  # checked before a store (and its swap directory) exists
    trained = {id(p) for g in groups for p in g["params"]}
    store = _store_for(model, cfg, comm)
    if not cfg.optimizer_given:
        hp = cfg.optimizer.params
        log.warning("infinity: the config has no optimizer section: training with %s lr %g, betas %s, eps %g, "
                    "weight_decay %g (add an optimizer section to choose)", cfg.optimizer.type, hp.lr,
                    tuple(hp.betas), hp.eps, hp.weight_decay)

    def failed():
        if store is not current_store():
            store.close()  # what zero_init wrote goes too: nothing of a failed setup stays on disk

    together(comm, "the disk-room check", lambda: check_disk_room(cfg, store, model, trained, comm.world), failed,
             error=lambda message: ConfigError("", message))
    try:  # a failure here (a shard too big for the pool's buffers, ...) leaves no open store or files
        _adopt(model, store, trained)
        cfg, plan, optimizer = _optimizer_for(cfg, store, comm, groups)
    except BaseException:
        failed()
        raise
    store.finish_setup()
    hooks = ParamHooks(store)
    hooks.install(model)
    hooks.guard_state_dict(model)
    try:
        engine = Engine(model, cfg, plan=plan, store=store, optimizer=optimizer, hooks=hooks, batch=batch,
                        lr_scheduler=lr_scheduler_for(cfg, optimizer, lr_scheduler))
    except BaseException:  # e.g. a scheduler that does not fit the groups: nothing of this setup may stay behind
        hooks.remove()
        optimizer.close()
        store.close()
        raise
    set_mmap_threshold(cfg.infinity.mmap_threshold)
    return engine


def _store_for(model: torch.nn.Module, cfg: Config, comm):
    """The store the model's parameters are in (zero_init's), or a new one with its pool fitted to the model."""
    store = next((managed(p).store for p in model.parameters() if managed(p) is not None), None)
    if store is None:
        store = current_store() or build_store(cfg, comm,
                                               largest_shard_numel=pool_shard_numel(cfg, model, comm.world))
    store.set_prefetch_bucket(cfg.zero_optimization.stage3_prefetch_bucket_size)  # "auto" may be the model's now
    return store


def _adopt(model: torch.nn.Module, store, trained: set) -> None:
    """Construction is over: what user code left staged or reassigned becomes shards, persistent parameters'
    shards catch up with their full values, and the access mode ends (see [Note: partitioned access]). Then
    every floating-point parameter is a shard (frozen ones too, in the compute dtype), those outside `trained`
    are frozen, and the buffers go to the compute device."""
    for name, p in reversed(list(model.named_parameters())):  # full names in messages from here on
        if managed(p) is not None:
            managed(p).name = name
    store.settle_staged()
    store.adopt_reassigned(store.params)
    store.sync_persistent()
    store.end_access()
    for name, p in model.named_parameters():
        if managed(p) is None:
            if id(p) in trained or p.is_floating_point():
                store.adopt(p, name)
        else:
            managed(p).name = name
    store.retain({id(p) for p in model.parameters()})
    for mp in store.params:
        if id(mp.param) not in trained:
            store.freeze(mp)
    for module in model.modules():  # parameters stay placeholders
        for key, b in module._buffers.items():
            if b is not None:
                module._buffers[key] = b.to(store.device)


def _optimizer_for(cfg: Config, store, comm, groups: list[dict]):
    """(the config with its fitted sizes, the OffloadPlan, the ShardedAdam over it); an NVMe pool that was opened
    is closed again if the optimizer cannot be built."""
    cfg, plan = plan_offload(cfg, store, [[managed(p) for p in g["params"]] for g in groups], say=comm.rank == 0)
    if plan.fitted and comm.rank == 0:
        log.info("infinity: %s", plan.fitted)
    swap = None
    try:
        if plan.optimizer_buffers:
            swap = SwapContext.for_optimizer(cfg, rank=comm.rank, world=comm.world,
                                             largest_group_numel=plan.largest_sub_group, tail_bytes=plan.tail_bytes)
            # The engine may be collected before exit without close() (a script's main() returns): its
            # optimizer files go at exit all the same; [Note: swap files die with the process]. The swapper is
            # what is tracked: its reaper threads keep it alive until it is closed, whoever else lets go of it.
            lifetime.track(swap.swapper, remove_at_exit=cfg.infinity.remove_swap_at_exit)
        optimizer = ShardedAdam(store, cfg, comm, plan=plan, param_groups=groups, swap=swap,
                                trace=Trace() if cfg.infinity.trace_path else None)
    except BaseException:
        if swap is not None:
            swap.close()
        raise
    return cfg, plan, optimizer


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


def lr_scheduler_for(cfg: Config, optimizer, client):
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
