"""Hugging Face `from_pretrained` under zero_init: a checkpoint streamed into this rank's shards.

[Note: streamed from_pretrained]
Plain `from_pretrained` builds the model on the meta device and then
assigns whole tensors, which a partitioned model cannot take. Inside
`zero_init` it is replaced by `load_pretrained`, which does what it does, in
an order that never holds the model:
1. the config, as `from_pretrained` reads it (the same kwargs);
2. the model, built under zero_init with initialisation skipped (HF's
   `no_init_weights`): each module is partitioned as its `__init__` ends,
   and its shards are not written yet (`ParamStore.defer_writes`);
3. every tensor of `model.safetensors` (or its sharded index, or
   `pytorch_model.bin`), read once: only the rows that hold this rank's
   shard are read, and they land on the shard's tier at once;
4. the parameters the checkpoint lacked are initialised by the model's own
   `initialize_weights`, which (as in plain HF) skips the loaded ones, so
   the RNG is consumed as a plain `from_pretrained` consumes it. Its writes
   go through [Note: partitioned access].
Tied weights are tied before loading, so the one tensor the checkpoint
keeps fills both. Peak memory beyond the store is one module under
construction (its values uninitialised) and one tensor's rows.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re

import torch

from infinity.engine.params import ParamStatus, managed
from infinity.swap.tier import HOST

log = logging.getLogger("infinity")

_UNSUPPORTED = ("_adapter_model_path", "device_map", "quantization_config", "load_in_8bit", "load_in_4bit", "gguf_file", "tp_plan",
                "from_tf", "from_flax", "max_memory", "offload_folder", "offload_state_dict")
# Hub and loading-strategy kwargs: meaningless for a local directory read this way.
_IGNORED = ("cache_dir", "force_download", "local_files_only", "token", "revision", "proxies", "resume_download",
            "low_cpu_mem_usage", "weights_only", "disable_mmap", "trust_remote_code", "_from_auto", "_from_pipeline",
            "_commit_hash", "use_auth_token", "mirror", "code_revision", "adapter_kwargs", "_adapter_model_path")


def partitioned_from_pretrained(store):
    """The `from_pretrained` classmethod body that zero_init installs on PreTrainedModel."""
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs):
        return load_pretrained(store, cls, pretrained_model_name_or_path, model_args, kwargs)
    return from_pretrained


def load_pretrained(store, cls, name_or_path, model_args, kwargs):
    """See [Note: streamed from_pretrained]."""
    from transformers import PreTrainedConfig
    from transformers.initialization import no_init_weights

    path = os.fspath(name_or_path)
    if kwargs.get("subfolder"):
        path = os.path.join(path, kwargs.pop("subfolder"))
    kwargs.pop("subfolder", None)
    if not os.path.isdir(path):
        raise OSError(f"from_pretrained under infinity.zero_init reads a local directory, and {path!r} is not one; "
                      f"download it first (huggingface_hub.snapshot_download({path!r})) and pass that directory")
    if (kwargs.get("adapter_kwargs") or {}).get("_adapter_model_path"):
        kwargs["_adapter_model_path"] = kwargs["adapter_kwargs"]["_adapter_model_path"]
    bad = sorted(k for k in _UNSUPPORTED if kwargs.get(k))
    if bad:
        raise ValueError(f"from_pretrained under infinity.zero_init: {bad} are not supported (the engine places "
                         "and partitions the weights itself); drop them")
    if model_args:
        raise TypeError("from_pretrained under infinity.zero_init: positional model arguments are not supported; "
                        "pass them as keyword arguments")
    for k in _IGNORED:
        kwargs.pop(k, None)
    config = kwargs.pop("config", None)
    want_info = kwargs.pop("output_loading_info", False)
    ignore_mismatched = kwargs.pop("ignore_mismatched_sizes", False)
    use_safetensors = kwargs.pop("use_safetensors", None)
    key_mapping = kwargs.pop("key_mapping", None) or {}
    dtype = kwargs.pop("dtype", None)
    torch_dtype = kwargs.pop("torch_dtype", None)
    _check_dtype(store, dtype if dtype is not None else torch_dtype)
    if not isinstance(config, PreTrainedConfig):
        config, kwargs = cls.config_class.from_pretrained(config if config is not None else path,
                                                          return_unused_kwargs=True, **kwargs)
    files = weight_files(path, use_safetensors)
    store.settle_staged()
    with store.writes_deferred(), no_init_weights():
        model = cls._from_config(config, dtype=torch.float32, **kwargs)
    model.tie_weights()
    targets = dict(model.state_dict(keep_vars=True))
    info = {"missing_keys": [], "unexpected_keys": [], "mismatched_keys": [], "error_msgs": []}
    loaded: set[int] = set()
    prefix = getattr(cls, "base_model_prefix", "") or ""
    for file in files:
        for key, shape, read in _tensors(file):
            name = _resolve(key, targets, prefix, key_mapping)
            if name is None:
                info["unexpected_keys"].append(key)
                continue
            target = targets[name]
            if tuple(shape) != tuple(target.shape):
                if ignore_mismatched:
                    info["mismatched_keys"].append((key, tuple(shape), tuple(target.shape)))
                    continue
                raise ValueError(f"from_pretrained: {key} in {file} has shape {tuple(shape)}, the model's {name} "
                                 f"has {tuple(target.shape)}; pass ignore_mismatched_sizes=True to keep the model's "
                                 "initialisation for it")
            _land(store, target, shape, read)
            loaded.add(id(target))
            target._is_hf_initialized = True
    info["missing_keys"] = [k for k, t in targets.items() if id(t) not in loaded]
    _filter_ignored(model, info)
    model.initialize_weights()  # only what the checkpoint lacked: HF skips tensors marked initialised
    store.settle_staged()
    for mp in store.params:  # a gathered (persistent) one's full value is its value, as in a plain build
        if mp.status is ParamStatus.GATHERED:
            mp.unwritten = False
    _write_unwritten(store, model)
    model.eval()
    model.config.name_or_path = path  # as plain from_pretrained records it (peft's adapter config and checkpoints read it)
    _generation_config(model, path)
    if info["missing_keys"]:
        log.warning("infinity: %s: %d weights were not in %s and are newly initialised: %s", cls.__name__,
                    len(info["missing_keys"]), path, info["missing_keys"][:10])
    if info["unexpected_keys"]:
        log.warning("infinity: %s: %d weights of %s were not used: %s", cls.__name__, len(info["unexpected_keys"]),
                    path, info["unexpected_keys"][:10])
    return (model, info) if want_info else model


def _check_dtype(store, dtype) -> None:
    if dtype is None or dtype == "auto":
        return
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, dtype)
    if dtype not in (torch.float32, store.dtype):
        raise ValueError(f"from_pretrained(dtype={dtype}) under infinity.zero_init: the engine keeps fp32 master "
                         f"weights and computes in the config's precision ({store.dtype}); set bf16/fp16 in the "
                         "config instead, or drop dtype")


def weight_files(path: str, use_safetensors=None) -> list[str]:
    """The checkpoint files of a save_pretrained directory, safetensors first (as HF prefers them)."""
    options = []
    if use_safetensors is not False:
        options += [("model.safetensors.index.json", True), ("model.safetensors", False)]
    if use_safetensors is not True:
        options += [("pytorch_model.bin.index.json", True), ("pytorch_model.bin", False)]
    for name, is_index in options:
        full = os.path.join(path, name)
        if not os.path.isfile(full):
            continue
        if not is_index:
            return [full]
        with open(full) as f:
            weight_map = json.load(f)["weight_map"]
        return [os.path.join(path, n) for n in sorted(set(weight_map.values()))]
    raise OSError(f"from_pretrained: {path} has none of {[n for n, _ in options]}; save the model with "
                  "save_pretrained(...) into it")


_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                       "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
                       "U8": torch.uint8, "BOOL": torch.bool}


def _tensors(file: str):
    """(key, shape, read(first_row, end_row) -> tensor of those rows) for each tensor of a checkpoint file.

    safetensors files are read with pread of just the requested rows (no mmap: mapped pages would stay
    resident and count against the memory bound); .bin files go through torch.load(mmap=True).
    """
    if file.endswith(".safetensors"):
        with open(file, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n))
            base = 8 + n
            for key, entry in header.items():
                if key == "__metadata__":
                    continue
                dtype = _SAFETENSORS_DTYPES.get(entry["dtype"])
                if dtype is None:
                    raise ValueError(f"from_pretrained: {key} in {file} has dtype {entry['dtype']}, which torch "
                                     "cannot load")
                shape = tuple(entry["shape"])
                start = base + entry["data_offsets"][0]
                yield key, shape, (lambda lo, hi, f=f, s=shape, d=dtype, o=start: _pread_rows(f, o, s, d, lo, hi))
        return
    state = torch.load(file, map_location=HOST, mmap=True, weights_only=True)
    for key, t in state.items():
        yield key, tuple(t.shape), (lambda lo, hi, t=t: t[lo:hi] if t.dim() else t)


def _pread_rows(f, offset: int, shape, dtype, lo: int, hi: int) -> torch.Tensor:
    row = math.prod(shape[1:]) if len(shape) > 1 else 1
    if not shape:
        lo, hi, row = 0, 1, 1
    esize = torch.empty((), dtype=dtype).element_size()
    nbytes = (hi - lo) * row * esize
    buf = bytearray(nbytes)
    got = os.preadv(f.fileno(), [buf], offset + lo * row * esize) if nbytes else 0
    if got != nbytes:
        raise OSError(f"from_pretrained: short read of {f.name} at byte {offset + lo * row * esize}: {got} of "
                      f"{nbytes} bytes (a truncated checkpoint file)")
    out = torch.frombuffer(buf, dtype=dtype) if nbytes else torch.empty(0, dtype=dtype)
    return out.reshape((hi - lo,) + tuple(shape[1:])) if shape else out.reshape(())


def _resolve(key: str, targets: dict, prefix: str, key_mapping: dict):
    for pattern, repl in key_mapping.items():
        key = re.sub(pattern, repl, key)
    if key in targets:
        return key
    if prefix and f"{prefix}.{key}" in targets:
        return f"{prefix}.{key}"
    if prefix and key.startswith(prefix + ".") and key[len(prefix) + 1:] in targets:
        return key[len(prefix) + 1:]
    return None


def _land(store, target: torch.Tensor, shape, read) -> None:
    """One checkpoint tensor into its place: this rank's rows into a shard, or the whole into a full tensor."""
    mp = managed(target)
    with torch.no_grad():
        if mp is None or mp.status is ParamStatus.GATHERED:
            dst = target if mp is None else mp.param.data
            dst.copy_(read(0, shape[0] if shape else 0).reshape(dst.shape))
            if mp is not None:
                mp.unwritten = False  # its full value is what initialize will shard
            return
        numel = mp.numel
        lo, hi = store.comm.rank * mp.part, min(numel, (store.comm.rank + 1) * mp.part)
        shard = torch.zeros(mp.part, dtype=mp.param.dtype)
        if hi > lo:
            row = math.prod(shape[1:]) if len(shape) > 1 else 1
            r0, r1 = lo // row, -(-hi // row)
            rows = read(r0, r1).reshape(-1)
            shard[:hi - lo].copy_(rows[lo - r0 * row:hi - r0 * row])
        store.write_shard(mp, shard, wait=True, keep_dtype=True)


