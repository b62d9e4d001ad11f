"""ShardedAdam: Adam/AdamW over this rank's fp32 master shards, held in RAM or swapped from NVMe.

The managed parameters' shards are packed, in registration order, into
sub-groups of at most `zero_optimization.sub_group_size` elements (a larger
parameter is a group of its own). A group is what the optimizer moves and
steps at once: one flat fp32 gradient buffer (the `grad` view of each
ManagedParam points into it), and one master/exp_avg/exp_avg_sq triple,
either as tensors in RAM (offload_optimizer none or cpu) or as one
[param | exp_avg | exp_avg_sq] swap partition (nvme, via OptimizerSwapper).
After each group's Adam the new weights go straight to the parameter store
(`publish`), in the compute dtype the kernel wrote in the same pass.

[Note: stepping during backward]
A group's gradient is final once every one of its parameters has had its
post-accumulate-grad hook in the last micro-batch's backward. When nothing
needs all gradients at once (no clipping, no fp16 overflow check), the
group is stepped right then, while backward goes on with the layers below:
its state is read when its first gradient lands, and its gradient buffer is
freed after the step. So the optimizer's I/O overlaps backward compute, and
only the groups still receiving gradients hold a gradient buffer. A
parameter cannot be needed again after its gradient is final, so writing
its new shard mid-backward is safe; a second gradient for a group already
stepped (reentrant checkpointing that shares a parameter with code outside
the checkpoint) is an error. With clipping or fp16, the step runs after
backward, over all groups, from gradients kept in RAM.

[Note: parameter groups]
`param_groups` are torch's: one dict per group the user passed to
initialize (`params`, `lr`, `weight_decay`, `betas`, `eps`), so torch's lr
schedulers drive them as they drive torch.optim.AdamW. Sub-groups are packed
within one parameter group and never across two, so each sub-group's Adam
runs with one set of hyper-parameters, read from its parameter group at
every step. Only the parameters in some group are optimized; the others
(frozen, or left out) have no master weights, moments or gradient buffer.

It subclasses torch.optim.Optimizer only for `param_groups`; its state lives
in the sub-groups, not in `state`.
"""

from __future__ import annotations

import math

import torch

from infinity.engine.comm import Comm
from infinity.engine.params import ParamStore
from infinity.optim import cpu_adam_step, grads_finite
from infinity.swap.registry import Residency
from infinity.swap.swapper import wait_all
from infinity.swap.telemetry import StepStats


class _Group:
    __slots__ = ("index", "params", "offsets", "numel", "grad", "master", "exp_avg", "exp_avg_sq", "waiting",
                 "stepped", "param_group")

    def __init__(self, index, params, param_group: int = 0):
        self.index = index
        self.param_group = param_group
        """Index into ShardedAdam.param_groups: whose lr, betas, eps and weight decay this sub-group uses."""
        self.params = params
        self.offsets = []
        off = 0
        for mp in params:
            self.offsets.append(off)
            off += mp.part
        self.numel = off
        self.grad = self.master = self.exp_avg = self.exp_avg_sq = None
        self.waiting = 0
        self.stepped = False


