"""The swap config as typed, frozen dataclasses, with DeepSpeed's key names.

Each field's docstring says what it does. Ranges live in `metadata` and are
checked by `infinity.config.load` before anything touches the disk. Keys that
DeepSpeed accepts but `infinity` does not use yet are listed in
`DEEPSPEED_ACCEPTED`: a config copied from DeepSpeed loads, and each such key
is reported once as ignored.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from infinity.config.tier import Tier


def spec(default, *, low=None, high=None, choices=None, kind=None, default_factory=None):
    """A field with its checks: numeric bounds, allowed strings, or an explicit kind."""
    meta = {"low": low, "high": high, "choices": choices, "kind": kind}
    if default_factory is not None:
        return field(default_factory=default_factory, metadata=meta)
    return field(default=default, metadata=meta)


def _paths(first: str | None, listed: tuple) -> tuple[str, ...]:
    if listed and listed[0] == first:  # a nvme_path replaced after loading (one string) wins over the list
        return tuple(listed)
    return (first,) if first else ()


@dataclass(frozen=True, kw_only=True, slots=True)
class OffloadParamConfig:
    """zero_optimization.offload_param: where fp16/bf16 parameter partitions live (stage 3 only)."""

    device: str = spec("none", choices=("none", "cpu", "nvme"))
    """none: on the device; cpu: pinned host memory; nvme: swap files under nvme_path."""
    nvme_path: str | None = spec(None, kind="path")
    """Directory for parameter swap files (device=nvme). Must exist, be writable and support O_DIRECT. A list
    of directories (one per disk) places the files across them: see [Note: several NVMe paths] in
    swap/swapper.py. Loaded, this is the first of them; `paths` has all."""
    nvme_path_list: tuple = field(default=(), metadata={"internal": True})
    """Every directory nvme_path listed, in order (empty when it was one string)."""
    buffer_count: int = spec(5, low=1, high=1 << 16)
    """Number of pool buffers for parameter swapping."""
    buffer_size: int = spec(100_000_000, low=1, high=1 << 40)
    """Elements per pool buffer; must hold the largest parameter partition."""
    max_in_cpu: int = spec(0, low=0, high=1 << 50)
    """With device nvme: this rank's first max_in_cpu shard elements (registration order) stay in host RAM, the
    rest go to NVMe. DeepSpeed's default is 1e9, which keeps a model under 1e9 parameters per rank entirely in
    RAM; infinity's default 0 puts every shard on NVMe, as device nvme says."""
    pin_memory: bool = spec(False)
    """Page-lock the buffers (cudaHostRegister) for asynchronous device copies."""

    @property
    def tier(self) -> Tier:
        """`device`, parsed."""
        return Tier(self.device)

    @property
    def paths(self) -> tuple[str, ...]:
        """Every directory the swap files go to: nvme_path's list, or nvme_path alone."""
        return _paths(self.nvme_path, self.nvme_path_list)


@dataclass(frozen=True, kw_only=True, slots=True)
class OffloadOptimizerConfig:
    """zero_optimization.offload_optimizer: where fp32 master weights and Adam moments live."""

    device: str = spec("none", choices=("none", "cpu", "nvme"))
    """none: on the device; cpu: host memory; nvme: swap files under nvme_path."""
    nvme_path: str | None = spec(None, kind="path")
    """Directory for optimizer swap files (device=nvme), or a list of them, one per disk (as offload_param's)."""
    nvme_path_list: tuple = field(default=(), metadata={"internal": True})
    """Every directory nvme_path listed, in order (empty when it was one string)."""
    buffer_count: int = spec(4, low=1, high=1 << 16)
    """Pool buffers for the optimizer swapper (at least 3 to overlap read, Adam and write)."""
    pin_memory: bool = spec(False)
    """Page-lock the buffers."""
    pipeline_read: bool = spec(False)
    """Read the next sub-group while Adam runs on this one."""
    pipeline_write: bool = spec(False)
    """Write the previous sub-group while Adam runs on this one."""
    fast_init: bool = spec(False)
    """DeepSpeed: skip writing initial state through the swapper (accepted; state is always written)."""
    moments_dtype: str = spec("fp32", choices=("fp32", "bf16", "int8"))
    """How Adam's exp_avg and exp_avg_sq are stored and swapped (infinity only; the master weights stay fp32).
    bf16 halves their bytes: 8 B of state per parameter instead of 12. int8 stores each in 8-bit blocks
    ([Note: 8-bit moments] in optim/moments8.py): about 6 B per parameter, so NVMe moves half as much per step
    and holds twice the model. Checkpoints hold the moments' values (fp32 for int8, exact). See the README's
    "Smaller optimizer state" for when to use each."""
    moments_rounding: str = spec("stochastic", choices=("nearest", "stochastic"))
    """With moments_dtype bf16 or int8: how new moments are rounded. stochastic (seeded, reproducible) keeps
    the second moment decaying; nearest-even stalls it (see [Note: bf16 moments] in native/cpu/adam.cpp)."""
    ratio: float = spec(1.0, low=0.0, high=1.0)
    """Fraction of the optimizer's sub-groups to offload (DeepSpeed's Twin-Flow; stage 3 with device cpu): the first
    int(ratio x count) sub-groups go to the CPU, the rest stay on the compute device and are stepped there."""

    @property
    def tier(self) -> Tier:
        """`device`, parsed."""
        return Tier(self.device)

    @property
    def paths(self) -> tuple[str, ...]:
        """Every directory the swap files go to: nvme_path's list, or nvme_path alone."""
        return _paths(self.nvme_path, self.nvme_path_list)


