"""Measurement for the planner: the speeds its cost model needs (matmul, one real layer, CPU Adam, memcpy,
CRC-32C, the disk through AsyncIO), measured in a few seconds at plan time, and the process's baseline RSS."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from infinity.memory_stats import reset_peak, rss_bytes
from infinity.tools.plan.shape import ModelShape


@dataclass(frozen=True, kw_only=True, slots=True)
class Rates:
    """Measured speeds (bytes/s, FLOP/s, parameters/s)."""

    flops: float
    adam_params_s: float
    memcpy_bytes_s: float
    disk_read_bytes_s: float | None
    disk_write_bytes_s: float | None
    layer_s: float | None = None  # one layer's forward + backward at the run's batch (None: not measurable)
    crc_bytes_s: float | None = None  # CRC-32C of swapped bytes (checksums on)

    def describe(self) -> str:
        disk = "no disk" if self.disk_read_bytes_s is None else (
            f"disk read {self.disk_read_bytes_s / 1e9:.2f} GB/s, write {self.disk_write_bytes_s / 1e9:.2f} GB/s")
        layer = "" if self.layer_s is None else f"one layer fwd+bwd {self.layer_s * 1e3:.1f} ms, "
        return (f"{layer}matmul {self.flops / 1e9:.0f} GFLOP/s, CPU Adam {self.adam_params_s / 1e6:.0f}M params/s, "
                f"memcpy {self.memcpy_bytes_s / 1e9:.1f} GB/s, {disk}")


def measure_layer(block, *, micro: int, seq: int, dim: int, dtype) -> float | None:
    """Seconds for one forward + backward of one layer at the run's batch, in the compute dtype.

    The layer is materialised from its meta-device copy with small random weights. None when its forward
    does not take a bare (batch, seq, dim) tensor (some Hugging Face layers need masks or rotary tables);
    the planner then falls back to counting FLOPs.
    """
    import copy

    import torch

    if block is None:
        return None
    try:
        layer = copy.deepcopy(block).to_empty(device="cpu").to(dtype)
        with torch.no_grad():
            for p in layer.parameters():
                p.normal_(0.0, 0.02)
        x = torch.randn(micro, seq, dim, dtype=dtype, requires_grad=True)
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            y = layer(x)
            y = y[0] if isinstance(y, tuple) else y
            y.float().sum().backward()
            best = min(best, time.perf_counter() - t0)
        return best
    except Exception:  # any layer that cannot run alone: use the FLOPs estimate
        return None


def measure_rates(*, dim: int, tokens: int, dtype, nvme_path: str | None, aio: dict | None = None,
                  disk_bytes: int = 256 << 20, shape: ModelShape | None = None, micro: int = 1,
                  direct: bool = True) -> Rates:
    """A few seconds of measurement: matmul, one layer, CPU Adam, memcpy, and a write and read pass on the disk."""
    import torch

    from infinity._native_loader import native
    from infinity.optim import cpu_adam_step

    a = torch.randn(max(tokens, 64), dim).to(dtype)
    b = torch.randn(dim, 4 * dim).to(dtype)
    torch.mm(a, b)
    reps, t0 = 0, time.perf_counter()
    while reps < 3 or time.perf_counter() - t0 < 0.3:
        torch.mm(a, b)
        reps += 1
    flops = 2 * a.shape[0] * dim * 4 * dim * reps / (time.perf_counter() - t0)

    n = 1 << 22
    p, g, m, v = (torch.randn(n) for _ in range(4))
    v.abs_()
    adam = n / _best_of(4, lambda: cpu_adam_step(p, g, m, v, step=2, lr=1e-3))

    # CPU rates are the best of a few passes: on a shared machine noise only ever slows a pass down.
    src = torch.empty(64 << 20, dtype=torch.uint8).fill_(1)
    dst = torch.empty_like(src)
    memcpy = src.numel() / _best_of(4, lambda: dst.copy_(src))
    crc = None
    if native is not None:  # the pure-Python CRC would take minutes here; without the extension, no checksum term
        crc = src.numel() / _best_of(4, lambda: native.crc32c(src.data_ptr(), src.numel()))

    read = write = None
    if nvme_path is not None:
        read, write = measure_disk(nvme_path, aio or {}, disk_bytes, direct=direct)
    layer = None if shape is None else measure_layer(shape.block, micro=micro, seq=shape.seq, dim=shape.dim,
                                                      dtype=dtype)
    return Rates(flops=flops, adam_params_s=adam, memcpy_bytes_s=memcpy, disk_read_bytes_s=read,
                 disk_write_bytes_s=write, layer_s=layer, crc_bytes_s=crc)


def _best_of(n: int, fn) -> float:
    """The fastest of n timed calls (after one untimed warm-up call)."""
    fn()
    best = float("inf")
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measure_disk(path: str, aio: dict, nbytes: int, direct: bool = True) -> tuple[float, float]:
    """(read, write) bytes/s of one pass each through AsyncIO with these aio settings; the file is removed."""
    from infinity.io import AsyncIO, aligned_empty

    f = os.path.join(path, f"infinity-plan-{os.getpid()}.dat")
    buf = aligned_empty(nbytes, pin=False)
    buf.fill_(7)
    backend = aio.get("backend", "auto")
    try:
        with AsyncIO(backend=backend if backend != "python" else "auto",
                     block_size=aio.get("block_size", 1 << 20), queue_depth=aio.get("queue_depth", 32),
                     threads=aio.get("intra_op_parallelism", aio.get("thread_count", 1)), direct=direct,
                     single_submit=aio.get("single_submit", False),
                     overlap_events=aio.get("overlap_events", True)) as h:
            h.write(buf, f)  # lay out
            t0 = time.perf_counter()
            h.write(buf, f)
            write = nbytes / (time.perf_counter() - t0)
            t0 = time.perf_counter()
            h.read(buf, f)
            read = nbytes / (time.perf_counter() - t0)
    finally:
        if os.path.exists(f):
            os.unlink(f)
    return read, write


def baseline_rss() -> int:
    """RSS now, after the imports and torch's one-time optimizer import (see [Note: what the memory budget
    covers] in cost.py); the peak RSS restarts here, so that the planner's own measurements are not in it."""
    import gc

    import torch

    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)  # imports torch._dynamo once per process
    gc.collect()
    reset_peak()
    return rss_bytes()
