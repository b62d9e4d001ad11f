"""GroupState: one optimizer sub-group's fp32 master weights and Adam moments, on one tier.

This is the "group moved together" layer of the swap service. The
optimizer holds one GroupState per sub-group and never asks where it lives:
each class below answers the same verbs for its tier.

- `prefetch()`  start bringing the state in, if that takes nothing the critical path needs
  (`fetch()`: start it now, waiting for a buffer);
- `open()`      wait for it and give `AdamViews` of it (or, `blank=True`, room to fill);
- `adam()`      step it in place (CPU Adam, or torch ops on an accelerator);
- `close()`     done with the views: write them back, or drop them;
- `lend()`      the master weights of one parameter's shard, when they are in host memory anyway (see
  [Note: backward reads from the state] in engine/optimizer.py);
- `export()` / `import_()`  hand host fp32 views to a checkpoint writer / reader;
- `abandon()`   after a failure: let in-flight I/O finish and give back every buffer it may (a group
  whose write failed keeps its buffer and its newer bytes).

`StatePipeline` (pipeline.py) drives these verbs for the step, the
checkpoint export and the import alike (see [Note: one pipeline]).
"""

from __future__ import annotations

import abc
import math
from dataclasses import dataclass

import torch

from infinity.errors import StaleLend
from infinity.optim import cpu_adam_step, moments8
from infinity.optim.rounding import bf16_stochastic
from infinity.swap.registry import Residency
from infinity.swap.swapper import TensorSwapper
from infinity.swap.tier import HOST, Tier


EIGHT_BIT = torch.uint8
"""The moments' dtype with offload_optimizer.moments_dtype "int8": each moment is a uint8 tensor holding its
8-bit codes and block scales ([Note: 8-bit moments] in optim/moments8.py), not one value per element."""
MOMENT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": EIGHT_BIT}
"""offload_optimizer.moments_dtype's spellings."""


def moment_nbytes(numel: int, moments: torch.dtype = torch.float32) -> int:
    """Bytes of one moment of `numel` elements: 4 or 2 per element, or the 8-bit format's codes and scales."""
    if moments == EIGHT_BIT:
        return moments8.nbytes(numel)
    return numel * moments.itemsize


def state_nbytes(numel: int, moments: torch.dtype = torch.float32, *, master: bool = True) -> int:
    """Bytes of one sub-group's optimizer state of `numel` parameters: the fp32 master weights (unless the
    parameters are their own master) and two moments. A multiple of 4."""
    return (4 * numel if master else 0) + 2 * moment_nbytes(numel, moments)


def state_bytes(moments: torch.dtype = torch.float32, *, master: bool = True) -> float:
    """Bytes of optimizer state per parameter, for estimates: 12 (fp32 master and moments), 8 with bf16
    moments, 6.03 with 8-bit ones (their scales add 4 B per 256 parameters); without the master, 4 less."""
    if moments == EIGHT_BIT:
        return state_nbytes(moments8.BLOCK, moments, master=master) / moments8.BLOCK
    return state_nbytes(1, moments, master=master)


def _moment_len(numel: int, moments: torch.dtype) -> int:
    """Elements of `moments` dtype one moment takes (its bytes for 8-bit moments)."""
    return moment_nbytes(numel, moments) // moments.itemsize


def value_dtype(moments: torch.dtype) -> torch.dtype:
    """The dtype of the moments' values as export() hands them out: fp32 for 8-bit moments, else their own."""
    return torch.float32 if moments == EIGHT_BIT else moments


def moments_name(moments: torch.dtype) -> str:
    """What checkpoints and messages call a moments dtype: float32, bfloat16 or int8."""
    return "int8" if moments == EIGHT_BIT else str(moments).replace("torch.", "")


