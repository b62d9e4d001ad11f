"""ParamStore: every managed parameter's shard, where it lives, and how it is gathered and released.

Three layers, as in the swap service (see shared/STYLE.md):
- `ManagedParam`: one parameter. Its module still owns the nn.Parameter;
  between uses `param.data` is a placeholder (see [Note: placeholder]) and
  the real values are this rank's 1/world shard, in RAM or in a swap file.
- `ParamStore`: all of a model's managed parameters, and each one's shard
  home (homes.py: the compute device's memory, host RAM or an NVMe swap
  file), with the swap context that moves NVMe shards.
- `PrefetchScheduler` (scheduler.py): decides which shards to read ahead.

[Note: placeholder]
A released parameter's `.data` is a 0-dim NaN expanded to the full shape: it
costs one element, keeps `param.shape` right for code that reads it, and any
accidental use outside a gather turns into NaN (a loss of NaN) rather than
plausible garbage. Autograd's AccumulateGrad accepts it, since the shape
matches; the gradient it produces is taken by `ParamStore.on_grad`. Each
placeholder has a storage of its own, so its address names its parameter
(`ParamStore.placeholder_owner`): that is how [Note: partitioned access] in
construct.py finds the parameter an op is really about.

[Note: gathered from the buffer]
A gather assembles the full parameter from the memory the shard is read
into: a pool buffer, the optimizer's state (a lent shard), or a RAM home's
tensor (ShardHome.gather). With several ranks that memory is all-gather's
input; with CUDA compute and page-locked pool buffers it is the source of
the host-to-device copy, on a side stream the host waits on alone
(`to_device`; other devices copy synchronously). Only one rank on the host
copies, since the buffer goes back to the pool once the gather returns. A
shard is converted first only to change dtype. The reuse cache keeps what
the gather made: with one rank the gathered value itself, with several a
copy of this rank's slice of it, both on the compute device. Holding pool
buffers while their parameters are gathered would save the one-rank copy,
but gathered parameters are not released in fetch order, so the buffers
they held could leave none for the fetch on the critical path (see [Note:
trace-based prefetch] in scheduler.py). That copy is 46 MB of forward
weights in the bf16 bench train model, about 21 ms of a 0.95 s step (2 %)
on the reference VM, most of it the page faults of the new tensor.

[Note: shard layout]
A parameter of numel n is flattened and zero-padded to world x ceil(n/world);
rank r owns elements [r x part, (r+1) x part). The padding is zero in the
weights, the gradients and Adam's moments, so it stays zero.
"""

from __future__ import annotations

import contextlib
import enum
import math
from dataclasses import dataclass
from typing import Protocol

import torch

from infinity.engine.comm import Comm
from infinity.engine.homes import NvmeHome, RamHome
from infinity.engine.plan import ShardSource
from infinity.engine.scheduler import PrefetchScheduler
from infinity.swap.tier import HOST, Tier


class ParamStatus(enum.Enum):
    """Whether a managed parameter's full value exists right now."""

    SHARDED = "sharded"
    """`param.data` is the placeholder; only this rank's shard exists (in its home tier): 1/world of the bytes."""
    GATHERED = "gathered"
    """`param.data` holds the full parameter in the compute dtype: numel x element size outside any pool."""


