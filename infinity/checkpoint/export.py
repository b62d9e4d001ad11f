"""`infinity checkpoint export|info`: a checkpoint without the engine.

export writes a plain state_dict (fp32 parameters, buffers in their own
dtype, tied names repeated) to .safetensors or .pt. It streams: each chunk
file is read in pieces of PIECE bytes, its CRC-32C checked, and its values
(without the padding) appended to the output, so memory stays at one piece
whatever the model's size. The output appears under its name only when
complete (temp file, fsync, rename).
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import struct

import numpy as np
import torch

from infinity.checkpoint.layout import (STATES, CheckpointCorruptionError, CheckpointError, Manifest, chunk_path,
                                        fsync_dir)
from infinity.checkpoint.load import resolve
from infinity.checkpoint.stream import ChunkReader
from infinity.dtypes import BY_NAME
from infinity.io.checksum import crc32c

PIECE = 16 << 20
_ST_DTYPES = {torch.float32: "F32", torch.float64: "F64", torch.float16: "F16", torch.bfloat16: "BF16",
              torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
              torch.bool: "BOOL"}


def safetensors_header(tensors, metadata: dict) -> bytes:
    """The start of a safetensors file whose tensors follow back to back in this order: the 8-byte header
    length, then the JSON header padded with spaces to a multiple of 8. `tensors` is (name, dtype, shape,
    nbytes) per tensor."""
    header, pos = {}, 0
    for name, dtype, shape, nbytes in tensors:
        header[name] = {"dtype": _ST_DTYPES[dtype], "shape": list(shape), "data_offsets": [pos, pos + nbytes]}
        pos += nbytes
    header["__metadata__"] = metadata
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def entries(m: Manifest, state: str = "master", *, aliases: bool = True):
    """{state_dict key: (shape, dtype, chunk files as [(file key, stored bytes, bytes to keep)])}, by element size.

    aliases=False names a tied weight once (as save_pretrained does; from_pretrained ties it again)."""
    out = {}
    size = m.itemsize(state)
    for p in m.params:
        nbytes, chunk = size * p.numel, size * p.part
        files = []
        for c in range(-(-p.numel // p.part)):
            files.append((("param", state, p.name, c), chunk, min(chunk, nbytes - c * chunk)))
        out[p.name] = (p.shape, m.dtype_of(state), files)
    # tied weights: torch's state_dict names them all; safetensors cannot share storage, so they are repeated
    for alias, name in (m.aliases if aliases else {}).items():
        if name in out:  # not when the weight is a frozen one left out at save
            out[alias] = out[name]
    for e in m.extras:
        dtype = BY_NAME[e.dtype]
        n = int(np.prod(e.shape, dtype=np.int64)) * dtype.itemsize
        out[e.name] = (e.shape, dtype, [(("extra", "extra", e.name, 0), n, n)] if n else [])
    # By falling element size (stable): every tensor then starts aligned to its own element size, since the
    # data block starts 8-aligned, as torch.frombuffer and mmap readers want.
    return dict(sorted(out.items(), key=lambda kv: -kv[1][1].itemsize))


def all_chunks(root: str, m: Manifest):
    """(path, value bytes, what) of every chunk file of a checkpoint."""
    for p in m.params:
        for state in (STATES[:1] if p.frozen else STATES):
            for c in range(-(-p.numel // p.part)):
                yield chunk_path(root, state, p.name, c), m.itemsize(state) * p.part, f"{state} of parameter {p.name}"
    for e in m.extras:
        n = int(np.prod(e.shape, dtype=np.int64)) * BY_NAME[e.dtype].itemsize
        if n:
            yield chunk_path(root, "extra", e.name, 0), n, f"buffer {e.name}"


def check_array_metadata(root: str, m: Manifest) -> int:
    """Every array's zarr.json is exactly what the save wrote for it (zarr-python reads the arrays through
    them, and our loader through the manifest alone, so a corrupted one would pass every other check); the
    number checked. CheckpointError names the first that is missing, unreadable or different."""
    from infinity.checkpoint.layout import array_meta
    from infinity.checkpoint.save import ZARR_DTYPES
    from infinity.dtypes import name_of

    arrays = []
    for p in m.params:
        for state in (STATES[:1] if p.frozen else STATES):
            dt = m.dtype_of(state)
            arrays.append((os.path.dirname(chunk_path(root, state, p.name, 0)), f"{state} of parameter {p.name}",
                           array_meta(p.numel, p.part, ZARR_DTYPES[dt],
                                      attributes={"shape": list(p.shape), "dtype": name_of(dt)})))
    for e in m.extras:
        numel = int(np.prod(e.shape, dtype=np.int64))
        arrays.append((os.path.dirname(chunk_path(root, "extra", e.name, 0)), f"buffer {e.name}",
                       array_meta(numel, max(1, numel), ZARR_DTYPES[BY_NAME[e.dtype]],
                                  attributes={"shape": list(e.shape), "dtype": e.dtype})))
    for where, what, expected in arrays:
        path = os.path.join(where, "zarr.json")
        try:
            with open(path, "rb") as f:
                got = json.loads(f.read())
        except FileNotFoundError:
            raise CheckpointError(f"checkpoint {root} is corrupted: {path} ({what}) is missing") from None
        except (ValueError, UnicodeDecodeError) as exc:
            raise CheckpointError(f"checkpoint {root} is corrupted: {path} ({what}) is not valid JSON ({exc})") from None
        if got != expected:
            keys = sorted(k for k in set(got) | set(expected) if isinstance(got, dict) and got.get(k) != expected.get(k)) \
                if isinstance(got, dict) else ["(not an object)"]
            raise CheckpointError(f"checkpoint {root} is corrupted: {path} ({what}) does not describe the array the "
                                  f"manifest records (differs in {', '.join(keys)})")
    return len(arrays)


def stream_chunk(path: str, nbytes: int, keep: int, sink, stage: torch.Tensor, what: str) -> None:
    """Read a chunk file in pieces, pass its first `keep` value bytes to sink, and check its CRC-32C."""
    ChunkReader.check_size(path, nbytes, what)
    with open(path, "rb", buffering=0) as f:
        mv = memoryview(stage.numpy())
        crc, off = 0, 0
        while off < nbytes:
            n = f.readinto(mv[:min(len(mv), nbytes - off)])
            if not n:
                raise CheckpointError(f"chunk file {path} of {what} ended early at byte {off}")
            crc = crc32c(stage, n, crc)
            if sink is not None and off < keep:
                sink(mv[:min(n, keep - off)])
            off += n
        stored = int.from_bytes(f.read(4), "little")
    if crc != stored:
        raise CheckpointCorruptionError(path, what, stored, crc)


def export(directory, out_path, tag: str | None = None) -> dict:
    """Write the checkpoint's weights as a plain state_dict; returns {"path", "tensors", "bytes"}."""
    root, m = resolve(directory, tag)
    out_path = os.path.abspath(os.fspath(out_path))
    kind = "safetensors" if out_path.endswith(".safetensors") else "pt" if out_path.endswith((".pt", ".pth")) else None
    if kind is None:
        raise ValueError(f"checkpoint export: {out_path} must end in .safetensors, .pt or .pth (the format)")
    if not os.path.isdir(os.path.dirname(out_path)):
        raise FileNotFoundError(f"checkpoint export: the directory of {out_path} does not exist")
    ents = entries(m)
    st_path = out_path + ".tmp" if kind == "safetensors" else out_path + ".tmp.safetensors"
    try:
        total, offsets = _write_safetensors(root, m, ents, st_path)
        if kind == "safetensors":
            os.replace(st_path, out_path)
        else:
            _safetensors_to_pt(st_path, ents, offsets, out_path)
        fsync_dir(os.path.dirname(out_path))
    finally:
        for p in (st_path, out_path + ".tmp"):
            if os.path.exists(p):
                os.unlink(p)
    return {"path": out_path, "tensors": len(ents), "bytes": total, "left_out": list(m.excluded_frozen)}


