"""Turning user buffers into (address, size), and aligned/pinned allocation."""

from __future__ import annotations

import mmap
import weakref

import numpy as np
import torch

from infinity._native_loader import native

LAZY_BYTES = 1 << 20


def buffer_memory(buf, *, writable: bool, op: str):
    """(address, nbytes, keepalive) for a contiguous CPU tensor, numpy array or buffer.

    `keepalive` must be held until the I/O finishes: for buffer-protocol
    objects it is a memoryview, whose export also stops a bytearray from
    being resized underneath the kernel.
    """
    if isinstance(buf, torch.Tensor):
        if buf.device.type != "cpu":
            raise ValueError(f"{op}: buf is on {buf.device}; file I/O needs a CPU tensor "
                             "(use infinity.io.aligned_empty for a pinned staging buffer)")
        if not buf.is_contiguous():
            raise ValueError(f"{op}: buf is not contiguous ({tuple(buf.shape)=}, {buf.stride()=}); "
                             "pass buf.contiguous()")
        return buf.data_ptr(), buf.numel() * buf.element_size(), buf
    try:
        mv = memoryview(buf)
    except TypeError:
        raise ValueError(f"{op}: buf must be a contiguous CPU torch.Tensor, a numpy array or a buffer, "
                         f"got {type(buf).__name__}") from None
    if native is not None:
        try:
            addr, nbytes = native.buffer_address(mv, writable)
        except ValueError as exc:
            raise ValueError(f"{op}: {exc}") from None
        return addr, nbytes, mv
    if writable and mv.readonly:
        raise ValueError(f"{op}: buffer is read-only: pread needs a writable buffer to read into")
    if not mv.c_contiguous:
        raise ValueError(f"{op}: buffer is not contiguous: pass a contiguous copy")
    arr = np.frombuffer(mv.cast("B") if mv.nbytes else b"", dtype=np.uint8)
    return (arr.ctypes.data if mv.nbytes else 0), mv.nbytes, mv


def _pin(tensor: torch.Tensor, owner) -> None:
    """Page-lock `tensor` through cudaHostRegister; unregister when `owner` dies."""
    cudart = torch.cuda.cudart()
    ptr, nbytes = tensor.data_ptr(), tensor.numel()
    err = int(cudart.cudaHostRegister(ptr, nbytes, 0))
    if err != 0:
        raise RuntimeError(f"aligned_empty: cudaHostRegister({nbytes} bytes) failed with CUDA error {err}; "
                           "the host may be out of lockable memory (ulimit -l)")
    # The finalizer runs before the owner's memory is freed (weakref
    # callbacks fire first in dealloc), so memory is never freed while pinned.
    weakref.finalize(owner, cudart.cudaHostUnregister, ptr)


def aligned_empty(nbytes: int, alignment: int = 4096, *, pin: bool | None = None) -> torch.Tensor:
    """A uint8 CPU tensor of `nbytes` whose address is a multiple of `alignment`.

    Its contents are zero. With pin=None it is page-locked (cudaHostRegister)
    when CUDA is available, so device copies from it can be asynchronous.

    From LAZY_BYTES up it is an anonymous mapping: the kernel's zero pages,
    resident only once touched, and no memset. A swap pool sized by a
    config (DeepSpeed's buffer_size of 1e8 elements, 2 GB for 5 buffers) then
    costs the bytes its shards use, not its whole size, and no seconds of
    zeroing up front; unmapped when the tensor and its views are gone.
    Page-locking (CUDA) makes every page resident, as it must.
    """
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
        raise ValueError(f"aligned_empty: nbytes must be an int >= 0, got {nbytes!r}")
    if isinstance(alignment, bool) or not isinstance(alignment, int) or alignment < 8 or alignment & (alignment - 1):
        raise ValueError(f"aligned_empty: alignment must be a power of two >= 8, got {alignment!r}")
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    if nbytes >= LAZY_BYTES and alignment <= mmap.PAGESIZE:
        owner = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE)  # page-aligned: any smaller alignment holds
        tensor = torch.frombuffer(owner, dtype=torch.uint8)
    elif native is not None:
        owner = native.AlignedBuffer(nbytes, alignment)
        tensor = torch.frombuffer(owner, dtype=torch.uint8)
    else:
        raw = np.zeros(nbytes + alignment, dtype=np.uint8)
        start = (-raw.ctypes.data) % alignment
        owner = raw
        tensor = torch.from_numpy(raw[start:start + nbytes])
    if pin is None:
        pin = torch.cuda.is_available()
    if pin:
        _pin(tensor, owner)
    return tensor