class ShardedAdam(torch.optim.Optimizer):
    def __init__(self, store: ParamStore, cfg, comm: Comm, *, swap=None, param_groups: list[dict] | None = None):
        """param_groups: torch-style groups of the store's trainable parameters (see [Note: parameter
        groups]); None means one group of all of them. Missing hyper-parameters come from the config."""
        opt = cfg.optimizer
        hp = opt.params
        if hp.amsgrad:
            raise ValueError("optimizer.params.amsgrad: AMSGrad is not supported; set it to false")
        self.hyper = dict(adamw=opt.type == "AdamW" or hp.adam_w_mode, bias_correction=hp.bias_correction)
        if param_groups is None:
            param_groups = [{"params": [mp.param for mp in store.params if mp.trainable]}]
        super().__init__(param_groups, {"lr": hp.lr, "betas": tuple(hp.betas), "eps": hp.eps,
                                        "weight_decay": hp.weight_decay})
        self.store = store
        self.comm = comm
        self.tier = cfg.zero_optimization.offload_optimizer.device
        self.step_count = 0
        self.groups = self._plan(self.managed_groups(), cfg.zero_optimization.sub_group_size)
        self.group_of = {id(mp): g for g in self.groups for mp in g.params}
        self.grad_device = store.device if self.tier == "none" else torch.device("cpu")
        self.lowp = None
        if store.dtype != torch.float32:
            biggest = max((g.numel for g in self.groups), default=0)
            self.lowp = torch.empty(biggest, dtype=store.dtype)
        self.swap = swap
        self.swapper = None
        self.overlapping = False
        self._overlap_stats = None
        self._overlap_sq = 0.0
        store.grad_for = self.grad_for
        store.grad_ready = self.grad_ready
        self._init_state()

    def managed_groups(self) -> list[list]:
        """The ManagedParams of each parameter group, in registration order."""
        from infinity.engine.params import managed

        return [[managed(p) for p in pg["params"]] for pg in self.param_groups]

    @staticmethod
    def _plan(param_groups: list[list], sub_group_size: int) -> list[_Group]:
        """Pack each parameter group's shards into sub-groups of at most sub_group_size elements."""
        groups = []
        for k, params in enumerate(param_groups):
            cur, size = [], 0
            for mp in sorted(params, key=lambda mp: mp.index):
                if cur and size + mp.part > sub_group_size:
                    groups.append(_Group(len(groups), cur, k))
                    cur, size = [], 0
                cur.append(mp)
                size += mp.part
            if cur:
                groups.append(_Group(len(groups), cur, k))
        return groups

    def hyper_for(self, g: _Group, **step) -> dict:
        """Adam's hyper-parameters for one sub-group now: its parameter group's, plus this step's."""
        pg = self.param_groups[g.param_group]
        return dict(self.hyper, lr=float(pg["lr"]), betas=tuple(pg["betas"]), eps=float(pg["eps"]),
                    weight_decay=float(pg["weight_decay"]), **step)

    def _init_state(self) -> None:
        """Master weights from the store's current shards; then the store switches to the compute dtype."""
        store = self.store
        if self.tier == "nvme":
            from infinity.swap.optimizer import OptimizerSwapper

            self.swapper = OptimizerSwapper(self.swap.swapper, [g.numel for g in self.groups], name="optim")
        for i, g in enumerate(self.groups):
            master = torch.empty(g.numel, dtype=torch.float32)
            for mp, off in zip(g.params, g.offsets):
                master[off:off + mp.part].copy_(store.read_shard(mp, torch.float32, scheduled=False))
            if self.swapper is not None:
                self.swapper.initialize(i, master)
            else:
                dev = store.device if self.tier == "none" else torch.device("cpu")
                g.master = master.to(dev)
                g.exp_avg = torch.zeros_like(g.master)
                g.exp_avg_sq = torch.zeros_like(g.master)
            if not self._aliasing():
                self._publish(g, master)
        if self._aliasing():
            from infinity.engine.alias import OptimizerSliceReader

            reader = OptimizerSliceReader(store, self)
            for g in self.groups:
                for mp, off in zip(g.params, g.offsets):
                    sid = f"alias/{mp.index}"
                    reader.place(mp, sid, g.index, off)
            store.alias_to(reader)
            for i, g in enumerate(self.groups):  # checksums of the initial shards, from the files just written
                p, _, _ = self.swapper.read_state(i)
                for mp, off in zip(g.params, g.offsets):
                    reader.record(f"alias/{mp.index}", p[off:off + mp.part])
        self._flush()
        store.refresh_persistent()

    def _aliasing(self) -> bool:
        """fp32 compute with parameters and optimizer both on NVMe: see [Note: fp32 shards live in the
        optimizer file] in alias.py."""
        return (self.swapper is not None and self.store.tier == "nvme" and self.store.dtype == torch.float32
                and self.store.swap is not None)

    # ----------------------------------------------------------- gradients

    def grad_for(self, mp) -> torch.Tensor:
        """The fp32 gradient shard of `mp`, allocating its group's buffer on first use."""
        g = self.group_of[id(mp)]
        if g.stepped:
            raise RuntimeError(f"infinity: parameter {mp.name} received a gradient after its group was stepped; "
                               "see [Note: stepping during backward] (use non-reentrant activation checkpointing, "
                               "or set gradient_clipping to keep the step after backward)")
        if g.grad is None:
            g.grad = torch.zeros(g.numel, dtype=torch.float32, device=self.grad_device)
            for p, off in zip(g.params, g.offsets):
                p.grad = g.grad[off:off + p.part]
            if self.overlapping and self.swapper is not None:
                self.swapper.prefetch_group(g.index)
        return mp.grad

    def grad_ready(self, mp) -> None:
        """A parameter's gradient for this backward has been added (see [Note: stepping during backward])."""
        if not self.overlapping:
            return
        g = self.group_of[id(mp)]
        g.waiting -= 1
        if g.waiting == 0:
            self._step_now(g)

    def _grads(self) -> list[torch.Tensor]:
        for g in self.groups:
            if g.grad is None:  # no parameter of the group had a gradient
                g.grad = torch.zeros(g.numel, dtype=torch.float32, device=self.grad_device)
                for p, off in zip(g.params, g.offsets):
                    p.grad = g.grad[off:off + p.part]
        return [g.grad for g in self.groups]

    # ----------------------------------------------- step during backward

    def begin_overlapped_step(self) -> None:
        """Before the last micro-batch's backward: step each group as soon as its gradient is final."""
        self.overlapping = True
        self.step_count += 1
        self._overlap_hyper = dict(step=self.step_count, grad_scale=1.0)
        self._overlap_stats = StepStats()
        self._overlap_sq = 0.0
        for g in self.groups:
            g.waiting = len(g.params)
            g.stepped = False

    def _step_now(self, g: _Group) -> None:
        self._overlap_sq += float(torch.linalg.vector_norm(g.grad)) ** 2
        self._step_group(g, self.hyper_for(g, **self._overlap_hyper), self._overlap_stats)
        g.stepped = True
        g.grad = None
        for mp in g.params:
            mp.grad = None

    def end_overlapped_step(self):
        """After backward: step groups some parameter of which got no gradient; wait for the writes.

        Returns (overflowed=False, grad_norm, StepStats), like step().
        """
        try:
            for g in self.groups:
                if not g.stepped:
                    self._grads()
                    self._step_now(g)
            if self.swapper is not None:
                self.swapper.finish_groups(self._overlap_stats)
        finally:
            self.overlapping = False
            for g in self.groups:
                g.stepped = False
        self._flush()
        self.store.refresh_persistent()
        sq = torch.tensor([self._overlap_sq], dtype=torch.float64)
        return False, math.sqrt(self.comm.all_reduce_(sq).item()), self._overlap_stats

    # ------------------------------------------------------ step after backward

    @torch.no_grad()
    def step(self, closure=None, *, loss_scale: float = 1.0, max_norm: float = 0.0):
        """Unscale, check for overflow on every rank, clip to the global norm, step, publish.

        Returns (overflowed, grad_norm, StepStats). An overflow anywhere skips the step everywhere.
        """
        grads = self._grads()
        flag = torch.tensor([0.0 if _finite(grads) else 1.0])
        if self.comm.all_reduce_(flag, op=torch.distributed.ReduceOp.MAX).item() > 0:
            return True, float("inf"), StepStats(skipped=True)
        # fp32 norms per group, summed in fp64: a fp64 norm would convert every gradient first.
        sq = torch.tensor([sum(float(torch.linalg.vector_norm(g)) ** 2 for g in grads if g.numel())],
                          dtype=torch.float64)
        norm = math.sqrt(self.comm.all_reduce_(sq).item()) / loss_scale
        coef = 1.0
        if max_norm > 0:
            coef = min(1.0, max_norm / (norm + 1e-6))
        self.step_count += 1
        stats = self._step_all(grads, dict(step=self.step_count, grad_scale=loss_scale / coef))
        self._flush()
        self.store.refresh_persistent()
        return False, norm, stats

    def _step_all(self, grads, step: dict) -> StepStats:
        hypers = [self.hyper_for(g, **step) for g in self.groups]
        if self.swapper is not None:
            lowps = None if self.lowp is None else [self.lowp[:g.numel] for g in self.groups]
            return self.swapper.step(grads, check_finite=False, out_lowp=lowps,
                                     on_updated=lambda i, p: self._publish(self.groups[i], p, lowps and lowps[i]),
                                     per_group=hypers, **hypers[0]) if self.groups else StepStats()
        stats = StepStats()
        for g, hyper in zip(self.groups, hypers):
            self._step_group(g, hyper, stats)
        return stats

    def _step_group(self, g: _Group, hyper: dict, stats: StepStats) -> None:
        lowp = None if self.lowp is None else self.lowp[:g.numel]
        if self.swapper is not None:
            self.swapper.step_group(g.index, g.grad, stats, out_lowp=lowp,
                                    on_updated=lambda i, p: self._publish(g, p, lowp), **hyper)
        elif g.master.device.type == "cpu":
            cpu_adam_step(g.master, g.grad, g.exp_avg, g.exp_avg_sq, out_lowp=lowp, check_finite=False, **hyper)
            self._publish(g, g.master, lowp)
        else:
            _device_adam(g, **hyper)
            self._publish(g, g.master, None)

    def _publish(self, g: _Group, master: torch.Tensor, lowp: torch.Tensor | None = None):
        if self.store.alias is not None:  # the group's own write carries the shards; only their checksums here
            for mp, off in zip(g.params, g.offsets):
                self.store.alias.record(f"alias/{mp.index}", master[off:off + mp.part])
            return
        src = lowp if lowp is not None else master
        for mp, off in zip(g.params, g.offsets):
            values = src[off:off + mp.part]
            if mp.shard is not None and mp.shard.data_ptr() == values.data_ptr():
                continue
            self.store.write_shard(mp, values)

    # ------------------------------------------------------------ checkpoints

    def export_state(self, use) -> None:
        """Call use(group, param, exp_avg, exp_avg_sq) for every group, with CPU fp32 views of its state.

        `use` returns a function that waits until it is done with the views
        (its writes have landed); if `use` raises, it must have waited for
        whatever it started. RAM state is waited for at the end (it does not
        move), so writes of consecutive groups overlap. On NVMe the next group is read while the
        previous one's writes are in flight, so up to three pool buffers are
        held (two being written, one being read). State on an accelerator
        is copied one parameter at a time. Nothing here changes the state.
        """
        if self.swapper is None:
            waits = []
            for g in self.groups:
                if g.master.device.type == "cpu":
                    waits.append(use(g, g.master, g.exp_avg, g.exp_avg_sq))
                else:  # one parameter's shard at a time, so the staging copy is bounded by the largest shard
                    for sub, lo, hi in _per_param(g):
                        use(sub, g.master[lo:hi].cpu(), g.exp_avg[lo:hi].cpu(), g.exp_avg_sq[lo:hi].cpu())()
            for w in waits:
                w()
            return
        sw, ids = self.swapper.swapper, self.swapper.ids
        inflight: list = []  # [id, wait] of groups whose buffers are held (swapped in, maybe being written)

        def retire():
            pid, w = inflight.pop(0)
            try:
                if w is not None:
                    w()
            finally:
                sw.release(pid)

        fut, fut_id = (sw.swap_in(ids[0]), ids[0]) if ids else (None, None)
        try:
            for i, g in enumerate(self.groups):
                state = fut.wait()
                entry = [ids[i], None]
                inflight.append(entry)  # from here on, retire() hands the buffer back whatever happens
                fut = fut_id = None
                if i + 1 < len(ids):
                    fut, fut_id = sw.swap_in(ids[i + 1], prefetch=True), ids[i + 1]
                n = g.numel
                entry[1] = use(g, state[:n], state[n:2 * n], state[2 * n:])
                while len(inflight) > 1 or (inflight and fut is None and i + 1 < len(ids)):
                    retire()
                if fut is None and i + 1 < len(ids):
                    fut = sw.swap_in(ids[i + 1])
        except BaseException:
            while inflight:
                try:
                    retire()
                except BaseException:  # noqa: BLE001 - the first error is the one raised
                    pass
            if fut is not None:
                try:
                    fut.wait()
                    sw.release(fut_id)
                except BaseException:  # noqa: BLE001
                    pass
            raise
        while inflight:
            retire()

    def import_state(self, fill, *, refresh: bool = True) -> None:
        """Replace every group's state: fill(group, param, exp_avg, exp_avg_sq) writes CPU fp32 views of it.

        `fill` must have finished every read into the views when it returns
        or raises. Then the parameter store gets the new weights (in the
        compute dtype), and with `refresh`, persistent parameters are
        re-gathered (a collective: load_checkpoint does it once every rank
        has loaded). An error part-way leaves a mix of old and new groups:
        load_checkpoint verifies the whole checkpoint before it calls this.
        """
        if self.swapper is None:
            for g in self.groups:
                if g.master.device.type == "cpu":
                    fill(g, g.master, g.exp_avg, g.exp_avg_sq)
                else:  # staged one parameter's shard at a time
                    for sub, lo, hi in _per_param(g):
                        tmp = torch.empty(3, hi - lo, dtype=torch.float32)
                        fill(sub, tmp[0], tmp[1], tmp[2])
                        for dst, src in zip((g.master, g.exp_avg, g.exp_avg_sq), tmp):
                            dst[lo:hi].copy_(src)
                self._publish(g, g.master)
        else:
            sw, ids = self.swapper.swapper, self.swapper.ids
            busy = [pid for pid in ids if sw.registry[pid].residency is not Residency.ON_DISK]
            if busy:
                raise RuntimeError(f"import_state: optimizer partitions {busy[:3]} are not at rest (an earlier swap "
                                   "failed or is still running); nothing was changed")
            writes = []
            try:
                for i, g in enumerate(self.groups):
                    n = g.numel
                    buf = sw.pool.acquire(f"load {ids[i]}")
                    try:
                        state = buf.view(torch.float32, 3 * n)
                        fill(g, state[:n], state[n:2 * n], state[2 * n:])
                        self._publish(g, state[:n])
                        writes.append(sw.swap_out_buffer(ids[i], buf, torch.float32, 3 * n))
                    except BaseException:
                        if sw.registry[ids[i]].buffer is not buf:  # the swapper did not take it over
                            sw.pool.release(buf)
                        raise
            except BaseException:
                try:
                    wait_all(writes)  # no buffer may be reused while a write still reads it
                except BaseException:  # noqa: BLE001 - the first error is the one raised
                    pass
                raise
            wait_all(writes)
        self._flush()
        if refresh:
            self.store.refresh_persistent()

    def _flush(self) -> None:
        if self.store.tier == "nvme":
            self.store.swap.swapper.flush()

    def zero_grad(self, set_to_none: bool = False) -> None:
        for g in self.groups:
            if g.grad is not None:
                g.grad.zero_()
        for group in self.groups:
            for mp in group.params:
                mp.param.grad = None

    def close(self) -> None:
        if self.swap is not None:
            self.swap.close()
            self.swap = None