@dataclass(frozen=True, kw_only=True, slots=True)
class ZeroConfig:
    """zero_optimization: partitioning stage, offload targets, and bucket sizes."""

    stage: int = spec(0, low=0, high=3)
    """0: off; 1: optimizer state partitioned; 2: + gradients; 3: + parameters."""
    offload_param: OffloadParamConfig = spec(None, default_factory=OffloadParamConfig)
    """Parameter offload (stage 3 only)."""
    offload_optimizer: OffloadOptimizerConfig = spec(None, default_factory=OffloadOptimizerConfig)
    """Optimizer-state offload."""
    sub_group_size: int = spec(1_000_000_000, low=1, high=1 << 50)
    """Elements per optimizer sub-group: the unit the optimizer swapper moves."""
    stage3_prefetch_bucket_size: int = spec(50_000_000, low=0, high=1 << 50)
    """Parameter elements prefetched ahead of use."""
    stage3_max_live_parameters: int = spec(1_000_000_000, low=0, high=1 << 50)
    """Most parameter elements gathered at once."""
    stage3_max_reuse_distance: int = spec(1_000_000_000, low=0, high=1 << 50)
    """Keep a gathered parameter if it is reused within this many elements of compute."""
    stage3_param_persistence_threshold: int = spec(100_000, low=0, high=1 << 50)
    """Parameters smaller than this stay gathered."""
    reduce_bucket_size: int = spec(500_000_000, low=0, high=1 << 50)
    """Elements per gradient reduce-scatter bucket (0: one parameter per bucket)."""
    overlap_comm: bool = spec(False)
    """Overlap gradient communication with backward."""
    contiguous_gradients: bool = spec(True)
    """Copy gradients into one contiguous buffer as they are produced."""
    cpu_offload: bool = spec(False)
    """DeepSpeed's older switch for offload_optimizer.device = "cpu" (stages 1-2)."""
    stage3_gather_16bit_weights_on_model_save: bool = spec(False)
    """At stage 3, engine.save_16bit_model gathers and saves the model only when this is true (as DeepSpeed)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Fp16Config:
    """fp16: half precision with dynamic (loss_scale = 0) or static loss scaling."""

    enabled: bool = spec(False)
    """Train in fp16 with fp32 master weights."""
    loss_scale: float = spec(0.0, low=0.0)
    """0 for dynamic loss scaling, else the fixed scale."""
    initial_scale_power: int = spec(16, low=0, high=64)
    """Dynamic scaling starts at 2**initial_scale_power."""
    loss_scale_window: int = spec(1000, low=1)
    """Clean steps before the scale doubles."""
    hysteresis: int = spec(2, low=1)
    """Overflows tolerated before the scale halves."""
    min_loss_scale: float = spec(1.0, low=1e-30)
    """The scale never drops below this."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Bf16Config:
    """bf16: bfloat16 compute with fp32 master weights; no loss scaling needed."""

    enabled: bool = spec(False)
    """Train in bf16."""


