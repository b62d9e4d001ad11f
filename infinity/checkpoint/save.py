"""engine.save_checkpoint: every rank streams its own shards into the zarr store; rank 0 commits.

The data path of a save (see [Note: checkpoint layout] and [Note: atomic checkpoint]):
  rank 0      DIR/.<tag>.partial: the group and array metadata
  every rank  optimizer groups one at a time (NVMe: read into a pool buffer, the next read overlapping
              this group's writes) -> one chunk file per (state, parameter): values, then CRC-32C;
              its RNG states; syncfs
  rank 0      buffers and frozen parameters; the root zarr.json (the manifest, "complete"); syncfs;
              rename to DIR/<tag>; DIR/latest
Each phase ends with an all-ranks agreement, so a failure on any rank stops
every rank with an error, and rank 0 removes the partial directory.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import os
import pickle
import random
import shutil
import signal
import sys
import threading
import time

import numpy as np
import torch

from infinity.checkpoint.layout import (FORMAT, PARTIAL_SUFFIX, STATES, VERSION, CheckpointError, array_meta, check_tag,
                                        chunk_path, crc_of, default_tag, exchange_or_rename, fsync_dir, group_meta,
                                        partial_dir, read_latest, sync_filesystem, write_json, write_latest)
from infinity.checkpoint.stream import ChunkWriter, open_io
from infinity.dtypes import name_of
from infinity.swap.state import moments_name, value_dtype
from infinity.engine.comm import together as comm_together
from infinity.engine.params import managed

# zarr v3 has no bfloat16: such arrays are stored as uint16 with the real dtype in their attributes.
ZARR_DTYPES = {torch.float32: "float32", torch.float64: "float64", torch.float16: "float16",
               torch.bfloat16: "uint16", torch.int64: "int64", torch.int32: "int32", torch.int16: "int16",
               torch.int8: "int8", torch.uint8: "uint8", torch.bool: "bool"}


def together(comm, what: str, fn, on_failure=None):
    """comm.together for a phase of a checkpoint: the other ranks raise CheckpointError."""
    return comm_together(comm, f"checkpoint {what}", fn, on_failure, error=CheckpointError)


def extra_tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """state_dict entries the engine does not partition: buffers and frozen parameters."""
    return {k: v.detach() for k, v in module.state_dict(keep_vars=True).items() if managed(v) is None}


def aliases(module: torch.nn.Module) -> dict[str, str]:
    """state_dict keys that name a managed parameter saved under another name (tied weights)."""
    out = {}
    for k, v in module.state_dict(keep_vars=True).items():
        mp = managed(v)
        if mp is not None and mp.name != k:
            out[k] = mp.name
    return out


def rng_state() -> dict:
    np_state = np.random.get_state()
    state = {"torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode(),
             "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
             "python": [random.getstate()[0], list(random.getstate()[1]), random.getstate()[2]]}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [base64.b64encode(s.numpy().tobytes()).decode() for s in torch.cuda.get_rng_state_all()]
    return state


def _jsonable(value, what: str, *, exact: bool = False):
    """value as strict JSON carries it (tuples become lists, unless exact); else a TypeError naming `what`."""
    try:
        back = json.loads(json.dumps(value, allow_nan=False))
    except (TypeError, ValueError) as exc:
        raise TypeError(f"save_checkpoint: {what} must be JSON-serialisable (dicts with str keys, lists, str, "
                        f"finite numbers, bool, None): {exc}") from None
    if back != (value if exact else _lists(value)):
        raise TypeError(f"save_checkpoint: {what} does not survive a JSON round trip unchanged (dict keys that "
                        "are not str?)")
    return back


def _lists(x):
    if isinstance(x, (list, tuple)):
        return [_lists(v) for v in x]
    if isinstance(x, dict):
        return {k: _lists(v) for k, v in x.items()}
    return x


def client_state_entries(client_state) -> dict:
    """client_state as JSON when it survives the round trip exactly, else pickled (DeepSpeed's rule: any
    picklable object); load_checkpoint gives back the same object either way."""
    try:
        return {"client_state": _jsonable(client_state, "client_state", exact=True)}
    except TypeError:
        try:
            data = pickle.dumps(client_state)
        except Exception as exc:  # noqa: BLE001 - whatever pickle raises, the user's object is at fault
            raise TypeError(f"save_checkpoint: client_state must be picklable: {exc}") from None
        return {"client_state": None, "client_state_pickle": base64.b64encode(data).decode()}


def scheduler_state(sched) -> dict | None:
    """The lr scheduler's state_dict: as JSON when that carries it exactly, else pickled (e.g. MultiStepLR's
    milestones are a Counter with int keys, which JSON would turn into strings)."""
    if sched is None:
        return None
    state = sched.state_dict()
    try:
        return {"type": type(sched).__name__, "json": _jsonable(state, "the lr scheduler's state", exact=True)}
    except TypeError:
        return {"type": type(sched).__name__, "pickle": base64.b64encode(pickle.dumps(state)).decode()}


def manifest(engine, tag: str, client_state, *, exclude_frozen: bool = False) -> dict:
    store, opt = engine.store, engine.optimizer
    extras = extra_tensors(engine.module)
    excluded = {"excluded_frozen": [mp.name for mp in store.params if not mp.trainable]} if exclude_frozen else {}
    return {
        "format": FORMAT, "version": VERSION, "complete": True, "tag": tag, "world_size": engine.comm.world,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "compute_dtype": name_of(store.dtype), "states": list(STATES), "moments_dtype": moments_name(opt.moments),
        "params": [{"name": mp.name, "shape": list(mp.shape), "numel": mp.numel, "part": mp.part,
                    "frozen": not mp.trainable} for mp in store.params if mp.trainable or not exclude_frozen],
        "hf_config": hf_config(engine.module),
        "hf_source": hf_source(engine.module),
        "peft": peft_record(engine.module, {mp.name for mp in store.params} | set(extras)),
        "aliases": aliases(engine.module),
        "extras": [{"name": k, "shape": list(v.shape), "dtype": name_of(v.dtype)}
                   for k, v in extras.items()],
        "engine": {"global_steps": engine.global_steps, "skipped_steps": engine.skipped_steps,
                   "micro_steps": engine.micro_steps, "optimizer_steps": opt.step_count,
                   "lr": [float(g["lr"]) for g in opt.param_groups], "loss_scaler": engine.scaler.state_dict(),
                   "fp16": bool(engine.config.fp16.enabled), "lr_scheduler": scheduler_state(engine.lr_scheduler)},
        **client_state_entries(client_state),
        "config": json.loads(json.dumps(dataclasses.asdict(engine.config), default=str)),
        **excluded,
    }


def states_of(mp) -> tuple:
    """What a checkpoint holds of a managed parameter: a frozen one has weights and no optimizer state."""
    return STATES if mp.trainable else STATES[:1]


def write_frozen(store, w, partial: str) -> None:
    """This rank's shard of every frozen partitioned parameter (PEFT's base weights), one at a time, as fp32
    `master` chunks: the checkpoint then holds the whole model, and `export` writes it."""
    rank = store.comm.rank
    for mp in store.params:
        if mp.trainable or rank * mp.part >= mp.numel:
            continue
        shard = store.read_shard(mp, torch.float32)
        w.write(chunk_path(partial, "master", mp.name, rank), shard)
        w.wait_upto(w.mark())  # the shard is a temporary: its write lands before the next is read


def hf_config(module) -> dict | None:
    """A Hugging Face model's config (for `checkpoint export --hf`), or None for any other module."""
    mu = sys.modules.get("transformers.modeling_utils")
    if mu is None or not isinstance(module, mu.PreTrainedModel):
        return None
    return json.loads(module.config.to_json_string())