@dataclass(eq=False)
class ManagedParam:
    """One parameter partitioned over ranks (see [Note: shard layout])."""

    param: torch.nn.Parameter
    name: str
    index: int
    shape: torch.Size
    numel: int
    part: int
    """Elements per rank's shard, padding included."""
    persistent: bool = False
    """Small enough (stage3_param_persistence_threshold) or stage < 3: stays GATHERED."""
    status: ParamStatus = ParamStatus.GATHERED
    users: int = 0
    """Module forwards (and gathered_parameters blocks) currently using the full value."""
    home: object = None
    """Its ShardHome (homes.py): where the shard lives between uses."""
    shard: torch.Tensor | None = None
    """RAM homes: this rank's shard. NVMe: None (it is in the swap file)."""
    swap_dtype: torch.dtype | None = None
    """NVMe home: the dtype of its swap file (fp32 until initialize, then the compute dtype)."""
    unwritten: bool = False
    """Adopted while the store deferred writes (from_pretrained), and nothing has written its shard since."""
    reuse: torch.Tensor | None = None
    """The prefetch scheduler's copy of the shard, kept for a use within the reuse distance."""
    store: object = None
    """The ParamStore that manages it."""
    grad: torch.Tensor | None = None
    """fp32 view of this rank's gradient shard, inside the optimizer's group buffer."""
    trainable: bool = True
    """Optimized (has master weights, moments and a gradient); False for frozen parameters (PEFT's base
    weights), which keep only their shard on the parameter tier."""
    placeholder: torch.Tensor | None = None
    """While SHARDED: the tensor `param.data` was set to (see [Note: placeholder])."""

    def gathered(self, full: torch.Tensor) -> None:
        assert self.status is ParamStatus.SHARDED, f"{self.name}: gathered while {self.status.name}"
        self.param.data = full
        self.placeholder = None
        self.status = ParamStatus.GATHERED

    def released(self) -> None:
        assert self.status is ParamStatus.GATHERED, f"{self.name}: released while {self.status.name}"
        self.placeholder = placeholder(self.shape, self.param.dtype, self.param.device)
        self.param.data = self.placeholder
        self.status = ParamStatus.SHARDED

    def reassigned(self) -> bool:
        """SHARDED, but `param.data` is no longer the placeholder: user code ran `p.data = t`."""
        return (self.status is ParamStatus.SHARDED and self.placeholder is not None
                and self.param.untyped_storage().data_ptr() != self.placeholder.untyped_storage().data_ptr())


def placeholder(shape, dtype, device) -> torch.Tensor:
    """See [Note: placeholder]."""
    return torch.full((), float("nan"), dtype=dtype, device=device).expand(shape)