@dataclass(frozen=True, kw_only=True, slots=True)
class OptimizerParams:
    """optimizer.params: Adam/AdamW hyperparameters."""

    lr: float = spec(1e-3, low=0.0)
    """Learning rate."""
    betas: tuple = spec((0.9, 0.999), kind="betas")
    """(beta1, beta2), each in [0, 1)."""
    eps: float = spec(1e-8, low=0.0)
    """Added to the denominator."""
    weight_decay: float = spec(0.0, low=0.0)
    """Decoupled (AdamW) or L2 (Adam) weight decay."""
    bias_correction: bool = spec(True)
    """Apply Adam's bias correction."""
    adam_w_mode: bool = spec(True)
    """DeepSpeed's switch between AdamW (True) and Adam with L2 (False) for type Adam."""
    amsgrad: bool = spec(False)
    """Not supported: must be false (accepted so that DeepSpeed configs that spell it out load)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class OptimizerConfig:
    """optimizer: which optimizer and its params."""

    type: str = spec("AdamW", choices=("Adam", "AdamW"))
    """Adam or AdamW (case-insensitive on input)."""
    params: OptimizerParams = spec(None, default_factory=OptimizerParams)
    """Hyperparameters."""


@dataclass(frozen=True, kw_only=True, slots=True)
class AioConfig:
    """aio: the asynchronous I/O engine (infinity.io.AsyncIO)."""

    block_size: int = spec(1 << 20, low=4096, high=1 << 30)
    """Bytes per I/O piece; a multiple of 4096."""
    queue_depth: int = spec(32, low=1, high=4096)
    """Pieces in flight per worker thread."""
    intra_op_parallelism: int = spec(1, low=1, high=256)
    """Worker threads (DeepSpeed's older name: thread_count)."""
    single_submit: bool = spec(False)
    """Submit one piece per syscall instead of a batch (as DeepSpeed's)."""
    overlap_events: bool = spec(True)
    """Refill the queue as pieces complete; False waits for a whole batch before the next (as DeepSpeed's)."""
    backend: str = spec("auto", choices=("auto", "io_uring", "libaio", "threads", "python"))
    """infinity's addition: which AsyncIO backend to use."""


@dataclass(frozen=True, kw_only=True, slots=True)
class InfinityConfig:
    """infinity: our own settings, kept apart from DeepSpeed's sections."""

    checksums: bool = spec(True)
    """Checksum every swapped partition and verify it on read."""
    direct_io: bool = spec(True)
    """Use O_DIRECT for swap files (turn off on filesystems without it, e.g. old tmpfs)."""
    mmap_threshold: int = spec(1 << 16, low=1 << 12, high=1 << 25, kind="size")
    """glibc's M_MMAP_THRESHOLD (and a trim threshold of twice it) once initialize() returns; construction and
    setup use 64 KiB. Host blocks at least this big are mapped on allocation and returned at free; smaller ones
    come from the heap, which keeps up to twice this much free at its top. 64 KiB keeps peak RSS at what is
    alive; up to 32 MiB (glibc's own ceiling) trades host memory for speed: a new tensor below it reuses pages
    already faulted in (see [Note: glibc's mmap threshold]). Process-wide: the last initialize() sets it."""
    memory_budget: int | None = spec(None, low=1 << 20, kind="size")
    """Host-memory budget in bytes (or "8GiB"); the planner sizes the pools to fit it."""
    trace_path: str | None = spec(None, kind="str")
    """At engine close, write a Chrome-trace JSON here: forward, backward, each optimizer step, and each sub-group's
    read, Adam and write (`.rank<R>` appended with several ranks). Parameter fetches are not in it. The first
    500,000 spans are kept (about 50 MB); a run that ends without close() writes none."""
    leftovers: str = spec("clear", choices=("clear", "reuse", "error"))
    """What to do with swap files left by a crashed run."""
    remove_swap_at_exit: bool = spec(True)
    """Remove this process's swap files when it exits without engine.close(): an exception, sys.exit or SIGTERM
    (see [Note: swap files die with the process]). false leaves them for inspection or for `leftovers: reuse`."""
    step_during_backward: bool = spec(True)
    """Step each optimizer sub-group as soon as its gradients are final, overlapping backward. With
    gradient_clipping or fp16, which need every gradient first, only as a bet (speculative_step)."""
    speculative_step: bool = spec(True)
    """With gradient_clipping or fp16, parameters and optimizer on NVMe: when the last step did not clip or
    overflow, step during backward as a bet that this one will not either, writing a second file per optimizer
    sub-group; the bet is committed at step() when it holds, else rolled back and the step taken after backward
    (bit-identical either way; see [Note: the speculative step] in engine/optimizer.py). Needs disk room for a
    second copy of the optimizer's files, reserved at initialize; without it, off (said once)."""
    step_during_forward: bool = spec(True)
    """With the step after backward (clipping, fp16) under ZeRO-3 and the optimizer on NVMe: step each sub-group
    that holds no persistent parameter when the next forward first needs it, so the optimizer's I/O overlaps
    that forward (see [Note: the step finishes in the next forward]). The same values either way."""
    comm_timeout_s: float = spec(300.0, low=1.0, high=86400.0)
    """Seconds a collective may wait for the other ranks before the job fails (a dead or hung rank)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SchedulerConfig:
    """scheduler: {"type": ..., "params": {...}}, checked against the scheduler's own parameters."""

    type: str
    """WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle or LRRangeTest."""
    params: dict
    """The scheduler's parameters with DeepSpeed's names; missing ones take DeepSpeed's defaults."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Config:
    """A whole swap config: DeepSpeed's top-level keys plus `infinity`."""

    train_batch_size: int | None = spec(None, low=1)
    """Global batch: micro batch x accumulation steps x ranks."""
    train_micro_batch_size_per_gpu: int | None = spec(None, low=1)
    """Samples per rank per forward/backward."""
    gradient_accumulation_steps: int | None = spec(None, low=1)
    """Micro-batches per optimizer step; derived from the other two batch keys when absent (1 if they say
    nothing); see [Note: batch sizes] in resolve.py."""
    gradient_clipping: float = spec(0.0, low=0.0)
    """Clip the global gradient norm to this (0 = off)."""
    dataloader_drop_last: bool = spec(False)
    """The loader deepspeed.initialize(training_data=...) makes drops the last incomplete batch."""
    fp16: Fp16Config = spec(None, default_factory=Fp16Config)
    """fp16 mixed precision."""
    bf16: Bf16Config = spec(None, default_factory=Bf16Config)
    """bf16 mixed precision."""
    optimizer: OptimizerConfig = spec(None, default_factory=OptimizerConfig)
    """The optimizer."""
    zero_optimization: ZeroConfig = spec(None, default_factory=ZeroConfig)
    """ZeRO stage and offload."""
    aio: AioConfig = spec(None, default_factory=AioConfig)
    """Async I/O settings."""
    scheduler: SchedulerConfig | None = spec(None, kind="scheduler")
    """DeepSpeed's lr scheduler section (infinity/optim/schedules.py): WarmupLR, WarmupDecayLR,
    WarmupCosineLR, OneCycle or LRRangeTest, with DeepSpeed's formulas."""
    infinity: InfinityConfig = spec(None, default_factory=InfinityConfig)
    """infinity's own settings."""
    ignored: tuple = field(default=(), metadata={"internal": True})
    """DeepSpeed keys that were accepted but have no effect here, each as "key (why)" (filled by the loader)."""
    auto: tuple = field(default=(), metadata={"internal": True})
    """Dotted keys given as "auto" (see [Note: auto] in resolve.py)."""
    given: frozenset | None = field(default=None, metadata={"internal": True})
    """Dotted keys the config wrote a value for (aliases under their field's name): the sizes not among them
    are the engine's to fit to the model (see [Note: sizes fitted to the model] in engine/plan.py). None for
    a Config built in Python rather than loaded: every value in it counts as written."""
    optimizer_given: bool = field(default=True, metadata={"internal": True})
    """False when the config had no optimizer section (the default AdamW is then said once)."""


# Aliases: DeepSpeed's older spellings of a key.
ALIASES = {"": {"bfloat16": "bf16"}, "aio": {"thread_count": "intra_op_parallelism"}, "bf16": {},
           "zero_optimization": {"stage3_gather_fp16_weights_on_model_save":
                                 "stage3_gather_16bit_weights_on_model_save"}}

# Keys DeepSpeed accepts that infinity does not act on (yet): loaded, reported, ignored.
DEEPSPEED_ACCEPTED = {
    "": {"steps_per_print", "wall_clock_breakdown", "zero_allow_untested_optimizer",
         "dump_state", "prescale_gradients", "gradient_predivide_factor", "sparse_gradients", "amp",
         "activation_checkpointing", "flops_profiler", "tensorboard", "wandb", "csv_monitor",
         "communication_data_type", "zero_force_ds_cpu_optimizer", "data_types", "memory_breakdown",
         "hybrid_engine"},
    "zero_optimization": {"allgather_partitions", "allgather_bucket_size", "reduce_scatter",
                          "round_robin_gradients", "ignore_unused_parameters",
                          "elastic_checkpoint", "zero_hpz_partition_size", "zero_quantized_weights",
                          "zero_quantized_gradients", "load_from_fp32_weights",
                          "memory_efficient_linear", "stage3_module_granularity_threshold", "mics_shard_size",
                          "log_trace_cache_warnings", "offload_param_nvme_path", "zenflow"},
    "fp16": {"auto_cast", "consecutive_hysteresis", "fp16_master_weights_and_grads"},
    "bf16": {"immediate_grad_update", "check_grad_overflow"},
    "aio": {"use_gds"},
    "optimizer.params": {"torch_adam", "fused"},
    "zero_optimization.offload_optimizer": {"max_in_cpu", "super_offload", "cpuadam_cores_perc"},
}

# Why an accepted key has no effect here (said once, with the key). Keys not listed get the generic reason.
INERT_REASONS = {
    "zero_optimization.overlap_comm": "gradient reduce-scatters always run asynchronously, one bucket in flight",
    "zero_optimization.contiguous_gradients": "gradients always land in one flat fp32 buffer per sub-group",
    "zero_optimization.offload_optimizer.pipeline_read": "NVMe sub-groups are always read ahead while Adam runs",
    "zero_optimization.offload_optimizer.pipeline_write": "NVMe sub-groups are always written behind Adam",
    "zero_optimization.offload_optimizer.fast_init": "the initial state is written once either way",
    "zero_optimization.offload_optimizer.max_in_cpu": "DeepSpeed does not read it for the optimizer either",
    "steps_per_print": "infinity train prints every step; the engine reports each step in engine.last_report",
    "wall_clock_breakdown": "engine.last_report always carries the step's time split",
    "prescale_gradients": "gradients are averaged in fp32, where the order does not matter",
    "gradient_predivide_factor": "gradients are averaged in fp32, where the order does not matter",
    "communication_data_type": "gradients are reduced in fp32",
    "data_types": "gradients are accumulated and reduced in fp32 (DeepSpeed's grad_accum_dtype defaults to bf16 "
                  "with bf16; bench/RESULTS.md: Losses against DeepSpeed)",
    "zero_optimization.allgather_bucket_size": "parameters are gathered one at a time, ahead of use",
    "zero_optimization.allgather_partitions": "parameters are gathered one at a time, ahead of use",
    "zero_optimization.reduce_scatter": "gradients are always reduce-scattered",
    "zero_optimization.round_robin_gradients": "each rank owns one shard of every parameter",
    "zero_optimization.ignore_unused_parameters": "a parameter without a gradient is stepped with a zero gradient",
    "optimizer.params.torch_adam": "the CPU Adam kernel is always used (same math as torch.optim.AdamW)",
    "optimizer.params.fused": "the CPU Adam kernel is always used (same math as torch.optim.AdamW)",
    "hybrid_engine": "it is off; infinity has no inference engine to switch to (RLHF generation runs the "
                     "training model)",
    "zero_optimization.zenflow": "the step here is exact AdamW on every parameter at every step; ZenFlow's "
                                 "deferred, stale updates of low-importance columns would change the result, and "
                                 "the overlap it buys is what the pipelined NVMe/CPU step already does",
    "zero_optimization.offload_optimizer.super_offload": "the step here is exact AdamW on every parameter at every "
                                                         "step; SuperOffload's speculative step and rollback would "
                                                         "change when updates land, and the overlap it buys is what "
                                                         "the pipelined CPU/NVMe step already does",
    "zero_optimization.offload_optimizer.cpuadam_cores_perc": "the CPU Adam uses the cores torch.get_num_threads() "
                                                              "gives it (set OMP_NUM_THREADS to limit them)",
}

# Accepted keys that would change training when switched on, which infinity does not do: refused then.
REFUSED_WHEN_ON = {
    "amp": "NVIDIA apex AMP is not supported; use bf16 or fp16",
    "zero_optimization.zero_quantized_weights": "quantized weight gathers are not supported; remove it",
    "zero_optimization.zero_quantized_gradients": "quantized gradient reduction is not supported; remove it",
    "fp16.fp16_master_weights_and_grads": "master weights are always fp32; remove it",
    "fp16.auto_cast": "inputs are cast to the compute dtype by the engine; remove it",
    "sparse_gradients": "sparse gradients are not supported; remove it",
    "hybrid_engine": "DeepSpeed's hybrid engine (inference kernels for RLHF generation) is not supported; set "
                     "hybrid_engine.enabled to false and generate with the training model",
}