def export_hf(directory, out_dir, tag: str | None = None, *, max_shard_bytes: int = 5 << 30,
              merge_lora: bool = False) -> dict:
    """A save_pretrained-style directory from a checkpoint of a Hugging Face model: config.json and
    model.safetensors (or model-0000k-of-0000n.safetensors with model.safetensors.index.json), streamed.
    `from_pretrained(out_dir)` loads the trained weights. A peft model's checkpoint gives its adapter, or with
    merge_lora the merged model (see [Note: a PEFT checkpoint's export]). Returns {"path", "files", "tensors",
    "bytes"}."""
    root, m = resolve(directory, tag)
    if m.peft is not None:
        return _export_peft(root, m, out_dir, merge_lora=merge_lora, max_shard_bytes=max_shard_bytes)
    if merge_lora:
        raise CheckpointError(f"checkpoint {root} is not of a peft model, so there is no adapter to merge; drop "
                              "--merge-lora")
    _refuse_excluded(root, m)
    config = m.hf_config
    if config is None:
        raise CheckpointError(f"checkpoint {root} was not saved from a Hugging Face PreTrainedModel (its manifest has "
                              "no hf_config), so there is no config.json to write; export a state_dict instead: "
                              "infinity checkpoint export DIR model.safetensors")
    return _write_hf(root, m, out_dir, entries(m, aliases=False), stem="model", max_shard_bytes=max_shard_bytes,
                     config=("config.json", config))


