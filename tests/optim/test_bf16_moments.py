"""bf16 Adam moments (offload_optimizer.moments_dtype "bf16"): the kernel against a torch-op reference of the
same rounding, why stochastic rounding is the default, and the argument checks."""

import math

import pytest
import torch

from infinity._native_loader import native
from infinity.optim import cpu_adam_step
from infinity.optim.rounding import bf16_stochastic, moment_bits


pytestmark = pytest.mark.skipif(native is None, reason="bf16 moments need the native extension")


def _reference(p, g, m, v, *, step, lr, betas, eps, wd, rounding, seed):
    """The kernel's bf16-moment step in torch ops: fp32 update (torch's AdamW order; sqrt(v) times
    1/sqrt(bc2)), then the moments stored with the kernel's rounding."""
    m32, v32 = m.float(), v.float()
    p.mul_(1 - lr * wd)
    m32.lerp_(g, 1 - betas[0])
    v32.mul_(betas[1]).addcmul_(g, g, value=1 - betas[1])
    bc1, bc2 = 1 - betas[0] ** step, 1 - betas[1] ** step
    p.addcdiv_(m32, (v32.sqrt() * (1 / math.sqrt(bc2))).add_(eps), value=-lr / bc1)
    if rounding == "nearest":  # torch's rounding, after subnormals go to zero of their sign
        tiny = torch.finfo(torch.float32).tiny
        m.copy_(torch.where(m32.abs() < tiny, m32 * 0.0, m32))
        v.copy_(torch.where(v32.abs() < tiny, v32 * 0.0, v32))
    else:
        m.copy_(bf16_stochastic(m32, seed, 0))
        v.copy_(bf16_stochastic(v32, seed, 16))


def _bits(t):
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("n", [1, 37, 100_003])
def test_kernel_tracks_a_torch_reference_of_the_same_rounding(simd, rounding, n):
    gen = torch.Generator().manual_seed(n)
    p = torch.randn(n, generator=gen)
    m = (torch.randn(n, generator=gen) * 0.1).bfloat16()
    v = (torch.randn(n, generator=gen) * 0.01).abs().bfloat16()
    rp, rm, rv = p.clone(), m.clone(), v.clone()
    out = torch.empty(n, dtype=torch.bfloat16)
    for step in (1, 2):  # from the same inputs: each step starts from the kernel's state
        rp.copy_(p), rm.copy_(m), rv.copy_(v)
        g = torch.randn(n, generator=gen)
        seed = 7919 * step
        cpu_adam_step(p, g, m, v, step=step, lr=1e-2, weight_decay=0.1, out_lowp=out, moment_rounding=rounding,
                      moment_seed=seed)
        _reference(rp, g, rm, rv, step=step, lr=1e-2, betas=(0.9, 0.999), eps=1e-8, wd=0.1, rounding=rounding,
                   seed=seed)
        torch.testing.assert_close(p, rp, rtol=1e-6, atol=1e-7)
    # torch's vectorised lerp may fuse a multiply-add, so its fp32 moments can differ by an ulp, which can
    # move a rounded bf16 moment by one bf16 ulp (up to 2^-6 relative at a binade edge); the weights agree to a few fp32 ulp.
    torch.testing.assert_close(m.float(), rm.float(), rtol=2 ** -6, atol=1e-30)
    torch.testing.assert_close(v.float(), rv.float(), rtol=2 ** -6, atol=1e-30)
    assert torch.equal(_bits(out), _bits(p.bfloat16()))


def test_kernel_rounds_with_exactly_the_ported_random_bits(simd):
    """beta1 = 0 makes the new exp_avg exactly g, and a zero v makes the new exp_avg_sq exactly (c2 * g) * g,
    so what the kernel stores is the rounding alone: it must equal bf16_stochastic's bits (the port the
    accelerator path uses)."""
    n = 100_003
    g = torch.randn(n, generator=torch.Generator().manual_seed(3))
    m, v = torch.zeros(n, dtype=torch.bfloat16), torch.zeros(n, dtype=torch.bfloat16)
    cpu_adam_step(torch.zeros(n), g, m, v, step=1, lr=1e-3, betas=(0.0, 0.999), moment_rounding="stochastic",
                  moment_seed=12345)
    c2 = torch.tensor(1 - 0.999, dtype=torch.float32)
    assert torch.equal(_bits(m), _bits(bf16_stochastic(g, 12345, 0)))
    assert torch.equal(_bits(v), _bits(bf16_stochastic(c2 * g * g, 12345, 16)))


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_every_simd_path_equals_scalar_bit_for_bit(simd, rounding, monkeypatch):
    n = 100_003  # several threads' ranges and a scalar tail
    runs = []
    for level in ("scalar", simd):
        monkeypatch.setenv("INFINITY_SIMD", level)
        gen = torch.Generator().manual_seed(5)
        p = torch.randn(n, generator=gen)
        m, v = torch.zeros(n, dtype=torch.bfloat16), torch.zeros(n, dtype=torch.bfloat16)
        out = torch.empty(n, dtype=torch.bfloat16)
        for step in range(1, 4):
            cpu_adam_step(p, torch.randn(n, generator=gen).bfloat16(), m, v, step=step, lr=1e-2,
                          weight_decay=0.1, out_lowp=out, moment_rounding=rounding, moment_seed=step)
        runs.append([_bits(t) for t in (p, m, v, out)])
    assert all(torch.equal(a, b) for a, b in zip(*runs))


