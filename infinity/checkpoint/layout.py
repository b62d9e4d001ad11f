"""What a checkpoint looks like on disk: a zarr v3 group, one array per parameter and state.

[Note: checkpoint layout]
    DIR/latest                        the tag of the newest complete checkpoint (text, replaced atomically)
    DIR/<tag>/zarr.json               root group; its attributes hold the manifest (written last: see below)
    DIR/<tag>/<state>/<param>/        one 1-D array per (state, parameter), state one of master
                                      (float32), exp_avg, exp_avg_sq (float32, or bfloat16 stored as
                                      uint16 with bf16 moments: the manifest's moments_dtype); shape
                                      (numel,), chunk (part,)
    DIR/<tag>/<state>/<param>/c.<r>   chunk r = the shard rank r owned when saving: part values + CRC-32C
    DIR/<tag>/extra/<name>/c.0        buffers and frozen parameters (replicated; rank 0 writes them)
    DIR/<tag>/ranks/<r>/zarr.json     rank r's RNG states, in the group's attributes

Arrays use the `bytes` codec (little endian) and the `crc32c` codec, so a
chunk file is the raw values followed by their 4-byte CRC-32C, and any zarr
v3 reader (zarr-python's `zarr.open_group`) reads them and checks the sums.
A chunk is exactly a rank's shard (see [Note: shard layout]): every rank
writes only its own chunks, and the last chunk carries the zero padding,
as zarr stores edge chunks at full size.

[Note: atomic checkpoint]
A save writes everything under DIR/.<tag>.partial, syncs the filesystem,
then writes the root zarr.json with `"complete": true`, syncs again, and
renames the directory to DIR/<tag> (exchanging it with an older <tag> in one
renameat2 call when there is one). Only then is DIR/latest replaced (temp
file, fsync, rename, fsync of DIR). A save killed at any moment therefore
leaves DIR/latest naming the previous complete checkpoint, whose files were
never opened for writing. The next save into DIR removes every leftover
DIR/.*.partial (one save into a directory at a time). The manifest and each
rank's RNG record carry a CRC-32C of their canonical JSON.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import json
import os
import re
from dataclasses import dataclass, field

import torch

from infinity.dtypes import BY_NAME
from infinity.errors import CheckpointError, CheckpointCorruptionError  # noqa: F401 - raised here, defined there

FORMAT = "infinity-checkpoint"
VERSION = 1
STATES = ("master", "exp_avg", "exp_avg_sq")
LATEST = "latest"
PARTIAL_SUFFIX = ".partial"
_TAG = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.+-]{0,127}$")


_REQUIRED = object()


def _unusable(root: str, what: str, why: str) -> CheckpointError:
    return CheckpointError(f"checkpoint {root} is corrupted: its manifest's {what} is unusable ({why})")


def _take(d: dict, key: str, kind, root: str, where: str = "", default=_REQUIRED):
    """d[key] if it is a `kind` (a type or tuple of types; bool is no int here), else d's default when key is
    absent and there is one; else a CheckpointError naming root and the field."""
    what = f"{where}.{key}" if where else key
    if key not in d:
        if default is _REQUIRED:
            raise _unusable(root, what, "missing")
        return default
    value, kinds = d[key], kind if isinstance(kind, tuple) else (kind,)
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        expected = " or ".join("None" if k is type(None) else k.__name__ for k in kinds)
        raise _unusable(root, what, f"{type(value).__name__} where {expected} was expected")
    return value


def _count(d: dict, key: str, root: str, where: str, low: int) -> int:
    value = _take(d, key, int, root, where)
    if value < low:
        raise _unusable(root, f"{where}.{key}" if where else key, f"{value} is below {low}")
    return value


def _shape(d: dict, root: str, where: str) -> tuple[int, ...]:
    shape = _take(d, "shape", list, root, where)
    if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape):
        raise _unusable(root, f"{where}.shape", f"{shape!r} is not a list of sizes")
    return tuple(shape)


def _entries(d: dict, key: str, root: str, default=_REQUIRED) -> list[tuple[str, dict]]:
    """(field name, entry) of each object in the list d[key]."""
    items = _take(d, key, list, root, default=default)
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise _unusable(root, f"{key}[{i}]", f"{type(item).__name__} where dict was expected")
    return [(f"{key}[{i}]", item) for i, item in enumerate(items)]


@dataclass(frozen=True, slots=True, kw_only=True)
class SavedParam:
    """One partitioned parameter in a checkpoint: a 1-D float32 array per state, chunked by the saving shards."""

    name: str
    """Its name: the managed parameter's (state_dict key) and its arrays' directory under each state."""
    shape: tuple[int, ...]
    """Its shape in the model."""
    numel: int
    """Its number of elements: the arrays' length (without padding)."""
    part: int
    """Elements per chunk: the shard size of the saving world, so chunk r is what rank r owned."""
    frozen: bool = False
    """Saved frozen (requires_grad=False): only `master` holds it, there is no optimizer state."""

    @classmethod
    def parse(cls, d: dict, root: str, where: str) -> SavedParam:
        return cls(name=_take(d, "name", str, root, where), shape=_shape(d, root, where),
                   numel=_count(d, "numel", root, where, 0), part=_count(d, "part", root, where, 1),
                   frozen=_take(d, "frozen", bool, root, where, False))


