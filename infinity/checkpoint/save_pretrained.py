"""engine.save_pretrained: a partitioned model back to a Hugging Face directory, one parameter at a time.

[Note: streamed save_pretrained]
Hugging Face's own `save_pretrained` asks `model.state_dict()` for every
value at once, which a partitioned model does not have (its parameters are
placeholders between uses, and the guard in hooks.py refuses that route).
Here every shape and dtype is known before any value is read, so the shard
files' headers are written first; then each parameter is gathered on every
rank (a collective), rank 0 appends its bytes to the current shard, and the
gathered value is released before the next one. Memory stays at one
parameter, whatever the model's size. The values are the compute dtype's
(fp32 without bf16/fp16, so the engine's master weights bit for bit),
buffers keep their own dtype. Every file is written under a temporary name
and renamed once all are complete; weight files of an earlier save into the
same directory that this one does not rewrite are removed, as Hugging Face
does, so `from_pretrained` never mixes two saves.

What is written:
- a model: config.json, generation_config.json (when the model generates),
  model.safetensors or model-0000k-of-0000n.safetensors with
  model.safetensors.index.json; a tensor shared by several names (tied
  weights) is written once, under its first name, and `from_pretrained`
  ties it again;
- a peft model: the adapter (adapter_config.json, adapter_model.safetensors)
  under the names peft's `get_peft_model_state_dict` gives;
- a peft model with merge_lora: the base model with each adapter's delta
  added, computed by peft's own `get_delta_weight` on gathered values, as
  `merge_and_unload()` computes it;
- with a tokenizer, its files.
"""

from __future__ import annotations

import contextlib
import json
import os
import re

import torch

from infinity.checkpoint.export import safetensors_header
from infinity.checkpoint.layout import fsync_dir
from infinity.engine.params import managed
from infinity.engine.zero_init import gathered_parameters
from infinity.swap.tier import HOST
from infinity.units import parse_size

WEIGHTS = "model.safetensors"
ADAPTER = "adapter_model.safetensors"
_OLD_WEIGHTS = re.compile(r"^(model|pytorch_model|adapter_model)(-\d{5}-of-\d{5})?\.(safetensors|bin)(\.index\.json)?$")


class _Entry:
    """One tensor of the output: its name, how to get its full value, and its output shape and dtype."""

    __slots__ = ("key", "params", "value", "shape", "dtype")

    def __init__(self, key, params, value, shape, dtype):
        self.key, self.params, self.value, self.shape, self.dtype = key, params, value, shape, dtype

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * torch.empty((), dtype=self.dtype).element_size()


