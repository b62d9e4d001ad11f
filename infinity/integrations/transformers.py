"""`transformers.Trainer` on infinity's engine: `InfinityTrainer`.

    trainer = InfinityTrainer(model="path/or/model-id", args=TrainingArguments(...), infinity_config="ds.json",
                              train_dataset=..., processing_class=tokenizer)
    trainer.train()
    trainer.save_model()          # a Hugging Face directory, gathered from the partitions

[Note: the Trainer's loop, the engine's step]
The Trainer keeps its own loop (batching, accumulation, callbacks, logging, evaluation, checkpoint rotation);
the engine takes the four places where a model's parameters, gradients and optimizer are touched:
- the model: built under `zero_init` (a path is streamed into partitions) or partitioned at `initialize`;
  the engine is what the loop calls forward on (`_wrap_model`), and nothing wraps it in DDP, because the
  engine reduce-scatters gradients itself;
- backward: the Trainer's own `training_step` normalises the loss (by the accumulation steps, or by the
  items in the batch when the model takes them) and ends in `accelerator.backward`, which this trainer's
  accelerator routes to `engine.backward(scale_wrt_gas=False)` with the accumulation boundary the loop
  decided (a short last accumulation of an epoch included);
- clipping and the step: the Trainer's `max_grad_norm` is the engine's `gradient_clipping`, applied in the
  engine's step; the norm the Trainer logs is the engine's pre-clip norm, filled in when the step has run;
- the optimizer and scheduler: the Trainer's own `create_optimizer` builds the torch optimizer its arguments
  ask for (its decay/no-decay groups, lr, betas, eps), and the engine's CPU Adam takes it over as a client
  optimizer (anything but Adam/AdamW is refused by name). The Trainer's scheduler (or the config's
  `scheduler` section) drives the lr of the engine's groups; it does not advance on an fp16 step the engine
  skipped.
Checkpoints are the Trainer's directories (`checkpoint-N`, with its trainer state, RNG and scheduler files,
rotated by `save_total_limit`), holding the Hugging Face model (`save_model`) and the engine's own checkpoint
under `infinity/`, from which `train(resume_from_checkpoint=...)` resumes exactly.

"auto" in the config is filled from TrainingArguments as Hugging Face fills it for DeepSpeed, and a value
written in the config that disagrees with TrainingArguments is an error naming both; a key the config lacks
takes the TrainingArguments value (so `max_grad_norm` clips even when the config has no gradient_clipping).
"""

from __future__ import annotations

import copy
import logging
import os
import warnings

import torch
from transformers import Trainer, TrainingArguments

from infinity.config import ConfigError
from infinity.config.tier import Tier
from infinity.engine.plan import fit_param_buffer

log = logging.getLogger("infinity")

if not all(hasattr(Trainer, name) for name in ("_prepare_for_training", "_run_epoch", "_get_grad_norm")):
    import transformers as _transformers

    raise ImportError(f"infinity.integrations.transformers needs transformers >= 5.0 (its Trainer's loop in "
                      f"_prepare_for_training/_run_epoch); this is {_transformers.__version__}: pip install "
                      f"'infinity[hf]' brings a tested one")

ENGINE_DIR = "infinity"
"""Where a Trainer checkpoint keeps the engine's checkpoint (checkpoint-N/infinity/...)."""

_SCHEDULER_NAME = "scheduler.pt"
_TRAINING_ARGS_NAME = "training_args.bin"


