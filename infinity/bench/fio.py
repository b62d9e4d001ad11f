"""Runs fio as the peer of `infinity bench io`: same file, engine, sizes, direct flag."""

from __future__ import annotations

import json
import shutil
import subprocess

# Our backend -> the fio engine that does the same thing.
FIO_ENGINE = {"libaio": "libaio", "io_uring": "io_uring", "threads": "psync"}


def fio_available() -> bool:
    return shutil.which("fio") is not None


def run_fio(*, op: str, path: str, size: int, backend: str, block_size: int, queue_depth: int,
            threads: int, direct: bool, extra: tuple = ()) -> float:
    """Bandwidth in bytes/s of one fio pass over `path`.

    Like our handle, `threads` jobs split the file between them (each takes a
    contiguous 1/threads of it) rather than each moving the whole file.
    """
    if backend not in FIO_ENGINE:
        raise ValueError(f"fio has no engine matching backend {backend!r}")
    per_job = size // threads
    cmd = ["fio", "--name=infinity-peer", f"--filename={path}", f"--rw={op}", f"--bs={block_size}",
           f"--iodepth={queue_depth if FIO_ENGINE[backend] != 'psync' else 1}",
           f"--ioengine={FIO_ENGINE[backend]}", f"--direct={int(direct)}", f"--size={per_job}",
           f"--numjobs={threads}", f"--offset_increment={per_job}", "--group_reporting",
           "--output-format=json", "--invalidate=1", *extra]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"fio failed ({' '.join(cmd)}): {out.stderr.strip() or out.stdout.strip()}")
    # fio may print warnings before the JSON document.
    doc = json.loads(out.stdout[out.stdout.index("{"):])
    job = doc["jobs"][0]
    return float(job["write" if op == "write" else "read"]["bw_bytes"])
