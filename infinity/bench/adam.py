"""`infinity bench adam`: params/s of our CPU Adam beside torch's, and our share of the memory roofline.

All implementations run in one process on tensors of the same size, one
optimizer step per timed sample, round-robin across implementations, median
of --repeats after one warm-up each, with a pause before each sample (see
_PAUSE_S). "vs fused" is the median over rounds of the ratio to torch's
fused step in the same round (paired_ratio).
Rows, per size:
  fp32 only        infinity/<simd> (with and without the inf/nan pre-check),
                   torch.optim.AdamW fused=True and foreach=True
  + bf16 copy      infinity writes it in the same pass; torch steps, then
                   copy_()s into a bf16 tensor
  amp sequence     torch: unscale + inf check (_amp_foreach_non_finite_check_and_unscale_),
                   fused step, bf16 copy; infinity: one call with grad_scale
  amp, bf16 grads  the same with bf16 gradients (as they come off a bf16
                   model): torch first widens them into the fp32 .grad
  bf16 moments     infinity/<simd>/bf16-moments[-sr]: offload_optimizer.moments_dtype
                   "bf16", nearest-even or stochastic rounding, against torch's
                   fused fp32 AdamW (20 bytes per element move instead of 28),
                   and infinity/<simd>/int8-moments[-sr]: moments_dtype "int8"
                   (about 16 bytes per element: [Note: 8-bit moments]),
                   without the inf/nan pre-check, as the engine calls it (its
                   global check runs once over all gradients first);
                   each is first bit-compared with the scalar reference of the
                   same rounding (bitexact_vs_scalar)
The roofline is a streaming kernel with Adam's traffic (read p, g, m, v;
write p, m, v; plus the 2-byte copy when there is one); roofline_frac is our
params/s divided by its params/s.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass

import torch

from infinity._native_loader import native
from infinity.optim import moments8
from infinity.units import parse_count

LEVELS = ("avx512_bf16", "avx512", "avx2", "scalar")


@dataclass(kw_only=True, slots=True)
class AdamResult:
    """Median params/s of one implementation at one size."""

    impl: str
    numel: int
    lowp: str | None
    params_per_s: float
    stdev: float
    vs_torch_fused: float | None = None
    roofline_frac: float | None = None
    bitexact_vs_scalar: bool | None = None


# Before each sample. torch's OpenMP workers spin-wait for a while after a parallel region; on a 2-core
# machine that took 15-20 % of the cores from whatever ran next (our 50M-element bf16-moments step ran at
# 2.29 Gparam/s right after torch's fused step, 2.85 after 50 ms). The pause lets them go to sleep, so no
# row is charged for the one before it.
_PAUSE_S = 0.05


def _interleaved_samples(fns: list, numel: int, repeats: int) -> list[list[float]]:
    """params/s of every round per function, timed round-robin.

    One step of each implementation per round, so drift in a shared
    machine's memory bandwidth hits all of them alike.
    """
    for fn in fns:
        fn()  # warm-up: page faults, thread pools, lazy state
    samples = [[] for _ in fns]
    for _ in range(repeats):
        for k, fn in enumerate(fns):
            time.sleep(_PAUSE_S)
            t0 = time.perf_counter()
            fn()
            samples[k].append(numel / (time.perf_counter() - t0))
    return samples


def paired_ratio(ours: list[float], base: list[float]) -> float:
    """Median over rounds of ours/base, each round's two samples taken moments apart.

    On a machine whose memory bandwidth drifts by tens of percent within a
    minute, the ratio of two medians mixes different moments; the ratio
    within a round does not.
    """
    return statistics.median(a / b for a, b in zip(ours, base, strict=True))


class _Tensors:
    def __init__(self, n: int):
        g = torch.Generator().manual_seed(0)
        self.p = torch.randn(n, generator=g)
        self.g = torch.randn(n, generator=g) * 1e-2
        self.g16 = self.g.to(torch.bfloat16)
        self.m = torch.zeros(n)
        self.v = torch.zeros(n)
        self.out = torch.empty(n, dtype=torch.bfloat16)
        self.m16 = torch.zeros(n, dtype=torch.bfloat16)
        self.v16 = torch.zeros(n, dtype=torch.bfloat16)
        self.m8 = torch.zeros(moments8.nbytes(n), dtype=torch.uint8)
        self.v8 = torch.zeros(moments8.nbytes(n), dtype=torch.uint8)
        self.step = 0


def _native_step(t: _Tensors, level: str, grad, *, lowp: bool, check: bool, scale: float,
                 rounding: str | None, step: int, moments: str = "bfloat16") -> None:
    """One native step; `rounding` None: fp32 moments, else `moments` (bfloat16 or int8) rounded that way."""
    gdt = "bfloat16" if grad.dtype == torch.bfloat16 else "float32"
    scales = (0, 0)
    if rounding is None:
        m, v, moments = t.m, t.v, "float32"
    elif moments == "int8":
        m, v = t.m8, t.v8
        scales = tuple(moments8.split(x, t.p.numel())[1].data_ptr() for x in (m, v))
    else:
        m, v = t.m16, t.v16
    native.adam_step(t.p.data_ptr(), grad.data_ptr(), gdt, m.data_ptr(), v.data_ptr(), t.p.numel(),
                     step, 1e-4, 0.9, 0.999, 1e-8, 0.01, True, True, scale,
                     t.out.data_ptr() if lowp else 0, "bfloat16" if lowp else "", check, level,
                     moments, rounding or "nearest", step, *scales)


def _ours(t: _Tensors, level: str, *, lowp: bool, check: bool, scale: float = 1.0, bf16_grads: bool = False,
          rounding: str | None = None, moments: str = "bfloat16"):
    grad = t.g16 if bf16_grads else t.g

    def run():
        t.step += 1
        _native_step(t, level, grad, lowp=lowp, check=check, scale=scale, rounding=rounding, step=t.step,
                     moments=moments)
    return run


def bitexact_vs_scalar(numel: int, level: str, rounding: str, steps: int = 3, moments: str = "bfloat16") -> bool:
    """`level` and the scalar reference give the same bits for `moments` (bfloat16 or int8) rounded
    `rounding`."""
    a, b = _Tensors(numel), _Tensors(numel)
    for step in range(1, steps + 1):
        for t, lv in ((a, level), (b, "scalar")):
            _native_step(t, lv, t.g, lowp=True, check=True, scale=1.0, rounding=rounding, step=step, moments=moments)
    held = ("m8", "v8") if moments == "int8" else ("m16", "v16")
    return all(torch.equal(getattr(a, k).view(torch.uint8), getattr(b, k).view(torch.uint8))
               for k in ("p", *held, "out"))


class _TorchAdamW:
    """One torch AdamW (fused or foreach) and its own param/grad/state copies.

    The variants below share it: timing does not depend on the values, and
    one state per torch implementation keeps 200M-parameter runs in RAM.
    """

    def __init__(self, t: _Tensors, *, fused: bool):
        self.p = t.p.clone().requires_grad_()
        self.p.grad = t.g.clone()
        kind = {"fused": True} if fused else {"foreach": True}
        self.opt = torch.optim.AdamW([self.p], lr=1e-4, weight_decay=0.01, **kind)


def _torch(t: _Tensors, ref: _TorchAdamW, *, lowp: bool, amp: bool, bf16_grads: bool = False):
    p, opt = ref.p, ref.opt
    found_inf = torch.zeros(1)
    inv_scale = torch.ones(1)

    def run():
        if bf16_grads:
            # torch's fused AdamW needs grads in the params' dtype: bf16
            # grads from the device are first widened into the fp32 .grad.
            p.grad.copy_(t.g16)
        if amp:
            torch._amp_foreach_non_finite_check_and_unscale_([p.grad], found_inf, inv_scale)
            if found_inf.item():
                return
        opt.step()
        if lowp:
            t.out.copy_(p.detach())
    return run


def _roofline(arrays: list, out, *, lowp: bool):
    # Its own arrays: the kernel's additions would otherwise drive the Adam
    # state to NaN and change what the other rows measure.
    p, g, m, v = arrays
    args = (p.data_ptr(), g.data_ptr(), m.data_ptr(), v.data_ptr(), out.data_ptr() if lowp else 0, p.numel())
    return lambda: native.stream_adam_traffic(*args, 1)


def measure(numel: int, repeats: int, levels: list[str]) -> list[AdamResult]:
    t = _Tensors(numel)
    fused, foreach = _TorchAdamW(t, fused=True), _TorchAdamW(t, fused=False)
    plan = []  # (impl, lowp, fn)
    for lowp_on, lowp in ((False, None), (True, "bf16")):
        for level in levels:
            plan.append((f"infinity/{level}", lowp, _ours(t, level, lowp=lowp_on, check=True)))
        plan.append((f"infinity/{levels[0]}/no-check", lowp, _ours(t, levels[0], lowp=lowp_on, check=False)))
        plan.append(("torch/fused", lowp, _torch(t, fused, lowp=lowp_on, amp=False)))
        plan.append(("torch/foreach", lowp, _torch(t, foreach, lowp=lowp_on, amp=False)))
    for lowp_on, lowp in ((False, None), (True, "bf16")):
        for moments, kind in (("bfloat16", "bf16"), ("int8", "int8")):
            for rounding, tag in (("nearest", f"{kind}-moments"), ("stochastic", f"{kind}-moments-sr")):
                plan.append((f"infinity/{levels[0]}/{tag}", lowp,
                             _ours(t, levels[0], lowp=lowp_on, check=False, rounding=rounding, moments=moments)))
    plan.append((f"infinity/{levels[0]}/amp", "bf16", _ours(t, levels[0], lowp=True, check=True, scale=1024.0)))
    plan.append(("torch/fused/amp", "bf16", _torch(t, fused, lowp=True, amp=True)))
    plan.append((f"infinity/{levels[0]}/amp-bf16grad", "bf16",
                 _ours(t, levels[0], lowp=True, check=True, scale=1024.0, bf16_grads=True)))
    plan.append(("torch/fused/amp-bf16grad", "bf16", _torch(t, fused, lowp=True, amp=True, bf16_grads=True)))
    roof_arrays = [torch.zeros(numel) for _ in range(4)]
    roof_out = torch.empty(numel, dtype=torch.bfloat16)
    plan.append(("roofline", None, _roofline(roof_arrays, roof_out, lowp=False)))
    plan.append(("roofline", "bf16", _roofline(roof_arrays, roof_out, lowp=True)))
    samples = _interleaved_samples([fn for _, _, fn in plan], numel, repeats)
    rows = [AdamResult(impl=impl, numel=numel, lowp=lowp, params_per_s=statistics.median(s),
                       stdev=statistics.stdev(s) if len(s) > 1 else 0.0)
            for (impl, lowp, _), s in zip(plan, samples)]
    of = {id(r): s for r, s in zip(rows, samples)}

    roof = {r.lowp: r.params_per_s for r in rows if r.impl == "roofline"}
    for r in rows:
        if r.impl == "roofline":
            continue
        suffix = r.impl.rsplit("/", 1)[-1]
        peer = f"torch/fused/{suffix}" if suffix.startswith("amp") else "torch/fused"
        base = next(x for x in rows if x.impl == peer and x.lowp == r.lowp)
        r.vs_torch_fused = paired_ratio(of[id(r)], of[id(base)])
        if "-moments" in r.impl:
            # The roofline kernel moves fp32 moments: no fraction of it applies to these rows.
            rounding = "stochastic" if r.impl.endswith("-sr") else "nearest"
            moments = "int8" if "int8-moments" in r.impl else "bfloat16"
            r.bitexact_vs_scalar = bitexact_vs_scalar(min(numel, 1 << 20) + 3, levels[0], rounding, moments=moments)
        elif r.impl.startswith("infinity/"):
            r.roofline_frac = r.params_per_s / roof[r.lowp]
    return rows


def add_arguments(p) -> None:
    p.add_argument("--sizes", default="10M,50M,200M", help="comma-separated parameter counts (K/M/G = 1e3/1e6/1e9)")
    p.add_argument("--repeats", type=int, default=7, help="timed steps per implementation; the median is reported")
    p.add_argument("--threads", type=int, default=0, help="threads for both torch and ours (default: all cores)")
    p.add_argument("--json", action="store_true", help="one JSON object per line")


def run(args) -> int:
    if native is None:
        raise SystemExit("bench adam: needs the native extension (make build)")
    sizes = [parse_count(s, name="--sizes") for s in args.sizes.split(",") if s.strip()]
    if args.repeats < 1:
        raise SystemExit("bench adam: --repeats must be >= 1")
    if args.threads > 0:
        torch.set_num_threads(args.threads)
        native.set_num_threads(args.threads)
    levels = [lv for lv in LEVELS if LEVELS.index(lv) >= LEVELS.index(native.simd_level())]
    if not args.json:
        print(f"# bench adam: sizes={sizes} repeats={args.repeats} threads: ours={native.get_num_threads()} "
              f"torch={torch.get_num_threads()} simd={levels} torch={torch.__version__}", flush=True)
        print(f"{'impl':38} {'numel':>11} {'lowp':>5} {'Gparam/s':>9} {'±':>6} {'vs fused':>8} {'roofline':>8}")
    for numel in sizes:
        for r in measure(numel, args.repeats, levels):
            if args.json:
                print(json.dumps(asdict(r)), flush=True)
            else:
                vs = f"{r.vs_torch_fused:8.2f}" if r.vs_torch_fused is not None else " " * 8
                rf = f"{100 * r.roofline_frac:7.1f}%" if r.roofline_frac is not None else ""
                if r.bitexact_vs_scalar is not None:
                    rf = " bit-exact vs scalar" if r.bitexact_vs_scalar else " DIFFERS FROM SCALAR"
                print(f"{r.impl:38} {r.numel:>11} {r.lowp or '-':>5} {r.params_per_s / 1e9:9.3f} "
                      f"{r.stdev / 1e9:6.3f} {vs} {rf}", flush=True)
    return 0