class InfinityTrainer(Trainer):
    """A `transformers.Trainer` whose model, backward and optimizer step run on infinity's engine (ZeRO
    stages 0-3, parameters and optimizer state on the device, CPU or NVMe, as `infinity_config` says).

    model: a model, or a path or model id built under `zero_init` with `model_class.from_pretrained` (its
    weights streamed into partitions; `model_init_kwargs` go to from_pretrained). infinity_config: a
    DeepSpeed-style config, as a path or a dict. Everything else is the Trainer's. It overrides only the
    Trainer's hooks named in [Note: the Trainer's loop, the engine's step], so a trainer that keeps the
    Trainer's loop can put it first in its bases (`class MySFT(InfinityTrainer, SFTTrainer)`)."""

    def __init__(self, model=None, args: TrainingArguments | None = None, *args_rest, infinity_config=None,
                 model_class=None, model_init_kwargs: dict | None = None, **kwargs):
        if args_rest:
            raise TypeError("InfinityTrainer: pass the Trainer's arguments after `args` by keyword")
        if args is None:
            args = TrainingArguments(output_dir="trainer_output")
        refuse_unsupported(args, kwargs)
        raw = load_raw(infinity_config)
        fill_from_training_args(raw, args)
        self._raw_config = raw
        self._engine = None
        if isinstance(model, (str, os.PathLike)):
            model = _from_pretrained(str(model), raw, model_class, model_init_kwargs or {})
        super().__init__(model=model, args=args, **kwargs)
        self._norm = None
        self._engine = self._build_engine()
        self.model_wrapped = self._engine

    # --------------------------------------------------------------- the engine

    @property
    def engine(self):
        """The infinity Engine that trains the model."""
        return self._engine

    def _build_engine(self):
        from infinity.deepspeed.api import _groups
        from infinity.engine.assemble import initialize

        raw = copy.deepcopy(self._raw_config)
        optimizer_section = raw.pop("optimizer", None)
        raw.pop("scheduler", None)  # built at train() from the run's length, stepped by the Trainer's loop
        torch_opt = Trainer.create_optimizer(self)  # the optimizer the Trainer's arguments ask for
        self.optimizer = None
        if not isinstance(torch_opt, (torch.optim.Adam, torch.optim.AdamW)):
            optim = getattr(self.args.optim, "value", self.args.optim)
            raise ValueError(f"InfinityTrainer: TrainingArguments.optim={optim!r} makes the optimizer "
                             f"{type(torch_opt).__name__}; the engine's optimizer is Adam/AdamW, so use "
                             "optim='adamw_torch_fused' (the default) or 'adamw_torch'")
        if optimizer_section is not None:
            _check_optimizer_section(optimizer_section, torch_opt)
        groups = _groups(torch_opt, None, raw, self.model)
        engine = initialize(self.model, raw, model_parameters=groups)
        if engine.gas != self.args.gradient_accumulation_steps:
            engine.close()
            raise ConfigError("gradient_accumulation_steps", f"the engine accumulates {engine.gas} micro-batches "
                              f"and TrainingArguments {self.args.gradient_accumulation_steps}; make them agree")
        return engine

    def create_optimizer(self, model=None):
        if self._engine is None:  # during Trainer.__init__ nothing is built yet
            return None
        if self.optimizer is None:
            self.optimizer = EngineOptimizer(self._engine, self)
        return self.optimizer

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        # The loop would enter accelerate's no_sync (the engine's, refused at ZeRO-2/3) for all but the last
        # micro-batch of an accumulation; the engine reduce-scatters each micro-batch's gradients as backward
        # produces them, so every micro-batch is a "sync" one to the loop.
        state = self.accelerator.gradient_state
        state.plugin_kwargs = dict(state.plugin_kwargs, sync_each_batch=True)
        # The Trainer's training_step (and a subclass's around it, e.g. TRL's) normalises the loss and ends in
        # accelerator.backward: this trainer's accelerator hands that loss to the engine.
        self.accelerator.backward = self._engine_backward
        # ... and unwrap_model(engine) is the user's model (the Trainer asks it whether it is a peft model, which
        # loss to smooth labels for, what to save).
        unwrap = self.accelerator.unwrap_model
        self.accelerator.unwrap_model = lambda model, *a, **kw: unwrap(
            model.module if self._engine is not None and model is self._engine else model, *a, **kw)

    def compute_loss_context_manager(self):
        # Before the forward: the engine's forward hooks read whether this micro-batch ends an accumulation (a step
        # coming lets them start the optimizer state's reads early); _engine_backward sets it again.
        if self._engine is not None:
            self._engine.set_gradient_accumulation_boundary(self.accelerator.gradient_state.sync_gradients)
        return super().compute_loss_context_manager()

    def _engine_backward(self, loss, **kwargs) -> None:
        """The loss as the Trainer normalised it (by the accumulation steps, or by the items in the batch when
        the model takes them), backward through the engine, at the accumulation boundary the loop decided."""
        unknown = set(kwargs) - {"retain_graph"}
        if unknown:
            raise ValueError(f"InfinityTrainer: backward({', '.join(sorted(unknown))}=...) is not supported by the "
                             "engine")
        self._engine.set_gradient_accumulation_boundary(self.accelerator.gradient_state.sync_gradients)
        self._engine.backward(loss, scale_wrt_gas=False, retain_graph=bool(kwargs.get("retain_graph", False)))

    def _move_model_to_device(self, model, device):
        """The engine places the parameters (partitions on their tier, the compute copy on the device)."""

    def _wrap_model(self, model, training: bool = True, dataloader=None):
        return self._engine if self._engine is not None else model

    def autocast_smart_context_manager(self, cache_enabled: bool | None = True):
        """No autocast: the engine's compute dtype (bf16/fp16 from the config or TrainingArguments) is it."""
        import contextlib

        return contextlib.nullcontext()

    def _prepare_for_training(self, max_steps, train_dataloader, resume_from_checkpoint):
        if self._created_lr_scheduler:
            self.lr_scheduler = None
            self._created_lr_scheduler = False
        state = self.accelerator.gradient_state  # another Trainer in this process may have reset it
        state.plugin_kwargs = dict(state.plugin_kwargs, sync_each_batch=True)
        self.create_optimizer()
        self._create_engine_scheduler(max_steps)
        self.model_wrapped = self._engine
        if resume_from_checkpoint is not None:
            self._load_optimizer_and_scheduler(resume_from_checkpoint)
        for attr in ("model", "optimizer", "lr_scheduler"):
            setattr(self.callback_handler, attr, getattr(self, attr))
        self.callback_handler.train_dataloader = train_dataloader
        return self._engine, train_dataloader

    def _create_engine_scheduler(self, max_steps: int) -> None:
        section = self._raw_config.get("scheduler")
        if section is None:
            self.create_scheduler(num_training_steps=max_steps, optimizer=self.optimizer)
            sched = self.lr_scheduler
        else:
            from infinity.config.load import load_config
            from infinity.optim.schedules import build_scheduler

            section = fill_scheduler(copy.deepcopy(section), self.args, max_steps)
            cfg = load_config({"scheduler": section})
            sched = build_scheduler(cfg.scheduler, self._engine.optimizer)
        self.lr_scheduler = _StepsUnlessSkipped(sched, self.optimizer)
        self._created_lr_scheduler = True

    # ------------------------------------------------------ backward and step

    def _clip_grad_norm(self, model):
        """The engine clips in its step (gradient_clipping = max_grad_norm); see _get_grad_norm."""
        return None

    def _get_grad_norm(self, model, grad_norm=None):
        """The engine's pre-clip global norm, written into this tensor by the step that follows."""
        self._norm = torch.full((), float("nan"))
        return self._norm

    # ------------------------------------------------------------ checkpoints

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        self._engine.save_checkpoint(output_dir, tag=ENGINE_DIR, save_latest=False, own_dir=False)
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, _SCHEDULER_NAME))

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        """The weights come back with the engine's checkpoint (_load_optimizer_and_scheduler)."""
        if not os.path.isdir(os.path.join(resume_from_checkpoint, ENGINE_DIR)):
            raise ValueError(f"InfinityTrainer: {resume_from_checkpoint} has no {ENGINE_DIR}/ (the engine's "
                             "checkpoint: it was saved with save_only_model=True, or not by InfinityTrainer), so "
                             "there is no optimizer state to resume; start from its model with "
                             "model=<that directory> instead")

    def _load_optimizer_and_scheduler(self, checkpoint):
        if checkpoint is None:
            return
        self._load_from_checkpoint(checkpoint)
        self._engine.load_checkpoint(checkpoint, tag=ENGINE_DIR)
        path = os.path.join(checkpoint, _SCHEDULER_NAME)
        if os.path.isfile(path):
            self.lr_scheduler.load_state_dict(torch.load(path, weights_only=True))

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """A Hugging Face directory (config, safetensors shards, the tokenizer when there is one), gathered one
        parameter at a time by engine.save_pretrained. Every rank must call it; rank 0 writes."""
        output_dir = output_dir or self.args.output_dir
        tokenizer = self.processing_class if hasattr(self.processing_class, "save_pretrained") else None
        self._engine.save_pretrained(output_dir, tokenizer=tokenizer)
        if self.args.should_save:
            torch.save(self.args, os.path.join(output_dir, _TRAINING_ARGS_NAME))
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _save(self, output_dir: str | None = None, state_dict=None) -> None:
        if state_dict is not None:
            raise ValueError("InfinityTrainer._save: the weights are partitioned; save_model() gathers them")
        self.save_model(output_dir, _internal_call=True)


