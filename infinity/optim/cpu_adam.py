"""CPU Adam/AdamW over flat fp32 state, with fused unscale, inf/nan check and low-precision copy.

`cpu_adam_step` is what the swap pipeline calls on pool buffers; `CPUAdam`
wraps it as a `torch.optim.Optimizer` whose state_dict has the same layout as
`torch.optim.AdamW`'s, so checkpoints move freely between the two.
"""

from __future__ import annotations

import math

import torch

from infinity._native_loader import native
from infinity.optim import moments8

_GRAD_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
_LOWP_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}
_MOMENT_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.uint8: "int8"}
"""A uint8 moment is one 8-bit moment's bytes (moments8.py)."""
ROUNDINGS = ("nearest", "stochastic")
"""How bf16 moments are stored: round to nearest even, or stochastically (see [Note: bf16 moments] in
native/cpu/adam.cpp)."""


def _check_tensor(name: str, t, dtypes, numel: int | None) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"cpu_adam_step: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise ValueError(f"cpu_adam_step: {name} is on {t.device}; CPU Adam needs CPU tensors")
    if t.dtype not in dtypes:
        allowed = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise ValueError(f"cpu_adam_step: {name} has dtype {str(t.dtype).replace('torch.', '')}; "
                         f"expected {allowed}")
    if not t.is_contiguous():
        raise ValueError(f"cpu_adam_step: {name} is not contiguous ({tuple(t.shape)=}, {t.stride()=}); "
                         f"pass {name}.contiguous()")
    if numel is not None and t.numel() != numel:
        raise ValueError(f"cpu_adam_step: {name} has {t.numel()} elements but param has {numel}")


def _span(t: torch.Tensor) -> tuple[int, int]:
    start = t.data_ptr()
    return start, start + t.numel() * t.element_size()


def _check_no_overlap(named: dict) -> None:
    """Written buffers may not share memory with each other or with the grad."""
    spans = {k: _span(v) for k, v in named.items() if v is not None and v.numel()}
    names = list(spans)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            (a0, a1), (b0, b1) = spans[a], spans[b]
            if a0 < b1 and b0 < a1:
                raise ValueError(f"cpu_adam_step: {a} and {b} overlap in memory; each needs its own buffer")


def _check_scalars(step, lr, betas, eps, weight_decay, grad_scale) -> None:
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise ValueError(f"cpu_adam_step: step must be an int >= 1 (1 on the first update), got {step!r}")
    if not (isinstance(lr, (int, float)) and math.isfinite(lr) and lr >= 0):
        raise ValueError(f"cpu_adam_step: lr must be a finite number >= 0, got {lr!r}")
    if not (isinstance(betas, (tuple, list)) and len(betas) == 2):
        raise ValueError(f"cpu_adam_step: betas must be a pair (beta1, beta2), got {betas!r}")
    for i, b in enumerate(betas):
        if not (isinstance(b, (int, float)) and 0.0 <= b < 1.0):
            raise ValueError(f"cpu_adam_step: betas[{i}] must be in [0, 1), got {b!r}")
    if not (isinstance(eps, (int, float)) and math.isfinite(eps) and eps >= 0):
        raise ValueError(f"cpu_adam_step: eps must be a finite number >= 0, got {eps!r}")
    if not (isinstance(weight_decay, (int, float)) and math.isfinite(weight_decay) and weight_decay >= 0):
        raise ValueError(f"cpu_adam_step: weight_decay must be a finite number >= 0, got {weight_decay!r}")
    if not (isinstance(grad_scale, (int, float)) and math.isfinite(grad_scale) and grad_scale > 0):
        raise ValueError(f"cpu_adam_step: grad_scale must be a finite number > 0, got {grad_scale!r}")


