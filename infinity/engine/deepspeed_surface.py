"""What DeepSpeed's engine offers beside forward, backward and step: its getters, no_sync, and saving and loading
(checkpoints, 16-bit weights, Hugging Face directories). A mixin of Engine (engine.py), kept apart so that the
training path reads on its own."""

from __future__ import annotations

import contextlib
import logging
import os
import warnings

import torch

log = logging.getLogger("infinity")


class DeepSpeedSurface:
    """DeepSpeed's engine methods over Engine's state (config, batch, optimizer, store, comm)."""

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

    def train(self, mode: bool = True):
        self.module.train(mode)
        return self

    def eval(self):
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

    # ------------------------------------------------- saving and loading

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