def _refuse_excluded(root: str, m: Manifest) -> None:
    if m.excluded_frozen:
        raise CheckpointError(f"checkpoint {root} was saved with exclude_frozen_parameters, so it lacks "
                              f"{len(m.excluded_frozen)} frozen weights (e.g. {m.excluded_frozen[0]}); from_pretrained "
                              "would initialise them at random. Load it into the model built from its base weights "
                              "and save again without exclude_frozen_parameters")


def _export_peft(root: str, m: Manifest, out_dir, *, merge_lora: bool, max_shard_bytes: int) -> dict:
    """[Note: a PEFT checkpoint's export]
    A checkpoint of a peft model records (save.peft_record), taken from the
    live model when it was saved: the adapter's config, the name peft's
    `get_peft_model_state_dict` gives each adapter tensor, the base model's
    name of every other tensor, and for each LoRA-wrapped Linear or Conv1D
    weight its lora_A, lora_B, scaling and fan_in_fan_out. The adapter export
    is then a renaming; the merged export adds (B @ A) x scaling (transposed
    for fan_in_fan_out) to the fp32 weight, as peft's merge does, one weight
    in memory at a time. What the record says it cannot merge (DoRA,
    embedding LoRA, modules_to_save) is refused by name."""
    p = m.peft
    if "unexportable" in p:
        raise CheckpointError(f"checkpoint {root} is of a peft model that export cannot write: "
                              f"{p['unexportable']}; load it into the model and save with engine.save_pretrained")
    ents = entries(m, aliases=False)
    if not merge_lora:
        missing = [name for name in p["adapter"] if name not in ents]
        if missing:
            raise CheckpointError(f"checkpoint {root} lacks adapter tensor {missing[0]}")
        config = dict(p["adapter_config"], inference_mode=True)
        return _write_hf(root, m, out_dir, {p["adapter"][k]: ents[k] for k in p["adapter"]}, stem="adapter_model",
                         max_shard_bytes=1 << 62, config=("adapter_config.json", config))
    if p["unmergeable"]:
        raise CheckpointError(f"checkpoint {root}: the adapter cannot be merged here: {p['unmergeable']}; export the "
                              "adapter (without --merge-lora) and merge it with peft's merge_and_unload")
    _refuse_excluded(root, m)
    if p["base_config"] is None:
        raise CheckpointError(f"checkpoint {root}: the peft model's base is not a Hugging Face PreTrainedModel, so "
                              "there is no config.json to write; export the adapter instead")
    out = {p["merged"][k]: ent for k, ent in ents.items() if k in p["merged"]}
    stage = torch.empty(PIECE, dtype=torch.uint8)

    def merged(name: str, d: dict):
        def value() -> torch.Tensor:
            w, a, b = (_read_tensor(root, ents[k], stage) for k in (name, d["A"], d["B"]))
            delta = (b.float() @ a.float()).to(w.dtype)
            return w + (delta.T if d["fan_in_fan_out"] else delta) * d["scaling"]
        return value
    computed = {p["merged"][k]: merged(k, d) for k, d in p["deltas"].items()}
    return _write_hf(root, m, out_dir, out, stem="model", max_shard_bytes=max_shard_bytes,
                     config=("config.json", p["base_config"]), computed=computed)