def peft_record(module, names: set) -> dict | None:
    """For a peft model, what `checkpoint export --hf` needs to write its adapter or the merged model without
    peft's modules (see [Note: a PEFT checkpoint's export]); None for any other module. It never stops a save:
    a model it cannot describe is recorded as one that export refuses, with the reason."""
    if not (hasattr(module, "peft_config") and hasattr(module, "get_base_model")):
        return None
    try:
        return _peft_record(module, names)
    except Exception as exc:  # noqa: BLE001 - the checkpoint itself is still good
        return _no_peft_export(f"describing the peft model failed ({type(exc).__name__}: {exc})")


def _peft_record(module, names: set) -> dict:
    from peft import get_peft_model_state_dict
    from peft.tuners.tuners_utils import BaseTunerLayer

    adapter_name = getattr(module, "active_adapter", "default")
    adapter_name = adapter_name if isinstance(adapter_name, str) else adapter_name[0]
    state = module.state_dict(keep_vars=True)
    name_of = {id(t): k for k, t in state.items()}
    adapter = {}
    for key, t in get_peft_model_state_dict(module, state_dict=state, adapter_name=adapter_name).items():
        if name_of.get(id(t)) not in names:
            return _no_peft_export(f"peft gives {key} as a tensor that is not one of the model's own")
        adapter[name_of[id(t)]] = key
    prefix = "base_model.model."  # where peft's tuner keeps the base model inside the PeftModel
    if not all(k.startswith(prefix) for k in state):
        return _no_peft_export(f"its state_dict keys do not all start with {prefix!r} (a peft type other than a "
                               "LoRA-style tuner)")
    deltas, unmergeable = {}, None
    if any(".modules_to_save." in k for k in state):
        unmergeable = "it has modules_to_save, whose trained copies this merge does not place"
    for mname, sub in module.named_modules():
        if not isinstance(sub, BaseTunerLayer):
            continue
        if getattr(sub, "merged", False):
            unmergeable = f"{mname} already has an adapter merged into its weight"
        elif getattr(sub, "lora_bias", {}).get(adapter_name):
            unmergeable = f"{mname} has a LoRA bias (lora_bias=True), which this merge does not add"
        if adapter_name in getattr(sub, "lora_A", {}) and not getattr(sub, "use_dora", {}).get(adapter_name) and \
                isinstance(sub.get_base_layer().weight, torch.Tensor):
            deltas[f"{mname}.base_layer.weight"] = {
                "A": f"{mname}.lora_A.{adapter_name}.weight", "B": f"{mname}.lora_B.{adapter_name}.weight",
                "scaling": float(sub.scaling[adapter_name]), "fan_in_fan_out": bool(getattr(sub, "fan_in_fan_out",
                                                                                              False)),
                "kind": type(sub.get_base_layer()).__name__}
            if deltas[f"{mname}.base_layer.weight"]["kind"] not in ("Linear", "Conv1D"):
                unmergeable = f"{mname} wraps a {deltas[f'{mname}.base_layer.weight']['kind']}"
        else:
            unmergeable = f"{mname} is a {type(sub).__name__} adapter (embedding LoRA, DoRA or another tuner)"
    merged = {k: k[len(prefix):].replace(".base_layer.", ".") for k in state if "lora_" not in k}
    config = module.peft_config[adapter_name].to_dict()
    return {"adapter_name": adapter_name, "adapter_config": json.loads(json.dumps(config, default=_peft_json)),
            "adapter": adapter, "merged": merged, "deltas": deltas, "unmergeable": unmergeable,
            "base_config": hf_config(module.get_base_model())}