class EngineOptimizer(torch.optim.Optimizer):
    """What the Trainer's loop calls `optimizer`: its param_groups are the engine's (so a torch lr scheduler
    built on it sets the lr the engine's Adam uses), step() is engine.step() at the boundary the Trainer
    decided, zero_grad() is the engine's (it has already zeroed after its step)."""

    def __init__(self, engine, trainer):
        self.engine = engine
        self._trainer = trainer
        self.defaults = engine.optimizer.defaults
        self.param_groups = engine.optimizer.param_groups
        self.state = {}
        self._optimizer_step_pre_hooks = {}
        self._optimizer_step_post_hooks = {}
        self._optimizer_state_dict_pre_hooks = {}
        self._optimizer_state_dict_post_hooks = {}
        self._optimizer_load_state_dict_pre_hooks = {}
        self._optimizer_load_state_dict_post_hooks = {}

    def step(self, closure=None):
        if closure is not None:
            raise ValueError("EngineOptimizer.step: a closure is not supported (the engine steps once per "
                             "accumulation boundary)")
        self.engine.step()
        norm = self.engine.get_global_grad_norm()
        if self._trainer._norm is not None and norm is not None:
            self._trainer._norm.fill_(float(norm))

    def zero_grad(self, set_to_none: bool = True) -> None:
        pass  # the engine zeroes its gradient buffers after each step

    def state_dict(self):
        raise RuntimeError("InfinityTrainer: the optimizer state is partitioned (and may be on NVMe); it is saved "
                           "with the engine's checkpoint under checkpoint-N/infinity/")

    def load_state_dict(self, state_dict):
        raise RuntimeError("InfinityTrainer: the optimizer state loads with the engine's checkpoint "
                           "(train(resume_from_checkpoint=...))")

    @property
    def overflow(self) -> bool:
        return bool(getattr(self.engine.optimizer, "overflow", False))


