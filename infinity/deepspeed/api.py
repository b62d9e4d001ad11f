"""deepspeed.initialize, init_distributed and add_config_arguments over infinity's engine."""

from __future__ import annotations

import os
from datetime import timedelta

import torch

from infinity.deepspeed.config import script_config

_SUPPORTED = ("torch.optim.Adam, torch.optim.AdamW, deepspeed.ops.adam.DeepSpeedCPUAdam or FusedAdam, a callable "
              "making one of them, or the config's optimizer section")


def initialize(args=None, model=None, optimizer=None, model_parameters=None, training_data=None, lr_scheduler=None,
               distributed_port: int = 29500, mpu=None, dist_init_required=None, collate_fn=None, config=None,
               mesh_param=None, config_params=None):
    """DeepSpeed's initialize: returns (engine, optimizer, training dataloader or None, lr scheduler or None).

    The config is args.deepspeed_config, config or config_params (exactly one). A torch Adam/AdamW passed as
    `optimizer` becomes the engine's CPU Adam with its parameter groups and hyper-parameters; `training_data`
    (a Dataset) becomes a loader of micro batches sampled as DeepSpeed samples (see DeepSpeedDataLoader).
    """
    from infinity.engine.assemble import initialize as engine_initialize

    if model is None:
        raise ValueError("deepspeed.initialize: model is required")
    if mpu is not None or mesh_param is not None:
        raise ValueError("deepspeed.initialize: mpu/mesh_param (model parallelism) are not supported; infinity is "
                         "data parallel with ZeRO partitioning")
    raw = script_config(args, config, config_params)
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        init_distributed()  # the one-rank group DeepSpeed's initialize leaves; several ranks: the engine joins
    groups = _groups(optimizer, model_parameters, raw, model)
    engine = engine_initialize(model, raw, model_parameters=groups, lr_scheduler=lr_scheduler)
    loader = None
    if training_data is not None:
        micro = engine.train_micro_batch_size_per_gpu()
        if micro is None:
            raise ValueError("deepspeed.initialize(training_data=...): the config gives neither "
                             "train_micro_batch_size_per_gpu nor train_batch_size, so the loader has no batch size")
        loader = DeepSpeedDataLoader(training_data, batch_size=micro, collate_fn=collate_fn,
                                     world=engine.world_size, rank=engine.rank,
                                     drop_last=engine.config.dataloader_drop_last)
    return engine, engine.optimizer, loader, engine.lr_scheduler


def _groups(optimizer, model_parameters, raw: dict, model):
    """model_parameters for infinity.initialize, with a client optimizer turned into the config's section."""
    if optimizer is None:
        return model_parameters
    if callable(optimizer) and not isinstance(optimizer, torch.optim.Optimizer):
        optimizer = optimizer(model_parameters if model_parameters is not None else model.parameters())
    if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        raise TypeError(f"deepspeed.initialize: optimizer {type(optimizer).__name__} is not supported; supported: "
                        f"{_SUPPORTED}")
    if "optimizer" in raw:
        raise ValueError("deepspeed.initialize: an optimizer was passed and the config has an optimizer section; "
                         "keep one of them")
    d = optimizer.defaults
    for key in ("maximize", "amsgrad", "capturable", "differentiable"):
        if d.get(key):
            raise ValueError(f"deepspeed.initialize: the optimizer sets {key}=True, which infinity's Adam does not "
                             f"do; supported: {_SUPPORTED} without it")
    # torch's AdamW, Adam(decoupled_weight_decay=True), DeepSpeedCPUAdam/FusedAdam with adamw_mode: AdamW
    adamw = isinstance(optimizer, torch.optim.AdamW) or bool(d.get("decoupled_weight_decay"))
    raw["optimizer"] = {"type": "AdamW" if adamw else "Adam",
                        "params": {"lr": float(d["lr"]), "betas": list(d["betas"]), "eps": float(d["eps"]),
                                   "weight_decay": float(d["weight_decay"]), "adam_w_mode": adamw,
                                   "bias_correction": bool(d.get("bias_correction", True))}}
    return [{"params": list(g["params"]), "lr": g["lr"], "betas": tuple(g["betas"]), "eps": g["eps"],
             "weight_decay": g["weight_decay"]} for g in optimizer.param_groups]


class DeepSpeedDataLoader:
    """Micro batches of `dataset` as DeepSpeed's loader makes them: under a launcher (LOCAL_RANK set), a
    DistributedSampler over the ranks, shuffled with seed 0, whose epoch advances at every pass, so every rank
    sees its share in DeepSpeed's order; in a plain process, a RandomSampler."""

    def __init__(self, dataset, *, batch_size: int, collate_fn=None, world: int = 1, rank: int = 0,
                 drop_last: bool = False):
        from torch.utils.data import DataLoader, RandomSampler
        from torch.utils.data.distributed import DistributedSampler

        if "LOCAL_RANK" in os.environ or world > 1:
            self.data_sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=0)
        else:
            self.data_sampler = RandomSampler(dataset)
        # drop_last applies to the batches, not to the sampler (which pads to equal shares), as in DeepSpeed
        self.loader = DataLoader(dataset, batch_size=batch_size, sampler=self.data_sampler, collate_fn=collate_fn,
                                 drop_last=drop_last)
        self.epoch = 0
        self.batch_size = batch_size

    def __iter__(self):
        sampler = self.data_sampler
        if hasattr(sampler, "set_epoch"):
            if sampler.epoch != self.epoch and sampler.epoch != 0:
                self.epoch = sampler.epoch  # the caller set the epoch (loader.data_sampler.set_epoch(e)): keep it
            sampler.set_epoch(self.epoch)
        self.epoch += 1
        return iter(self.loader)

    def __len__(self) -> int:
        return len(self.loader)


def init_distributed(dist_backend: str | None = None, auto_mpi_discovery: bool = True,
                     distributed_port: int = 29500, verbose: bool = True, timeout=timedelta(minutes=30),
                     init_method=None, dist_init_required=None, config=None, rank: int = -1, world_size: int = -1):
    """Join the process group the launcher describes (torchrun's or deepspeed's environment): gloo on CPU,
    NCCL on CUDA, or dist_backend. Without a launcher, a one-rank group (in-process store, no port), as
    DeepSpeed always leaves one: scripts call torch.distributed.get_rank() and barrier() at any world size."""
    import torch.distributed as dist

    from infinity.engine.comm import init_distributed as join

    if dist.is_initialized():
        return
    if world_size > 1 and "WORLD_SIZE" not in os.environ:
        os.environ.update(WORLD_SIZE=str(world_size), RANK=str(rank), MASTER_PORT=str(distributed_port))
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
    join(seconds, backend=dist_backend)
    if not dist.is_initialized():
        # CPU tensors through gloo and, on a GPU, CUDA tensors through NCCL: a script's barrier() or all_reduce
        # of either kind works.
        backend = dist_backend or ("cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo")
        if "nccl" in backend:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                                timeout=timedelta(seconds=seconds))


def add_config_arguments(parser):
    """DeepSpeed's command-line arguments: --deepspeed, --deepspeed_config (and the older --deepscale ones)."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument("--deepspeed", default=False, action="store_true",
                       help="enable DeepSpeed (infinity: always on; accepted for scripts that pass it)")
    group.add_argument("--deepspeed_config", default=None, type=str, help="DeepSpeed json configuration file")
    group.add_argument("--deepscale", default=False, action="store_true", help="deprecated: --deepspeed")
    group.add_argument("--deepscale_config", default=None, type=str, help="deprecated: --deepspeed_config")
    return parser