def _peft_json(o):
    """json.dumps' default for a peft config: sets (target_modules) as sorted lists, enums as their value."""
    return sorted(o) if isinstance(o, (set, frozenset)) else str(o)


def _no_peft_export(reason: str) -> dict:
    """The record of a peft model that export cannot write as an adapter: it says why."""
    return {"unexportable": reason}


def hf_source(module) -> str | None:
    """The local directory a Hugging Face model (or a peft model's base) was loaded from, when it is one:
    `checkpoint export --hf` copies its tokenizer and generation config."""
    base = module.get_base_model() if hasattr(module, "get_base_model") else module
    path = getattr(getattr(base, "config", None), "name_or_path", None)
    return os.path.abspath(path) if isinstance(path, str) and path and os.path.isdir(path) else None


CRASH_POINTS = ("prepared", "group", "written", "marked", "renamed")


def crash_point(name: str) -> None:
    """Test hook for the crash tests: INFINITY_CHECKPOINT_CRASH_AT=<name> SIGKILLs this process at that point."""
    if os.environ.get("INFINITY_CHECKPOINT_CRASH_AT") == name:
        os.kill(os.getpid(), signal.SIGKILL)


def save(engine, directory, tag: str | None = None, client_state=None, *, save_latest: bool = True,
         exclude_frozen: bool = False, own_dir: bool = True) -> str:
    """See Engine.save_checkpoint. Three phases, each ended by an agreement of every rank (a failure anywhere
    removes the partial directory): rank 0 prepares it, every rank writes its shards, rank 0 commits."""
    comm, rank = engine.comm, engine.comm.rank
    _check_savable(engine)
    directory = os.path.abspath(os.fspath(directory))
    tag = check_tag(default_tag(engine.global_steps) if tag is None else tag)
    meta = manifest(engine, tag, client_state, exclude_frozen=exclude_frozen)
    partial = partial_dir(directory, tag)
    final = os.path.join(directory, tag)
    metadata = _metadata(engine, exclude_frozen)

    def discard():
        if rank == 0:
            shutil.rmtree(partial, ignore_errors=True)

    together(comm, "preparation", lambda: _prepare(engine, directory, partial, metadata, own_dir) if rank == 0
             else None, discard)
    crash_point("prepared")
    together(comm, "write", lambda: _write_rank(engine, partial, metadata, exclude_frozen), discard)
    crash_point("written")
    together(comm, "commit", lambda: _commit(directory, partial, final, tag, meta, save_latest) if rank == 0
             else None, discard)
    return final