class _StepsUnlessSkipped:
    """The scheduler the Trainer steps: it does not advance after an fp16 step the engine skipped (the
    DeepSpeed engine's rule), and otherwise is the scheduler itself."""

    def __init__(self, scheduler, optimizer: EngineOptimizer):
        self.scheduler = scheduler
        self._optimizer = optimizer  # not `optimizer`: that name is the scheduler's own, forwarded below

    def step(self, *args, **kwargs):
        if self._optimizer.overflow:
            return
        self.scheduler.step(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.scheduler, name)


# -------------------------------------------------------------- config from TrainingArguments

# TrainingArguments that would be silently ignored or fight the engine, with what to do instead.
_REFUSED = {
    "deepspeed": "InfinityTrainer is the engine; put the DeepSpeed config in infinity_config= instead",
    "fsdp": "the engine partitions the model (ZeRO-3); drop fsdp and set zero_optimization.stage in infinity_config",
    "fsdp_config": "the engine partitions the model; drop fsdp_config",
    "torch_compile": "the engine's gather/release hooks run around every module's forward; turn torch_compile off",
    "auto_find_batch_size": "the engine's batch sizes are fixed at build time; set per_device_train_batch_size",
    "load_best_model_at_end": "loading the best checkpoint back into the engine is not supported yet; pick the "
                              "checkpoint-N directory yourself (its HF model loads with from_pretrained)",
    "use_liger_kernel": "Liger's kernels patch the model's modules, which the engine's hooks wrap; turn it off",
    "fp16_full_eval": "evaluation runs in the engine's compute dtype, the training one; set fp16=True for both",
    "bf16_full_eval": "evaluation runs in the engine's compute dtype, the training one; set bf16=True for both",
    "enable_jit_checkpoint": "it saves between backward and the optimizer step, where the weights are about to "
                             "change; use save_steps",
    "parallelism_config": "tensor/context parallelism is not composed with the engine yet; drop parallelism_config",
    "save_on_each_node": "the engine's save writes from global rank 0 only; save to shared storage",
}
_SCHEDULERS_REFUSED = {"reduce_lr_on_plateau": "it steps on evaluation metrics", "greedy": "it steps on evaluation "
                       "metrics"}