_COPY_STREAMS: dict = {}


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`t` on `device` (itself when it is there already); `t` may be reused as soon as this returns.

    See [Note: gathered from the buffer]: from page-locked host memory to CUDA
    the copy runs on a side stream, so the host waits for this copy only, not
    for the compute queued before it.
    """
    if t.device == device:
        return t
    if device.type != "cuda" or t.device.type != "cpu" or not t.is_pinned():
        return t.to(device)  # synchronous with respect to `t`
    stream = _COPY_STREAMS.get(device)
    if stream is None:
        stream = _COPY_STREAMS[device] = torch.cuda.Stream(device)
    compute = torch.cuda.current_stream(device)
    with torch.cuda.stream(stream):
        out = t.to(device, non_blocking=True)
    done = torch.cuda.Event()
    done.record(stream)
    compute.wait_event(done)  # kernels that use `out` run after the copy
    out.record_stream(compute)  # allocated on the side stream, used on the compute one
    done.synchronize()  # the source (a pool buffer) is released, or the state rewritten, once this returns
    return out


def managed(t) -> ManagedParam | None:
    return getattr(t, "_infinity", None)


class ZeroParamStatus(enum.Enum):
    """DeepSpeed's names for whether a ZeRO-3 parameter's full value exists (`param.ds_status`)."""

    AVAILABLE = 1
    NOT_AVAILABLE = 2
    INFLIGHT = 3


class PartitionedParameter(torch.nn.Parameter):
    """[Note: DeepSpeed's ZeRO-3 attributes]
    A stage-3 managed parameter is an nn.Parameter of this class, so scripts
    written for DeepSpeed find the attributes they test: `hasattr(p,
    "ds_id")` is how DeepSpeed-Chat and others decide to gather before they
    save. Each is read from the ManagedParam at the moment it is asked, so it
    is never stale:
    - ds_id: the registration index; ds_numel, ds_shape: the full size;
    - ds_status: AVAILABLE while the full value is in `param.data`, else
      NOT_AVAILABLE;
    - ds_tensor: this rank's partition: the shard itself in a RAM home, or,
      in an NVMe home (the shard is in the swap file), a meta tensor of the
      partition's shape, which any read of values refuses.
    The class is set in ParamStore.adopt on a plain nn.Parameter only (a
    subclass such as a quantized one keeps its own class)."""

    @property
    def ds_id(self) -> int:
        return self._infinity.index

    @property
    def ds_numel(self) -> int:
        return self._infinity.numel

    @property
    def ds_shape(self) -> torch.Size:
        return self._infinity.shape

    @property
    def ds_status(self) -> ZeroParamStatus:
        return (ZeroParamStatus.AVAILABLE if self._infinity.status is ParamStatus.GATHERED
                else ZeroParamStatus.NOT_AVAILABLE)

    @property
    def ds_persist(self) -> bool:
        return self._infinity.persistent

    @property
    def ds_tensor(self) -> torch.Tensor:
        mp = self._infinity
        if mp.shard is not None:
            return mp.shard
        return torch.empty(mp.part, dtype=mp.swap_dtype or self.dtype, device="meta")


class OptimizerLink(Protocol):
    """What a ParamStore asks of the optimizer that owns its master weights (ShardedAdam)."""

    pending: object
    """Its unfinished last step (deferred.DeferredStep), or None."""

    def take_grad(self, mp: ManagedParam, grad: torch.Tensor) -> None:
        """mp's full gradient of this backward, as autograd made it (the optimizer reduces it to its owner)."""

    def lend(self, mp: ManagedParam, *, backward: bool):
        """mp's master weights from the group state (a future), or None."""

    def need(self, mp: ManagedParam) -> None:
        """Before a read of mp's shard: finish the pending step's groups of mp."""

    def advance(self) -> None:
        """Step what the pending step has read, without waiting."""


class ParamStore:
    """The shards of every managed parameter of one rank, and gather / release / write-back."""

    def __init__(self, comm: Comm, *, tier: Tier, dtype: torch.dtype, device: torch.device, persistence: int,
                 stage: int, swap=None, max_in_cpu: int = 0, max_live: int = 1 << 62, prefetch_bucket: int = 0,
                 reuse_distance: int = 0):
        """swap: a SwapContext-like (.pool, .swapper) for an NVMe tier, which then comes with a PrefetchScheduler
        of prefetch_bucket elements ahead and reuse_distance (stage3_prefetch_bucket_size,
        stage3_max_reuse_distance). max_live: stage3_max_live_parameters."""
        self.comm = comm
        self.tier = tier
        """Where shards go (offload_param.device); with NVMe, up to max_in_cpu elements stay in host RAM."""
        self.ram = RamHome(Tier.DEVICE, device) if tier is Tier.DEVICE else RamHome(Tier.CPU, HOST)
        self.nvme = NvmeHome(self) if tier is Tier.NVME else None
        self.max_in_cpu = max_in_cpu if tier is Tier.NVME else 0
        self.in_cpu = 0  # shard elements NVMe-tier parameters keep in host RAM (offload_param.max_in_cpu)
        self.dtype = dtype
        """The compute dtype: gathered parameters and (after initialize) the shards."""
        self.device = device
        self.persistence = persistence
        self.stage = stage
        self.swap = swap  # SwapContext-like: .pool, .swapper (tier nvme only)
        self.scheduler = PrefetchScheduler(self, prefetch_bucket, reuse_distance) if swap is not None else None
        self.params: list[ManagedParam] = []
        self.alias = None  # the OptimizerSliceReader, from alias_to() on (alias.py)
        self.shard_source = ShardSource.HOME
        """Where trained shards are read from between uses (the plan's; OPTIMIZER_FILE from alias_to() on)."""
        self.max_live = max_live
        self.live_elements = 0
        self.peak_live_elements = 0
        self.bytes_gathered = 0
        self.frozen = False  # from finish_setup() (end of initialize): the optimizer owns the master weights
        self._optimizer: OptimizerLink | None = None  # attach(): who takes the gradients and owns the masters
        self.first_use: dict[int, int] = {}  # mp.index -> its place in the order forwards first gathered them
        self.defer_writes = False  # inside writes_deferred() (from_pretrained builds): adopt() skips writing shards
        self.access = None  # construct.PartitionedAccess while the model is being built (zero_init -> initialize)
        self._closed = False
        self._staged: list = []  # [ManagedParam, full value, dirty]: see [Note: partitioned access]
        self._placeholders: dict[int, ManagedParam] = {}  # placeholder storage address -> its parameter

    # ------------------------------------------------------------ wiring

    def attach(self, optimizer: "OptimizerLink") -> None:
        """From now on `optimizer` takes this store's gradients and may lend or stage shards (ShardedAdam, at
        its construction)."""
        self._optimizer = optimizer

    def set_prefetch_bucket(self, prefetch_bucket: int) -> None:
        """stage3_prefetch_bucket_size as initialize resolved it ("auto" is filled in from the model, which a
        store made under zero_init did not know yet)."""
        if self.scheduler is not None:
            self.scheduler.resize(prefetch_bucket)

    def begin_access(self, access) -> None:
        """Parameters are accessed through `access` (a construct.PartitionedAccess) while the model is built."""
        self.access = access
        access.__enter__()

    def end_access(self) -> None:
        """Construction is over (initialize, or a failed zero_init block): the access mode ends."""
        if self.access is not None:
            self.access.close()
            self.access = None

    @contextlib.contextmanager
    def writes_deferred(self):
        """Inside: adopt() keeps no values, the shards' values are loaded next (see [Note: streamed
        from_pretrained] in pretrained.py)."""
        self.defer_writes = True
        try:
            yield
        finally:
            self.defer_writes = False

    def finish_setup(self) -> None:
        """The end of initialize: the optimizer owns the master weights, the placeholders take the compute dtype
        and the parameter pool shrinks to the training shards ([Note: the parameter pool shrinks after
        setup])."""
        self.frozen = True
        self.placeholders_to_compute_dtype()
        self.fit_pool()

    def reset_peak(self) -> None:
        """Start a new peak of live elements (each step report has its own)."""
        self.peak_live_elements = self.live_elements

    @property
    def pending(self):
        """The optimizer's unfinished last step (a deferred.DeferredStep), or None."""
        return self._optimizer.pending if self._optimizer is not None else None

    def lend(self, mp: ManagedParam, *, backward: bool):
        """mp's shard from the optimizer's state instead of a read, or None (see [Note: backward reads from the
        state] in optimizer.py)."""
        return self._optimizer.lend(mp, backward=backward) if self._optimizer is not None else None

    def advance(self) -> None:
        """Let the optimizer's unfinished step go on with what it has read, without waiting."""
        if self._optimizer is not None:
            self._optimizer.advance()

    # ------------------------------------------------------------ partition

    def adopt(self, param: torch.nn.Parameter, name: str) -> ManagedParam:
        """Take over a parameter: keep this rank's shard of its current value, release the rest."""
        if managed(param) is not None:
            return managed(param)
        if not param.is_floating_point():
            raise ValueError(f"infinity: parameter {name} has dtype {param.dtype}; only floating-point parameters "
                             "can be partitioned")
        if param.dtype == torch.float64:  # it would be gathered in the compute dtype, its master kept in fp32
            raise ValueError(f"infinity: parameter {name} is float64; the engine keeps fp32 master weights and "
                             "computes in fp32, bf16 or fp16, so its float64 values would silently become float32: "
                             "cast the model to float32 (model.float()) before initialize, or build it under "
                             "zero_init with torch.float32 as the default dtype")
        if param.is_meta:
            raise ValueError(f"infinity: parameter {name} is on the meta device, so it has no values to partition; "
                             "zero_init builds real values one module at a time, so build the model without "
                             "torch.device('meta') / init_empty_weights (from_pretrained under zero_init streams "
                             "the weights itself, if transformers was imported before the zero_init block began)")
        numel = param.numel()
        part = max(1, math.ceil(numel / self.comm.world))
        mp = ManagedParam(param=param, name=name, index=len(self.params), shape=param.shape, numel=numel, part=part,
                          persistent=self.stage < 3 or numel <= self.persistence, store=self)
        mp.home = self._home_for(mp)
        self._store_shard(mp, self.shard_of(mp, param))
        param._infinity = mp
        if self.stage == 3 and type(param) is torch.nn.Parameter:
            param.__class__ = PartitionedParameter  # DeepSpeed's ds_* attributes ([Note: DeepSpeed's ZeRO-3 attributes])
        self.params.append(mp)
        if mp.persistent:
            self.live_elements += numel
            self.peak_live_elements = max(self.peak_live_elements, self.live_elements)
        else:
            self._release(mp)
        return mp

    def trained(self) -> list[ManagedParam]:
        """The managed parameters the optimizer holds state for (checkpoints save these)."""
        return [mp for mp in self.params if mp.trainable]

    def placeholder_owner(self, ptr: int) -> ManagedParam | None:
        """The SHARDED parameter whose placeholder lives at storage address `ptr` (see [Note: placeholder])."""
        return self._placeholders.get(ptr)

    def _release(self, mp: ManagedParam) -> None:
        mp.released()
        self._placeholders[mp.placeholder.untyped_storage().data_ptr()] = mp

    def placeholders_to_compute_dtype(self) -> None:
        """At initialize: every SHARDED parameter's placeholder takes the compute dtype, the dtype its gathered
        value has from now on. Code that reads `p.dtype` between uses sees what forward will see: peft's LoRA
        casts its input to the adapter weight's dtype before the adapter's own forward gathers it (see
        [Note: placeholder])."""
        for mp in self.params:
            if mp.status is ParamStatus.SHARDED and mp.placeholder is not None and mp.placeholder.dtype != self.dtype:
                self._placeholders.pop(mp.placeholder.untyped_storage().data_ptr(), None)
                mp.placeholder = placeholder(mp.shape, self.dtype, mp.param.device)
                mp.param.data = mp.placeholder
                self._placeholders[mp.placeholder.untyped_storage().data_ptr()] = mp

    def fit_pool(self) -> None:
        """[Note: the parameter pool shrinks after setup]
        The NVMe parameter pool's buffers are sized for fp32 shards, the dtype a model is built in (its initial
        values become the fp32 master weights). Once initialize has made the masters, every shard the pool
        reads or writes is in its stored dtype, the compute dtype for trained shards in bf16/fp16 runs: half
        the pool would sit unused through training, the phase that also holds activations and gradients. So at
        the end of initialize the buffers shrink to the largest shard in its stored dtype (154 -> 77 MiB a
        buffer for gpt-125m's tied embedding). The peak then is the larger of setup (fp32 pool, no
        activations) and training (half the pool); the planner counts both (tools/plan/cost.py)."""
        if self.swap is None:
            return
        need = max((mp.part * (mp.swap_dtype or self.dtype).itemsize for mp in self.params
                    if mp.home.tier is Tier.NVME), default=1)
        if need < self.swap.pool.size and self.swap.pool.in_use == 0:  # a held buffer (none is, here) keeps it
            self.swap.pool.shrink(need)

    def _gather_into(self, mp: ManagedParam, full: torch.Tensor) -> None:
        self._placeholders.pop(mp.placeholder.untyped_storage().data_ptr(), None)
        mp.gathered(full)

    # ------------------------------------------- construction (see construct.py)

    def shard_of(self, mp: ManagedParam, full: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a full value, zero-padded to `part` elements (see [Note: shard layout])."""
        flat = full.detach().reshape(-1)
        lo, hi = self.comm.rank * mp.part, min(mp.numel, (self.comm.rank + 1) * mp.part)
        shard = torch.zeros(mp.part, dtype=mp.param.dtype, device=HOST)
        if hi > lo:
            shard[:hi - lo].copy_(flat[lo:hi])
        return shard

    def staged_full(self, mp: ManagedParam, *, need_values: bool, keep_others: bool = False) -> torch.Tensor:
        """The full value of a SHARDED parameter for an op outside any gather (see [Note: partitioned access]).

        One parameter is staged at a time: staging another writes the previous one back first, unless
        keep_others (an op over two parameters; the caller settles right after).
        """
        for entry in self._staged:
            if entry[0] is mp:
                return entry[1]
        if not keep_others:
            self.settle_staged()
        if need_values:
            # On the device the module was built on, like a plain build's value (and its RNG).
            full = self.gather_full(mp, scheduled=False, dtype=mp.param.dtype).to(mp.param.device, copy=True)
        else:
            full = torch.empty(mp.shape, dtype=mp.param.dtype, device=mp.param.device)
        self._staged.append([mp, full, False])
        return full

    def mark_staged_dirty(self, mp: ManagedParam) -> None:
        for entry in self._staged:
            if entry[0] is mp:
                entry[2] = True

    def settle_staged(self) -> None:
        """Write every staged, changed full value back as this rank's shard, and drop them."""
        entries, self._staged = self._staged, []
        for mp, full, dirty in entries:
            if dirty:
                self.write_shard(mp, self.shard_of(mp, full), wait=True, keep_dtype=True)
        self._staged = []

    def _write_back_staged(self, mp: ManagedParam) -> None:
        """A reader of mp's shard must see a staged change: write it back (write_shard drops the entry)."""
        for entry in list(self._staged):
            if entry[0] is mp and entry[2]:
                self.write_shard(mp, self.shard_of(mp, entry[1]), wait=True, keep_dtype=True)

    def drop_staged(self, mps, *, clean_only: bool = False) -> None:
        """Forget staged values of these parameters (after a failed op: only the clean ones it staged)."""
        ids = {id(mp) for mp in mps}
        self._staged = [e for e in self._staged if id(e[0]) not in ids or (clean_only and e[2])]

    def adopt_reassigned(self, mps) -> None:
        """Re-partition parameters whose `.data` user code replaced (`p.data = t`; see [Note: partitioned
        access]). Before initialize the new value becomes the shard; after, it would be lost, so it raises."""
        for mp in mps:
            if not mp.reassigned():
                continue
            new = mp.param.data
            if self.frozen:
                raise RuntimeError(f"infinity: {mp.name}.data was assigned after initialize(); the optimizer holds "
                                   "this parameter's fp32 master weights and would never see the new value. Assign "
                                   "it inside zero_init or before initialize(), or load it with load_checkpoint")
            if tuple(new.shape) != tuple(mp.shape) or not new.is_floating_point():
                mp.param.data = mp.placeholder
                raise ValueError(f"infinity: {mp.name}.data was assigned a {new.dtype} tensor of shape "
                                 f"{tuple(new.shape)}, but the partitioned parameter is floating point with shape "
                                 f"{tuple(mp.shape)}; a partitioned parameter keeps its shape, so build the module "
                                 "with the new shape instead")
            self._staged = [e for e in self._staged if e[0] is not mp]  # the assignment is newer
            shard = self.shard_of(mp, new.to(mp.placeholder.dtype))
            self.write_shard(mp, shard, wait=True, keep_dtype=True)
            mp.param.data = mp.placeholder

    def freeze(self, mp: ManagedParam) -> None:
        """Not optimized: no master weights or moments; its shard moves to the compute dtype, and stays."""
        mp.trainable = False
        if self._shard_dtype(mp) != self.dtype:
            self.write_shard(mp, self.read_shard(mp, torch.float32), wait=True)

    def _shard_dtype(self, mp: ManagedParam):
        return mp.home.dtype(mp)

    def _home_for(self, mp: ManagedParam):
        """NVMe, unless the host-RAM allowance (offload_param.max_in_cpu, in registration order) has room."""
        if self.nvme is None:
            return self.ram
        if self.in_cpu + mp.part <= self.max_in_cpu:
            self.in_cpu += mp.part
            return self.ram
        self.max_in_cpu = self.in_cpu  # a prefix: once one shard goes to NVMe, every later one does
        return self.nvme

    def homes(self) -> list:
        """The shard homes in use."""
        return [h for h in (self.ram, self.nvme) if h is not None]

    def flush(self) -> None:
        """Wait until every shard write started so far has landed."""
        for home in self.homes():
            home.flush()

    def sync_persistent(self) -> None:
        """Before initialize, a persistent parameter's full `param.data` is its value (user code may have
        written it in place or reassigned it); make its shard agree before the optimizer reads it."""
        for mp in self.params:
            if mp.persistent and mp.status is ParamStatus.GATHERED:
                self.write_shard(mp, self.shard_of(mp, mp.param.data), wait=True, keep_dtype=True)

    def unwritten(self, mp: ManagedParam) -> bool:
        """Adopted while defer_writes was set, and nothing has written its shard since."""
        return mp.unwritten

    def _store_shard(self, mp: ManagedParam, shard: torch.Tensor) -> None:
        if self.defer_writes:  # its values are about to be loaded (see [Note: streamed from_pretrained])
            mp.unwritten = True
            mp.home.defer(mp, shard)
        else:
            mp.home.keep(mp, shard)

    def alias_to(self, reader) -> None:
        """Trainable shards are read from the optimizer's files from now on, in reader.dtype (see [Note: fp32
        shards live in the optimizer file] and [Note: compute-dtype shards in the optimizer file]); their own
        swap files are deleted. Frozen ones keep theirs."""
        for mp in self.params:
            if mp.trainable:
                mp.home.forget(mp)
                mp.swap_dtype = reader.dtype
        self.alias = reader
        self.shard_source = ShardSource.OPTIMIZER_FILE

    def retain(self, keep: set) -> None:
        """Forget managed parameters the model no longer holds (e.g. replaced by a tied weight)."""
        for mp in [mp for mp in self.params if id(mp.param) not in keep]:
            if mp.placeholder is not None:
                self._placeholders.pop(mp.placeholder.untyped_storage().data_ptr(), None)
            mp.home.forget(mp)
            if mp.persistent:
                self.live_elements -= mp.numel
            del mp.param._infinity
            mp.param.data = torch.empty(0, dtype=mp.param.dtype)
        self.params = [mp for mp in self.params if id(mp.param) in keep]

    # --------------------------------------------------------------- shards

    def read_shard(self, mp: ManagedParam, dtype=None) -> torch.Tensor:
        """This rank's shard as a tensor of its own (a copy for nvme; the stored tensor for RAM tiers), outside
        the prefetch trace."""
        if not self._stored(mp):
            return torch.zeros(mp.part, dtype=dtype or mp.home.dtype(mp))
        if self.pending is not None:
            self._optimizer.need(mp)
        return mp.home.read(mp, dtype)

    def _stored(self, mp: ManagedParam) -> bool:
        """Before a read of mp's shard: a staged change of it is written back first. False while nothing has
        written it (uninitialised memory in a plain build; readers get zeros)."""
        if self._staged:
            self._write_back_staged(mp)
        return not mp.unwritten

    def write_shard(self, mp: ManagedParam, values: torch.Tensor, *, wait: bool = False, keep_dtype: bool = False):
        """Replace this rank's shard with `values` (part elements), stored in the compute dtype.

        keep_dtype keeps the shard's current dtype (fp32 until initialize()
        has made the master weights from it).
        """
        fut = mp.home.write(mp, values, mp.home.dtype(mp) if keep_dtype else self.dtype)
        mp.unwritten = False
        if self._staged:  # a newer shard: a staged full value of mp is stale now
            self.drop_staged([mp])
        return fut.wait() if wait and fut is not None else fut

    def write_piece(self, mp: ManagedParam, lo: int, values: torch.Tensor) -> None:
        """Replace elements [lo, lo + len(values)) of a RAM home's shard, in the compute dtype: a piece of a shard
        split over sub-groups ([Note: a large shard is split over sub-groups of its own] in optimizer.py)."""
        mp.home.write_piece(mp, lo, values, self.dtype)
        mp.unwritten = False
        if self._staged:
            self.drop_staged([mp])

    # -------------------------------------------------------- gather/release

    def gather_full(self, mp: ManagedParam, *, scheduled: bool = True, dtype=None) -> torch.Tensor:
        """The full parameter on the compute device (a new tensor unless GATHERED), in the compute dtype
        after initialize, and in the dtype it was built in before (construction keeps fp32 values exact)."""
        if mp.status is ParamStatus.GATHERED:
            return mp.param.data
        if dtype is None:
            dtype = self.dtype if self.frozen else mp.param.dtype
        full = self._padded_full(mp, dtype, scheduled=scheduled)
        self.bytes_gathered += mp.numel * full.element_size()
        return full[:mp.numel].view(mp.shape)

    def _padded_full(self, mp: ManagedParam, dtype, *, scheduled: bool) -> torch.Tensor:
        """Every rank's shard of mp, concatenated, on the compute device (see [Note: gathered from the buffer])."""
        if not self._stored(mp):
            return self._assemble(torch.zeros(mp.part, dtype=dtype), True)
        if self.pending is not None:
            self._optimizer.need(mp)
        return mp.home.gather(mp, dtype, self._assemble, scheduled=scheduled)

    def _assemble(self, shard: torch.Tensor, owned: bool) -> torch.Tensor:
        """The padded full parameter from this rank's shard; aliases `shard` only if `owned` (ShardHome.gather)."""
        moved = to_device(shard, self.device)
        if self.comm.world > 1:
            return self.comm.all_gather(moved)
        return moved if owned or moved is not shard else shard.clone()

    def own_slice(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's shard of a padded full value, as a tensor of its own (the value itself with one rank)."""
        if self.comm.world == 1:
            return full
        part = full.numel() // self.comm.world
        return full[self.comm.rank * part:(self.comm.rank + 1) * part].clone()

    def use(self, mp: ManagedParam, *, scheduled: bool = True) -> None:
        """One more user of the full value; gathers it on the first. Fetches outside forward/backward
        (gathered_parameters) pass scheduled=False, so that they stay out of the prefetch trace."""
        if scheduled and self.frozen:
            self.first_use.setdefault(mp.index, len(self.first_use))
        if mp.users == 0 and mp.status is ParamStatus.SHARDED:
            self.adopt_reassigned([mp])
            self._check_placeholder(mp)
            self._gather_into(mp, self.gather_full(mp, scheduled=scheduled))
            self.live_elements += mp.numel
            self.peak_live_elements = max(self.peak_live_elements, self.live_elements)
        mp.users += 1

    def _check_placeholder(self, mp: ManagedParam) -> None:
        """An in-place write that torch lets through on a placeholder (fill_, copy_ of a scalar) changes its
        one element; after initialize nothing could keep it, so it is an error rather than a lost value."""
        if self.frozen and mp.placeholder is not None and mp.placeholder.device == HOST:
            # (On an accelerator the check would sync the stream on every gather, so it is skipped there.)
            value = mp.placeholder.as_strided((), ()).item()
            if value == value:  # not NaN
                mp.placeholder.as_strided((), ()).fill_(float("nan"))
                raise RuntimeError(f"infinity: {mp.name} was written in place after initialize(), outside any "
                                   "gather; the optimizer holds its fp32 master weights, so the write cannot be kept. "
                                   "Write parameters inside zero_init or before initialize(), or load them with "
                                   "load_checkpoint")

    def unuse(self, mp: ManagedParam) -> None:
        """One user fewer; the last one releases it (unless persistent)."""
        assert mp.users > 0, f"{mp.name}: unuse without use"
        mp.users -= 1
        if mp.users == 0 and not mp.persistent and mp.status is ParamStatus.GATHERED:
            self._release(mp)
            self.live_elements -= mp.numel

    def refresh_persistent(self) -> None:
        """After a step: re-gather the parameters that stay gathered from their new shards."""
        for mp in self.params:
            if mp.persistent or mp.status is ParamStatus.GATHERED:
                mp.param.data = self._fresh(mp)

    def _fresh(self, mp: ManagedParam) -> torch.Tensor:
        return self._padded_full(mp, self.dtype, scheduled=False)[:mp.numel].view(mp.shape)

    # ----------------------------------------------------------------- grads

    def on_grad(self, param: torch.nn.Parameter) -> None:
        """post-accumulate-grad hook: hand the full gradient to the optimizer, which takes it to its owner rank
        (see [Note: gradient buckets] in buckets.py)."""
        mp = managed(param)
        g = param.grad
        param.grad = None
        if g is None or self._optimizer is None or not mp.trainable:
            return  # a parameter outside every optimizer group is not trained (see [Note: parameter groups])
        self._optimizer.take_grad(mp, g)

    def swap_open(self) -> bool:
        """False once closed (an nvme store's swap files are gone)."""
        return not self._closed

    def close(self) -> None:
        self._closed = True
        if self.access is not None:
            self.access.active = False
        if self.scheduler is not None:
            self.scheduler.drain()
        if self.swap is not None:
            self.swap.close()
            self.swap = None