def cpu_adam_step(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *,
                  step: int, lr: float, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                  adamw: bool = True, bias_correction: bool = True, grad_scale: float = 1.0,
                  out_lowp: torch.Tensor | None = None, check_finite: bool = True,
                  moment_rounding: str = "nearest", moment_seed: int = 0) -> bool:
    """One Adam/AdamW step in place, in one pass over the optimizer state.

    `grad` (fp32, bf16 or fp16) is divided by `grad_scale`. With
    `check_finite` (the default) the gradients are checked first; if any is
    inf/nan, nothing is written and True is returned so that a loss scaler
    can skip the step. `out_lowp` (bf16 or fp16) receives the new weights,
    rounded exactly like `param.to(out_lowp.dtype)`. Shapes may differ; only
    element counts must match. Returns False when the step was applied.

    `exp_avg` and `exp_avg_sq` are both fp32, or both bf16 (offload_optimizer.moments_dtype "bf16"): then
    they are read as bf16, updated in fp32 and stored rounded to bf16, by `moment_rounding` "nearest"
    (even; subnormal moments become zero and a NaN keeps its payload's top, as AVX512_BF16's VCVTNE2PS2BF16
    rounds, on every code path) or "stochastic", whose random bits are a hash of `moment_seed` (a uint32) and
    the element's index. Or both are uint8 tensors of `moments8.nbytes(n)` bytes (moments_dtype "int8"):
    8-bit codes and their block scales ([Note: 8-bit moments] in infinity/optim/moments8.py), decoded,
    updated in fp32 and encoded again in the same pass, rounded by `moment_rounding` the same way.

    The code path follows the CPU (AVX-512 with AVX512_BF16, AVX-512, AVX2 or scalar); set
    INFINITY_SIMD=scalar|avx2|avx512|avx512_bf16 to force a lower one.
    """
    _check_tensor("param", param, (torch.float32,), None)
    n = param.numel()
    _check_tensor("grad", grad, tuple(_GRAD_DTYPES), n)
    eight = isinstance(exp_avg, torch.Tensor) and exp_avg.dtype == torch.uint8
    _check_tensor("exp_avg", exp_avg, tuple(_MOMENT_DTYPES), None if eight else n)
    _check_tensor("exp_avg_sq", exp_avg_sq, (exp_avg.dtype,), None if eight else n)
    for name, t in (("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        if eight and t.numel() != moments8.nbytes(n):
            raise ValueError(f"cpu_adam_step: {name} holds {t.numel()} bytes, but 8-bit moments of {n} elements "
                             f"take {moments8.nbytes(n)} (infinity.optim.moments8.nbytes)")
    if moment_rounding not in ROUNDINGS:
        raise ValueError(f"cpu_adam_step: moment_rounding must be one of {', '.join(ROUNDINGS)}, "
                         f"got {moment_rounding!r}")
    if isinstance(moment_seed, bool) or not isinstance(moment_seed, int) or not 0 <= moment_seed < 2 ** 32:
        raise ValueError(f"cpu_adam_step: moment_seed must be an int in [0, 2**32), got {moment_seed!r}")
    if out_lowp is not None:
        _check_tensor("out_lowp", out_lowp, tuple(_LOWP_DTYPES), n)
    _check_scalars(step, lr, betas, eps, weight_decay, grad_scale)
    _check_no_overlap({"param": param, "grad": grad, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq,
                       "out_lowp": out_lowp})
    if n == 0:
        return False
    scales = (0, 0)
    if eight:
        scales = tuple(moments8.split(t, n)[1].data_ptr() for t in (exp_avg, exp_avg_sq))
    if native is None:
        if exp_avg.dtype != torch.float32:
            raise RuntimeError(f"cpu_adam_step: {_MOMENT_DTYPES[exp_avg.dtype]} moments need the native "
                               "extension (infinity._native), which did not load; reinstall infinity or use "
                               "moments_dtype fp32")
        return _reference_step(param, grad, exp_avg, exp_avg_sq, step, lr, betas, eps, weight_decay, adamw,
                               bias_correction, grad_scale, out_lowp, check_finite)
    return native.adam_step(
        param.data_ptr(), grad.data_ptr(), _GRAD_DTYPES[grad.dtype], exp_avg.data_ptr(), exp_avg_sq.data_ptr(),
        n, step, float(lr), float(betas[0]), float(betas[1]), float(eps), float(weight_decay), bool(adamw),
        bool(bias_correction), float(grad_scale), out_lowp.data_ptr() if out_lowp is not None else 0,
        _LOWP_DTYPES[out_lowp.dtype] if out_lowp is not None else "", bool(check_finite), "auto",
        _MOMENT_DTYPES[exp_avg.dtype], moment_rounding, int(moment_seed), *scales)


def grads_finite(grads, grad_scale: float = 1.0) -> bool:
    """True when every gradient / grad_scale is finite: the global check before a skippable step.

    A read-only sweep with no temporaries (torch.isfinite would allocate a
    bool tensor per gradient, and a fp32 copy of each bf16/fp16 one).
    """
    for g in grads:
        _check_tensor("grad", g, tuple(_GRAD_DTYPES), None)
        if g.numel() == 0:
            continue
        if native is None:
            if not bool(torch.isfinite(g.float() * (1.0 / grad_scale)).all()):
                return False
        elif native.any_nonfinite(g.data_ptr(), _GRAD_DTYPES[g.dtype], g.numel(), float(grad_scale)):
            return False
    return True


def _reference_step(param, grad, exp_avg, exp_avg_sq, step, lr, betas, eps, weight_decay, adamw,
                    bias_correction, grad_scale, out_lowp, check_finite) -> bool:
    """Torch-op fallback for builds without the extension (same math, several passes)."""
    g = grad.float() * (1.0 / grad_scale)
    if check_finite and not bool(torch.isfinite(g).all()):
        return True
    p, m, v = param.view(-1), exp_avg.view(-1), exp_avg_sq.view(-1)
    g = g.view(-1)
    if not adamw and weight_decay:
        g = g.add(p, alpha=weight_decay)
    if adamw:
        p.mul_(1 - lr * weight_decay)
    m.lerp_(g, 1 - betas[0])
    v.mul_(betas[1]).addcmul_(g, g, value=1 - betas[1])
    bc1 = 1 - betas[0] ** step if bias_correction else 1.0
    bc2 = 1 - betas[1] ** step if bias_correction else 1.0
    denom = (v.sqrt() / math.sqrt(bc2)).add_(eps)
    p.addcdiv_(m, denom, value=-lr / bc1)
    if out_lowp is not None:
        out_lowp.view(-1).copy_(p)
    return False


class CPUAdam(torch.optim.Optimizer):
    """Adam/AdamW on CPU fp32 parameters through the SIMD kernel.

    Its state_dict matches torch.optim.AdamW's (per-parameter `step`,
    `exp_avg`, `exp_avg_sq`), so each can load the other's. torch lr
    schedulers work as with any Optimizer (they edit `group["lr"]`).
    """

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, adamw_mode: bool = True, bias_correction: bool = True):
        _check_scalars(1, lr, betas, eps, weight_decay, 1.0)
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, adamw_mode=adamw_mode,
                        bias_correction=bias_correction, amsgrad=False, maximize=False, foreach=None,
                        capturable=False, differentiable=False, fused=None)
        super().__init__(params, defaults)

    def __setstate__(self, state):
        super().__setstate__(state)
        for group in self.param_groups:
            group.setdefault("adamw_mode", True)
            group.setdefault("bias_correction", True)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group.get("amsgrad") or group.get("maximize"):
                raise ValueError("CPUAdam: amsgrad and maximize are not supported; use torch.optim.AdamW")
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise ValueError("CPUAdam: sparse gradients are not supported")
                if p.dtype != torch.float32 or p.device.type != "cpu" or not p.is_contiguous():
                    raise ValueError(f"CPUAdam: parameters must be contiguous fp32 CPU tensors, got "
                                     f"{p.dtype} on {p.device} ({tuple(p.shape)=})")
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0, dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                cpu_adam_step(p, p.grad.contiguous(), state["exp_avg"], state["exp_avg_sq"],
                              step=int(state["step"].item()), lr=float(group["lr"]), betas=group["betas"],
                              eps=group["eps"], weight_decay=group["weight_decay"], adamw=group["adamw_mode"],
                              bias_correction=group["bias_correction"], check_finite=False)
        return loss