def _check_savable(engine) -> None:
    """A checkpoint holds no gradients: refuse a save in the middle of an accumulation or a backward."""
    if not engine.boundary_forced and engine.micro_steps % engine.gas:
        raise RuntimeError(f"save_checkpoint: called after {engine.micro_steps % engine.gas} of "
                           f"{engine.gas} micro-batches of gradient accumulation; the accumulated gradients are not "
                           "part of a checkpoint, so save after engine.step()")
    if engine.gradients_pending():
        raise RuntimeError("save_checkpoint: called between engine.backward() and engine.step(); the gradients "
                           "(or a step taken during backward) are not part of a checkpoint, so save after "
                           "engine.step()")


def _metadata(engine, exclude_frozen: bool) -> dict:
    """Relative directory -> the zarr.json of each group and array. The directories are made in the preparation
    (every rank writes chunks into them), the files on a thread of rank 0 while the chunk writes run."""
    metadata = {state: group_meta() for state in STATES + ("extra", "ranks")}
    for mp in engine.store.params:
        if exclude_frozen and not mp.trainable:
            continue
        for state in states_of(mp):
            dt = value_dtype(engine.optimizer.moments) if state != STATES[0] else torch.float32
            metadata[os.path.join(state, mp.name)] = array_meta(
                mp.numel, mp.part, ZARR_DTYPES[dt], attributes={"shape": list(mp.shape), "dtype": name_of(dt)})
    for name, t in extra_tensors(engine.module).items():
        metadata[os.path.join("extra", name)] = array_meta(
            t.numel(), max(1, t.numel()), ZARR_DTYPES[t.dtype],
            attributes={"shape": list(t.shape), "dtype": name_of(t.dtype)})
    return metadata


def _prepare(engine, directory: str, partial: str, metadata: dict, own_dir: bool) -> None:
    """Rank 0: the save directory (owned by this run with own_dir), with killed saves removed, and the partial
    checkpoint's directory tree."""
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise NotADirectoryError(f"save_checkpoint: {directory} exists and is not a directory")
    os.makedirs(directory, exist_ok=True)
    if not os.access(directory, os.W_OK):
        raise PermissionError(f"save_checkpoint: {directory} is not writable")
    if own_dir:
        engine.own_save_dir(directory)  # before anything in it is touched
    for name in os.listdir(directory):  # saves that were killed (one save into a directory at a time)
        if name.startswith(".") and (name.endswith(PARTIAL_SUFFIX) or name.endswith(PARTIAL_SUFFIX + ".old")):
            shutil.rmtree(os.path.join(directory, name), ignore_errors=True)
    os.mkdir(partial)
    for d in metadata:
        os.mkdir(os.path.join(partial, d))