@dataclass(frozen=True, slots=True, kw_only=True)
class SavedExtra:
    """A buffer or frozen unpartitioned parameter in a checkpoint: one chunk, extra/<name>/c.0, in its own dtype."""

    name: str
    """Its state_dict key, and its array's directory under extra/."""
    shape: tuple[int, ...]
    """Its shape in the model."""
    dtype: str
    """Its dtype's name (a key of infinity.dtypes.BY_NAME: "float32", "bfloat16", ...)."""

    @classmethod
    def parse(cls, d: dict, root: str, where: str) -> SavedExtra:
        from infinity.dtypes import BY_NAME

        dtype = _take(d, "dtype", str, root, where)
        if dtype not in BY_NAME:
            raise _unusable(root, f"{where}.dtype", f"unknown dtype {dtype!r}")
        return cls(name=_take(d, "name", str, root, where), shape=_shape(d, root, where), dtype=dtype)


@dataclass(frozen=True, slots=True, kw_only=True)
class Manifest:
    """A checkpoint's manifest (the root zarr.json's infinity_checkpoint attribute), as save.manifest writes it."""

    version: int
    """The format version it was written in (at most VERSION)."""
    tag: str
    """The tag it was saved under."""
    world_size: int
    """How many ranks saved it (RNG states are per rank: only a load into as many ranks restores them)."""
    created: str
    """When it was saved: UTC, %Y-%m-%dT%H:%M:%SZ."""
    compute_dtype: str
    """The engine's compute dtype's name."""
    states: tuple[str, ...]
    """The optimizer states it holds per trainable parameter (STATES)."""
    params: tuple[SavedParam, ...]
    """Every partitioned parameter, in the engine's registration order."""
    extras: tuple[SavedExtra, ...] = ()
    """Buffers and frozen unpartitioned parameters."""
    aliases: dict[str, str] = field(default_factory=dict)
    """state_dict keys of tied weights -> the name of the parameter saved for them."""
    engine: dict | None = None
    """Counters, lrs, loss scaler, fp16 and lr scheduler state as saved; checked by the load that applies them
    (a module-only load does not)."""
    client_state: object = None
    """The caller's client_state when JSON carried it exactly; None when it was pickled."""
    client_state_pickle: str | None = None
    """The pickled client_state (base64), when JSON could not carry it."""
    hf_config: dict | None = None
    """The Hugging Face model's config (for `checkpoint export --hf`); None for any other module."""
    hf_source: str | None = None
    """The directory the Hugging Face model was loaded from, when known: export --hf copies its tokenizer."""
    peft: dict | None = None
    """For a peft model: its adapter's config and names, and how each adapted weight merges (save.peft_record);
    None for any other module."""
    config: dict = field(default_factory=dict)
    """The engine config it was saved with (as JSON)."""
    excluded_frozen: tuple[str, ...] = ()
    """Frozen parameters left out (save_checkpoint(exclude_frozen_parameters=True)): a load keeps their values."""
    moments_dtype: str = "float32"
    """The dtype the engine kept exp_avg and exp_avg_sq in (offload_optimizer.moments_dtype; float32 before it
    was recorded): float32, bfloat16, or int8, whose arrays hold the decoded values in float32 (exact: they
    encode back to the same codes). The master weights are always float32."""

    def dtype_of(self, state: str) -> torch.dtype:
        """The dtype of a state's arrays."""
        if state == STATES[0] or self.moments_dtype == "int8":
            return torch.float32
        return BY_NAME[self.moments_dtype]

    def itemsize(self, state: str) -> int:
        """Bytes per element of a state's arrays."""
        return self.dtype_of(state).itemsize

    @classmethod
    def parse(cls, d: dict, root: str) -> Manifest:
        """The record of manifest d (its format, version, completeness and CRC-32C already checked, see
        load.resolve); a CheckpointError naming root and the first unusable field."""
        params = tuple(SavedParam.parse(p, root, where) for where, p in _entries(d, "params", root))
        excluded = _take(d, "excluded_frozen", list, root, default=[])
        names = {p.name for p in params} | set(excluded)
        aliases = _take(d, "aliases", dict, root, default={})
        for alias, name in aliases.items():
            if not isinstance(name, str) or name not in names:
                raise _unusable(root, f"aliases[{alias!r}]", f"{name!r} is not a saved parameter")
        moments = _take(d, "moments_dtype", str, root, default="float32")
        if moments not in ("float32", "bfloat16", "int8"):
            raise _unusable(root, "moments_dtype", f"{moments!r} is not float32, bfloat16 or int8")
        states = _take(d, "states", list, root)
        if not all(isinstance(s, str) for s in states):
            raise _unusable(root, "states", f"{states!r} is not a list of names")
        return cls(version=_take(d, "version", int, root, default=0), tag=_take(d, "tag", str, root),
                   world_size=_count(d, "world_size", root, "", 1), created=_take(d, "created", str, root),
                   compute_dtype=_take(d, "compute_dtype", str, root), states=tuple(states), params=params,
                   extras=tuple(SavedExtra.parse(e, root, where) for where, e in _entries(d, "extras", root, [])),
                   aliases=aliases, engine=_take(d, "engine", (dict, type(None)), root, default=None),
                   client_state=d.get("client_state"),
                   client_state_pickle=_take(d, "client_state_pickle", str, root, default=None),
                   hf_config=_take(d, "hf_config", (dict, type(None)), root, default=None),
                   hf_source=_take(d, "hf_source", (str, type(None)), root, default=None),
                   peft=_take(d, "peft", (dict, type(None)), root, default=None),
                   config=_take(d, "config", dict, root, default={}),
                   excluded_frozen=tuple(excluded), moments_dtype=moments)