def _filter_ignored(model, info: dict) -> None:
    for field, attr in (("missing_keys", "_keys_to_ignore_on_load_missing"),
                        ("unexpected_keys", "_keys_to_ignore_on_load_unexpected")):
        patterns = getattr(model, attr, None) or []
        info[field] = [k for k in info[field] if not any(re.search(p, k) for p in patterns)]


def _write_unwritten(store, model) -> None:
    """A parameter neither loaded nor initialised by the model's _init_weights would be uninitialised memory
    in plain HF; here it becomes zeros, said once."""
    names = {id(p): n for n, p in model.named_parameters()}
    empty = [mp for mp in store.params if store.unwritten(mp) and id(mp.param) in names]
    for mp in empty:
        store.write_shard(mp, torch.zeros(mp.part, dtype=mp.param.dtype), wait=True, keep_dtype=True)
    if empty:
        log.warning("infinity: %d parameters were neither in the checkpoint nor initialised by the model's "
                    "_init_weights; they start at zero: %s", len(empty), [names[id(mp.param)] for mp in empty][:10])


def _generation_config(model, path: str) -> None:
    if not getattr(model, "can_generate", lambda: False)():
        return
    try:
        from transformers import GenerationConfig

        model.generation_config = GenerationConfig.from_pretrained(path)
    except OSError:
        pass  # no generation_config.json: the one built from the model config stays, as in plain HF
