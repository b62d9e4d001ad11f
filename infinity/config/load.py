"""load_config: JSON (or a dict) -> frozen Config, validated before anything touches the disk.

Every error is a ConfigError whose message starts with the dotted key path
and says how to fix it.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import json
import math
import os
import tempfile
import typing
import warnings

from infinity.config import schema
from infinity.config.schema import (ALIASES, DEEPSPEED_ACCEPTED, INERT_REASONS, REFUSED_WHEN_ON, Config,
                                    SchedulerConfig)
from infinity.errors import ConfigError
from infinity.units import parse_size


def as_config(config) -> Config:
    """`config` as a Config: one already built stays as it is; anything else is loaded (None: every default)."""
    return config if isinstance(config, Config) else load_config(config if config is not None else {})


def load_config(source, *, nvme_path=None) -> Config:
    """Load a swap config from a path, a JSON string's file, or a dict.

    `nvme_path` (a directory, or a list of one per disk) overrides both offload sections' `nvme_path` (the
    shipped configs carry a placeholder, and `infinity train --nvme-path` sets it).
    """
    raw, origin = _read(source)
    if not isinstance(raw, dict):
        raise ConfigError("", f"{origin}: the top level must be a JSON object, got {type(raw).__name__}")
    if nvme_path is not None:
        paths = [os.fspath(p) for p in nvme_path] if isinstance(nvme_path, (list, tuple)) else os.fspath(nvme_path)
        raw = _override_nvme(raw, paths[0] if isinstance(paths, list) and len(paths) == 1 else paths)
    notes = _Notes()
    cfg = _build(Config, raw, "", notes)
    cfg = dataclasses.replace(cfg, ignored=tuple(notes.ignored), auto=tuple(notes.auto), given=frozenset(notes.given),
                              optimizer_given="optimizer" in raw)
    cfg = _path_lists(_legacy(cfg))
    cfg = _partial_offload(cfg, notes)
    cfg = _param_offload_below_stage3(cfg, notes)
    _check_semantics(cfg)
    _check_paths(cfg)
    if notes.ignored:
        warnings.warn("infinity: these DeepSpeed keys have no effect here: " + "; ".join(notes.ignored),
                      stacklevel=2)
    if notes.auto:
        warnings.warn('infinity: "auto" (a Hugging Face Trainer placeholder) took DeepSpeed\'s default for '
                      + ", ".join(notes.auto) + "; bucket sizes are derived from the model's hidden_size at "
                      "initialize, batch sizes from the others (or the training data)", stacklevel=2)
    return cfg


@dataclasses.dataclass
class _Notes:
    """What loading a config found besides values: keys without effect here, and keys given as "auto"."""

    ignored: list = dataclasses.field(default_factory=list)
    auto: list = dataclasses.field(default_factory=list)
    given: list = dataclasses.field(default_factory=list)
    canonical: dict = dataclasses.field(default_factory=dict)  # a key as spelled -> under its fields' names


_AUTO = object()


def _path_lists(cfg: Config) -> Config:
    """An nvme_path given as a list: nvme_path becomes its first directory and nvme_path_list keeps them all
    (`paths`)."""
    zero = cfg.zero_optimization
    changed = {}
    for name in ("offload_param", "offload_optimizer"):
        section = getattr(zero, name)
        if isinstance(section.nvme_path, tuple):
            changed[name] = dataclasses.replace(section, nvme_path=section.nvme_path[0],
                                                nvme_path_list=section.nvme_path)
    if not changed:
        return cfg
    return dataclasses.replace(cfg, zero_optimization=dataclasses.replace(zero, **changed))


def _legacy(cfg: Config) -> Config:
    """DeepSpeed's older spellings that mean a newer key: zero_optimization.cpu_offload."""
    zero = cfg.zero_optimization
    if zero.cpu_offload:
        if zero.offload_optimizer.device == "nvme":
            raise ConfigError("zero_optimization.cpu_offload", "is true (optimizer state on the CPU) but "
                              'offload_optimizer.device is "nvme"; keep one of them')
        zero = dataclasses.replace(zero, offload_optimizer=dataclasses.replace(zero.offload_optimizer, device="cpu"))
        cfg = dataclasses.replace(cfg, zero_optimization=zero)
    return cfg


# ----------------------------------------------------------------- reading

def _read(source):
    if isinstance(source, dict):
        return source, "config dict"
    path = os.fspath(source)
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        raise ConfigError("", f"config file {path} does not exist") from None
    except OSError as exc:
        raise ConfigError("", f"cannot read config file {path}: {exc.strerror}") from None
    try:
        return json.loads(text), path
    except json.JSONDecodeError as exc:
        raise ConfigError("", f"{path}: invalid JSON at line {exc.lineno}, column {exc.colno}: {exc.msg}") from None