def refuse_unsupported(args: TrainingArguments, kwargs: dict) -> None:
    for name, fix in _REFUSED.items():
        value = getattr(args, name, None)
        if value not in (None, False, "", [], {}):
            raise ValueError(f"InfinityTrainer: TrainingArguments.{name}={value!r} is not supported: {fix}")
    kind = getattr(args.lr_scheduler_type, "value", args.lr_scheduler_type)
    if kind in _SCHEDULERS_REFUSED:
        raise ValueError(f"InfinityTrainer: TrainingArguments.lr_scheduler_type={kind!r} is not supported "
                         f"({_SCHEDULERS_REFUSED[kind]}, and the engine's scheduler advances once per optimizer "
                         "step); use 'linear', 'cosine', 'constant_with_warmup' or the config's scheduler section")
    if args.n_gpu > 1:
        raise ValueError(f"InfinityTrainer: {args.n_gpu} GPUs in one process (DataParallel) is not supported; "
                         "launch one process per GPU with torchrun")
    if kwargs.get("optimizers", (None, None)) != (None, None) or kwargs.get("optimizer_cls_and_kwargs"):
        raise ValueError("InfinityTrainer: optimizers=/optimizer_cls_and_kwargs= are not supported: the engine's "
                         "Adam owns the optimizer state; set learning_rate, adam_beta1/2, adam_epsilon, "
                         "weight_decay and lr_scheduler_type in TrainingArguments (or the config's sections)")
    if kwargs.get("model_init") is not None:
        raise ValueError("InfinityTrainer: model_init= (hyper-parameter search) is not supported; pass model=")
    if getattr(args, "save_safetensors", True) is False:
        raise ValueError("InfinityTrainer: save_safetensors=False is not supported: save_model writes safetensors "
                         "shards")


def load_raw(infinity_config) -> dict:
    if infinity_config is None:
        raise ValueError("InfinityTrainer: infinity_config is required: a DeepSpeed-style config as a path or a "
                         "dict, e.g. {'zero_optimization': {'stage': 3, 'offload_optimizer': {'device': 'cpu'}}}")
    from infinity.deepspeed.config import config_from

    return config_from(infinity_config)  # a dict (copied), a path to JSON, or a JSON string


def fill_from_training_args(raw: dict, args: TrainingArguments) -> None:
    """Fill "auto" (and absent) values from TrainingArguments as Hugging Face fills them for DeepSpeed; a
    written value that disagrees is collected, and all of them raised at once, naming both sides."""
    mismatches = []
    world = max(1, args.world_size)

    def fill(path: str, value, arg: str):
        *parents, key = path.split(".")
        node = raw
        for p in parents:
            node = node.setdefault(p, {})
        have = node.get(key, "auto")
        if have == "auto":
            node[key] = value
        elif not _same(have, value):
            mismatches.append(f"{path}={have!r} but TrainingArguments.{arg}={value!r}")

    micro, gas = args.per_device_train_batch_size, args.gradient_accumulation_steps
    fill("train_micro_batch_size_per_gpu", micro, "per_device_train_batch_size")
    fill("gradient_accumulation_steps", gas, "gradient_accumulation_steps")
    fill("train_batch_size", micro * gas * world, "per_device_train_batch_size x gradient_accumulation_steps x "
         "world_size")
    fill("gradient_clipping", args.max_grad_norm, "max_grad_norm")
    fill("fp16.enabled", bool(args.fp16), "fp16")
    fill("bf16.enabled", bool(args.bf16), "bf16")
    if raw.get("optimizer") is not None:  # no section: the Trainer's optimizer is taken over as it is
        fill("optimizer.params.lr", args.learning_rate, "learning_rate")
        fill("optimizer.params.betas", [args.adam_beta1, args.adam_beta2], "adam_beta1/adam_beta2")
        fill("optimizer.params.eps", args.adam_epsilon, "adam_epsilon")
        fill("optimizer.params.weight_decay", args.weight_decay, "weight_decay")
    if mismatches:
        raise ValueError("InfinityTrainer: the config and TrainingArguments disagree (write \"auto\" in the "
                         "config to take TrainingArguments' value, or change one side):\n  " + "\n  ".join(mismatches))