def check_tag(tag: str) -> str:
    if not isinstance(tag, str) or not _TAG.match(tag) or tag.startswith(LATEST) or tag.endswith(PARTIAL_SUFFIX):
        raise ValueError(f"checkpoint tag {tag!r} is not usable: use letters, digits and _.+- (not starting with "
                         f"'.' or {LATEST!r}, at most 128 characters, not ending in {PARTIAL_SUFFIX!r})")
    return tag


def canonical(obj) -> bytes:
    """The bytes a manifest's CRC-32C is taken over (strict JSON: no NaN or Infinity)."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def crc_of(obj) -> int:
    import torch

    from infinity.io.checksum import crc32c

    data = canonical(obj)
    return crc32c(torch.frombuffer(bytearray(data), dtype=torch.uint8), len(data)) if data else 0


def default_tag(step: int) -> str:
    return f"global_step{step}"


def partial_dir(directory: str, tag: str) -> str:
    return os.path.join(directory, f".{tag}{PARTIAL_SUFFIX}")


def chunk_path(root: str, state: str, name: str, index: int) -> str:
    return os.path.join(root, state, name, f"c.{index}")


def array_meta(numel: int, chunk: int, dtype: str = "float32", attributes: dict | None = None) -> dict:
    """zarr v3 metadata of a 1-D array whose chunk files are raw little-endian values + CRC-32C."""
    return {"zarr_format": 3, "node_type": "array", "shape": [numel], "data_type": dtype,
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [chunk]}},
            "chunk_key_encoding": {"name": "default", "configuration": {"separator": "."}},
            "fill_value": False if dtype == "bool" else 0,
            "codecs": [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}],
            "attributes": attributes or {}, "storage_transformers": []}


def group_meta(attributes: dict | None = None) -> dict:
    return {"zarr_format": 3, "node_type": "group", "attributes": attributes or {}}


def write_json(path: str, obj: dict) -> None:
    """Write a small metadata file (made durable by the save's syncfs). An OSError names the file (a write
    error alone, ENOSPC, says nothing of which)."""
    data = json.dumps(obj, indent=1, allow_nan=False).encode()
    try:
        with open(path, "wb") as f:
            f.write(data)
    except OSError as exc:
        raise _naming(exc, path) from None


def _naming(exc: OSError, path: str) -> OSError:
    if exc.filename is not None or exc.errno is None:
        return exc
    return type(exc)(exc.errno, f"{exc.strerror} (writing {path})", path)


def read_latest(directory: str) -> str | None:
    """What DIR/latest holds (stripped; undecodable bytes replaced), or None when there is none."""
    try:
        with open(os.path.join(directory, LATEST), "rb") as f:
            return f.read().decode(errors="replace").strip()
    except FileNotFoundError:
        return None


def write_latest(directory: str, tag: str) -> None:
    """Point DIR/latest at tag, crash-atomically: temp file, fsync, rename, fsync of DIR."""
    path = os.path.join(directory, LATEST)
    tmp = path + ".tmp"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, (tag + "\n").encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError as exc:  # latest still names the previous checkpoint; no latest.tmp is left behind
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise _naming(exc, tmp) from None
    fsync_dir(directory)


def read_json(path: str) -> dict:
    with open(path, "rb") as f:
        return json.loads(f.read())


def fsync_dir(path: str) -> None:
    fd = os.open(path or ".", os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_libc = None


def _c():
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    return _libc


def sync_filesystem(path: str) -> None:
    """Flush every dirty page and inode of the filesystem holding `path` (syncfs; checked)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fn = getattr(_c(), "syncfs", None)
        if fn is None:
            os.sync()
            return
        if fn(fd) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"syncfs failed: {os.strerror(err)}", path)
    finally:
        os.close(fd)


def exchange_or_rename(src: str, dst: str, *, dst_is_latest: bool) -> bool:
    """Move src to dst atomically. If dst exists, the two are exchanged (renameat2 RENAME_EXCHANGE) and True
    is returned: src then holds the old dst, for the caller to remove."""
    if not os.path.exists(dst):
        os.rename(src, dst)
        return False
    fn = getattr(_c(), "renameat2", None)
    if fn is not None:
        at_fdcwd, rename_exchange = -100, 2
        if fn(at_fdcwd, src.encode(), at_fdcwd, dst.encode(), rename_exchange) == 0:
            return True
        err = ctypes.get_errno()
        if err not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
            raise OSError(err, f"renameat2(RENAME_EXCHANGE) to {dst} failed: {os.strerror(err)}", src)
    # No exchange on this filesystem: replacing takes two renames, with a moment where dst is missing.
    # That is acceptable for an older tag, but not for the one `latest` names.
    if dst_is_latest:
        raise OSError(errno.EOPNOTSUPP, "this filesystem cannot swap two directories atomically, so the checkpoint "
                                        "that 'latest' names cannot be replaced safely; save under a new tag", dst)
    os.rename(dst, src + ".old")
    os.rename(src, dst)
    os.rename(src + ".old", src)
    return True