def _override_nvme(raw: dict, path) -> dict:
    raw = copy.deepcopy(raw)  # the caller's dict stays as it was
    zero = raw.get("zero_optimization")
    if isinstance(zero, dict):
        for section in ("offload_param", "offload_optimizer"):
            device = zero.get(section, {}).get("device") if isinstance(zero.get(section), dict) else None
            if isinstance(device, str) and device.lower() == "nvme":
                zero[section]["nvme_path"] = path
    return raw


# ---------------------------------------------------------------- building

def _build(cls, raw, path: str, notes: _Notes):
    if not isinstance(raw, dict):
        raise ConfigError(path, f"must be a JSON object, got {_describe(raw)}")
    fields = {f.name: f for f in dataclasses.fields(cls) if not f.metadata.get("internal")}
    hints = typing.get_type_hints(cls, vars(schema))
    aliases = ALIASES.get(path, {})
    accepted = DEEPSPEED_ACCEPTED.get(path, set())
    values: dict = {}
    spelled: dict = {}  # field name -> the key it was given as
    canonical_path = notes.canonical.get(path, path)
    for key, value in raw.items():
        where = f"{path}.{key}" if path else key
        name = aliases.get(key, key)
        notes.canonical[where] = f"{canonical_path}.{name}" if canonical_path else name
        if name in values:
            raise ConfigError(where, f"given twice (as {spelled[name]} and as {key}); keep one")
        spelled[name] = key
        if name not in fields:
            if key in accepted:
                _accepted(where, value, notes)
                continue
            raise ConfigError(where, _unknown(key, list(fields) + list(aliases)))
        f = fields[name]
        v = _value(hints[name], f, value, where, notes)
        if v is _AUTO:
            notes.auto.append(where)
            continue
        if where in INERT_REASONS:
            notes.ignored.append(f"{where} ({INERT_REASONS[where]})")
        values[name] = v
        notes.given.append(notes.canonical[where])
    return cls(**values)


def _accepted(where: str, value, notes: _Notes) -> None:
    """A DeepSpeed key infinity does not act on: refused if it would change training, else noted with why."""
    if where in REFUSED_WHEN_ON:
        on = value.get("enabled", False) if isinstance(value, dict) else bool(value)
        if on:
            raise ConfigError(where, REFUSED_WHEN_ON[where])
    reason = INERT_REASONS.get(where, "a DeepSpeed setting of its own internals, with nothing to set here")
    notes.ignored.append(f"{where} ({reason})")


def _unknown(key: str, valid: list[str]) -> str:
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.6)
    hint = f"did you mean {close[0]!r}?" if close else f"valid keys here: {', '.join(sorted(valid))}"
    return f"unknown key; {hint}"


def _describe(value) -> str:
    if isinstance(value, str):
        return f"the string {json.dumps(value)}"
    if isinstance(value, bool):
        return json.dumps(value)
    if value is None:
        return "null"
    return f"{type(value).__name__} {json.dumps(value)}" if isinstance(value, (int, float)) else type(value).__name__


def _value(hint, f: dataclasses.Field, value, where: str, notes: _Notes):
    meta = f.metadata
    if meta.get("kind") == "scheduler":
        return _scheduler(value, where, notes)
    if where == "zero_optimization" and isinstance(value, bool):  # DeepSpeed's oldest form: true means stage 1
        value = {"stage": 1 if value else 0}
    if dataclasses.is_dataclass(hint):
        return _build(hint, value, where, notes)
    optional = type(None) in typing.get_args(hint)
    if value is None:
        if optional:
            return None
        raise ConfigError(where, "must not be null; remove the key to use the default")
    if value == "auto" and "auto" not in (meta.get("choices") or ()):
        return _AUTO  # see [Note: auto] in resolve.py
    base = next((t for t in typing.get_args(hint) if t is not type(None)), hint)
    kind = meta.get("kind")
    if kind == "betas":
        return _betas(value, where)
    if kind == "size":
        return _checked_number(_size(value, where), meta, where)
    if kind == "path" and isinstance(value, list):  # several directories, one per disk
        if not value or not all(isinstance(v, str) and v for v in value):
            raise ConfigError(where, f"must be a directory or a non-empty list of directories, got {json.dumps(value)}")
        real = [os.path.realpath(v) for v in value]
        twice = sorted({v for v, r in zip(value, real) if real.count(r) > 1})
        if twice:
            raise ConfigError(where, f"lists {', '.join(twice)} more than once; give each directory once")
        return tuple(value)
    if kind in ("path", "str") or base is str:
        if not isinstance(value, str) or not value:
            raise ConfigError(where, f"must be a non-empty string, got {_describe(value)}")
        return _choice(value, meta, where)
    if base is bool:
        if not isinstance(value, bool):
            got = _describe(value)
            raise ConfigError(where, f"must be true or false (a JSON boolean, no quotes), got {got}")
        return value
    if base is int:
        return _checked_number(_integer(value, where), meta, where)
    if base is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ConfigError(where, f"must be a number, got {_describe(value)}")
        return _checked_number(float(value), meta, where)
    raise AssertionError(f"unhandled type {hint} for {where}")


