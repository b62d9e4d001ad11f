"""ShardedAdam: Adam/AdamW over this rank's fp32 master shards, held in RAM or swapped from NVMe.

The managed parameters' shards are packed, in registration order, into
sub-groups of at most `zero_optimization.sub_group_size` elements (a larger
parameter is a group of its own), the persistent ones first and apart. A group is what the optimizer moves and
steps at once: one flat fp32 gradient buffer (the `grad` view of each
ManagedParam points into it), and its master/exp_avg/exp_avg_sq, owned by a
`GroupState` of the group's tier (infinity/swap/state.py: device memory,
host RAM, or one [param | exp_avg | exp_avg_sq] NVMe swap partition; the
moments are fp32, or bf16 with offload_optimizer.moments_dtype "bf16"). The
step, the checkpoint export and the import are each one walk over the
groups' states by `StatePipeline` ([Note: one pipeline] in swap/pipeline.py),
with no tier branch here. After each group's Adam the new weights go
straight to the parameter store (`publish`), in the compute dtype the
kernel wrote in the same pass.

[Note: partial offload]
`offload_optimizer.ratio` (DeepSpeed's Twin-Flow, stage 3 with device cpu;
the config loader reports it as inert anywhere else) offloads part of the
optimizer state and keeps the rest on the compute device: as in DeepSpeed
0.19, sub-group i is offloaded when i < int(ratio x the number of
sub-groups), and the others get device states, stepped where they live.
ratio 1 (the default) offloads every group, ratio 0 none.

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
backward, over all groups, from gradients kept in RAM (under ZeRO-3 with
NVMe state it is finished by the next forward: [Note: the step finishes in
the next forward] in deferred.py). The states it takes first are read
during backward (`read_ahead_for_step`) into the buffers beyond the one its
walk needs, so backward lends from those as well.

[Note: the speculative step]
With clipping or fp16 the step needs every gradient first, so it used to
run after backward, and with its state on NVMe its I/O ran under the next
forward alone: with checkpointing about a quarter of the step, which at 1B
is shorter than the 26 B/param the step moves. Where most steps do not
clip, that wait buys nothing. So, with `infinity.speculative_step`, the
step during backward above also runs under clipping and fp16, betting that
the clip coefficient will be exactly 1 and nothing will overflow: each
group steps when its gradient is final, with grad_scale the loss scale
(what the step after backward uses when the coefficient is 1), and writes
its new state to the second slot of its file ([Note: a speculative step
writes a second slot] in swap/state.py), keeping the one it read. The
gradients are kept (the step after backward keeps them too). At the end of
backward the checks of the step after backward run on them, unchanged
(overflow on every rank, the global norm summed per shard in registration
order) and with the same collectives. If the coefficient is 1.0, nothing
overflowed and no group got a gradient after it stepped (reentrant
checkpointing), the bet holds, and `Engine.step` commits it (`commit_bet`:
every group's written slot becomes live, no I/O) unless the parameter
groups' lr, betas, eps or weight decay changed since backward began (on
any rank: the bet read them as each group stepped). Until then reads see
the old weights, as they would before a step after backward. So the step
is the one the step after backward would have taken, bit for bit: the same
gradients, hyper-parameters, grad_scale and state. Otherwise every group
goes back to the slot it read (`rollback`, no I/O), the step count too,
and `Engine.step` takes the step after backward as if nothing had been
tried; a held bet whose step() never comes is rolled back by whatever
touches the state next. A lost bet's cost is its I/O, on a disk backward's
reads share. So the engine bets only when the last step neither clipped
nor overflowed (its norm is known anyway): a run whose steps clip pays one
wasted step when it starts to, and nothing while it goes on clipping. A
bet lost to a late gradient, or to an lr changed before step(), turns
bets off for the run, since every bet of that model or loop would be lost
the same way. During a bet, a weight backward takes from a state lent
before the bet stepped it in place (reentrant recompute) is read again
from the live file instead (`StaleLend`).

It needs the state's slots on NVMe, and the shards read from the
optimizer's files (parameters and optimizer both on NVMe: alias.py), so
that a rollback leaves every copy of the weights as it was: reads of a
group's shards during backward (reentrant recompute) go to the slot that
is live, with its checksum ([Note: compute-dtype shards in the optimizer
file]; a speculative write's checksums wait in the reader until commit).
Where shards live in memory, publishing a group's new weights overwrites
them, and is not undone. It needs disk room for a second copy of the
optimizer's files on every rank (`can_speculate`, agreed by all ranks).

[Note: backward reads from the state]
A parameter shard is the compute-dtype rounding of its master weight (the
kernel writes it in the same pass, round-to-nearest-even as torch rounds),
and the master cannot change between two steps: gathered_parameters refuses
to modify a trained parameter after initialize. So wherever a sub-group's
master is in host memory anyway, the prefetch scheduler takes a shard from
it (`lend`) instead of reading the shard's own file: from a CPU-tier state
always, and from an NVMe state once its read for the step during backward
has started. That read is started by the first backward-phase fetch or
prefetch of any of the group's parameters, not by its first gradient, so the
same 12 B/param read feeds both backward's use of the weights and Adam: a
step moves 4 (forward) + 12 + 12 B/param in fp32, 2 + 12 + 12 + 2 in bf16,
instead of reading every weight a second time. The prefetch scheduler reads
ahead across the turn from forward to backward, so backward-phase prefetches
are issued while forward still runs, before the step begins: the engine says
at each forward whether the coming backward will step (`expect_step`), and
if so those reads start early and the step adopts them when it begins. An
early read nobody adopted (a forward without that backward) is dropped at
the next forward, step, export or import. A read takes a buffer only when
one is free beyond the critical path's (`reserve=1`); when none is, the
shard is read from its file as before. A group already stepped lends
nothing (its master is the next step's), nor does a state on an
accelerator.

[Note: a large shard is split over sub-groups of its own]
A buffer of the NVMe pool holds one sub-group's whole state, so a shard
larger than `sub_group_size` used to set the size of every buffer: GPT-2's
tied 38.6M-element embedding made gpt-125m's pool 4 x 516 MiB, more than the
1.6 GiB of state it swaps. When the shards live in the optimizer's files
(alias mode: parameters and optimizer both on NVMe, every sub-group
offloaded), such a shard is cut into pieces of at most sub_group_size
elements (starting at multiples of SPLIT_ALIGN), each a sub-group of its own
that holds no other parameter:
- its gradient is one buffer for the whole shard (what the reduce-scatter
  writes); each piece's group holds its view, and the piece is final when
  the shard's gradient is;
- forward and backward read the shard as its pieces, one read each, from
  the pieces' files into one parameter buffer (OptimizerSliceReader), each
  piece with its own CRC-32C; `lend` lends nothing from a split shard;
- a checkpoint writes the shard's chunk a piece at a time, the CRC combined
  across pieces, and reads it back into each piece (checkpoint/save.py,
  load.py). The format does not change.
Where the shards live in host or device memory (offload_param none or cpu,
ZeRO-3, every sub-group on NVMe: ZeRO-Offload's layout) the same holds, and
each piece's new weights are written into its slice of the shard
(ParamStore.write_piece) as the piece steps; at gpt-125m that takes the
optimizer-on-NVMe pool from 4 x 442 MiB to 4 x 96 MiB. Where a shard has an
NVMe file of its own, outside the optimizer's, it stays one sub-group:
publishing a piece would need a partial write of that file. `can_split` (plan.py)
decides.

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

import logging
import math

import torch

from infinity.engine.alias import slice_id
from infinity.engine.buckets import GradientBuckets
from infinity.engine.comm import Comm
from infinity.engine.deferred import DeferredStep
from infinity.engine.params import ParamStatus, ParamStore
from infinity.engine.plan import OffloadPlan, ShardSource
from infinity.optim import grads_finite
from infinity.swap.pipeline import Mode, StatePipeline
from infinity.swap.state import DeviceState, GroupState, HostState, NvmeState, state_nbytes
from infinity.swap.telemetry import StepStats
from infinity.swap.tier import HOST, Tier

log = logging.getLogger("infinity")


class _Group:
    __slots__ = ("index", "params", "offsets", "spans", "numel", "grad", "state", "waiting", "stepped",
                 "param_group")

    def __init__(self, index, params, param_group: int = 0, span: tuple[int, int] | None = None):
        self.index = index
        self.param_group = param_group
        """Index into ShardedAdam.param_groups: whose lr, betas, eps and weight decay this sub-group uses."""
        self.params = params
        self.spans = [span] if span is not None else [(0, mp.part) for mp in params]
        """Per parameter, the elements [lo, hi) of its shard this group holds: the whole shard, except in a
        piece of a split one (see [Note: a large shard is split over sub-groups of its own])."""
        self.offsets = []
        off = 0
        for lo, hi in self.spans:
            self.offsets.append(off)
            off += hi - lo
        self.numel = off
        self.grad = None
        self.state: GroupState | None = None
        """Its master weights and moments, on its tier."""
        self.waiting = 0
        self.stepped = False

    @property
    def split(self) -> bool:
        """A piece of a shard split over several sub-groups."""
        return self.spans[0] != (0, self.params[0].part)

    def entries(self):
        """(mp, offset in the group, lo, hi) per parameter: the group holds mp's shard elements [lo, hi)."""
        return [(mp, off, lo, hi) for mp, off, (lo, hi) in zip(self.params, self.offsets, self.spans)]

    def slices(self):
        """(a one-parameter group, lo, hi) per parameter: the unit a checkpoint stages through host memory (a
        device state's; those are never split)."""
        assert not self.split, "a device state holding a piece of a split shard"
        return [(_OneParam(mp, self.index), off, off + mp.part) for mp, off in zip(self.params, self.offsets)]


