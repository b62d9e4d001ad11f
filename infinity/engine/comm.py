"""Comm: the collectives the ZeRO engine needs, over torch.distributed or, without it, one process.

It exists so that the engine never asks "is distributed on?" itself, and so
that the one place that knows gloo lacks reduce-scatter is here. Every
collective runs under the process group's timeout: a dead rank makes the
others raise (see [Note: dead ranks]) instead of hanging.

[Note: dead ranks]
gloo notices a peer whose process died as a closed connection and raises at
once; a peer that hangs is caught by the group's timeout. Either way the
error is re-raised as RankFailure naming the collective and the rank, so the
surviving rank exits with one clear line.

[Note: a process group that outlives destroy_process_group]
torch.distributed.nn.functional binds `group=group.WORLD` as a default
argument of its functions, and `group.WORLD` is the default process group
itself once one exists. That module is imported lazily, by the first import
of torch._dynamo, which the first factory call under zero_init (or any
torch.compile) triggers: after init_process_group. Its ten function
defaults then hold the group, so destroy_process_group cannot free it: the
gloo loop and worker threads keep running into interpreter shutdown, where
the group is torn down among half-destroyed modules: the likely cause of
an occasional SIGABRT at the exit of 2-rank gloo test runs ("terminate
called without an active exception"; seen in CI, never reproduced on
demand). Importing the module before the group exists makes those
defaults None, and destroy_process_group frees the group again. This
module does so when it is imported (`import infinity` imports it) and no
group exists yet; a script that calls init_process_group itself before
importing infinity or torch.distributed.nn keeps torch's behaviour.
A script that never destroys its group (DeepSpeed's examples do not) hit
the same abort at exit: 2 of 15 runs of tests/deepspeed/ds_train.py on 2
gloo ranks. So an atexit handler destroys a group still alive at exit,
while the interpreter is whole.
"""

from __future__ import annotations

import atexit
import os
import time
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist

from infinity.errors import InfinityError, RankFailure

if not dist.is_initialized():
    # Before any group exists; see [Note: a process group that outlives destroy_process_group].
    import torch.distributed.nn  # noqa: F401


def _destroy_group_at_exit() -> None:
    """A script that never calls destroy_process_group (DeepSpeed's examples do not) gets it called here,
    while the interpreter is whole; see [Note: a process group that outlives destroy_process_group]."""
    if dist.is_available() and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - exiting anyway; the group's own teardown is all that is left
            pass


atexit.register(_destroy_group_at_exit)