def _scheduler(value, where: str, notes: _Notes):
    from infinity.optim.schedules import check_scheduler

    if not isinstance(value, dict):
        raise ConfigError(where, f"must be a JSON object with type and params, got {_describe(value)}")
    unknown = set(value) - {"type", "params"}
    if unknown:
        raise ConfigError(f"{where}.{sorted(unknown)[0]}", "unknown key; a scheduler section has type and params")
    params = value.get("params", {}) or {}
    if not isinstance(params, dict):
        raise ConfigError(f"{where}.params", f"must be a JSON object, got {_describe(params)}")
    auto = [k for k, v in params.items() if v == "auto"]
    notes.auto.extend(f"{where}.params.{k}" for k in auto)
    kind, checked = check_scheduler(value.get("type"), {k: v for k, v in params.items() if k not in auto}, where)
    return SchedulerConfig(type=kind, params=checked)


def _integer(value, where: str) -> int:
    # DeepSpeed configs write sizes as 1e9: accept floats that are whole numbers.
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(where, f"must be an integer, got {_describe(value)}")
    if isinstance(value, float) and not (math.isfinite(value) and value.is_integer()):
        raise ConfigError(where, f"must be a whole number, got {value}")
    return int(value)


def _size(value, where: str) -> int:
    if isinstance(value, str):
        try:
            return parse_size(value, name=where)
        except ValueError as exc:
            raise ConfigError(where, str(exc).split(": ", 1)[-1]) from None
    return _integer(value, where)


def _checked_number(value, meta, where: str):
    low, high = meta.get("low"), meta.get("high")
    if low is not None and value < low:
        raise ConfigError(where, f"must be >= {low}, got {value}")
    if high is not None and value > high:
        raise ConfigError(where, f"must be <= {high}, got {value}")
    return value


def _choice(value: str, meta, where: str) -> str:
    choices = meta.get("choices")
    if not choices:
        return value
    for c in choices:
        if value.lower() == c.lower():
            return c
    raise ConfigError(where, f"must be one of {', '.join(choices)}, got {json.dumps(value)}")


def _betas(value, where: str) -> tuple:
    if not (isinstance(value, list) and len(value) == 2):
        raise ConfigError(where, f"must be a list of two numbers [beta1, beta2], got {_describe(value)}")
    out = []
    for i, b in enumerate(value):
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not 0.0 <= b < 1.0:
            raise ConfigError(f"{where}[{i}]", f"must be a number in [0, 1), got {_describe(b)}")
        out.append(float(b))
    return tuple(out)


# --------------------------------------------------------------- semantics

def _partial_offload(cfg: Config, notes: _Notes) -> Config:
    """offload_optimizer.ratio < 1 acts, as in DeepSpeed 0.19, only at stage 3 with device cpu (see [Note: partial
    offload] in engine/optimizer.py); anywhere else it is reported as having no effect, and read as 1."""
    zero = cfg.zero_optimization
    off = zero.offload_optimizer
    if off.ratio >= 1.0 or (zero.stage == 3 and off.device == "cpu"):
        return cfg
    notes.ignored.append(f"zero_optimization.offload_optimizer.ratio (partial offload applies at stage 3 with device "
                         f"cpu, as in DeepSpeed; here stage is {zero.stage} and device {off.device!r})")
    return dataclasses.replace(cfg, zero_optimization=dataclasses.replace(
        zero, offload_optimizer=dataclasses.replace(off, ratio=1.0)))


def _param_offload_below_stage3(cfg: Config, notes: _Notes) -> Config:
    """offload_param below stage 3: DeepSpeed ignores it (only stage 3 partitions parameters), so it is
    accepted, said to have no effect, and read as device "none"."""
    zero = cfg.zero_optimization
    if zero.offload_param.device == "none" or zero.stage == 3:
        return cfg
    notes.ignored.append(f"zero_optimization.offload_param (device {zero.offload_param.device!r} at stage "
                         f"{zero.stage}: only stage 3 partitions the parameters, so they stay whole in memory, as "
                         "in DeepSpeed)")
    return dataclasses.replace(cfg, zero_optimization=dataclasses.replace(
        zero, offload_param=dataclasses.replace(zero.offload_param, device="none")))


