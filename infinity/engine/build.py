"""Building the parameter store from a config: what zero_init and initialize share."""

from __future__ import annotations

import math

import torch

from infinity.config import Config, load_config
from infinity.engine import lifetime
from infinity.engine.comm import Comm
from infinity.engine.params import ParamStore
from infinity.swap.tier import HOST, Tier


def as_config(config) -> Config:
    return config if isinstance(config, Config) else load_config(config if config is not None else {})


def compute_dtype(cfg: Config) -> torch.dtype:
    if cfg.bf16.enabled:
        return torch.bfloat16
    if cfg.fp16.enabled:
        return torch.float16
    return torch.float32


def compute_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return HOST


def build_store(cfg: Config, comm: Comm, *, largest_shard_numel: int | None = None) -> ParamStore:
    """The parameter store; `largest_shard_numel`, when the model is known, sizes the NVMe pool's buffers (see
    [Note: the parameter pool fits the model])."""
    from infinity.swap import SwapContext

    zero = cfg.zero_optimization
    tier = zero.offload_param.tier if zero.stage == 3 else Tier.DEVICE
    swap = SwapContext.for_params(cfg, rank=comm.rank, world=comm.world, largest_shard_numel=largest_shard_numel) \
        if tier is Tier.NVME else None
    persistence = zero.stage3_param_persistence_threshold if zero.stage == 3 else 1 << 62
    store = ParamStore(comm, tier=tier, dtype=compute_dtype(cfg), device=compute_device(), persistence=persistence,
                       stage=zero.stage, swap=swap, max_in_cpu=zero.offload_param.max_in_cpu,
                       max_live=zero.stage3_max_live_parameters, prefetch_bucket=zero.stage3_prefetch_bucket_size,
                       reuse_distance=zero.stage3_max_reuse_distance)
    lifetime.track(store, remove_at_exit=cfg.infinity.remove_swap_at_exit)  # [Note: swap files die with the process]
    if swap is not None:  # kept alive by its reaper threads until closed, even once the store is collected
        lifetime.track(swap.swapper, remove_at_exit=cfg.infinity.remove_swap_at_exit)
    return store


def pool_shard_numel(cfg: Config, model: torch.nn.Module, world: int) -> int:
    """[Note: the parameter pool fits the model]
    Each buffer of the NVMe parameter pool holds one rank's shard of one parameter, in fp32 until setup ends.
    offload_param.buffer_size says how many elements a buffer holds, and DeepSpeed's default, 1e8, is 400 MB a
    buffer: 2 GB for the default 5 buffers, allocated and touched up front, for any model (5.4 s of memset for
    a two-layer model, in every rank of every run). When the model is known before the store is built
    (initialize without zero_init), a buffer is never made larger than the largest shard; a buffer_size below
    that shard keeps its meaning (and its error). Under zero_init the store comes before the model: `infinity
    train` and InfinityTrainer measure the model on the meta device and fit buffer_size before it (see [Note:
    sizes fitted to the model] in sizing.py); a user's own zero_init block gets the config's buffer_size, which
    then costs address space, not memory: large buffers are mapped lazily (aligned_empty), so only the bytes the
    shards write become resident, and initialize shrinks the buffers to the largest shard ([Note: the parameter
    pool shrinks after setup] in params.py)."""
    from infinity.engine.sizing import fit_param_buffer

    largest = max((math.ceil(p.numel() / world) for p in model.parameters()), default=1)
    return fit_param_buffer(cfg, largest).zero_optimization.offload_param.buffer_size
