"""OffloadAdamW: a torch optimizer whose fp32 master weights and Adam moments live in host RAM or on NVMe.

    opt = OffloadAdamW(model.parameters(), lr=1e-4, weight_decay=0.01, offload="nvme", nvme_path="/local_nvme")
    ... loss.backward(); torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0); opt.step(); opt.zero_grad()

[Note: an offloading optimizer for loops that own their parameters]
The engine partitions the model; this optimizer does not touch it. The model's parameters stay where they are,
in their dtype and on their device, and their gradients arrive there as in any loop (DDP's all-reduce, a
clip_grad_norm_, an accelerate or Lightning loop: all before step()). What moves is the optimizer state:
- The parameters of each param_group are packed, in order, into sub-groups of at most `sub_group_size`
  elements (a larger parameter gets one of its own). Each sub-group's state is a GroupState of the swap
  service: [fp32 master | exp_avg | exp_avg_sq] in host RAM (HostState) or in one checksummed swap file
  (NvmeState), 12 bytes per parameter (8 with bf16 moments).
- step() walks the sub-groups through StatePipeline (the next one's read in flight while this one is stepped,
  the last one's write landing meanwhile): the sub-group's gradients are copied into one fp32 host buffer,
  the SIMD CPU Adam steps the state in one pass, and the new master values are copied back into the
  parameters (rounded to their dtype as `copy_` rounds).
- fp32 parameters in host memory are their own master: Adam steps them in place (their gradients too are
  read where they are), as DeepSpeedCPUAdam does, so the state is the two moments (8 bytes per parameter,
  4 with bf16 moments) and no weights are copied. On NVMe such a sub-group's file holds the moments only
  (NvmeState(master=False)), so a step moves 8 bytes per parameter each way instead of 12: a second fp32
  copy of weights that already sit in RAM would only cost disk time.
- torch AdamW's semantics, exactly: hyper-parameters are read from param_groups at every step (so torch lr
  schedulers work), a parameter without a gradient is skipped (its moments and step count stay), each
  parameter counts its own steps for bias correction, and weight decay is decoupled (Adam with L2 when
  `adamw=False`).
- state_dict() is torch AdamW's layout ({"state": {i: step, exp_avg, exp_avg_sq}, "param_groups"}), with
  the fp32 "master" added for parameters kept in a 16-bit dtype; load_state_dict() takes that layout, so a
  checkpoint written from torch.optim.AdamW loads here and the other way round. Both hold the whole state in
  memory at once; save(dir)/load(dir) stream it one sub-group at a time instead.
"""

from __future__ import annotations

import json
import os
import weakref

import torch

from infinity.optim.cpu_adam import cpu_adam_step
from infinity.swap.pipeline import Mode, StatePipeline
from infinity.swap.state import MOMENT_DTYPES, AdamViews, GroupState, HostState, NvmeState
from infinity.swap.tier import Tier


class _MomentsOnly(GroupState):
    """The state of a sub-group whose parameters are their own master (fp32, in host memory, offload cpu): the
    two moments in RAM; AdamViews.param is None."""

    tier = Tier.CPU

    def __init__(self, numel: int, moments: torch.dtype):
        super().__init__(numel, moments)
        self.views = AdamViews(None, torch.zeros(numel, dtype=moments), torch.zeros(numel, dtype=moments))

    def open(self, *, blank: bool = False) -> AdamViews:
        return self.views


class _SubGroup:
    """Consecutive parameters of one param_group sharing one state; offsets into its flat views."""

    def __init__(self, index: int, group: int, params: list):
        self.index = index
        self.group = group
        self.params = params
        self.offsets = []
        n = 0
        for p in params:
            self.offsets.append(n)
            n += p.numel()
        self.numel = n
        self.state = None