class ShardedAdam(torch.optim.Optimizer):
    def __init__(self, store: ParamStore, cfg, comm: Comm, *, plan: OffloadPlan, param_groups: list[dict],
                 swap=None, trace=None):
        """plan: the sub-groups and their tiers ([Note: one plan for the placement] in plan.py), packed from
        param_groups, the torch-style groups of the store's trainable parameters (see [Note: parameter
        groups]); their missing hyper-parameters come from the config. swap: the NVMe optimizer pool's
        SwapContext, when the plan puts a sub-group on NVMe. trace: a telemetry.Trace (infinity.trace_path) the
        pipelines add their spans to, or None."""
        opt = cfg.optimizer
        hp = opt.params
        if hp.amsgrad:
            raise ValueError("optimizer.params.amsgrad: AMSGrad is not supported; set it to false")
        self.hyper = dict(adamw=opt.type == "AdamW" or hp.adam_w_mode, bias_correction=hp.bias_correction)
        super().__init__(param_groups, {"lr": hp.lr, "betas": tuple(hp.betas), "eps": hp.eps,
                                        "weight_decay": hp.weight_decay})
        self.store = store
        self.comm = comm
        off = cfg.zero_optimization.offload_optimizer
        self.pin = off.pin_memory and torch.cuda.is_available()  # page-locking means nothing without CUDA
        self.plan = plan
        self.tier = plan.optimizer_tier
        """Where offloaded sub-groups live; with ratio < 1 the others stay on the device ([Note: partial offload])."""
        self.moments = plan.moments_dtype
        """exp_avg and exp_avg_sq's dtype on every tier (offload_optimizer.moments_dtype)."""
        if self.moments != torch.float32:
            self.hyper["moment_rounding"] = off.moments_rounding
        self.step_count = 0
        self.groups = [_Group(sg.index, list(sg.params), sg.param_group, sg.span) for sg in plan.sub_groups]
        self.groups_of: dict[int, list[_Group]] = {}
        """Per parameter, the sub-groups holding its shard: one, or the pieces of a split one, in order."""
        for g in self.groups:
            for mp in g.params:
                self.groups_of.setdefault(id(mp), []).append(g)
        self._offset_of = {id(mp): off for g in self.groups if not g.split for mp, off in zip(g.params, g.offsets)}
        self.in_state = plan.shard_dtype
        """The dtype of the trained shards kept in the optimizer's NVMe files (see [Note: fp32 shards live in
        the optimizer file] and [Note: compute-dtype shards in the optimizer file] in alias.py), or None."""
        if self.in_state is not None and self.in_state != torch.float32:
            largest = max(g.numel for g in self.groups)
            need = state_nbytes(largest, self.moments) + largest * store.dtype.itemsize
            if swap is None or swap.pool.size < need:
                raise ValueError(f"ShardedAdam: the optimizer's pool buffers must hold a sub-group's state and its "
                                 f"{store.dtype} weights ({need} B); build it with SwapContext.for_optimizer("
                                 f"..., tail_bytes={store.dtype.itemsize})")
        self.lowp = None
        if store.dtype != torch.float32 and self.in_state is None:
            biggest = max((g.numel for g in self.groups), default=0)
            # What the CPU kernel writes the compute-dtype weights into, copied to the device from there.
            self.lowp = torch.empty(biggest, dtype=store.dtype,
                                    pin_memory=off.pin_memory and torch.cuda.is_available())
        self.swap = swap
        self._pipe: StatePipeline | None = None  # the step during backward's, between begin and end
        self._expecting = False  # the coming backward steps: backward-phase fetches may start its reads
        self._early: list[GroupState] = []  # state reads started for that step before it began
        self.trace = trace
        self.overflow = False  # the last step's: an fp16 overflow skipped it (DeepSpeed's optimizer.overflow)
        self._overlap_sq = 0.0
        self._hyper_at_backward: list[tuple] = []  # the param groups' values when the last overlapped step began
        self._said_hyper = False
        self._speculative = False  # the step during backward is a bet ([Note: the speculative step])
        self._bet: StepStats | None = None  # a bet that held at backward's end, for commit_bet() in step()
        self._dropped = False  # that bet was rolled back before step() came
        self._spoiled = False  # a group got a gradient after it had stepped in the bet
        self.can_speculate = False
        """Every rank can take the step during backward as a bet ([Note: the speculative step])."""
        self.speculation: str | None = None
        """The last step's bet: "committed", "redone" (rolled back, then taken after backward) or None."""
        self.speculation_stats: StepStats | None = None  # a rolled-back bet's I/O, reported with its step
        self._stepped_order: list[int] = []  # this step during backward's groups, in the order they stepped
        self._last_order: list[int] = []  # the last completed one's (see _read_ahead)
        self._deferred: DeferredStep | None = None  # the rest of the last step, finished by the next forward
        self.deferred_wait_s = 0.0  # what deferred steps made their callers wait, in all (the engine reports it)
        self.buckets = GradientBuckets(comm, self, cfg.zero_optimization.reduce_bucket_size)
        store.attach(self)
        self._init_state()
        self.can_speculate = self._room_to_speculate(plan, cfg)

    def _room_to_speculate(self, plan: OffloadPlan, cfg) -> bool:
        """A speculative step is possible here and on every rank: the state on NVMe, the shards in its files,
        and room on each filesystem for a second copy of the optimizer's files (a collective). Where the config
        may bet (clipping or fp16), the second slots' files are reserved now."""
        ok = (self.store.shard_source is ShardSource.OPTIMIZER_FILE and bool(self.groups)
              and all(isinstance(g.state, NvmeState) for g in self.groups)
              and all(d.room_for_second_copy for d in plan.disk))
        inf = cfg.infinity
        if ok and inf.step_during_backward and inf.speculative_step and (cfg.gradient_clipping > 0
                                                                         or cfg.fp16.enabled):
            try:
                for g in self.groups:
                    g.state.reserve_second_slot()
            except OSError as exc:
                log.warning("infinity: no speculative step: reserving the second slot of the optimizer's files "
                            "failed: %s", exc)
                ok = False
        ok = self.comm.all_ok(ok)
        if not ok:
            self._drop_second_slots()  # reserved here, or on no rank, but some rank cannot bet
        return ok

    def _drop_second_slots(self) -> None:
        """Remove whatever second-slot files were reserved: no bet will use them."""
        for g in self.groups:
            if isinstance(g.state, NvmeState):
                g.state.drop_second_slot()

    @property
    def overlapping(self) -> bool:
        """A step during backward is under way (see [Note: stepping during backward])."""
        return self._pipe is not None

    def hyper_for(self, g: _Group, **step) -> dict:
        """Adam's hyper-parameters for one sub-group now: its parameter group's, plus this step's."""
        pg = self.param_groups[g.param_group]
        seed = {}
        if self.moments != torch.float32:
            # bf16 moments' stochastic rounding: a stream per (step, sub-group, rank), the same on every run.
            seed["moment_seed"] = (step["step"] * 0x9E3779B1 + g.index * 0x85EBCA77
                                   + self.comm.rank * 0xC2B2AE3D) & 0xFFFFFFFF
        return dict(self.hyper, lr=float(pg["lr"]), betas=tuple(pg["betas"]), eps=float(pg["eps"]),
                    weight_decay=float(pg["weight_decay"]), **step, **seed)

    # ------------------------------------------------------------ the state

    def _new_state(self, g: _Group, tier: Tier) -> GroupState:
        mo = self.moments
        tail = self.in_state if self.in_state != torch.float32 else None
        make = {Tier.DEVICE: lambda: DeviceState(g.numel, self.store.device, slices=g.slices(), moments=mo),
                Tier.CPU: lambda: HostState(g.numel, pin=self.pin, moments=mo),
                Tier.NVME: lambda: NvmeState(g.numel, self.swap.swapper, f"optim/g{g.index}", moments=mo,
                                             lowp=tail)}
        return make[tier]()

    def _init_state(self) -> None:
        """Master weights from the store's current shards, zero moments; then the store switches to the
        compute dtype (or, in alias mode, reads its shards from the optimizer's files)."""
        store = self.store
        for g, sg in zip(self.groups, self.plan.sub_groups):
            g.state = self._new_state(g, sg.tier)
        reader = None
        if self.in_state is not None:
            from infinity.engine.alias import OptimizerSliceReader

            reader = OptimizerSliceReader(store, self.in_state)

        whole = {}  # a split shard, read once for all its pieces

        def first(i: int, views) -> None:
            g = self.groups[i]
            for mp, off, lo, hi in g.entries():
                if g.split:
                    if id(mp) not in whole:
                        whole.clear()
                        whole[id(mp)] = store.read_shard(mp, torch.float32)
                    values = whole[id(mp)][lo:hi]
                else:
                    values = store.read_shard(mp, torch.float32)
                views.param[off:off + hi - lo].copy_(values)
            views.exp_avg.zero_()
            views.exp_avg_sq.zero_()
            if reader is None:
                self._publish(g, views)
                return
            # The initial shards' places and checksums, as they are about to be written.
            base = 0 if views.lowp is None else g.state.tail_offset
            shards = views.param if views.lowp is None else views.lowp
            for mp, _, _, hi in g.entries():
                if hi == mp.part:
                    whole.pop(id(mp), None)  # a split shard's last piece is in
                    if views.lowp is not None:  # read: the group's file is their home now (see [Note: swap
                        mp.home.forget(mp)  # files during setup]); a split shard's once its last piece is
            if views.lowp is not None:
                views.lowp.copy_(views.param)
            for mp, off, lo, hi in g.entries():
                reader.place(slice_id(mp), g.state, base + reader.itemsize * off, hi - lo,
                             at=lo)
                reader.record(reader.key(slice_id(mp), lo), shards[off:off + hi - lo])

        StatePipeline(Mode.FILL).over(self._states(), first)
        if reader is not None:
            store.alias_to(reader)
        store.flush()
        store.refresh_persistent()

    def _states(self) -> list[GroupState]:
        return [g.state for g in self.groups]

    # ----------------------------------------------------------- gradients

    def take_grad(self, mp, grad: torch.Tensor) -> None:
        """The store's hook hands over mp's full gradient: bucketed to its owner rank ([Note: gradient
        buckets] in buckets.py), which adds it to mp's gradient shard (grad_for) and says so (grad_ready)."""
        self.buckets.add(mp, grad)

    def flush_grads(self) -> None:
        """The end of backward: every gradient bucketed so far lands in its shard."""
        self.buckets.flush(final=True)

    def grad_for(self, mp) -> torch.Tensor:
        """The fp32 gradient shard of `mp`, allocating its group's buffer on first use."""
        if self._deferred is not None:
            self.settle()
        groups = self.groups_of[id(mp)]
        if self._speculative and any(g.stepped for g in groups):
            self._spoiled = True  # the bet is off; its gradient is kept, and the step after backward takes it
        elif any(g.stepped for g in groups):
            raise RuntimeError(f"infinity: parameter {mp.name} received a gradient after its group was stepped; "
                               "see [Note: stepping during backward] (use non-reentrant activation checkpointing, "
                               "or set gradient_clipping to keep the step after backward)")
        if groups[0].grad is None:
            self._new_grad(groups[0])
            if self._pipe is not None:
                for g in groups:
                    self._pipe.ahead(g.state)  # its state is read while backward goes on
        return mp.grad

    def lend(self, mp, *, backward: bool = False):
        """mp's fp32 master weights from its group's state, if they are in host memory or on their way (see
        [Note: backward reads from the state]): a future whose wait() gives a host view, or None. A fetch for
        backward (`backward`) of the step's backward starts the read Adam will use, if a buffer is free."""
        groups = self.groups_of.get(id(mp))
        if groups is None or groups[0].split or groups[0].stepped or self._deferred is not None:
            return None  # a split shard's master is in several states: its own read serves backward
        g = groups[0]
        if backward:
            if self._pipe is not None:
                self._pipe.ahead(g.state)
            elif self._expecting and g.state not in self._early:
                g.state.prefetch(reserve=1)
                if g.state.ready():
                    self._early.append(g.state)
        return g.state.lend(self._offset_of[id(mp)], mp.part)

    def expect_step(self, coming: bool) -> None:
        """At each forward: whether the backward after it will step during backward. Drops the reads an
        earlier forward started for a step that did not come."""
        self._drop_early()
        self._expecting = coming

    def _drop_early(self) -> None:
        early, self._early = self._early, []
        for state in early:
            state.abandon()

    def _new_grad(self, g: _Group) -> None:
        if g.split:  # one buffer for the whole shard; each piece's group holds its view of it
            mp = g.params[0]
            mp.grad = torch.zeros(mp.part, dtype=torch.float32, device=g.state.device, pin_memory=g.state.pinned)
            for piece in self.groups_of[id(mp)]:
                lo, hi = piece.spans[0]
                piece.grad = mp.grad[lo:hi]
            return
        g.grad = torch.zeros(g.numel, dtype=torch.float32, device=g.state.device, pin_memory=g.state.pinned)
        for p, off in zip(g.params, g.offsets):
            p.grad = g.grad[off:off + p.part]

    def grad_ready(self, mp) -> None:
        """A parameter's gradient for this backward has been added (see [Note: stepping during backward])."""
        if self._pipe is None:
            return
        for g in self.groups_of[id(mp)]:
            g.waiting -= 1
            if g.waiting == 0:
                self._step_now(g)

    def _grads(self) -> list[torch.Tensor]:
        for g in self.groups:
            if g.grad is None:  # no parameter of the group had a gradient
                self._new_grad(g)
        return [g.grad for g in self.groups]

    def backward_failed(self, error: BaseException) -> None:
        """A backward raised part-way (`error`): what it had not yet landed (the open bucket, a reduce-scatter
        in flight) is dropped, or the next backward would send it with its own. After a failed collective (a
        rank died or hung) the one in flight is not waited for: that would take another comm timeout before
        `error` is raised. Otherwise a collective that cannot finish must not hide `error`: it is logged."""
        from infinity.errors import RankFailure

        try:
            self.buckets.discard(wait=not isinstance(error, RankFailure))
        except Exception as exc:  # noqa: BLE001 - the backward's own error is the one raised
            log.warning("infinity: after the failed backward, its reduce-scatter in flight failed too: %s", exc)

    def forget_gradients(self) -> None:
        """Drop every gradient accumulated so far (they belong to a state that a checkpoint load replaced),
        those still in a bucket or a collective included, and any bet taken on them."""
        self.settle()  # a bet pending is rolled back
        self.take_speculation()
        self._dropped = False
        self.buckets.discard()
        for g in self.groups:
            g.grad = None
            for mp in g.params:
                mp.grad = None

    # ----------------------------------------------- step during backward

    def _drop_staged(self) -> None:
        """Before the state changes: the copies the last deferred step staged and nobody took go back ([Note:
        stepped shards are staged] in deferred.py)."""
        if self.store.shard_source is ShardSource.OPTIMIZER_FILE:
            self.store.alias.drop_staged()

    def begin_overlapped_step(self, *, speculative: bool = False, loss_scale: float = 1.0) -> None:
        """Before the last micro-batch's backward: step each group as soon as its gradient is final; with
        `speculative`, as a bet that the clip will not scale and nothing will overflow ([Note: the speculative
        step]), the gradients unscaled by `loss_scale`."""
        self._drop_staged()
        self.step_count += 1
        # loss_scale / a clip coefficient of 1.0, as the step after backward computes it
        self._overlap_hyper = dict(step=self.step_count, grad_scale=loss_scale / 1.0)
        self._overlap_sq = 0.0
        self._hyper_at_backward = self._hyper_now()
        self._speculative, self._spoiled, self._dropped = speculative, False, False
        self.speculation, self.speculation_stats = None, None
        if speculative:
            for g in self.groups:
                g.state.speculate()
        # reserve 1: a read started on a group's first gradient leaves the critical path a buffer.
        self._pipe = StatePipeline(Mode.UPDATE, reserve=1, trace=self.trace)
        self._expecting = False
        early, self._early = self._early, []
        for state in early:  # read since forward's prefetch crossed into backward: the step's now
            self._pipe.ahead(state)
        for g in self.groups:
            g.waiting = len(g.params)
            g.stepped = False
        self._stepped_order = []

    def _step_now(self, g: _Group) -> None:
        if not self._speculative:
            self._overlap_sq += float(torch.linalg.vector_norm(g.grad)) ** 2
        self._pipe.run(g.state, self._adam_work(g, self.hyper_for(g, **self._overlap_hyper)))
        g.stepped = True
        self._stepped_order.append(g.index)
        if not self._speculative:  # a bet keeps the gradients: a step after backward may need them
            g.grad = None
            for mp in g.params:
                mp.grad = None
        self._read_ahead()

    def _read_ahead(self, depth: int = 2) -> None:
        """Start the reads of the next `depth` groups expected to step, where a buffer is free beyond the
        reserve. A group's own triggers (its first backward fetch, its first gradient) try once; when no
        buffer was free then, nothing else would try again before its gradient is final. The tied embedding
        is the case: fetched at the head, first in backward, final at the very end. Expected order: the last
        overlapped step's, else the highest index first (backward's usual order)."""
        order = self._last_order or range(len(self.groups) - 1, -1, -1)
        started = 0
        for i in order:
            g = self.groups[i]
            if g.stepped:
                continue
            if not g.state.ready():
                self._pipe.ahead(g.state)
                if not g.state.ready():
                    return  # no buffer free beyond the reserve: the next step's end tries again
            started += 1
            if started >= depth:
                return

    def end_overlapped_step(self, *, loss_scale: float = 1.0, max_norm: float = 0.0):
        """After backward: step groups some parameter of which got no gradient; wait for the writes.

        Returns (overflowed=False, grad_norm, StepStats), like step(); after a bet ([Note: the speculative
        step]) that lost (the clip to `max_norm` scales, an overflow, a late gradient), None: every group is
        back as it was, its gradient kept, and step() takes the step after backward.
        """
        pipe = self._pipe
        try:
            for g in self.groups:
                if not g.stepped:
                    if g.grad is None:  # no gradient at all (a split shard's: none for any piece, so a fresh
                        self._new_grad(g)  # buffer is right; the stepped groups get none)
                    self._step_now(g)
            pipe.finish()
            self._last_order = self._stepped_order
        except BaseException:
            pipe.abandon()
            if self._speculative:
                self._rollback()
            raise
        finally:
            self._pipe = None
            for g in self.groups:
                g.stepped = False
        if self._speculative:
            return self._settle_bet(pipe.stats, loss_scale, max_norm)
        self.store.flush()
        self.store.refresh_persistent()
        sq = torch.tensor([self._overlap_sq], dtype=torch.float64)
        self.overflow = False  # (a step during backward runs only where no overflow can skip it)
        return False, math.sqrt(self.comm.all_reduce_(sq).item()), pipe.stats

    def cancel_overlapped_step(self) -> None:
        """Backward failed part-way: let what the step started finish, and hand every buffer back. Groups
        already stepped keep their new state; the others keep the old (after a bet, every group keeps the
        old)."""
        self.expect_step(False)
        if self._pipe is not None:
            self._pipe.abandon()
            self._pipe = None
            for g in self.groups:
                g.stepped = False
            if self._speculative:
                self._rollback()

    def _settle_bet(self, stats: StepStats, loss_scale: float, max_norm: float):
        """The end of a speculative step's backward: if the step after backward would scale or skip, roll it back
        now and return None; else return (False, norm, stats) and leave the bet to commit_bet() in step() (see
        [Note: the speculative step])."""
        self._speculative = False
        try:
            overflow, spoiled, norm = self._judge(loss_scale, spoiled=self._spoiled)
        except BaseException:
            self._rollback()
            raise
        if overflow or spoiled or clip_coef(norm, max_norm) != 1.0:
            self._rollback()
            self.speculation, self.speculation_stats = "redone", stats
            if spoiled:  # the model uses a parameter after its gradient is final: every bet would be lost so
                self._stop_betting("a parameter got a gradient after its sub-group had stepped during backward "
                                   "(reentrant activation checkpointing of a parameter also used outside it)")
            return None
        self._bet = stats
        return False, norm, stats

    def commit_bet(self) -> bool:
        """At step(), after a bet that held at the end of backward: commit it (the written slots become live; no
        I/O) and return True, or, if the parameter groups' lr, betas, eps or weight decay changed since backward
        began on any rank, roll it back and return False: the step after backward, with the new values, is then
        the step. True, doing nothing, when no bet is pending."""
        stats, self._bet = self._bet, None
        if stats is None:  # no bet, or one rolled back since backward (another backward came before this step)
            dropped, self._dropped = self._dropped, False
            return not dropped
        changed = torch.tensor([1.0 if self._hyper_now() != self._hyper_at_backward else 0.0])
        if self.comm.all_reduce_(changed, op=torch.distributed.ReduceOp.MAX).item() > 0:
            self._rollback()
            self.speculation, self.speculation_stats = "redone", stats
            self._stop_betting("the lr, betas, eps or weight_decay changed between backward and step() (change "
                               "them after step(), as torch's lr schedulers do)")
            return False
        self._drop_early()  # reads a forward since backward started of the slots about to stop being live
        unwritten = [g.index for g in self.groups if not g.state.wrote_next]
        if unwritten:  # checked before any slot flips: a commit is all the groups or none
            self._rollback()
            raise RuntimeError(f"infinity: the speculative step wrote no new state for sub-groups {unwritten[:3]}; "
                               "it was rolled back")
        for g in self.groups:
            g.state.commit()
        self.store.alias.commit_pending()
        for g in self.groups:  # the bet's gradients are not needed any more
            g.grad = None
            for mp in g.params:
                mp.grad = None
        self.speculation = "committed"
        self.overflow = False
        self.store.flush()
        self.store.refresh_persistent()
        return True

    def _drop_bet(self) -> None:
        """A bet that held but whose step() never came (the next backward, a checkpoint load, close): rolled
        back, as if no step had been taken; its gradients stay, as the step after backward's would, and the
        step() that comes takes the step after backward (commit_bet says so)."""
        if self._bet is not None:
            stats = self._bet
            self._rollback()
            self._dropped = True
            self.speculation, self.speculation_stats = "redone", stats

    def _stop_betting(self, why: str) -> None:
        """No more bets this run (every rank comes here together: `why` is an all-reduced verdict)."""
        if self.can_speculate:
            self.can_speculate = False
            self._drop_second_slots()
            log.warning("infinity: the speculative step is off for the rest of this run: %s; each bet would be "
                        "lost", why)

    def _hyper_now(self) -> list[tuple]:
        return [(float(pg["lr"]), tuple(pg["betas"]), float(pg["eps"]), float(pg["weight_decay"]))
                for pg in self.param_groups]

    def check_hyper_since_backward(self) -> None:
        """At step(), after the exact step during backward: say so if the parameter groups' hyper-parameters
        changed since backward began, since that step used the earlier ones (once a run; a bet is rolled back
        instead: commit_bet)."""
        if self._hyper_now() != self._hyper_at_backward and not self._said_hyper:
            self._said_hyper = True
            log.warning("infinity: the optimizer's lr, betas, eps or weight_decay changed between backward and "
                        "step(); without gradient clipping the step is taken during backward, with the values from "
                        "when backward began. Change them after step(), as torch's lr schedulers do, or set "
                        "infinity.step_during_backward to false")

    def take_speculation(self) -> tuple[str | None, StepStats | None]:
        """The last step's bet ("committed", "redone" or None) and a rolled-back bet's I/O; both are then
        forgotten."""
        out = self.speculation, self.speculation_stats
        self.speculation = self.speculation_stats = None
        return out

    def _rollback(self) -> None:
        """Every group back to the slot it read, its checksums with it, and the step count: as before the bet."""
        self._speculative = False
        self._bet = None
        self.step_count -= 1
        for g in self.groups:
            g.state.rollback()
        self.store.alias.drop_pending()

    # ------------------------------------------------------ step after backward

    @torch.no_grad()
    def step(self, closure=None, *, loss_scale: float = 1.0, max_norm: float = 0.0, defer: bool = False):
        """Unscale, check for overflow on every rank, clip to the global norm, step, publish.

        Returns (overflowed, grad_norm, StepStats). An overflow anywhere skips the step everywhere. With
        `defer`, the groups that hold no persistent parameter are stepped as the next forward needs them
        ([Note: the step finishes in the next forward] in deferred.py).
        """
        self.settle()
        self._drop_staged()
        early, self._early = self._early, []  # read_ahead_for_step's reads: this walk's now
        self._expecting = False
        try:
            result = self._step_after_backward(loss_scale, max_norm, defer)
        except BaseException:
            deferred = self._take_deferred()
            if deferred is not None:
                deferred.abandon()
            for state in early:
                state.abandon()
            raise
        self.overflow = result[0]
        if result[0]:  # skipped: nothing read the state
            for state in early:
                state.abandon()
        return result

    def read_ahead_for_step(self, *, defer: bool) -> None:
        """Before the backward whose step runs after it: start reading the states that step takes first, into
        free pool buffers beyond one (its walk's critical path needs one). The step adopts them; the next
        forward drops them if no step came."""
        now, later = self._walk_order(defer)
        for g in now + later:
            state = g.state
            if state in self._early:
                continue
            state.prefetch(reserve=1)
            if not state.ready():
                return
            if state.io_bytes:
                self._early.append(state)

    def _walk_order(self, defer: bool) -> tuple[list, list]:
        """The groups the step after backward takes at once, and (defer) those it leaves to the next forward, in
        the order forward first needs them ([Note: the step finishes in the next forward] in deferred.py)."""
        if not defer:
            return self.groups, []
        # Persistent parameters are used as plain tensors, without a read through the store, and so is one
        # gathered right now (inside gathered_parameters): their groups are stepped at once.
        def at_once(g):
            return any(mp.persistent or mp.status is ParamStatus.GATHERED for mp in g.params)

        now = [g for g in self.groups if at_once(g)]
        # Forward's order: as the forwards so far first gathered them (a tied weight is registered where it was
        # built, not where it is used first), else registration order.
        first = self.store.first_use
        later = sorted((g for g in self.groups if not at_once(g)),
                       key=lambda g: (min(first.get(mp.index, math.inf) for mp in g.params),
                                      min(mp.index for mp in g.params), g.index))
        return now, later

    def _judge(self, loss_scale: float, *, spoiled: bool = False) -> tuple[bool, bool, float]:
        """What every step checks on the gradients, on every rank: (an overflow anywhere, `spoiled` anywhere,
        the global norm of the unscaled gradients; inf after either)."""
        grads = self._grads()
        flag = torch.tensor([0.0 if _finite(grads) else 1.0, 1.0 if spoiled else 0.0])
        overflow, spoiled = (v > 0 for v in self.comm.all_reduce_(flag, op=torch.distributed.ReduceOp.MAX).tolist())
        if overflow or spoiled:
            return overflow, spoiled, float("inf")
        # fp32 norms per parameter shard, in registration order, summed in fp64 (a fp64 norm would convert every
        # gradient first): the same bits however the shards are packed into sub-groups.
        shards = sorted({id(mp): mp for g in self.groups for mp in g.params}.values(), key=lambda mp: mp.index)
        norms = [torch.linalg.vector_norm(mp.grad) for mp in shards if mp.grad.numel()]
        norms = torch.stack(norms).cpu().tolist() if norms else []  # one transfer from an accelerator
        sq = torch.tensor([sum(n * n for n in norms)], dtype=torch.float64)
        return False, False, math.sqrt(self.comm.all_reduce_(sq).item()) / loss_scale

    def _step_after_backward(self, loss_scale: float, max_norm: float, defer: bool):
        overflow, _, norm = self._judge(loss_scale)
        if overflow:
            return True, float("inf"), StepStats(skipped=True)
        coef = clip_coef(norm, max_norm)
        self.step_count += 1
        step = dict(step=self.step_count, grad_scale=loss_scale / coef)
        works = [self._adam_work(g, self.hyper_for(g, **step)) for g in self.groups]
        now, later = self._walk_order(defer)
        stats = StatePipeline(Mode.UPDATE, trace=self.trace).over([g.state for g in now],
                                                                  lambda i, views: works[now[i].index](views))
        self.store.flush()
        self.store.refresh_persistent()
        if later:
            from_file = self.store.shard_source is ShardSource.OPTIMIZER_FILE
            self._deferred = DeferredStep(self, later, {g.index: works[g.index] for g in later}, stats,
                                          wait_writes=from_file)
            self._deferred.poll()  # the first reads start now
        return False, norm, stats

    def _take_deferred(self) -> DeferredStep | None:
        """The pending deferred step, if any, which from now on is the caller's (the store asks `pending`)."""
        deferred, self._deferred = self._deferred, None
        return deferred

    @property
    def pending(self) -> DeferredStep | None:
        """The rest of the last step, which the next forward finishes (deferred.py), or None."""
        return self._deferred

    def restore_step_count(self, steps: int) -> None:
        """Adam's step count, as a checkpoint recorded it (bias correction continues from there)."""
        self.step_count = steps

    def settle(self) -> None:
        """Finish a deferred step (see [Note: the step finishes in the next forward]); a no-op without one. A bet
        whose step() never came is rolled back first."""
        self._drop_bet()
        deferred = self._take_deferred()
        if deferred is None:
            return
        try:
            deferred.settle()
        except BaseException:
            deferred.abandon()
            raise
        self.deferred_wait_s += deferred.wait_s
        self.store.flush()

    def need(self, mp) -> None:
        """Before a read of mp's shard: its deferred groups are finished (see [Note: the step finishes in the
        next forward])."""
        self._walk(lambda deferred: deferred.need(mp))

    def advance(self) -> None:
        """Step what the deferred walk has read and start more reads, without waiting (a prefetch that found a
        shard's group not yet stepped asks)."""
        if self._deferred is not None:
            self._walk(lambda deferred: deferred.advance())

    def _walk(self, ask) -> None:
        """ask(the pending DeferredStep); an error abandons the walk, and a walk left with nothing in flight is
        settled."""
        deferred = self._deferred
        try:
            ask(deferred)
            finished = deferred.done and deferred.pipe.idle()
        except BaseException:
            self._take_deferred().abandon()
            raise
        if finished:
            self.settle()

    def _adam_work(self, g: _Group, hyper: dict):
        """What the pipeline does with a group's state in a step: Adam, then the new weights to the store."""
        def work(views) -> None:
            lowp = views.lowp  # the state's own tail, written with it (alias.py)
            if lowp is None and self.lowp is not None:
                lowp = self.lowp[:g.numel]
            wrote_lowp = g.state.adam(views, g.grad, lowp, hyper)
            self._publish(g, views, lowp if wrote_lowp else None)
        return work

    def _publish(self, g: _Group, views, lowp: torch.Tensor | None = None):
        """The group's new weights (views.param, and `lowp` if the kernel wrote the compute-dtype copy there)
        become the store's shards."""
        master = views.param
        # From the optimizer's file, the group's own write carries the shards and their checksums.
        if self.store.shard_source is ShardSource.OPTIMIZER_FILE:
            base, size = 0, 4
            if views.lowp is not None:
                if lowp is None:  # not stepped (a checkpoint load): the copy is made from the master
                    views.lowp.copy_(master)
                base, size = g.state.tail_offset, views.lowp.element_size()
            reader = self.store.alias
            shards = [(reader.key(slice_id(mp), lo), base + size * off, hi - lo)
                      for mp, off, lo, hi in g.entries()]
            target = g.state.write_id  # a bet's writes go to the slot that is not live yet
            reader.record_on_write(g.state.swapper, target, shards, pending=target != g.state.id)
            return
        src = lowp if lowp is not None else master
        if g.split:  # a RAM home (can_split): this piece's slice of the shard
            (mp, off, lo, hi), = g.entries()
            self.store.write_piece(mp, lo, src[off:off + hi - lo])
            return
        for mp, off in zip(g.params, g.offsets):
            values = src[off:off + mp.part]
            if mp.shard is not None and mp.shard.data_ptr() == values.data_ptr():
                continue
            self.store.write_shard(mp, values)

    # ------------------------------------------------------------ checkpoints

    def export_state(self, use) -> None:
        """Call use(group, param, exp_avg, exp_avg_sq) for every group, with CPU views of its state (fp32
        weights; moments in self.moments).

        `use` returns a function that waits until it is done with the views
        (its writes have landed); if `use` raises, it must have waited for
        whatever it started. The walk is [Note: one pipeline]'s READ: the
        next group is read while the previous ones' writes are in flight, so
        up to three pool buffers are held. State on an accelerator is staged
        one parameter at a time. Nothing here changes the state.
        """
        self.settle()
        self.expect_step(False)
        StatePipeline(Mode.READ).over(self._states(),
                                      lambda i, views: self.groups[i].state.export(self.groups[i], views, use))

    def import_state(self, fill, *, refresh: bool = True, keep_unfilled: bool = False) -> int:
        """Replace every group's state: fill(group, param, exp_avg, exp_avg_sq) writes CPU views of it (fp32
        weights; moments in self.moments).

        With `keep_unfilled` the views start as the current state (it is read
        first: the pipeline's UPDATE instead of FILL), so what `fill` leaves
        alone stays, as a non-strict checkpoint load needs. `fill` must have
        finished every read into the views when it returns or raises. Then the parameter store gets the new weights (in the
        compute dtype), and with `refresh`, persistent parameters are
        re-gathered (a collective: load_checkpoint does it once every rank
        has loaded). An error part-way leaves a mix of old and new groups:
        load_checkpoint verifies the whole checkpoint before it calls this.

        Returns how many moment values did not survive their encoding into 8-bit moments (0 otherwise): with
        int8 moments from an int8 checkpoint, nonzero when the sub-groups (the blocks) differ from the saved run's.
        """
        self.settle()
        self._drop_staged()
        self.expect_step(False)
        busy = [g.index for g in self.groups if not g.state.at_rest()]
        if busy:
            raise RuntimeError(f"import_state: the optimizer state of sub-groups {busy[:3]} is not at rest (an "
                               "earlier swap failed or is still running); nothing was changed")

        changed = 0

        def load(i: int, views) -> None:
            nonlocal changed
            g = self.groups[i]
            changed += g.state.import_(g, views, fill)
            self._publish(g, views)

        StatePipeline(Mode.UPDATE if keep_unfilled else Mode.FILL).over(self._states(), load)
        self.store.flush()
        if refresh:
            self.store.refresh_persistent()
        return changed

    def zero_grad(self, set_to_none: bool = False) -> None:
        pending = self._deferred.pos if self._deferred is not None else {}
        for g in self.groups:
            if g.grad is not None and g.index not in pending:  # a deferred group's is used, then dropped
                g.grad.zero_()
        for group in self.groups:
            for mp in group.params:
                mp.param.grad = None

    def close(self) -> None:
        self._drop_bet()  # its step() never came
        deferred = self._take_deferred()
        if deferred is not None:  # the swap files go with the engine: the rest of the step would be written for
            deferred.abandon(quiet=True)  # nobody
        self._drop_staged()
        self.expect_step(False)
        if self.swap is not None:
            self.swap.close()
            self.swap = None


class _OneParam:
    """A group of one parameter (export_state/import_state stage accelerator state per parameter)."""

    __slots__ = ("params", "offsets", "spans", "numel", "index")

    def __init__(self, mp, index):
        self.params, self.offsets, self.spans, self.numel, self.index = [mp], [0], [(0, mp.part)], mp.part, index

    def entries(self):
        return [(self.params[0], 0, 0, self.numel)]


def clip_coef(norm: float, max_norm: float) -> float:
    """What the gradients are scaled by to clip their global norm to max_norm (0: no clipping)."""
    return min(1.0, max_norm / (norm + 1e-6)) if max_norm > 0 else 1.0


def _finite(grads) -> bool:
    host = [g for g in grads if g.device == HOST]
    dev = [g for g in grads if g.device != HOST]
    return grads_finite(host) and all(bool(torch.isfinite(g).all()) for g in dev)