def save_pretrained(engine, save_directory, *, tokenizer=None, max_shard_size="5GB", merge_lora: bool = False,
                    adapter_name: str = "default") -> list[str]:
    """See [Note: streamed save_pretrained]. Returns the files written (on every rank)."""
    model = engine.module
    out_dir = os.path.abspath(os.fspath(save_directory))
    limit = parse_size(max_shard_size, name="save_pretrained: max_shard_size")
    if limit <= 0:
        raise ValueError(f"save_pretrained: max_shard_size must be > 0, got {max_shard_size!r}")
    peft_model = _is_peft(model)
    if merge_lora and not peft_model:
        raise ValueError("save_pretrained(merge_lora=True): the model is not a peft model, so there is no adapter to "
                         "merge; drop merge_lora")
    if peft_model and not merge_lora:
        entries, name = _adapter_entries(engine, model, adapter_name), ADAPTER
    elif peft_model:
        entries, name = _merged_entries(engine, model, adapter_name), WEIGHTS
    else:
        entries, name = _model_entries(engine, model), WEIGHTS
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise NotADirectoryError(f"save_pretrained: {out_dir} is a file; pass a directory (it is created if missing)")
    shards = _plan_shards(entries, limit if name == WEIGHTS else 1 << 62)
    names = ([name] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    rank0 = engine.rank == 0
    err = None
    written: list[str] = []
    tmp: list[str] = []
    try:
        if rank0:
            os.makedirs(out_dir, exist_ok=True)
        for fname, shard in zip(names, shards):
            path = os.path.join(out_dir, fname + ".tmp") if rank0 else None  # only rank 0 writes, or removes
            if path is not None:
                tmp.append(path)
            err = _write_shard(engine, shard, path if err is None else None, err)
        if rank0 and err is None:
            try:
                written = _write_metadata(engine, model, out_dir, names, shards, tokenizer, peft_model and not merge_lora,
                                          merge_lora, adapter_name, tmp)
                _remove_stale(out_dir, set(written), adapter=peft_model and not merge_lora)
                for path in tmp:
                    os.replace(path, path[:-len(".tmp")])
                tmp = []
                fsync_dir(out_dir)
            except Exception as exc:  # noqa: BLE001 - every rank raises below
                err = exc
    finally:
        for path in tmp:
            if os.path.exists(path):
                os.unlink(path)
    if not engine.comm.all_ok(err is None):
        if err is not None:
            raise err
        raise RuntimeError(f"save_pretrained: writing {out_dir} failed on rank 0 (its own error says why)")
    return engine.comm.broadcast_object(written if rank0 else None, 0)


def _is_peft(model) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


def _entry_for(key: str, t: torch.Tensor, dtype) -> _Entry:
    out = dtype if t.is_floating_point() else t.dtype
    if managed(t) is not None:
        return _Entry(key, [t], None, tuple(t.shape), out)
    return _Entry(key, [], t, tuple(t.shape), out)


def _unique(state: dict) -> dict:
    """Each tensor once, under its first name (tied weights)."""
    seen, out = set(), {}
    for key, t in state.items():
        if id(t) not in seen:
            seen.add(id(t))
            out[key] = t
    return out


def _model_entries(engine, model) -> list[_Entry]:
    state = _unique(model.state_dict(keep_vars=True))
    return [_entry_for(k, t, engine.store.dtype) for k, t in state.items()]


def _adapter_entries(engine, model, adapter_name) -> list[_Entry]:
    from peft import get_peft_model_state_dict

    full = model.state_dict(keep_vars=True)
    by_id = {id(t): t for t in full.values()}
    picked = get_peft_model_state_dict(model, state_dict=full, adapter_name=adapter_name)
    entries = []
    for key, t in picked.items():
        if id(t) not in by_id and _aliases_placeholder(engine, t):
            raise RuntimeError(f"save_pretrained: peft returned {key} as a new tensor made from a partitioned "
                               "parameter's placeholder, so its values are not known here; save the merged model "
                               "(merge_lora=True) or report this adapter type")
        entries.append(_entry_for(key, t, engine.store.dtype))
    return entries


def _aliases_placeholder(engine, t) -> bool:
    return isinstance(t, torch.Tensor) and engine.store.placeholder_owner(t.untyped_storage().data_ptr()) is not None


def _merged_entries(engine, model, adapter_name) -> list[_Entry]:
    """The base model's names and values, each LoRA-wrapped weight with its delta added (peft's merge)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    base = model.get_base_model()
    layers = {}
    for name, module in base.named_modules():
        if not isinstance(module, BaseTunerLayer):
            continue
        if adapter_name in getattr(module, "lora_A", {}) and not getattr(module, "use_dora", {}).get(adapter_name):
            layers[f"{name}.base_layer.weight"] = module
        elif any(adapter_name in (getattr(module, a, None) or {}) for a in
                 ("lora_embedding_A", "lora_magnitude_vector", "ia3_l", "hada_w1_a", "oft_r")):
            raise ValueError(f"save_pretrained(merge_lora=True): {name} is a {type(module).__name__} adapter "
                             "(embedding LoRA, DoRA or another tuner), which this streamed merge does not handle; "
                             "save the adapter (merge_lora=False) and merge it with peft")
    entries = []
    for key, t in _unique(base.state_dict(keep_vars=True)).items():
        if "lora_" in key:
            continue
        out_key = key.replace(".base_layer.", ".")
        e = _entry_for(out_key, t, engine.store.dtype)
        module = layers.get(key)
        if module is not None:
            e.params = [t, module.lora_A[adapter_name].weight, module.lora_B[adapter_name].weight]
            e.value = (module, adapter_name)
        entries.append(e)
    return entries


def _plan_shards(entries: list[_Entry], limit: int) -> list[list[_Entry]]:
    shards, cur, size = [], [], 0
    for e in entries:
        if cur and size + e.nbytes > limit:
            shards.append(cur)
            cur, size = [], 0
        cur.append(e)
        size += e.nbytes
    shards.append(cur)
    return shards


def _value(engine, e: _Entry) -> torch.Tensor | None:
    """The entry's full value on rank 0 (None elsewhere); every rank must call it (gathers are collectives)."""
    managed_params = [p for p in e.params if managed(p) is not None]
    ctx = gathered_parameters(managed_params) if managed_params else contextlib.nullcontext()
    with ctx, torch.no_grad():
        if isinstance(e.value, tuple):  # a LoRA-wrapped weight: base + delta, as peft merges it
            module, adapter = e.value
            full = e.params[0].detach() + module.get_delta_weight(adapter).to(e.params[0].dtype)
        elif e.value is not None:
            full = e.value.detach()
        else:
            full = e.params[0].detach()
        if engine.rank != 0:
            return None
        return full.to(HOST, e.dtype).contiguous()


def _write_shard(engine, shard: list[_Entry], path: str | None, err):
    """Write one safetensors file (rank 0, path given) while every rank joins every gather. Returns the first
    error rank 0 met (the gathers go on, so the other ranks are not left waiting)."""
    f = None
    try:
        if path is not None:
            try:
                prefix = safetensors_header([(e.key, e.dtype, e.shape, e.nbytes) for e in shard],
                                            {"format": "pt", "source": "infinity engine.save_pretrained"})
                f = open(path, "wb")
                f.write(prefix)
            except Exception as exc:  # noqa: BLE001
                err = exc
        for e in shard:
            value = _value(engine, e)
            if f is not None and err is None:
                try:
                    if not torch.isfinite(value).all() if value.is_floating_point() else False:
                        raise RuntimeError(f"save_pretrained: {e.key} has non-finite values (NaN or inf); refusing "
                                           "to write them")
                    f.write(value.reshape(-1).view(torch.uint8).numpy().tobytes() if value.numel() else b"")
                except Exception as exc:  # noqa: BLE001
                    err = exc
        if f is not None and err is None:
            f.flush()
            os.fsync(f.fileno())
    finally:
        if f is not None:
            f.close()
    return err


def _write_metadata(engine, model, out_dir, names, shards, tokenizer, adapter: bool, merged: bool, adapter_name,
                    tmp: list) -> list[str]:
    """config / generation config / index / adapter config / tokenizer files, each as a .tmp in `tmp`, except
    the tokenizer's and configs' own writers, which write in place (they are small and rewritten whole)."""
    files = list(names)
    if len(names) > 1:
        index = {"metadata": {"total_size": sum(e.nbytes for s in shards for e in s)},
                 "weight_map": {e.key: n for n, s in zip(names, shards) for e in s}}
        path = os.path.join(out_dir, "model.safetensors.index.json.tmp")
        with open(path, "w") as f:
            json.dump(index, f, indent=2)
            f.write("\n")
        tmp.append(path)
        files.append("model.safetensors.index.json")
    if adapter:
        import copy

        cfg = copy.copy(model.peft_config[adapter_name])
        cfg.inference_mode = True
        cfg.save_pretrained(out_dir)
        files.append("adapter_config.json")
    else:
        base = model.get_base_model() if merged else model
        config = getattr(base, "config", None)
        if config is not None and hasattr(config, "save_pretrained"):
            config.save_pretrained(out_dir)
            files.append("config.json")
        gen = getattr(base, "generation_config", None)
        if gen is not None and getattr(base, "can_generate", lambda: False)():
            gen.save_pretrained(out_dir)
            files.append("generation_config.json")
    if tokenizer is not None:
        files += [os.path.basename(p) for p in tokenizer.save_pretrained(out_dir)]
    return files


def _remove_stale(out_dir: str, keep: set, *, adapter: bool) -> None:
    """Weight files of an earlier save of the same kind (model or adapter) that this one does not rewrite: other
    shard counts, .bin files. The other kind stays: an adapter saved into its base model's directory must not
    delete the base model."""
    for name in os.listdir(out_dir):
        m = _OLD_WEIGHTS.match(name)
        if m and name not in keep and (m.group(1) == "adapter_model") == adapter:
            os.unlink(os.path.join(out_dir, name))
