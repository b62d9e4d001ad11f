"""save_16bit_model: the consolidated weights in the compute dtype, gathered one parameter at a time.

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

from infinity.checkpoint.export import _ST_DTYPES
from infinity.checkpoint.layout import fsync_dir
from infinity.engine.params import managed
from infinity.engine.zero_init import gathered_parameters
from infinity.swap.tier import HOST


def save_16bit(engine, save_dir, save_filename: str, *, exclude_frozen: bool = False) -> bool:
    cfg = engine.config
    if cfg.zero_optimization.stage == 3 and not cfg.zero_optimization.stage3_gather_16bit_weights_on_model_save:
        if engine.rank == 0:
            print(f"infinity: did not save {save_filename}: zero_optimization."
                  "stage3_gather_16bit_weights_on_model_save is false (DeepSpeed saves nothing then either)")
        return False
    dtype = engine.store.dtype
    state = engine.module.state_dict(keep_vars=True)
    names = []
    for key, t in state.items():
        if exclude_frozen and isinstance(t, torch.nn.Parameter) and not t.requires_grad:
            continue
        names.append(key)
    out_dir = os.path.abspath(os.fspath(save_dir))
    if engine.rank == 0:
        os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, save_filename)
    st_path = path if path.endswith(".safetensors") else path + ".tmp.safetensors"
    header, pos = {}, 0
    for key in names:
        t = state[key]
        out_dtype = dtype if t.is_floating_point() else t.dtype
        n = t.numel() * torch.empty((), dtype=out_dtype).element_size()
        header[key] = {"dtype": _ST_DTYPES[out_dtype], "shape": list(t.shape), "data_offsets": [pos, pos + n]}
        pos += n
    header["__metadata__"] = {"format": "pt", "source": "infinity save_16bit_model"}
    f, err = None, None
    try:
        if engine.rank == 0:
            try:
                text = json.dumps(header, separators=(",", ":")).encode()
                text += b" " * (-len(text) % 8)
                f = open(st_path + ".part", "wb")
                f.write(struct.pack("<Q", len(text)))
                f.write(text)
            except Exception as exc:  # noqa: BLE001 - every rank raises it below, after the gathers
                err = exc
        for key in names:  # every rank joins every gather, whatever rank 0's file does
            t = state[key]
            ctx = gathered_parameters(t) if managed(t) is not None else contextlib.nullcontext()
            with ctx:
                if f is not None and err is None:
                    try:
                        value = t.detach().to(HOST, dtype if t.is_floating_point() else t.dtype).contiguous()
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
                    _to_torch_save(st_path, header, path)
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


def _to_torch_save(st_path: str, header: dict, out_path: str) -> None:
    """torch.save of tensors mapped (copy-on-write) from the safetensors file: file-backed pages, no copy of
    the model in anonymous memory."""
    dtypes = {v: k for k, v in _ST_DTYPES.items()}
    with open(st_path, "rb") as g:
        base = 8 + struct.unpack("<Q", g.read(8))[0]
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