def decoded(views: "AdamViews", numel: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The moments as values: themselves, or (8-bit) fp32 copies decoded from their codes."""
    if views.exp_avg.dtype != EIGHT_BIT:
        return views.exp_avg, views.exp_avg_sq
    return (moments8.decode(views.exp_avg, numel, "exp_avg"), moments8.decode(views.exp_avg_sq, numel, "exp_avg_sq"))


def encode_into(views: "AdamViews", numel: int, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor) -> int:
    """Store decoded()'s (possibly changed) values back: nothing for fp32/bf16 views (they were the views),
    8-bit codes rounded to nearest, so values decoded from the same blocks keep their codes exactly. Returns how
    many values the encoding changed (0 for fp32/bf16)."""
    if views.exp_avg.dtype != EIGHT_BIT:
        return 0
    changed = 0
    for blob, values, which in ((views.exp_avg, exp_avg, "exp_avg"), (views.exp_avg_sq, exp_avg_sq, "exp_avg_sq")):
        moments8.encode_(blob, values, which)
        changed += int((moments8.decode(blob, numel, which) != values.reshape(-1)).sum())
    return changed


@dataclass(slots=True)
class AdamViews:
    """Views of one sub-group's state, each `numel` values on the state's device."""

    param: torch.Tensor
    """The fp32 master weights."""
    exp_avg: torch.Tensor
    """Adam's first moment (fp32, or bf16 with offload_optimizer.moments_dtype bf16)."""
    exp_avg_sq: torch.Tensor
    """Adam's second moment (the same dtype as exp_avg)."""
    lowp: torch.Tensor | None = None
    """Where the state keeps the weights' compute-dtype copy (NvmeState with `lowp`; see [Note: compute-dtype
    shards in the optimizer file] in engine/alias.py), else None. Whoever writes the state writes it too."""


class GroupState(abc.ABC):
    """A sub-group's Adam state on one tier; see the module docstring for the verbs."""

    tier: Tier
    pinned: bool = False
    """Its gradient buffer is page-locked (HostState with offload_optimizer.pin_memory on CUDA)."""
    last_read = None
    """The future of its last read from storage, for telemetry spans (RAM tiers read nothing)."""

    @property
    def label(self) -> str:
        """What telemetry calls it."""
        return self.tier.value

    def __init__(self, numel: int, moments: torch.dtype = torch.float32):
        self.numel = numel
        self.moments = moments
        """The dtype exp_avg and exp_avg_sq are stored in."""

    @property
    def io_bytes(self) -> int:
        """Bytes one read of the whole state moves from storage."""
        return 0

    @property
    def io_write_bytes(self) -> int:
        """Bytes one write of it moves to storage (NvmeState with a compute-dtype copy: more than a read)."""
        return self.io_bytes

    def prefetch(self, *, reserve: int = 0) -> None:
        """Start bringing the state in without waiting for a buffer (RAM tiers: nothing to do)."""

    def fetch(self) -> None:
        """Start bringing the state in now, waiting for a buffer if none is free."""

    @property
    def device(self) -> torch.device:
        """Where open()'s views are (and so where the group's gradient buffer goes)."""
        return HOST

    def at_rest(self) -> bool:
        """No read, use or write of the state is in flight."""
        return True

    def ready(self) -> bool:
        """Its read has started (or it needs none): open() will not need a pool buffer it does not hold."""
        return True

    def read_landed(self) -> bool:
        """Its read (if it needs one) has finished: open() will not wait."""
        return True

    @abc.abstractmethod
    def open(self, *, blank: bool = False) -> AdamViews:
        """The state, in memory; `blank`: its current values are about to be overwritten, so none are read."""

    def close(self, *, write: bool):
        """Done with the views: with `write` they are the new state. Returns a future to wait for, or None."""
        return None

    def lend(self, offset: int, numel: int):
        """A future whose wait() gives the fp32 master weights [offset, offset + numel) as a host view, valid
        until the state is next stepped; None unless they are in host memory, or on their way there, already.
        Nothing is read for it and no buffer is taken: the view is of what open() will return."""
        return None

    def abandon(self) -> None:
        """After a failure anywhere: finish in-flight I/O quietly and hold no buffer, except a group whose write
        failed, which keeps its newer bytes. Never raises."""

    def adam(self, views: AdamViews, grad: torch.Tensor, out_lowp: torch.Tensor | None, hyper: dict) -> bool:
        """One Adam step in place. Returns whether `out_lowp` got the new weights in the compute dtype
        (the CPU kernel writes them in the same pass)."""
        cpu_adam_step(views.param, grad, views.exp_avg, views.exp_avg_sq, out_lowp=out_lowp,
                      check_finite=False, **hyper)
        return out_lowp is not None

    def export(self, owner, views: AdamViews, use):
        """Hand host views to `use(owner, p, m, v)`; returns its wait (see ShardedAdam.export_state). 8-bit
        moments go as decoded fp32 copies, which the wait keeps alive."""
        return use(owner, views.param, *decoded(views, self.numel))

    def import_(self, owner, views: AdamViews, fill) -> int:
        """`fill(owner, p, m, v)` writes the new state into host views (see ShardedAdam.import_state); 8-bit
        moments are filled as fp32 values and encoded after (rounded to nearest: a value decoded from the same
        block keeps its code). Returns how many moment values the encoding changed (encode_into)."""
        m, v = decoded(views, self.numel)
        fill(owner, views.param, m, v)
        return encode_into(views, self.numel, m, v)


class HostState(GroupState):
    """offload_optimizer cpu: the fp32 master and two moments in host RAM (12 bytes per parameter; 8 with bf16
    moments, about 6 with 8-bit ones), stepped by CPU Adam."""

    tier = Tier.CPU

    def __init__(self, numel: int, device: torch.device | None = None, *, pin: bool = False,
                 moments: torch.dtype = torch.float32):
        super().__init__(numel, moments)
        self.pinned = pin
        """offload_optimizer.pin_memory where CUDA is: the master weights (copied to the device after each step)
        are page-locked, and so is the group's gradient buffer (filled from the device); the moments never
        cross, so they are not."""
        self.views = AdamViews(torch.zeros(numel, dtype=torch.float32, device=device, pin_memory=pin),
                               *(torch.zeros(_moment_len(numel, moments), dtype=moments, device=device)
                                 for _ in range(2)))

    @property
    def device(self) -> torch.device:
        return self.views.param.device

    def open(self, *, blank: bool = False) -> AdamViews:
        return self.views

    def lend(self, offset: int, numel: int):
        if self.views.param.device != HOST:  # an accelerator's state: the shard's file is the host copy
            return None
        return _Lent(None, self.views.param[offset:offset + numel])


class DeviceState(HostState):
    """offload_optimizer none: the state stays in the compute device's memory and is stepped there.

    On a CPU-only machine the device is the host, and this is HostState. On
    an accelerator, Adam runs as torch ops with the CPU kernel's math, and a
    checkpoint stages one parameter's slice at a time through host memory,
    so the staging copy is bounded by the largest shard, not the sub-group.
    """

    tier = Tier.DEVICE

    def __init__(self, numel: int, device: torch.device, *, slices=(), moments: torch.dtype = torch.float32):
        super().__init__(numel, device, pin=False, moments=moments)
        self.slices = list(slices)
        """(owner, lo, hi) of each parameter's shard in the group: the checkpoint staging unit."""

    def _on_host(self) -> bool:
        return self.views.param.device == HOST

    def adam(self, views: AdamViews, grad: torch.Tensor, out_lowp: torch.Tensor | None, hyper: dict) -> bool:
        if self._on_host():
            return super().adam(views, grad, out_lowp, hyper)
        _device_adam(views, grad, **hyper)
        return False

    def export(self, owner, views: AdamViews, use):
        if self._on_host():
            return super().export(owner, views, use)
        state = (views.param, *decoded(views, self.numel))
        for sub, lo, hi in self.slices:
            use(sub, *(t[lo:hi].cpu() for t in state))()
        return None

    def import_(self, owner, views: AdamViews, fill) -> int:
        if self._on_host():
            return super().import_(owner, views, fill)
        state = (views.param, *decoded(views, self.numel))
        for sub, lo, hi in self.slices:
            # From the current values: what fill leaves alone (a non-strict load) must stay as it is.
            tmp = [t[lo:hi].to(HOST) for t in state]
            fill(sub, *tmp)
            for dst, src in zip(state, tmp):
                dst[lo:hi].copy_(src)
        return encode_into(views, self.numel, *state[1:])


class NvmeState(GroupState):
    """offload_optimizer nvme: one swap partition [param | exp_avg | exp_avg_sq] of n fp32 values and two moments.

    The group moves in one read and one write of 12 bytes per parameter (8
    with bf16 moments; with 8-bit ones each moment is its codes and block scales, state_nbytes), through one pool buffer of the swapper's pool. Between open() and
    close() that buffer is the group's; close(write=True) hands it to the
    write and the swapper's reaper gives it back (see [Note: who releases a
    swap-out buffer] in swapper.py).

    With `lowp` (a compute dtype), the partition has a write-only tail: the n
    weights in that dtype (AdamViews.lowp), written with the state and never
    read back with it (see [Note: compute-dtype shards in the optimizer file]
    in engine/alias.py). A write then moves 2 bytes per parameter more than a read.

    With `master=False` the partition is [exp_avg | exp_avg_sq] only and AdamViews.param is None: for
    parameters that are their own fp32 master in host memory (OffloadAdamW steps them in place), so a step moves
    8 bytes per parameter each way instead of 12.

    [Note: a speculative step writes a second slot]
    A step taken before it is known to stand (during backward, before the
    global norm says whether the clip scales: [Note: the speculative step] in
    engine/optimizer.py) must keep the state it started from until it
    commits. So the group has two partitions, each a file of its own: `<id>`
    and `<id>.b` (the second's blocks reserved at setup where the config may
    bet, `reserve_second_slot`, and removed if no bet can be taken). `speculate()` sends the next write
    to the slot that is not live, leaving the live one's file as it was;
    reads, lends and shard reads (engine/alias.py) keep going to the live
    slot. `commit()` makes the written slot live; `rollback()` forgets it, so
    the group is exactly as before the step. The flip is a Python field: no
    byte moves to commit, and the write that lands in the other slot never
    touches the bytes a rollback goes back to. The price is disk: a second
    copy of the optimizer's files (the engine checks the room for it first).
    """

    tier = Tier.NVME

    def __init__(self, numel: int, swapper: TensorSwapper, part_id: str, *, moments: torch.dtype = torch.float32,
                 lowp: torch.dtype | None = None, master: bool = True):
        super().__init__(numel, moments)
        if lowp is not None and not master:
            raise ValueError("NvmeState: a compute-dtype tail needs the master weights in the partition")
        self.master = master
        self.swapper = swapper
        self._ids = (part_id, f"{part_id}.b")
        self._slot = 0  # which of _ids is live
        self._next: int | None = None  # the slot the next write goes to, while speculating
        self._wrote_next = False
        self._opened = 0  # open()s so far: a lend made before the last one may show changed values
        self._read = None  # the prefetched (or open()'s) read future
        self._blank = None  # the pool buffer open(blank=True) took, until close() hands it to the write
        self._words = state_nbytes(numel, moments, master=master) // 4
        """The partition's length in fp32 words (it is swapped as fp32; the moments are viewed in their dtype)."""
        self.lowp = lowp
        self.tail_nbytes = 0 if lowp is None else numel * torch.empty((), dtype=lowp).element_size()
        """The compute-dtype copy's bytes, after the state's in the partition's buffer and file."""

    @property
    def io_bytes(self) -> int:
        return 4 * self._words

    @property
    def io_write_bytes(self) -> int:
        return 4 * self._words + self.tail_nbytes

    @property
    def tail_offset(self) -> int:
        """Where the compute-dtype copy starts, in bytes after the swap file's header."""
        return 4 * self._words

    def _views(self, buf) -> AdamViews:
        n, k = self.numel, _moment_len(self.numel, self.moments)
        state = buf.view(torch.float32, self._words)
        if not self.master:
            moments = state.view(self.moments)
            return AdamViews(None, moments[:k], moments[k:])
        moments = state[n:].view(self.moments)
        lowp = None
        if self.lowp is not None:
            lowp = buf.tensor[4 * self._words:4 * self._words + self.tail_nbytes].view(self.lowp)
        return AdamViews(state[:n], moments[:k], moments[k:], lowp)

    @property
    def id(self) -> str:
        """The live slot's partition: what reads, lends and shard reads use."""
        return self._ids[self._slot]

    @property
    def write_id(self) -> str:
        """The partition the next write goes to: the other slot while speculating, else the live one."""
        return self._ids[self._next] if self._next is not None else self.id

    def reserve_second_slot(self) -> None:
        """Reserve the second slot's file now, at setup, so the first speculative write does not allocate its
        blocks as it goes (TensorSwapper.preallocate); a filesystem that cannot leaves it to that write."""
        self.swapper.preallocate(self._ids[1], torch.float32, self._words, tail_nbytes=self.tail_nbytes)

    def drop_second_slot(self) -> None:
        """Remove the file of the slot that is not live (reserved, or written by an earlier bet); no bet may be
        pending."""
        if self._next is not None:
            raise RuntimeError(f"{self.id}: a speculative step is pending; commit or roll it back first")
        other = self._ids[1 - self._slot]
        if other in self.swapper.registry:
            self.swapper.remove(other)

    @property
    def wrote_next(self) -> bool:
        """A speculative write went to the slot that is not live (commit() may flip to it)."""
        return self._next is not None and self._wrote_next

    def speculate(self) -> None:
        """Send the next write to the slot that is not live (see [Note: a speculative step writes a second
        slot]); commit() or rollback() ends it."""
        if self._next is None:
            self._next, self._wrote_next = 1 - self._slot, False

    def commit(self) -> None:
        """The speculative write (landed) becomes the live state."""
        if self._next is None:
            return
        if not self._wrote_next:
            raise RuntimeError(f"{self._ids[0]}: commit of a speculative step that wrote nothing")
        if self._read is not None:  # a read of the old slot (a forward's early read for the next step): stale now
            self.abandon()
        self._slot, self._next = self._next, None
        self._opened += 1  # a lend of the old slot's read is stale from here on

    def rollback(self) -> None:
        """Forget the speculative write: the live slot still holds the state from before it. A write that failed
        (its partition kept the buffer, dirty) gives the buffer back."""
        if self._next is None:
            return
        other, self._next = self._ids[self._next], None
        if other in self.swapper.registry and self.swapper.registry[other].residency is Residency.IN_CPU:
            self.swapper.release(other, discard=True)

    @property
    def path(self) -> str:
        return self.swapper.path_of(self.id)

    @property
    def label(self) -> str:
        return self.id

    def prefetch(self, *, reserve: int = 0) -> None:
        if self._read is None:
            self._read = self.swapper.swap_in(self.id, prefetch=True, reserve=reserve)

    def fetch(self) -> None:
        if self._read is None:
            self._read = self.swapper.swap_in(self.id)

    def ready(self) -> bool:
        return self._read is not None

    def read_landed(self) -> bool:
        return self._read is not None and self._read.done()

    def lend(self, offset: int, numel: int):
        if self._read is None or not self.master:
            return None
        return _Lent(self._read, slice(offset, offset + numel), self)

    def open(self, *, blank: bool = False) -> AdamViews:
        self._opened += 1  # the work may change the buffer in place: what was lent of it is stale
        if blank:
            if self._next is not None:
                raise RuntimeError(f"{self.id}: a blank fill while a speculative step is pending would write the "
                                   "live slot")
            self._blank = self.swapper.pool.acquire(f"fill {self.id}")
            return self._views(self._blank)
        fut, self._read = self._read or self.swapper.swap_in(self.id), None
        self.last_read = fut
        fut.wait()  # a failed read has already given its buffer back
        return self._views(self.swapper.registry[self.id].buffer)

    def close(self, *, write: bool):
        sw = self.swapper
        if self._blank is not None:
            buf, self._blank = self._blank, None
            if not write:
                sw.pool.release(buf)
                return None
            try:
                return sw.swap_out_buffer(self.id, buf, torch.float32, self._words, tail_nbytes=self.tail_nbytes)
            except BaseException:
                if sw.registry[self.id].buffer is not buf:  # the swapper did not take it over
                    sw.pool.release(buf)
                raise
        if not write:
            sw.release(self.id)
            return None
        if self._next is not None:
            fut = sw.swap_out_as(self.id, self.write_id, tail_nbytes=self.tail_nbytes)
            self._wrote_next = True
            return fut
        view = sw.registry[self.id].buffer.view(torch.float32, self._words)
        return sw.swap_out(self.id, view, tail_nbytes=self.tail_nbytes)

    def abandon(self) -> None:
        sw = self.swapper
        fut, self._read = self._read, None
        if fut is not None:
            try:
                fut.wait()
            except BaseException:  # noqa: BLE001 - a failed read holds nothing
                pass
        if self._blank is not None:
            buf, self._blank = self._blank, None
            sw.pool.release(buf)
        try:
            part = sw.registry[self.id]
        except KeyError:
            return
        if part.residency is Residency.IN_CPU:
            try:
                sw.release(self.id)  # its file still holds the state from before this use
            except BaseException:  # noqa: BLE001 - a dirty partition (failed write) keeps its bytes
                pass

    def at_rest(self) -> bool:
        if self._read is not None or self._next is not None:
            return False
        return all(pid not in self.swapper.registry or self.swapper.registry[pid].buffer is None
                   for pid in self._ids)


class _Lent:
    """What lend() returns: the master's slice, once the state's read (if any) has landed and been verified."""

    __slots__ = ("_read", "_view", "_state", "_opened")

    def __init__(self, read, view, state=None):
        self._read, self._view, self._state = read, view, state
        self._opened = state._opened if state is not None else 0

    def wait(self) -> torch.Tensor:
        if self._read is None:
            return self._view
        if self._state is not None and self._state._opened != self._opened:
            # The read was opened for Adam since it was lent: the buffer may hold the new weights. Backward
            # wanted the old ones (reentrant checkpointing that uses the parameter after its group stepped).
            if self._state._next is not None:  # a bet: the live slot's file still holds them
                raise StaleLend(self._state.label)
            raise RuntimeError(f"{self._state.label}: backward took a parameter's master weights from its "
                               "optimizer sub-group's state after that sub-group had stepped during backward "
                               "(reentrant activation checkpointing of a parameter also used outside the "
                               "checkpoint): use non-reentrant checkpointing, or set infinity.step_during_backward "
                               "to false")
        return self._read.wait()[self._view]  # the p region is the partition's first numel words


def _device_adam(views: AdamViews, grad, *, step, lr, betas, eps, weight_decay, adamw, bias_correction,
                 grad_scale, moment_rounding: str = "nearest", moment_seed: int = 0):
    """Adam on an accelerator: the same math as cpu_adam_step, in torch ops (bf16 and 8-bit moments: updated in
    fp32, stored with the kernel's rounding and, when stochastic, its random bits)."""
    grad = grad / grad_scale
    p, m, v = views.param, views.exp_avg, views.exp_avg_sq
    low = m.dtype != torch.float32
    if m.dtype == EIGHT_BIT:
        m, v = decoded(views, p.numel())
    elif low:
        m, v = m.float(), v.float()
    if not adamw and weight_decay:
        grad = grad.add(p, alpha=weight_decay)
    if adamw and weight_decay:
        p.mul_(1 - lr * weight_decay)
    m.lerp_(grad, 1 - betas[0])
    v.mul_(betas[1]).addcmul_(grad, grad, value=1 - betas[1])
    bc1 = 1 - betas[0] ** step if bias_correction else 1.0
    bc2 = 1 - betas[1] ** step if bias_correction else 1.0
    if not low:
        p.addcdiv_(m, (v.sqrt() / math.sqrt(bc2)).add_(eps), value=-lr / bc1)
        return
    p.addcdiv_(m, (v.sqrt() * (1 / math.sqrt(bc2))).add_(eps), value=-lr / bc1)
    if views.exp_avg.dtype == EIGHT_BIT:
        seed = moment_seed if moment_rounding == "stochastic" else None
        moments8.encode_(views.exp_avg, m, "exp_avg", seed=seed)
        moments8.encode_(views.exp_avg_sq, v, "exp_avg_sq", seed=seed)
        return
    for dst, new, shift in ((views.exp_avg, m, 0), (views.exp_avg_sq, v, 16)):
        if moment_rounding == "stochastic":
            dst.copy_(bf16_stochastic(new, moment_seed, shift))
        else:
            dst.copy_(new)