class _OneParam:
    """A group of one parameter (export_state/import_state stage accelerator state per parameter)."""

    __slots__ = ("params", "offsets", "numel", "index")

    def __init__(self, mp, index):
        self.params, self.offsets, self.numel, self.index = [mp], [0], mp.part, index


def _per_param(g: _Group):
    for mp, off in zip(g.params, g.offsets):
        yield _OneParam(mp, g.index), off, off + mp.part


def _finite(grads) -> bool:
    cpu = [g for g in grads if g.device.type == "cpu"]
    dev = [g for g in grads if g.device.type != "cpu"]
    return grads_finite(cpu) and all(bool(torch.isfinite(g).all()) for g in dev)


def _device_adam(g: _Group, *, step, lr, betas, eps, weight_decay, adamw, bias_correction, grad_scale):
    """Adam on an accelerator (offload_optimizer none on CUDA): the same math as cpu_adam_step, in torch ops."""
    grad = g.grad / grad_scale
    p, m, v = g.master, g.exp_avg, g.exp_avg_sq
    if not adamw and weight_decay:
        grad = grad.add(p, alpha=weight_decay)
    if adamw and weight_decay:
        p.mul_(1 - lr * weight_decay)
    m.lerp_(grad, 1 - betas[0])
    v.mul_(betas[1]).addcmul_(grad, grad, value=1 - betas[1])
    bc1 = 1 - betas[0] ** step if bias_correction else 1.0
    bc2 = 1 - betas[1] ** step if bias_correction else 1.0
    p.addcdiv_(m, (v.sqrt() / math.sqrt(bc2)).add_(eps), value=-lr / bc1)