class OffloadAdamW(torch.optim.Optimizer):
    """AdamW (Adam with adamw=False) whose state lives in host RAM (`offload="cpu"`) or on NVMe
    (`offload="nvme"`, swap files under `nvme_path`); see [Note: an offloading optimizer for loops that own
    their parameters]. Call close() (or use `with`) to remove its swap files; they also go when the optimizer is
    collected, and at exit.

    On NVMe the memory it holds is `buffer_count` buffers of the largest sub-group's state (12 B per parameter,
    8 with bf16 moments; 8 and 4 when every parameter is fp32 in host memory, its own master): 4 x 10M
    parameters is 480 MB by default (320 MB for fp32 host parameters). A parameter larger than `sub_group_size` is
    a sub-group of its own, so a large embedding sets the buffer size."""

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 1e-2,
                 *, offload: str = "cpu", nvme_path: str | None = None, sub_group_size: int = 10_000_000,
                 buffer_count: int = 4, moments_dtype: str = "fp32", adamw: bool = True, bias_correction: bool = True,
                 rank: int | None = None):
        if offload not in ("cpu", "nvme"):
            raise ValueError(f"OffloadAdamW: offload={offload!r}; use 'cpu' or 'nvme'")
        if offload == "nvme" and not nvme_path:
            raise ValueError("OffloadAdamW: offload='nvme' needs nvme_path= (a directory on a fast local disk)")
        if moments_dtype not in MOMENT_DTYPES:
            raise ValueError(f"OffloadAdamW: moments_dtype={moments_dtype!r}; use one of {sorted(MOMENT_DTYPES)}")
        if moments_dtype == "int8":  # its state_dict hands out per-parameter moments; 8-bit blocks span them
            raise ValueError("OffloadAdamW: moments_dtype='int8' is for the ZeRO engine (infinity.initialize, "
                             "offload_optimizer.moments_dtype); OffloadAdamW keeps fp32 or bf16 moments, so use "
                             "moments_dtype='bf16' here")
        if not 0.0 <= lr or not 0.0 <= eps or not all(0.0 <= b < 1.0 for b in betas) or weight_decay < 0:
            raise ValueError(f"OffloadAdamW: invalid hyper-parameters lr={lr}, betas={betas}, eps={eps}, "
                             f"weight_decay={weight_decay}")
        if sub_group_size < 1 or buffer_count < 1:
            raise ValueError("OffloadAdamW: sub_group_size and buffer_count must be >= 1")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        _refuse_unsupported_options(self.param_groups)
        self.offload = offload
        self.moments = MOMENT_DTYPES[moments_dtype]
        self.hyper = dict(adamw=adamw, bias_correction=bias_correction)
        self._closed = False
        self._swap = None
        seen = set()
        for g in self.param_groups:
            for p in g["params"]:
                if id(p) in seen:
                    raise ValueError("OffloadAdamW: a parameter appears in more than one param_group")
                seen.add(id(p))
                if not p.is_floating_point():
                    raise ValueError(f"OffloadAdamW: a parameter of dtype {p.dtype} cannot be optimized")
        self.sub_groups = self._plan(sub_group_size)
        self._steps = {id(p): 0 for g in self.param_groups for p in g["params"]}
        """Each parameter's own step count (torch's state["step"]): a step without its gradient leaves it."""
        self._grad = None  # one fp32 host buffer, the largest sub-group's size
        # per sub-group: its parameters are fp32 in host memory, so they are their own master
        own = [all(p.dtype == torch.float32 and p.device.type == "cpu" and p.is_contiguous() for p in s.params)
               for s in self.sub_groups]
        if offload == "nvme":
            self._swap = _swap_context(nvme_path, buffer_count, max(s.numel for s in self.sub_groups),
                                       moments_dtype, _rank(rank), master=not all(own))
            # The files go with close(), when this optimizer is collected, or at exit, whichever comes first
            # ([Note: swap files die with the process]): the finalizer holds the swap context, not the optimizer.
            self._finalizer = weakref.finalize(self, self._swap.close)
        for s, own_master in zip(self.sub_groups, own):
            if self._swap is not None:
                s.state = NvmeState(s.numel, self._swap.swapper, f"offload_adam/g{s.index}", moments=self.moments,
                                    master=not own_master)
            elif own_master:
                s.state = _MomentsOnly(s.numel, self.moments)
            else:
                s.state = HostState(s.numel, pin=self._pin(s), moments=self.moments)

        def first(i, views):
            s = self.sub_groups[i]
            if views.param is not None:
                for p, off in zip(s.params, s.offsets):
                    views.param[off:off + p.numel()].copy_(p.detach().reshape(-1))
            views.exp_avg.zero_()
            views.exp_avg_sq.zero_()

        try:
            StatePipeline(Mode.FILL).over(self._states(), first)
        except BaseException:
            self.close()
            raise

    def _plan(self, size: int) -> list[_SubGroup]:
        subs = []
        for k, g in enumerate(self.param_groups):
            cur, n = [], 0
            for p in g["params"]:
                if cur and n + p.numel() > size:
                    subs.append(_SubGroup(len(subs), k, cur))
                    cur, n = [], 0
                cur.append(p)
                n += p.numel()
            if cur:
                subs.append(_SubGroup(len(subs), k, cur))
        if not subs:
            raise ValueError("OffloadAdamW: no parameters to optimize")
        return subs

    @staticmethod
    def _pin(s: _SubGroup) -> bool:
        return torch.cuda.is_available() and any(p.is_cuda for p in s.params)

    def _states(self):
        return [s.state for s in self.sub_groups]

    def add_param_group(self, param_group):
        if getattr(self, "sub_groups", None) is not None:
            raise NotImplementedError("OffloadAdamW.add_param_group: the state is laid out at construction; build "
                                      "the optimizer with every group")
        super().add_param_group(param_group)

    # ------------------------------------------------------------------ step

    @torch.no_grad()
    def step(self, closure=None):
        self._check_open()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        work = [self._work(s) for s in self.sub_groups]
        live = [i for i, w in enumerate(work) if w is not None]
        if live:
            StatePipeline(Mode.UPDATE).over([self.sub_groups[i].state for i in live],
                                            lambda j, views: work[live[j]](views))
        return loss

    def _work(self, s: _SubGroup):
        """What the pipeline does with sub-group `s`'s state this step, or None when none of it has a gradient."""
        have = [p.grad is not None for p in s.params]
        if not any(have):
            return None
        for p in s.params:
            if p.grad is not None and p.grad.is_sparse:
                raise RuntimeError("OffloadAdamW does not support sparse gradients")
        g = self.param_groups[s.group]
        if self._grad is None:
            self._grad = torch.empty(max(x.numel for x in self.sub_groups), dtype=torch.float32,
                                     pin_memory=torch.cuda.is_available())
        grad = self._grad  # one buffer for every sub-group: each fills it when its turn comes
        def work(views):
            for p in s.params:  # counted when the state is stepped: a step that fails before leaves them
                if p.grad is not None:
                    self._steps[id(p)] += 1
            if views.param is None:  # the parameters are the master: step them in place
                for p, off, on in zip(s.params, s.offsets, have):
                    if on:
                        n = p.numel()
                        pg = p.grad if p.grad.dtype == torch.float32 and p.grad.is_contiguous() else None
                        if pg is None:
                            grad[off:off + n].copy_(p.grad.reshape(-1))
                        cpu_adam_step(p.view(-1), grad[off:off + n] if pg is None else pg.view(-1),
                                      views.exp_avg[off:off + n], views.exp_avg_sq[off:off + n],
                                      step=self._steps[id(p)], check_finite=False, **hyper())
                return
            for p, off in zip(s.params, s.offsets):
                if p.grad is not None:
                    grad[off:off + p.numel()].copy_(p.grad.reshape(-1), non_blocking=True)
            for device in {p.grad.device for p in s.params if p.grad is not None and p.grad.is_cuda}:
                torch.cuda.synchronize(device)  # the device-to-host copies above have landed, from every GPU
            for lo, hi, step in self._runs(s, have):
                cpu_adam_step(views.param[lo:hi], grad[lo:hi], views.exp_avg[lo:hi], views.exp_avg_sq[lo:hi],
                              step=step, check_finite=False, **hyper())
            for p, off, on in zip(s.params, s.offsets, have):
                if on:
                    p.copy_(views.param[off:off + p.numel()].view_as(p))

        def hyper():
            return dict(lr=float(g["lr"]), betas=tuple(g["betas"]), eps=float(g["eps"]),
                        weight_decay=float(g["weight_decay"]), **self.hyper)

        return work

    def _runs(self, s: _SubGroup, have: list[bool]) -> list[tuple[int, int, int]]:
        """Spans [lo, hi) of consecutive parameters that have gradients and one step count: one kernel call each."""
        runs = []
        for p, off, on in zip(s.params, s.offsets, have):
            if not on:
                continue
            step = self._steps[id(p)]
            if runs and runs[-1][1] == off and runs[-1][2] == step:
                runs[-1] = (runs[-1][0], off + p.numel(), step)
            else:
                runs.append((off, off + p.numel(), step))
        return runs

    # ------------------------------------------------------------ state dicts

    def state_dict(self):
        """torch AdamW's layout (plus "master" for 16-bit parameters): the whole state, in host memory."""
        self._check_open()
        index = {id(p): i for i, p in enumerate(p for g in self.param_groups for p in g["params"])}
        state = {}

        def take(i, views):
            s = self.sub_groups[i]
            for p, off in zip(s.params, s.offsets):
                n, k = p.numel(), self._steps[id(p)]
                if k == 0:
                    continue
                entry = {"step": torch.tensor(float(k)),
                         "exp_avg": views.exp_avg[off:off + n].float().clone().view(p.shape),
                         "exp_avg_sq": views.exp_avg_sq[off:off + n].float().clone().view(p.shape)}
                if p.dtype != torch.float32 and views.param is not None:
                    entry["master"] = views.param[off:off + n].clone().view(p.shape)
                state[index[id(p)]] = entry
            return None

        StatePipeline(Mode.READ).over(self._states(), take)
        groups = []
        for g in self.param_groups:
            packed = {k: v for k, v in g.items() if k != "params"}
            packed["params"] = [index[id(p)] for p in g["params"]]
            groups.append(packed)
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict):
        """torch AdamW's layout (from this optimizer or from torch.optim.AdamW over the same parameters)."""
        self._check_open()
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups) or any(
                len(a["params"]) != len(b["params"]) for a, b in zip(groups, self.param_groups)):
            raise ValueError("OffloadAdamW.load_state_dict: the state dict's param_groups do not match this "
                             "optimizer's (group count or sizes differ)")
        params = [p for g in self.param_groups for p in g["params"]]
        saved = {int(k): v for k, v in state_dict["state"].items()}
        for k, v in saved.items():
            p = params[k]
            for name in ("exp_avg", "exp_avg_sq"):
                if tuple(v[name].shape) != tuple(p.shape):
                    raise ValueError(f"OffloadAdamW.load_state_dict: parameter {k}'s {name} has shape "
                                     f"{tuple(v[name].shape)}, the parameter {tuple(p.shape)}")
        _refuse_unsupported_options(groups)
        index = {id(p): i for i, p in enumerate(params)}
        steps = {}

        def fill(i, views):
            s = self.sub_groups[i]
            for p, off in zip(s.params, s.offsets):
                n, entry = p.numel(), saved.get(index[id(p)])
                master = entry.get("master") if entry is not None else None
                value = (master if master is not None else p.detach()).reshape(-1)
                if views.param is not None:
                    views.param[off:off + n].copy_(value)
                elif master is not None:
                    with torch.no_grad():
                        p.copy_(master.view_as(p))
                if entry is None:
                    views.exp_avg[off:off + n].zero_()
                    views.exp_avg_sq[off:off + n].zero_()
                    steps[id(p)] = 0
                else:
                    views.exp_avg[off:off + n].copy_(entry["exp_avg"].reshape(-1))
                    views.exp_avg_sq[off:off + n].copy_(entry["exp_avg_sq"].reshape(-1))
                    steps[id(p)] = int(float(entry["step"]))
            return None

        StatePipeline(Mode.FILL).over(self._states(), fill)
        self._steps.update(steps)  # only once every state holds the loaded values
        for mine, theirs in zip(self.param_groups, groups):
            for key, value in theirs.items():
                if key != "params":
                    mine[key] = tuple(value) if key == "betas" else value

    def save(self, directory: str) -> None:
        """The state, one sub-group at a time: directory/meta.json and one file per sub-group."""
        self._check_open()
        os.makedirs(directory, exist_ok=True)
        try:  # meta.json marks a finished save: gone until this one has finished
            os.remove(os.path.join(directory, "meta.json"))
        except FileNotFoundError:
            pass

        def write(i, views):
            s = self.sub_groups[i]
            master = views.param if views.param is not None else torch.cat([p.detach().reshape(-1) for p in s.params])
            torch.save({"param": master.clone(), "exp_avg": views.exp_avg.clone(),
                        "exp_avg_sq": views.exp_avg_sq.clone()}, os.path.join(directory, f"group{i}.pt"))
            return None

        StatePipeline(Mode.READ).over(self._states(), write)
        params = [p for g in self.param_groups for p in g["params"]]
        meta = {"format": 1, "sizes": [s.numel for s in self.sub_groups], "steps": [self._steps[id(p)] for p in params],
                "param_groups": [{k: (list(v) if k == "betas" else v) for k, v in g.items() if k != "params"}
                                 for g in self.param_groups]}
        tmp = os.path.join(directory, "meta.json.tmp")
        with open(tmp, "w") as f:
            json.dump(meta, f)
        os.replace(tmp, os.path.join(directory, "meta.json"))  # last: a directory without it is incomplete

    def load(self, directory: str) -> None:
        """What save(directory) wrote, with the same parameters and sub_group_size; the parameters get the
        saved master values."""
        self._check_open()
        path = os.path.join(directory, "meta.json")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"OffloadAdamW.load: {path} is missing (save() writes it last, so the save "
                                    "did not finish)")
        with open(path) as f:
            meta = json.load(f)
        if meta["sizes"] != [s.numel for s in self.sub_groups]:
            raise ValueError(f"OffloadAdamW.load: {directory} holds sub-groups of {meta['sizes']} elements, this "
                             f"optimizer {[s.numel for s in self.sub_groups]}; build it over the same parameters "
                             "with the same sub_group_size")
        params = [p for g in self.param_groups for p in g["params"]]

        def fill(i, views):
            saved = torch.load(os.path.join(directory, f"group{i}.pt"), weights_only=True)
            if views.param is not None:
                views.param.copy_(saved["param"])
            views.exp_avg.copy_(saved["exp_avg"])
            views.exp_avg_sq.copy_(saved["exp_avg_sq"])
            s = self.sub_groups[i]
            with torch.no_grad():
                for p, off in zip(s.params, s.offsets):
                    p.copy_(saved["param"][off:off + p.numel()].view_as(p))
            return None

        StatePipeline(Mode.FILL).over(self._states(), fill)
        for p, k in zip(params, meta["steps"]):
            self._steps[id(p)] = k
        for mine, theirs in zip(self.param_groups, meta["param_groups"]):
            mine.update({k: (tuple(v) if k == "betas" else v) for k, v in theirs.items()})

    # --------------------------------------------------------------- lifetime

    def close(self) -> None:
        """Remove the swap files (nvme); the optimizer cannot step after this."""
        if self._closed:
            return
        self._closed = True
        if self._swap is not None:
            self._finalizer()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("OffloadAdamW is closed")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _refuse_unsupported_options(groups) -> None:
    for g in groups:
        for key in ("amsgrad", "maximize", "capturable", "differentiable"):
            if g.get(key):
                raise ValueError(f"OffloadAdamW: {key}=True is not supported (the CPU Adam steps plain Adam/AdamW); "
                                 "drop it")


def _rank(rank: int | None) -> int:
    if rank is not None:
        return rank
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _swap_context(nvme_path: str, buffer_count: int, largest: int, moments_dtype: str, rank: int, *, master: bool):
    from infinity.config import load_config
    from infinity.swap import SwapContext

    cfg = load_config({"zero_optimization": {"stage": 1, "offload_optimizer": {
        "device": "nvme", "nvme_path": nvme_path, "buffer_count": buffer_count, "moments_dtype": moments_dtype}}})
    return SwapContext.for_optimizer(cfg, rank=rank, largest_group_numel=largest, master=master)
