"""What a checkpoint looks like on disk: a zarr v3 group, one array per parameter and state.

[Note: checkpoint layout]
    DIR/latest                        the tag of the newest complete checkpoint (text, replaced atomically)
    DIR/<tag>/zarr.json               root group; its attributes hold the manifest (written last: see below)
    DIR/<tag>/<state>/<param>/        one 1-D float32 array per (state, parameter), state one of
                                      master, exp_avg, exp_avg_sq; shape (numel,), chunk (part,)
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

FORMAT = "infinity-checkpoint"
VERSION = 1
STATES = ("master", "exp_avg", "exp_avg_sq")
LATEST = "latest"
PARTIAL_SUFFIX = ".partial"
_TAG = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.+-]{0,127}$")


class CheckpointError(RuntimeError):
    """A checkpoint is missing, partial, corrupted, or does not fit the model it is loaded into."""


class CheckpointCorruptionError(CheckpointError, OSError):
    """A chunk's bytes do not match the CRC-32C stored with them (errno EIO, `filename`)."""

    def __init__(self, path: str, what: str, expected: int, actual: int):
        OSError.__init__(self, errno.EIO, f"checkpoint chunk of {what} is corrupted: CRC-32C is {actual:#010x}, "
                                          f"{expected:#010x} was stored", path)
        self.expected, self.actual = expected, actual


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

    from infinity.swap.checksum import crc32c

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
    """Write a small metadata file (made durable by the save's syncfs)."""
    with open(path, "wb") as f:
        f.write(json.dumps(obj, indent=1, allow_nan=False).encode())


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
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, (tag + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
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
