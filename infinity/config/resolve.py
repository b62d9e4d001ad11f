"""What a config means once the world size and the model are known: DeepSpeed's batch-size inference and the
values written as "auto".

[Note: batch sizes]
DeepSpeed relates its three batch keys by
    train_batch_size = train_micro_batch_size_per_gpu x gradient_accumulation_steps x world size
and derives whichever is missing from the other two (one alone: accumulation 1). A set that breaks the
equation is an error naming all three and the world size. Only the world size is missing at load time, so
this runs when the engine starts (`Engine.batch`).

[Note: auto]
"auto" is the Hugging Face Trainer's placeholder. Loaded without the Trainer, a key given as "auto" takes
DeepSpeed's default at load time (`Config.auto` remembers which), and the ones HF derives from the model are
filled again at initialize from `model.config.hidden_size` with HF's rules: reduce_bucket_size = h^2,
stage3_prefetch_bucket_size = 0.9 h^2, stage3_param_persistence_threshold = 10 h. Each filled value is
logged once.
"""

from __future__ import annotations

import dataclasses
import logging

from infinity.errors import ConfigError

log = logging.getLogger("infinity")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class BatchSizes:
    """The three batch keys, resolved for one world size (see [Note: batch sizes])."""

    train_batch_size: int | None
    """Samples per optimizer step over all ranks; None when no batch size was given at all."""
    micro_batch_per_rank: int | None
    """Samples per rank per forward/backward (train_micro_batch_size_per_gpu)."""
    gradient_accumulation_steps: int
    """Micro-batches per optimizer step."""


def resolve(cfg, model, world: int) -> tuple:
    """(cfg with the model's "auto" values filled, its batch sizes for `world` ranks): everything the config
    means once the model and the world size are known. An inconsistent batch set raises ConfigError here,
    before anything is built."""
    cfg = resolve_auto(cfg, model)
    return cfg, resolve_batch(cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu,
                              cfg.gradient_accumulation_steps, world)


def resolve_batch(train_batch_size, micro, gas, world: int) -> BatchSizes:
    """See [Note: batch sizes]. Raises ConfigError naming the three values and the world size."""
    def error(why):
        raise ConfigError("train_batch_size", f"train_batch_size {train_batch_size}, train_micro_batch_size_per_gpu "
                                              f"{micro} and gradient_accumulation_steps {gas} on {world} rank(s): "
                                              f"{why}")

    tb = train_batch_size
    if tb is not None and micro is not None and gas is not None:
        if tb != micro * gas * world:
            error(f"{micro} x {gas} x {world} = {micro * gas * world}, not {tb}; fix one of them (or give only two "
                  "and the third is derived)")
    elif tb is not None and micro is not None:
        if tb % (micro * world):
            error(f"train_batch_size must be a multiple of micro batch x ranks = {micro * world}")
        gas = tb // (micro * world)
    elif tb is not None and gas is not None:
        if tb % (gas * world):
            error(f"train_batch_size must be a multiple of accumulation steps x ranks = {gas * world}")
        micro = tb // (gas * world)
    elif micro is not None:
        gas = gas or 1
        tb = micro * gas * world
    elif tb is not None:
        gas = 1
        if tb % world:
            error(f"train_batch_size must be a multiple of the ranks ({world})")
        micro = tb // world
    else:
        gas = gas or 1
    return BatchSizes(train_batch_size=tb, micro_batch_per_rank=micro, gradient_accumulation_steps=gas)


def resolve_auto(cfg, model):
    """cfg with the model-derived "auto" values filled (see [Note: auto]); cfg itself if there are none."""
    derived = {"zero_optimization.reduce_bucket_size": lambda h: h * h,
               "zero_optimization.stage3_prefetch_bucket_size": lambda h: int(0.9 * h * h),
               "zero_optimization.stage3_param_persistence_threshold": lambda h: 10 * h}
    wanted = [k for k in cfg.auto if k in derived]
    if not wanted:
        return cfg
    hidden = _hidden_size(model)
    if hidden is None:
        log.info("infinity: %s were \"auto\" and the model has no config.hidden_size; they keep DeepSpeed's "
                 "defaults", ", ".join(wanted))
        return cfg
    zero = cfg.zero_optimization
    values = {k.split(".", 1)[1]: derived[k](hidden) for k in wanted}
    for k, v in values.items():
        log.info("infinity: zero_optimization.%s \"auto\" -> %d (hidden_size %d)", k, v, hidden)
    return dataclasses.replace(cfg, zero_optimization=dataclasses.replace(zero, **values))


def _hidden_size(model):
    config = getattr(model, "config", None)
    for name in ("hidden_size", "n_embd", "d_model"):
        value = getattr(config, name, None)
        if isinstance(value, int):
            return value
    return None