# torch 2.13 renamed the flat-tensor collectives; keep working on either side of the rename.
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class Comm:
    """rank, world size, and all_gather / reduce_scatter / all_reduce over the default group."""

    def __init__(self):
        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.distributed else 0
        self.world = dist.get_world_size() if self.distributed else 1
        self.backend = dist.get_backend() if self.distributed else None  # one process: no collectives
        # gloo has no reduce_scatter; an all_reduce then a slice gives the same shard at twice the traffic.
        self.native_reduce_scatter = self.backend == "nccl"
        self.time_s = 0.0  # wall time inside blocking collectives (communication in the step breakdown)

    def all_gather(self, shard: torch.Tensor) -> torch.Tensor:
        """The concatenation of every rank's shard (all the same numel), rank order."""
        if self.world == 1:
            return shard
        out = torch.empty(shard.numel() * self.world, dtype=shard.dtype, device=shard.device)
        self._run("all_gather", _ALL_GATHER, out, shard.contiguous())
        return out

    def reduce_scatter_mean(self, flat: torch.Tensor) -> torch.Tensor:
        """This rank's 1/world slice of the mean over ranks of `flat` (numel divisible by world)."""
        if self.world == 1:
            return flat
        part = flat.numel() // self.world
        if self.native_reduce_scatter:
            out = torch.empty(part, dtype=flat.dtype, device=flat.device)
            self._run("reduce_scatter", _REDUCE_SCATTER, out, flat.contiguous())
        else:
            flat = flat.clone()
            self._run("all_reduce", dist.all_reduce, flat)
            out = flat[self.rank * part:(self.rank + 1) * part]
        return out.div_(self.world)

    def reduce_scatter_mean_async(self, flat: torch.Tensor) -> "Pending":
        """Start reduce_scatter_mean; `.wait()` on the result gives this rank's slice (see reduce_scatter_mean)."""
        part = flat.numel() // self.world
        if self.native_reduce_scatter:
            out = torch.empty(part, dtype=flat.dtype, device=flat.device)
            work = self._run("reduce_scatter", _REDUCE_SCATTER, out, flat.contiguous(), async_op=True)
            return Pending(self, work, out)
        work = self._run("all_reduce", dist.all_reduce, flat, async_op=True)
        return Pending(self, work, flat[self.rank * part:(self.rank + 1) * part])

    def all_reduce_(self, t: torch.Tensor, op=None) -> torch.Tensor:
        """Sum (or `op`) across ranks, in place."""
        if self.world > 1:
            self._run("all_reduce", dist.all_reduce, t, op=op or dist.ReduceOp.SUM)
        return t

    def broadcast_(self, t: torch.Tensor, src: int) -> torch.Tensor:
        if self.world > 1:
            self._run("broadcast", dist.broadcast, t, src=src)
        return t

    def all_ok(self, ok: bool) -> bool:
        """True when `ok` is true on every rank (a barrier that also carries whether each rank succeeded)."""
        if self.world == 1:
            return ok
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
        self._run("all_reduce", dist.all_reduce, flag, op=dist.ReduceOp.MIN)
        return bool(flag.item())

    def untimed_all_ok(self):
        """`all_ok` without the job's comm timeout, as a function to call (the group it makes is reused): for
        a wait that takes as long as one rank's work does (rank 0 tokenizing a corpus). A rank that dies still
        breaks the group at once."""
        if self.world == 1:
            return lambda ok: ok
        group = dist.new_group(backend="gloo", timeout=timedelta(days=7))

        def all_ok(ok: bool) -> bool:
            flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
            self._run("all_reduce", dist.all_reduce, flag, op=dist.ReduceOp.MIN, group=group)
            return bool(flag.item())
        return all_ok

    def broadcast_object(self, obj, src: int = 0):
        """`obj` of rank `src`, on every rank (small, picklable values only)."""
        if self.world == 1:
            return obj
        box = [obj]
        self._run("broadcast_object_list", dist.broadcast_object_list, box, src=src)
        return box[0]

    def _run(self, name, fn, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        except (RuntimeError, dist.DistBackendError) as exc:
            raise self.failure(name, exc) from exc
        finally:
            self.time_s += time.perf_counter() - t0

    def failure(self, name: str, exc: BaseException) -> RankFailure:
        return RankFailure(f"infinity: {name} failed on rank {self.rank} of {self.world} ({exc}); another rank "
                           "probably died or hung. See [Note: dead ranks] in infinity/engine/comm.py")


def together(comm: Comm, what: str, fn, on_failure=None, error: Callable[[str], InfinityError] = RankFailure):
    """Run fn on every rank, then agree; if any rank failed, every rank raises (after on_failure).

    The failing rank raises its own error; the others raise `error(message)` ("<what> failed on another rank":
    an exception class, or a function making one). `what` names the phase as a user would read it ("checkpoint
    write", "the disk-room check")."""
    err = None
    out = None
    try:
        out = fn()
    except Exception as exc:  # noqa: BLE001 - re-raised below, after the other ranks know
        err = exc
    try:
        ok = comm.all_ok(err is None)
    except BaseException:  # a rank died or hung (RankFailure): clean up what we can, then say so
        if on_failure is not None:
            on_failure()
        raise
    if not ok:
        if on_failure is not None:
            on_failure()
        if err is not None:
            raise err
        raise error(f"{what} failed on another rank (its own error says why)")
    return out


class Pending:
    """An asynchronous reduce-scatter in flight; wait() gives this rank's mean slice."""

    def __init__(self, comm: Comm, work, out: torch.Tensor):
        self.comm, self.work, self.out = comm, work, out

    def wait(self) -> torch.Tensor:
        t0 = time.perf_counter()
        try:
            self.work.wait()
        except (RuntimeError, dist.DistBackendError) as exc:
            raise self.comm.failure("reduce_scatter", exc) from exc
        finally:
            self.comm.time_s += time.perf_counter() - t0
        return self.out.div_(self.comm.world)


def init_distributed(timeout_s: float = 300.0, backend: str | None = None) -> Comm:
    """Join the process group torchrun describes (gloo on CPU, NCCL on CUDA, unless `backend` says which); a
    single process without it."""
    if "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1 and not dist.is_initialized():
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        # (A group that existed when this module was imported, and has since been destroyed.) The `as` matters:
        # a bare `import torch.distributed.nn` would make `torch` a local name of this function.
        import torch.distributed.nn as _dist_nn  # noqa: F401 - [Note: a process group that outlives ...]
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    return Comm()