def test_nearest_moments_flush_subnormals_on_every_path(simd):
    # [Note: bf16 moments round as VCVTNE2PS2BF16 does] in native/cpu/lowp.hpp: every code path stores a
    # subnormal moment as zero of its sign (torch's .to(bfloat16) would keep it), a normal one to nearest even.
    n = 70  # two-vector loop, a single vector and the scalar tail on every SIMD width
    sub = torch.tensor([1e-39, -2e-39, 5e-40, -1e-39] * 17 + [1e-39, -1e-39]).bfloat16()
    assert (sub.float().abs() < torch.finfo(torch.float32).tiny).all() and (sub != 0).all()
    p = torch.zeros(n)
    m, v = sub.clone(), torch.full((n,), 1.0).bfloat16()
    cpu_adam_step(p, torch.zeros(n), m, v, step=1, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                  moment_rounding="nearest")
    assert torch.equal(_bits(m), _bits(sub.float().mul(0.0).bfloat16())), "zero of the moment's sign"
    assert torch.equal(_bits(v), _bits(torch.full((n,), 0.999).bfloat16()))


def test_stochastic_bits_depend_on_seed_and_index_only():
    idx = torch.arange(1 << 16, dtype=torch.int64)
    a, b = moment_bits(1, idx), moment_bits(2, idx)
    assert not torch.equal(a, b)
    assert torch.equal(moment_bits(1, idx[1000:2000]), a[1000:2000])
    # about uniform in each 16-bit half: the mean of a uniform 16-bit value is 32767.5
    for half in (a & 0xFFFF, a >> 16):
        assert abs(half.double().mean().item() - 32767.5) < 300


def test_stochastic_rounding_is_unbiased_and_exact_values_stay():
    x = torch.full((1 << 16,), 1.0 + 1.0 / 1024)  # 1/8 of the way from bf16 1.0 to 1 + 2^-7
    r = bf16_stochastic(x, 42, 0).float()
    assert set(r.unique().tolist()) == {1.0, 1.0 + 2.0 ** -7}
    assert abs(r.mean().item() - x[0].item()) < 2e-5
    exact = torch.tensor([0.0, -0.0, 1.0, -2.5, float("inf"), float("-inf")])
    assert torch.equal(bf16_stochastic(exact, 3, 16).float(), exact)
    assert torch.isnan(bf16_stochastic(torch.tensor([float("nan")]), 3, 0).float()).all()


def test_nearest_stalls_the_second_moment_and_stochastic_keeps_it_decaying():
    """[Note: bf16 moments]: with zero gradients v should fall by beta2 each step. Rounded to nearest, a
    bf16 v never moves (beta2 takes off 0.1 %, half a bf16 ulp is 0.2 %); rounded stochastically it decays
    as in fp32, on average."""
    n, steps = 50_000, 200
    g0 = torch.full((n,), 1e-2)
    zero = torch.zeros(n)
    results = {}
    for rounding in ("nearest", "stochastic"):
        p = torch.zeros(n)
        m = torch.zeros(n, dtype=torch.bfloat16)
        v = torch.zeros(n, dtype=torch.bfloat16)
        cpu_adam_step(p, g0, m, v, step=1, lr=0.0, moment_rounding=rounding, moment_seed=1)
        start = v.float().mean().item()
        for step in range(2, steps + 2):
            cpu_adam_step(p, zero, m, v, step=step, lr=0.0, moment_rounding=rounding, moment_seed=step)
        results[rounding] = v.float().mean().item() / start
    expected = 0.999 ** steps  # 0.819
    assert results["nearest"] == 1.0
    assert abs(results["stochastic"] - expected) < 0.01 * expected


def test_bad_moment_arguments_are_named():
    p, g = torch.zeros(8), torch.zeros(8)
    m16, v16 = torch.zeros(8, dtype=torch.bfloat16), torch.zeros(8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="exp_avg_sq has dtype float32; expected bfloat16"):
        cpu_adam_step(p, g, m16, torch.zeros(8), step=1, lr=1e-3)
    with pytest.raises(ValueError, match="exp_avg has dtype float16; expected float32, bfloat16"):
        cpu_adam_step(p, g, m16.half(), v16.half(), step=1, lr=1e-3)
    with pytest.raises(ValueError, match="moment_rounding must be one of nearest, stochastic, got 'up'"):
        cpu_adam_step(p, g, m16, v16, step=1, lr=1e-3, moment_rounding="up")
    with pytest.raises(ValueError, match=r"moment_seed must be an int in \[0, 2\*\*32\), got -1"):
        cpu_adam_step(p, g, m16, v16, step=1, lr=1e-3, moment_seed=-1)
    assert torch.equal(m16, torch.zeros(8, dtype=torch.bfloat16))  # nothing ran