def _read_tensor(root: str, ent, stage: torch.Tensor) -> torch.Tensor:
    """One whole saved tensor (its chunks' CRCs checked)."""
    shape, dtype, files = ent
    buf = bytearray()
    for (kind, state, name, c), nbytes, keep in files:
        stream_chunk(chunk_path(root, state, name, c), nbytes, keep, buf.extend, stage, f"{state} of {name}")
    return torch.frombuffer(buf, dtype=dtype).view(shape) if buf else torch.empty(shape, dtype=dtype)


def _write_hf(root: str, m: Manifest, out_dir, ents: dict, *, stem: str, max_shard_bytes: int, config: tuple,
              computed: dict | None = None) -> dict:
    """`ents` as stem.safetensors (or stem-0000k-of-0000n.safetensors and an index) beside the config file and
    the source's tokenizer; every file under a temp name until all are complete."""
    out_dir = os.path.abspath(os.fspath(out_dir))
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise NotADirectoryError(f"checkpoint export --hf: {out_dir} is a file; give a directory")
    os.makedirs(out_dir, exist_ok=True)
    shards, cur, size = [], {}, 0
    for key, ent in ents.items():
        n = sum(k for _, _, k in ent[2])
        if cur and size + n > max_shard_bytes:
            shards.append(cur)
            cur, size = {}, 0
        cur[key] = ent
        size += n
    shards.append(cur)
    names = ([f"{stem}.safetensors"] if len(shards) == 1 else
             [f"{stem}-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    total = 0
    tmp_paths = []
    try:
        for name, part in zip(names, shards):
            tmp = os.path.join(out_dir, name + ".tmp")
            tmp_paths.append(tmp)
            n, _ = _write_safetensors(root, m, part, tmp, computed)
            total += n
        writes = [(os.path.join(out_dir, config[0]), json.dumps(config[1], indent=2, sort_keys=True) + "\n")]
        if len(shards) > 1:
            index = {"metadata": {"total_size": total},
                     "weight_map": {k: name for name, part in zip(names, shards) for k in part}}
            writes.append((os.path.join(out_dir, f"{stem}.safetensors.index.json"), json.dumps(index, indent=2) + "\n"))
        for path, text in writes:
            with open(path + ".tmp", "w") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
            tmp_paths.append(path + ".tmp")
        for name in names:
            os.replace(os.path.join(out_dir, name + ".tmp"), os.path.join(out_dir, name))
        for path, _ in writes:
            os.replace(path + ".tmp", path)
        extra = _source_files(m.hf_source, out_dir)
        fsync_dir(out_dir)
    finally:
        for p in tmp_paths:
            if os.path.exists(p):
                os.unlink(p)
    return {"path": out_dir, "files": names + extra, "tensors": len(ents), "bytes": total}


def _source_files(source: str | None, out_dir: str) -> list[str]:
    """The tokenizer and generation config of the directory the model was loaded from, when it still exists,
    so that AutoTokenizer.from_pretrained(out_dir) works; nothing (and a warning) when it is gone."""
    if source is None:
        return []
    if not os.path.isdir(source):
        import warnings

        warnings.warn(f"checkpoint export --hf: the model was loaded from {source}, which no longer exists, so the "
                      "export has no tokenizer; copy the tokenizer files into it yourself", stacklevel=3)
        return []
    files = []
    gen = os.path.join(source, "generation_config.json")
    if os.path.isfile(gen):
        import shutil

        shutil.copyfile(gen, os.path.join(out_dir, "generation_config.json"))
        files.append("generation_config.json")
    try:
        from transformers import AutoTokenizer

        files += [os.path.basename(p) for p in AutoTokenizer.from_pretrained(source).save_pretrained(out_dir)]
    except (OSError, ValueError, ImportError):
        pass  # no tokenizer there: the export is the model alone, as before
    return files


def _write_safetensors(root, m: Manifest, ents, path, computed: dict | None = None):
    """ents streamed into one safetensors file; a key in `computed` is written as computed[key]() instead
    (finite, or refused)."""
    computed = computed or {}
    offsets, pos, tensors = {}, 0, []
    for key, (shape, dtype, files) in ents.items():
        n = sum(k for _, _, k in files)
        tensors.append((key, dtype, shape, n))
        offsets[key] = pos
        pos += n
    prefix = safetensors_header(tensors, {"format": "pt", "source": "infinity checkpoint", "tag": m.tag,
                                          "global_steps": str(m.engine["global_steps"])})
    stage = torch.empty(PIECE, dtype=torch.uint8)
    with open(path, "wb") as f:
        f.write(prefix)
        for key, (shape, dtype, files) in ents.items():
            if key in computed:
                value = computed[key]().to(dtype).contiguous()
                if not torch.isfinite(value).all():
                    raise CheckpointError(f"checkpoint export: {key} is not finite (NaN or inf); refusing to write it")
                f.write(value.reshape(-1).view(torch.uint8).numpy().tobytes())
                continue
            for (kind, state, name, c), nbytes, keep in files:
                what = f"{'parameter' if kind == 'param' else 'buffer'} {name}"
                stream_chunk(chunk_path(root, state, name, c), nbytes, keep, f.write, stage, what)
        f.flush()
        os.fsync(f.fileno())
    return pos, offsets


def _safetensors_to_pt(st_path, ents, offsets, out_path):
    """torch.save of tensors memory-mapped from the streamed safetensors file (one mapping, copy-on-write):
    their pages are file-backed, so the kernel can drop them again; no copy of the model is held in
    anonymous memory."""
    with open(st_path, "rb") as f:
        base = 8 + struct.unpack("<Q", f.read(8))[0]
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    state = {}
    for key, (shape, dtype, _) in ents.items():
        n = int(np.prod(shape, dtype=np.int64))
        state[key] = (torch.frombuffer(mm, dtype=dtype, count=n, offset=base + offsets[key]).view(shape) if n
                      else torch.empty(shape, dtype=dtype))
    tmp = out_path + ".tmp"
    torch.save(state, tmp)
    del state
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, out_path)


def info(directory, tag: str | None = None, *, verify: bool = False) -> dict:
    """What a checkpoint holds (and, with verify, whether every chunk matches its CRC-32C)."""
    root, m = resolve(directory, tag)
    numel = sum(p.numel for p in m.params)
    disk = 0
    for dirpath, _, files in os.walk(root):
        disk += sum(os.path.getsize(os.path.join(dirpath, f)) for f in files)
    zero = m.config.get("zero_optimization", {})
    out = {"path": root, "tag": m.tag, "created": m.created, "world_size": m.world_size,
           "compute_dtype": m.compute_dtype, "global_steps": m.engine["global_steps"],
           "skipped_steps": m.engine["skipped_steps"], "lr": m.engine["lr"],
           "loss_scale": m.engine["loss_scaler"]["scale"], "parameters": numel,
           "tensors": len(m.params), "tied": len(m.aliases), "buffers": len(m.extras),
           "states": list(m.states), "moments_dtype": m.moments_dtype, "bytes_on_disk": disk,
           "offload": {"param": zero.get("offload_param", {}).get("device"),
                       "optimizer": zero.get("offload_optimizer", {}).get("device")},
           "client_state": m.client_state}
    latest = os.path.join(os.path.dirname(root), "latest")
    out["is_latest"] = os.path.exists(latest) and open(latest).read().strip() == m.tag
    if verify:
        out["verified_arrays"] = check_array_metadata(root, m)
        stage = torch.empty(PIECE, dtype=torch.uint8)
        out["verified_bytes"] = 0
        for path, nbytes, what in all_chunks(root, m):
            stream_chunk(path, nbytes, 0, None, stage, what)
            out["verified_bytes"] += nbytes
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="action", required=True)
    e = sub.add_parser("export", help="write a plain fp32 state_dict (.safetensors or .pt), streamed")
    e.add_argument("dir", help="checkpoint directory (the save_dir given to save_checkpoint)")
    e.add_argument("out", nargs="?", help="output file: NAME.safetensors or NAME.pt (or use --hf)")
    e.add_argument("--hf", metavar="OUT_DIR", help="write a Hugging Face model directory instead (config.json and "
                   "model.safetensors, sharded above --max-shard-size), for from_pretrained(OUT_DIR)")
    e.add_argument("--max-shard-size", default="5GiB", help="with --hf: the largest safetensors file (default 5GiB)")
    e.add_argument("--merge-lora", action="store_true", help="with --hf, for a peft model's checkpoint: write the "
                   "base model with the LoRA deltas merged in (default: the adapter)")
    e.add_argument("--tag", help="checkpoint tag (default: the one DIR/latest names)")
    i = sub.add_parser("info", help="summarise what a checkpoint holds")
    i.add_argument("dir")
    i.add_argument("--tag")
    i.add_argument("--verify", action="store_true", help="also read every chunk and check its CRC-32C")
    i.add_argument("--json", action="store_true")


