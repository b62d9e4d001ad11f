"""The parameter store from a config: built (zero_init and initialize share it), or taken from zero_init, and
made ready for the model's shards once the swap files' room is checked on every rank."""

from __future__ import annotations

import math
import os

import torch

from infinity.config import Config, ConfigError
from infinity.config.load import existing_ancestor
from infinity.engine import lifetime
from infinity.engine.comm import Comm, together
from infinity.engine.params import ParamStore, managed
from infinity.engine.plan import DiskNeed, fit_param_buffer
from infinity.swap.state import MOMENT_DTYPES, state_nbytes
from infinity.swap import swapper as swap_files
from infinity.swap.swapper import HEADER
from infinity.swap.tier import HOST, Tier


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


def store_for(cfg: Config, comm: Comm, model: torch.nn.Module, *, trained: set, existing=None,
              on_failure=None) -> tuple[ParamStore, tuple[DiskNeed, ...]]:
    """The store the model's shards go to: `existing` (zero_init's) with the prefetch bucket the config now
    resolves ("auto" may be the model's), or one built now with its pool fitted to the model. Every rank
    then checks that its swap files have room (check_disk_room, for the parameters not yet in files and the
    optimizer's state); when one has not, every rank calls on_failure(store) and raises ConfigError. Returns
    the store and the room each filesystem needs."""
    if existing is None:
        store = build_store(cfg, comm, largest_shard_numel=pool_shard_numel(cfg, model, comm.world))
    else:
        store = existing
        store.set_prefetch_bucket(cfg.zero_optimization.stage3_prefetch_bucket_size)
    disk = together(comm, "the disk-room check", lambda: check_disk_room(cfg, store, model, trained, comm.world),
                    on_failure and (lambda: on_failure(store)), error=lambda message: ConfigError("", message))
    return store, disk


def build_store(cfg: Config, comm: Comm, *, largest_shard_numel: int | None = None) -> ParamStore:
    """The parameter store; `largest_shard_numel`, when the model is known, sizes the NVMe pool's buffers (see
    [Note: the parameter pool fits the model])."""
    from infinity.swap import SwapContext

    zero = cfg.zero_optimization
    tier = zero.offload_param.tier if zero.stage == 3 else Tier.DEVICE
    dtype = compute_dtype(cfg)
    swap = SwapContext.for_params(cfg, rank=comm.rank, world=comm.world, largest_shard_numel=largest_shard_numel) \
        if tier is Tier.NVME else None
    persistence = zero.stage3_param_persistence_threshold if zero.stage == 3 else 1 << 62
    store = ParamStore(comm, tier=tier, dtype=dtype, device=compute_device(), persistence=persistence,
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
    sizes fitted to the model] in plan.py); a user's own zero_init block gets the config's buffer_size, which
    then costs address space, not memory: large buffers are mapped lazily (aligned_empty), so only the bytes the
    shards write become resident, and initialize shrinks the buffers to the largest shard ([Note: the parameter
    pool shrinks after setup] in params.py)."""
    largest = max((math.ceil(p.numel() / world) for p in model.parameters()), default=1)
    return fit_param_buffer(cfg, largest).zero_optimization.offload_param.buffer_size


def check_disk_room(cfg: Config, store, model, trained: set, world: int) -> tuple[DiskNeed, ...]:
    """Before initialize writes anything: do the nvme_path filesystems have room for this rank's swap files?
    Returns what each needs (DiskNeed, for the plan); raises ConfigError naming the path, the bytes needed
    (parameters and optimizer) and the bytes free."""
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
    fp32: list = []  # content bytes of each parameter file in fp32 (each file also has a header)
    existing = 0
    final: list = []
    opt: list = []
    off_o = zero.offload_optimizer
    tail = (store.tier is Tier.NVME and store.dtype != torch.float32 and off_o.tier is Tier.NVME
            and zero.offload_param.max_in_cpu == 0 and off_o.ratio >= 1)
    if store.tier is Tier.NVME:
        compute = torch.empty((), dtype=store.dtype).element_size()
        for k, p in params.items():
            mp = managed(p)
            if mp is None:
                if k in trained or p.is_floating_point():
                    fp32.append(4 * part[k])  # adopted now, in fp32
            elif mp.home is store.nvme and not mp.unwritten:
                fp32.append(4 * part[k])
                existing += HEADER + 4 * part[k]
        # fp32 compute keeps the fp32 files (with alias mode they are removed once the optimizer file holds
        # the shards: counting them is conservative).
        final = [compute * part[k] for k in params if not (tail and k in trained)] if compute != 4 else fp32
    if off_o.tier is Tier.NVME:  # a file per sub-group: bounded here by a file per trained shard (see _room)
        moments, lowp = MOMENT_DTYPES[off_o.moments_dtype], store.dtype.itemsize if tail else 0
        opt = [state_nbytes(part[k], moments) + lowp * part[k] for k in trained]
    ppaths = zero.offload_param.paths if fp32 else ()
    opaths = off_o.paths if opt else ()
    fs: dict = {}  # st_dev -> {the first path on it (the optimizer's when both are), and its bytes}
    for k, path in enumerate(opaths):
        e = _filesystem(fs, path)
        e["opt"] += _room(opt, len(opaths))
        e["slots"].append(k)
    for path in ppaths:
        e = _filesystem(fs, path)
        e["fp32"] += _room(fp32, len(ppaths))
        e["final"] += _room(final, len(ppaths))
        # With several paths, which of them holds zero_init's files is not known here: none is counted.
        e["existing"] += existing if len(ppaths) == 1 else 0
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))  # ranks on this host share its disks
    out = []
    for e in fs.values():
        p_bytes = max(0, max(e["fp32"], e["final"] + e["opt"]) - e["opt"] - e["existing"]) if e["fp32"] else 0
        o_bytes = e["opt"]
        free = shutil.disk_usage(existing_ancestor(e["path"])).free
        out.append(DiskNeed(path=e["path"], param_bytes=p_bytes, optimizer_bytes=o_bytes, ranks=local, free=free,
                            optimizer_slots=tuple(e["slots"])))
        p_bytes, o_bytes = p_bytes * local, o_bytes * local
        if free < p_bytes + o_bytes:
            raise ConfigError("zero_optimization.offload_param.nvme_path" if p_bytes else
                              "zero_optimization.offload_optimizer.nvme_path",
                              f"{e['path']} has {free:,} bytes free, but the swap files of this host's ranks need "
                              f"{p_bytes + o_bytes:,} ({p_bytes:,} for parameters, {o_bytes:,} for the optimizer); "
                              "free space there or point nvme_path at a bigger disk")
    return tuple(out)


def _room(sizes: list, paths: int) -> int:
    """The most bytes one of `paths` directories can take for files of these content sizes, each with its
    header ([Note: several NVMe paths] in swap/swapper.py): all of them with one path; else a striped file's
    chunk (its share, rounded up to 4 KiB) and every file too small to stripe, wherever the turn puts it.
    Shards packed into larger sub-groups only stripe more, so a file per shard bounds the optimizer's."""
    if paths == 1:
        return sum(HEADER + n for n in sizes)
    return sum(HEADER + (-(-(-(-n // paths)) // 4096) * 4096 if n >= paths * swap_files.MIN_STRIPE else n)
               for n in sizes)


def _filesystem(fs: dict, path: str) -> dict:
    """The entry of path's filesystem in `fs` (by st_dev; an nvme_path is made when its swapper starts)."""
    dev = os.stat(existing_ancestor(path)).st_dev
    return fs.setdefault(dev, {"path": path, "fp32": 0, "final": 0, "existing": 0, "opt": 0, "slots": []})