def _check_semantics(cfg: Config) -> None:
    zero = cfg.zero_optimization
    if cfg.fp16.enabled and cfg.bf16.enabled:
        raise ConfigError("fp16.enabled", "fp16 and bf16 are both enabled; enable one of them")
    if zero.offload_optimizer.device != "none" and zero.stage == 0:
        raise ConfigError("zero_optimization.offload_optimizer",
                          "optimizer offload needs zero_optimization.stage >= 1")
    for name in ("offload_param", "offload_optimizer"):
        section = getattr(zero, name)
        if section.device == "nvme" and not section.nvme_path:
            raise ConfigError(f"zero_optimization.{name}.nvme_path",
                              'is required when device is "nvme"; point it at a directory on a fast disk')
    if cfg.optimizer.params.amsgrad:
        raise ConfigError("optimizer.params.amsgrad", "amsgrad is not supported; set it to false or remove it")
    tb, mb, acc = cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps or 1
    if tb is not None and mb is not None and tb % (mb * acc) != 0:
        raise ConfigError("train_batch_size",
                          f"{tb} is not a multiple of train_micro_batch_size_per_gpu x gradient_accumulation_steps "
                          f"= {mb} x {acc}; it must equal that times the number of ranks")
    if cfg.aio.block_size % 4096:
        raise ConfigError("aio.block_size", f"must be a multiple of 4096, got {cfg.aio.block_size}")
    if zero.offload_optimizer.device == "nvme" and zero.offload_optimizer.buffer_count < 3 and (
            zero.offload_optimizer.pipeline_read or zero.offload_optimizer.pipeline_write):
        raise ConfigError("zero_optimization.offload_optimizer.buffer_count",
                          f"pipelining needs at least 3 buffers (read, Adam, write), got "
                          f"{zero.offload_optimizer.buffer_count}")


def _check_paths(cfg: Config) -> None:
    """nvme_path must be a writable directory, or creatable as one, and (with direct_io) on a filesystem with
    O_DIRECT. Parsing creates nothing: a missing nvme_path is created by the engine that swaps there (the swapper
    makes its directory when it starts), so loading a config never leaves a directory behind."""
    zero = cfg.zero_optimization
    for name in ("offload_param", "offload_optimizer"):
        section = getattr(zero, name)
        if section.device != "nvme":
            continue
        for path in section.paths:
            _check_path(cfg, f"zero_optimization.{name}.nvme_path", os.path.abspath(path))


def _check_path(cfg: Config, key: str, path: str) -> None:
    """One nvme_path directory: see _check_paths."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError(key, f"{path} is not a directory")
    base = existing_ancestor(path)
    if not os.path.isdir(base):
        raise ConfigError(key, f"{path} cannot be created: {base} is not a directory; point nvme_path at a "
                               "directory on a fast disk that you can write")
    try:
        with tempfile.TemporaryFile(dir=base):
            pass
    except OSError as exc:
        what = "is not writable" if base == path else f"does not exist and cannot be created in {base}"
        raise ConfigError(key, f"{path} {what} ({exc.strerror}); choose a directory you can write") from None
    if cfg.infinity.direct_io:
        from infinity._native_loader import native

        if native is not None and native.direct_alignment(base) == 0:
            raise ConfigError(key, f"the filesystem of {path} does not support O_DIRECT; use a directory on "
                                   'a real disk, or set infinity.direct_io = false (or aio.backend = "python")')


def existing_ancestor(path: str) -> str:
    """`path` itself if it exists, else its nearest existing parent (where it would be created)."""
    path = os.path.abspath(path)
    while not os.path.exists(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return path


def check_free_space(cfg: Config, needed_bytes: int) -> None:
    """Raise if the nvme_path filesystems cannot hold `needed_bytes` of swap files between them (spread evenly
    over several paths). A quick check for scripts; initialize checks each filesystem's own need itself."""
    import shutil

    for name in ("offload_param", "offload_optimizer"):
        section = getattr(cfg.zero_optimization, name)
        if section.device == "nvme":
            share = -(-needed_bytes // len(section.paths))
            for path in section.paths:
                free = shutil.disk_usage(existing_ancestor(path)).free
                if free < share:
                    raise ConfigError(f"zero_optimization.{name}.nvme_path",
                                      f"{path} has {free / 1e9:.1f} GB free but the swap files need "
                                      f"{share / 1e9:.1f} GB there; free space or choose a bigger disk")


def check_buffer_size(cfg: Config, largest_partition_numel: int) -> None:
    """Raise, naming a size that would work, if the parameter buffers cannot hold the largest partition."""
    section = cfg.zero_optimization.offload_param
    if section.device == "nvme" and section.buffer_size < largest_partition_numel:
        raise ConfigError("zero_optimization.offload_param.buffer_size",
                          f"{section.buffer_size} elements cannot hold the largest parameter partition "
                          f"({largest_partition_numel} elements); set it to at least {largest_partition_numel}")
