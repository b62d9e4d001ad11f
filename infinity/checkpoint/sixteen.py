"""save_16bit_model and the consolidated 16-bit state dict: the model's weights in the compute dtype, gathered one
parameter at a time.

Rank 0 streams them into a safetensors file as they are gathered (header
first: every shape and dtype is known up front), so memory stays at one
parameter; a torch.save file (DeepSpeed's default pytorch_model.bin) is made
from that file through one read-only mapping, as `checkpoint export` does.
Every rank takes part in each gather.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import struct

import torch

from infinity.checkpoint.export import _ST_DTYPES, safetensors_header
from infinity.checkpoint.layout import fsync_dir
from infinity.engine.params import managed
from infinity.engine.zero_init import gathered_parameters
from infinity.swap.tier import HOST


def _entries(engine, exclude_frozen: bool) -> dict:
    """The module's state_dict entries (parameters as Parameters), less frozen parameters when asked."""
    state = engine.module.state_dict(keep_vars=True)
    return {key: t for key, t in state.items()
            if not (exclude_frozen and isinstance(t, torch.nn.Parameter) and not t.requires_grad)}


def _gathered(engine, entries: dict, *, every_rank: bool = False):
    """(key, tensor) for each entry, gathered one at a time: on rank 0 (on every rank with every_rank) its value on
    the host in the compute dtype, elsewhere None. Every rank must iterate to the end (each gather is a
    collective)."""
    dtype = engine.store.dtype
    for key, t in entries.items():
        ctx = gathered_parameters(t) if managed(t) is not None else contextlib.nullcontext()
        with ctx:
            yield key, (t.detach().to(HOST, dtype if t.is_floating_point() else t.dtype)
                        if every_rank or engine.rank == 0 else None)


def consolidated_state_dict(engine, *, exclude_frozen: bool = False, every_rank: bool = False) -> dict:
    """The full state_dict in the compute dtype on rank 0 (an empty dict elsewhere; with every_rank, on every
    rank: engine.state_dict()), gathered one parameter at a time, as DeepSpeed's
    engine._zero3_consolidated_16bit_state_dict gives it. Call it on every rank. It holds the whole model in host
    memory; save_16bit_model streams to a file instead."""
    entries = _entries(engine, exclude_frozen)
    first: dict = {}  # tied weights (one tensor under several keys) are gathered and kept once
    unique = {}
    for key, t in entries.items():
        if id(t) not in first:
            first[id(t)] = key
            unique[key] = t
    kept = {key: value.clone() for key, value in _gathered(engine, unique, every_rank=every_rank) if value is not None}
    return {key: kept[first[id(t)]] for key, t in entries.items()} if every_rank or engine.rank == 0 else {}


def save_16bit(engine, save_dir, save_filename: str, *, exclude_frozen: bool = False) -> bool:
    cfg = engine.config
    if cfg.zero_optimization.stage == 3 and not cfg.zero_optimization.stage3_gather_16bit_weights_on_model_save:
        if engine.rank == 0:
            print(f"infinity: did not save {save_filename}: zero_optimization."
                  "stage3_gather_16bit_weights_on_model_save is false (DeepSpeed saves nothing then either)")
        return False
    dtype = engine.store.dtype
    state = _entries(engine, exclude_frozen)
    names = list(state)
    out_dir = os.path.abspath(os.fspath(save_dir))
    if engine.rank == 0:
        os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, save_filename)
    st_path = path if path.endswith(".safetensors") else path + ".tmp.safetensors"
    tensors = []
    for key in names:
        t = state[key]
        out_dtype = dtype if t.is_floating_point() else t.dtype
        tensors.append((key, out_dtype, t.shape, t.numel() * torch.empty((), dtype=out_dtype).element_size()))
    f, err = None, None
    try:
        if engine.rank == 0:
            try:
                prefix = safetensors_header(tensors, {"format": "pt", "source": "infinity save_16bit_model"})
                f = open(st_path + ".part", "wb")
                f.write(prefix)
            except Exception as exc:  # noqa: BLE001 - every rank raises it below, after the gathers
                err = exc
        for _, value in _gathered(engine, state):  # every rank joins every gather, whatever rank 0's file does
            if f is not None and err is None:
                try:
                    value = value.contiguous()
                    f.write(value.reshape(-1).view(torch.uint8).numpy().tobytes() if value.numel() else b"")
                except Exception as exc:  # noqa: BLE001
                    err = exc
        if f is not None and err is None:
            try:
                f.flush()
                os.fsync(f.fileno())
                f.close()
                f = None
                os.replace(st_path + ".part", st_path)
                if st_path != path:
                    _to_torch_save(st_path, path)
                fsync_dir(out_dir)
            except Exception as exc:  # noqa: BLE001
                err = exc
    finally:
        if f is not None:
            f.close()
        if engine.rank == 0:
            for leftover in (st_path + ".part", path + ".tmp.safetensors", path + ".tmp"):
                if os.path.exists(leftover):
                    os.unlink(leftover)
    if not engine.comm.all_ok(err is None):  # no rank returns before rank 0's file is complete, or failed
        if err is not None:
            raise err
        raise RuntimeError(f"save_16bit_model: writing {path} failed on rank 0 (its own error says why)")
    return True


def _to_torch_save(st_path: str, out_path: str) -> None:
    """torch.save of tensors mapped (copy-on-write) from the safetensors file: file-backed pages, no copy of
    the model in anonymous memory."""
    dtypes = {v: k for k, v in _ST_DTYPES.items()}
    with open(st_path, "rb") as g:
        n_header = struct.unpack("<Q", g.read(8))[0]
        header = json.loads(g.read(n_header))
        base = 8 + n_header
        mm = mmap.mmap(g.fileno(), 0, access=mmap.ACCESS_COPY)
    state = {}
    for key, h in header.items():
        if key == "__metadata__":
            continue
        dtype, (lo, hi) = dtypes[h["dtype"]], h["data_offsets"]
        n = (hi - lo) // torch.empty((), dtype=dtype).element_size()
        state[key] = (torch.frombuffer(mm, dtype=dtype, count=n, offset=base + lo).view(h["shape"]) if n
                      else torch.empty(h["shape"], dtype=dtype))
    torch.save(state, out_path + ".tmp")
    del state
    with open(out_path + ".tmp", "rb") as g:
        os.fsync(g.fileno())
    os.replace(out_path + ".tmp", out_path)
