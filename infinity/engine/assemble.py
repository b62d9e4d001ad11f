"""initialize: the engine assembled from the config and the model, in the order each piece needs the last.

  config        parsed; the process group joined; "auto" resolved from the model and the batch sizes checked
                for this world size (config/resolve.py)
  store         the zero_init block's, or built now with its pool fitted to the model, and the swap files'
                room checked on every rank before anything is written (build.py)
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
import warnings

import torch

from infinity.config import Config
from infinity.config.load import as_config
from infinity.config.resolve import resolve
from infinity.engine import lifetime
from infinity.engine.build import store_for
from infinity.engine.comm import init_distributed
from infinity.engine.engine import Engine
from infinity.engine.hooks import ParamHooks
from infinity.engine.memory import CONSTRUCTION, set_mmap_threshold
from infinity.engine.optimizer import ShardedAdam
from infinity.engine.params import managed
from infinity.engine.plan import plan_offload
from infinity.engine.zero_init import current_store
from infinity.swap import SwapContext
from infinity.swap.telemetry import Trace

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
    cfg = as_config(config)
    set_mmap_threshold(CONSTRUCTION)  # setup stays memory-bounded; the steps get cfg's: [Note: glibc's mmap threshold]
    comm = init_distributed(cfg.infinity.comm_timeout_s)
    cfg, batch = resolve(cfg, model, comm.world)  # before anything is built: an inconsistent set fails here
    groups = param_groups(model, model_parameters)  # checked before a store (and its swap directory) exists
    if not cfg.optimizer_given:
        hp = cfg.optimizer.params
        log.warning("infinity: the config has no optimizer section: training with %s lr %g, betas %s, eps %g, "
                    "weight_decay %g (add an optimizer section to choose)", cfg.optimizer.type, hp.lr,
                    tuple(hp.betas), hp.eps, hp.weight_decay)
    trained = {id(p) for g in groups for p in g["params"]}
    existing = next((managed(p).store for p in model.parameters() if managed(p) is not None), None)

    def failed(store):
        if store is not current_store():
            store.close()  # what zero_init wrote goes too: nothing of a failed setup stays on disk

    store, disk = store_for(cfg, comm, model, trained=trained, existing=existing or current_store(),
                            on_failure=failed)
    try:  # a failure here (a shard too big for the pool's buffers, ...) leaves no open store or files
        _adopt(model, store, trained)
        cfg, plan, optimizer = _optimizer_for(cfg, store, comm, groups, disk)
    except BaseException:
        failed(store)
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


def _optimizer_for(cfg: Config, store, comm, groups: list[dict], disk: tuple):
    """(the config with its fitted sizes, the OffloadPlan, the ShardedAdam over it); an NVMe pool that was opened
    is closed again if the optimizer cannot be built."""
    cfg, plan = plan_offload(cfg, store, [[managed(p) for p in g["params"]] for g in groups], disk=disk,
                             say=comm.rank == 0)
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