def run(args) -> int:
    if args.action == "export" and args.hf:
        if args.out:
            raise SystemExit("infinity checkpoint export: give either an output file or --hf OUT_DIR, not both")
        from infinity.units import parse_size

        r = export_hf(args.dir, args.hf, args.tag,
                      max_shard_bytes=parse_size(args.max_shard_size, name="--max-shard-size"),
                      merge_lora=args.merge_lora)
        print(f"wrote {r['path']}: {', '.join(r['files'])}; {r['tensors']} tensors, {r['bytes'] / 2**20:.1f} MiB")
        return 0
    if args.action == "export":
        if args.merge_lora:
            raise SystemExit("infinity checkpoint export: --merge-lora goes with --hf OUT_DIR")
        if not args.out:
            raise SystemExit("infinity checkpoint export: give an output file (NAME.safetensors or NAME.pt) or "
                             "--hf OUT_DIR")
        r = export(args.dir, args.out, args.tag)
        print(f"wrote {r['path']}: {r['tensors']} tensors, {r['bytes'] / 2**20:.1f} MiB")
        if r["left_out"]:
            print(f"note: {len(r['left_out'])} frozen parameters were left out when it was saved "
                  f"(exclude_frozen_parameters) and are not in the file: {r['left_out'][:3]}")
        return 0
    r = info(args.dir, args.tag, verify=args.verify)
    if args.json:
        print(json.dumps(r, indent=1))
        return 0
    print(f"checkpoint {r['path']}" + (" (latest)" if r["is_latest"] else ""))
    print(f"  saved {r['created']} by {r['world_size']} rank(s), step {r['global_steps']} "
          f"({r['skipped_steps']} skipped), lr {r['lr'][0]:g}, loss scale {r['loss_scale']:g}")
    print(f"  {r['parameters'] / 1e6:.2f}M parameters in {r['tensors']} tensors ({r['tied']} tied names), "
          f"{r['buffers']} buffers; compute dtype {r['compute_dtype']}; states {', '.join(r['states'])} "
          f"(moments in {r['moments_dtype']})")
    print(f"  saved with offload_param={r['offload']['param']}, offload_optimizer={r['offload']['optimizer']}; "
          f"{r['bytes_on_disk'] / 2**20:.1f} MiB on disk")
    if r["client_state"] is not None:
        print(f"  client_state: {json.dumps(r['client_state'])[:200]}")
    if "verified_bytes" in r:
        print(f"  every array's zarr.json is the one saved ({r['verified_arrays']} arrays), and every chunk "
              f"matches its CRC-32C ({r['verified_bytes'] / 2**20:.1f} MiB checked)")
    return 0