def _write_rank(engine, partial: str, metadata: dict, exclude_frozen: bool) -> None:
    """Every rank: its RNG states, and one chunk per (state, parameter) of its shards, streamed from the
    optimizer's groups; rank 0 also the buffers, and (on a thread) the metadata files. Synced when done."""
    rank, store = engine.comm.rank, engine.store
    os.mkdir(os.path.join(partial, "ranks", str(rank)))
    rng = rng_state()
    write_json(os.path.join(partial, "ranks", str(rank), "zarr.json"),
               group_meta({"rng": rng, "rng_crc32c": crc_of(rng)}))
    io = open_io(engine.config, partial)
    meta_writer = MetadataWriter(partial, metadata) if rank == 0 else None
    w = ChunkWriter(io)  # one window for all groups: its cap bounds the open files
    try:
        def use(g, p, m, v):
            try:
                for mp, off, lo, hi in g.entries():
                    if rank * mp.part >= mp.numel:  # this rank's shard is all padding: no chunk
                        continue
                    for state, t in zip(STATES, (p, m, v)):  # bf16 moments: their bytes, as uint16
                        path = chunk_path(partial, state, mp.name, rank)
                        if (lo, hi) == (0, mp.part):
                            w.write(path, t[off:off + mp.part])
                        else:  # a piece of a split shard: the pieces come in order
                            w.write_piece(path, t[off:off + hi - lo], last=hi == mp.part)
            except BaseException:
                w.finish_quietly()  # the views must outlive every write that was submitted
                raise
            crash_point("group")
            mark = w.mark()
            return lambda: w.wait_upto(mark)

        engine.optimizer.export_state(use)
        if not exclude_frozen:
            write_frozen(store, w, partial)
        if rank == 0:
            for name, t in extra_tensors(engine.module).items():
                if t.numel():
                    flat = t.reshape(-1).cpu().contiguous()
                    w.write(chunk_path(partial, "extra", name, 0),
                            flat.view(torch.uint16) if flat.dtype == torch.bfloat16 else flat)
        w.finish()
    except BaseException:
        w.finish_quietly()  # nothing may still be writing from the state once we return
        raise
    finally:
        io.close()
        if meta_writer is not None:
            meta_writer.join(raise_error=sys.exc_info()[0] is None)
    sync_filesystem(partial)


def _commit(directory: str, partial: str, final: str, tag: str, meta: dict, save_latest: bool) -> None:
    """Rank 0: the manifest (the checkpoint is complete from here), the rename to its tag, and `latest`."""
    write_json(os.path.join(partial, "zarr.json"), group_meta({"infinity_checkpoint": meta,
                                                               "infinity_checkpoint_crc32c": crc_of(meta)}))
    sync_filesystem(partial)
    crash_point("marked")
    exchanged = exchange_or_rename(partial, final, dst_is_latest=read_latest(directory) == tag)
    fsync_dir(directory)
    crash_point("renamed")
    if save_latest:
        write_latest(directory, tag)
    if exchanged:  # `partial` now holds the checkpoint this one replaced
        shutil.rmtree(partial, ignore_errors=True)


class MetadataWriter(threading.Thread):
    """Writes the zarr.json of every group and array (rank 0, beside the chunk writes); join() raises its error."""

    def __init__(self, root: str, metadata: dict):
        super().__init__(name="infinity-checkpoint-metadata", daemon=True)
        self.root, self.metadata, self.error = root, metadata, None
        self.start()

    def run(self) -> None:
        try:
            for d, meta in self.metadata.items():
                write_json(os.path.join(self.root, d, "zarr.json"), meta)
        except BaseException as exc:  # noqa: BLE001 - raised by join()
            self.error = exc

    def join(self, timeout=None, *, raise_error: bool = True) -> None:
        super().join(timeout)
        if self.error is not None and raise_error:
            raise self.error