def fill_scheduler(section: dict, args: TrainingArguments, max_steps: int) -> dict:
    """The config's scheduler section with "auto" filled as Hugging Face fills it (warmup from
    warmup_steps/warmup_ratio, the total from the run's steps, the peak lr from learning_rate)."""
    params = section.setdefault("params", {})
    auto = {"warmup_min_lr": 0, "warmup_max_lr": args.learning_rate, "warmup_num_steps":
            args.get_warmup_steps(max_steps), "total_num_steps": max_steps}
    for key, value in auto.items():
        if params.get(key) == "auto":
            params[key] = value
    return section


_OPTIMIZER_PARAMS = {"lr", "betas", "eps", "weight_decay", "adam_w_mode", "torch_adam", "fused"}


def _check_optimizer_section(section: dict, torch_opt) -> None:
    """The config's optimizer section must describe the optimizer TrainingArguments.optim makes (which the engine
    takes over): the same Adam flavour, and no parameter the Trainer's optimizer would not apply."""
    kind = str(section.get("type", "AdamW")).lower()
    params = section.get("params", {})
    # DeepSpeed's "Adam" is AdamW unless adam_w_mode is false (the schema's reading too)
    adamw = kind == "adamw" or (kind == "adam" and params.get("adam_w_mode", True))
    made_adamw = isinstance(torch_opt, torch.optim.AdamW) or bool(torch_opt.defaults.get("decoupled_weight_decay"))
    if kind not in ("adam", "adamw") or adamw != made_adamw:
        mode = "" if kind != "adam" else f" with adam_w_mode={bool(params.get('adam_w_mode', True))}"
        raise ValueError(f"InfinityTrainer: the config's optimizer is {section.get('type')!r}{mode}"
                         f" and TrainingArguments.optim makes {type(torch_opt).__name__}; make them agree or drop "
                         "the config's section")
    other = sorted(set(params) - _OPTIMIZER_PARAMS)
    if other:
        raise ValueError(f"InfinityTrainer: the config's optimizer.params {other} would not be applied (the "
                         "optimizer is the one TrainingArguments.optim makes, from learning_rate, adam_beta1/2, "
                         "adam_epsilon and weight_decay); remove them")


def _same(a, b) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, bool) or isinstance(b, bool):
        return a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return float(a) == float(b)
    return a == b


def _from_pretrained(path: str, raw: dict, model_class, kwargs: dict):
    """model_class.from_pretrained(path) under zero_init: the weights are streamed into partitions."""
    import infinity

    if model_class is None:
        from transformers import AutoModelForCausalLM as model_class
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the config's notes are said once, at initialize
        cfg = infinity.load_config({k: v for k, v in copy.deepcopy(raw).items() if k != "scheduler"})
    if cfg.zero_optimization.offload_param.tier is Tier.NVME:
        largest = _largest_shard(path, model_class, kwargs)
        if largest is not None:
            cfg = fit_param_buffer(cfg, largest)
    with infinity.zero_init(cfg):
        return model_class.from_pretrained(path, **kwargs)


def _largest_shard(path: str, model_class, kwargs: dict) -> int | None:
    """One rank's shard of the model's largest parameter, from the model built on the meta device (nothing is
    read but config.json): what the parameter pool's buffers must hold (see [Note: sizes fitted to the model]).
    None when the model cannot be built that way; the config's buffer_size then stands."""
    import math

    import torch.distributed as dist
    from transformers import AutoConfig, PretrainedConfig

    passed = {k: v for k, v in kwargs.items() if k in ("revision", "trust_remote_code", "cache_dir", "token")}
    try:
        config = kwargs.get("config")
        if not isinstance(config, PretrainedConfig):
            config = AutoConfig.from_pretrained(config or path, **passed)
        remote = {"trust_remote_code": True} if passed.get("trust_remote_code") else {}
        with torch.device("meta"):
            meta = (model_class.from_config(config, **remote) if hasattr(model_class, "from_config")
                    else model_class(config))
    except Exception as exc:  # noqa: BLE001 - sizing is an optimisation; from_pretrained reports real errors
        log.info("infinity: the model could not be measured on the meta device (%s); offload_param.buffer_size "
                 "stays the config's", exc)
        return None
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else int(
        os.environ.get("WORLD_SIZE", "1"))
    return max((math.ceil(p.numel() / world) for p in meta.parameters()), default=1)
