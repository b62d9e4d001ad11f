"""8-bit Adam moments (offload_optimizer.moments_dtype "int8", [Note: 8-bit moments] in optim/moments8.py): the
format's properties, the kernel against an independent float32 reference of the same update, every SIMD path
against the scalar one, and the argument checks."""

import numpy as np
import pytest
import torch

from infinity._native_loader import native
from infinity.optim import cpu_adam_step, moments8
from infinity.optim.rounding import moment_bits

BLOCK = moments8.BLOCK

pytestmark = pytest.mark.skipif(native is None, reason="8-bit moments need the native extension")


def _blob(n):
    return torch.zeros(moments8.nbytes(n), dtype=torch.uint8)


def _encoded(x, which, seed=None):
    b = _blob(x.numel())
    moments8.encode_(b, x, which, seed=seed)
    return b


# ------------------------------------------------------------------ the format


def test_layout_codes_then_padding_then_one_scale_per_block():
    assert moments8.nbytes(1) == 4 + 4
    assert moments8.nbytes(BLOCK) == BLOCK + 4
    assert moments8.nbytes(BLOCK + 1) == BLOCK + 4 + 8
    codes, scales = moments8.split(_blob(1001), 1001)
    assert codes.numel() == 1001 and scales.numel() == 4 and scales.data_ptr() % 4 == 0
    with pytest.raises(ValueError, match=r"an 8-bit moment of 1000 elements takes 1016 bytes, got 1001"):
        moments8.split(torch.zeros(1001, dtype=torch.uint8), 1000)


@pytest.mark.parametrize("which", ["exp_avg", "exp_avg_sq"])
def test_decoded_values_encode_to_the_same_codes(which):
    """What makes a checkpoint of decoded fp32 moments resume bit for bit."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(5000, generator=gen) * torch.logspace(-12, 2, 5000)
    if which == "exp_avg_sq":
        x = x * x
    b = _encoded(x, which, seed=7)
    y = moments8.decode(b, 5000, which)
    for seed in (None, 3, 99):
        assert torch.equal(_encoded(y, which, seed=seed), b)


@pytest.mark.parametrize("scale", [1e-36, 1e-20, 1e-9, 1.0, 1e9, 1e20, 1e36])
def test_a_decoded_v_encodes_back_at_every_magnitude(scale):
    """exp_avg_sq is stored as sqrt(v): its block exponent's floor keeps u * u a normal float, so a decoded v's
    square root is the stored u again, however small or large the block (down to a flushed zero)."""
    gen = torch.Generator().manual_seed(2)
    v = torch.rand(3 * BLOCK, generator=gen) * torch.logspace(-20, 0, 3 * BLOCK) * scale
    b = _encoded(v, "exp_avg_sq", seed=5)
    d = moments8.decode(b, v.numel(), "exp_avg_sq")
    assert torch.isfinite(d).all()
    assert torch.equal(_encoded(d, "exp_avg_sq"), b)
    assert torch.equal(d.sqrt() * d.sqrt(), d)


def test_relative_error_and_range_of_each_code():
    """exp_avg: 3 mantissa bits, so nearest is within 2^-4 of the value; exp_avg_sq: sqrt(v) with 4 bits, so v
    within about 2 * 2^-5. Both keep 16 binades under the block's largest; below that a value is zero."""
    x = torch.tensor([1.0, -0.3, 2.0 ** -14, -(2.0 ** -14.5), 2.0 ** -16] + [0.77] * (BLOCK - 5))
    kept = torch.ones(x.numel(), dtype=torch.bool)
    kept[4] = False  # 2^-16 under the block's largest
    m = moments8.decode(_encoded(x, "exp_avg"), x.numel(), "exp_avg")
    assert torch.all((m - x).abs()[kept] <= x.abs()[kept] * 2.0 ** -4)
    assert m[4] == 0 and m[1] < 0 and m[3] < 0
    v = x.abs() ** 2
    vd = moments8.decode(_encoded(v, "exp_avg_sq"), v.numel(), "exp_avg_sq")
    assert torch.all((vd.sqrt() - v.sqrt()).abs()[kept] <= v.sqrt()[kept] * 2.0 ** -5)
    assert vd[2] > 0 and vd[4] == 0  # sqrt(v) 2^-14 under the largest is kept, 2^-16 is not


def test_blocks_scale_independently():
    """A small block keeps its precision beside a large one."""
    x = torch.cat([torch.full((BLOCK,), 1e3), torch.full((BLOCK,), 1e-6 * 1.1)])
    y = moments8.decode(_encoded(x, "exp_avg"), x.numel(), "exp_avg")
    assert torch.allclose(y, x, rtol=2.0 ** -4)
    assert (y[BLOCK:] > 0).all()


def test_stochastic_rounding_is_unbiased():
    x = torch.full((1 << 16,), 1.0 + 1.0 / 32)  # a quarter of the way from 1.0 to 1.0 + 1/8 (E4M3's step at 1)
    x[0] = 1.5  # the block's largest: every other element sits in the same binade below it
    r = moments8.decode(_encoded(x, "exp_avg", seed=42), x.numel(), "exp_avg")[1:]
    assert set(r.unique().tolist()) == {1.0, 1.125}
    assert abs(r.mean().item() - x[1].item()) < 2e-3
    near = moments8.decode(_encoded(x, "exp_avg"), x.numel(), "exp_avg")[1:]
    assert set(near.unique().tolist()) == {1.0}


# ------------------------------------------------------------------ the kernel


def _np_step(p, g, m, v, *, step, lr, betas, eps, wd):
    """The kernel's update in numpy float32, one rounded operation at a time (adam_block8_scalar's order), from
    the decoded moments; returns the new p, m, v (v before its sqrt is stored)."""
    f = np.float32
    p, g, m, v = (t.numpy().astype(np.float32) for t in (p, g, m, v))
    w1, b2, c2 = f(1.0 - betas[0]), f(betas[1]), f(1.0 - betas[1])
    inv_bc2 = f(1.0 / np.sqrt(1.0 - betas[1] ** step))
    neg = f(-(lr / (1.0 - betas[0] ** step)))
    p = p * f(1.0 - lr * wd)
    m = m + w1 * (g - m)
    v = (v * b2) + (c2 * g) * g
    p = p + neg * (m / (np.sqrt(v) * inv_bc2 + f(eps)))
    return torch.from_numpy(p), torch.from_numpy(m), torch.from_numpy(v)


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("n", [1, 300, 70_001])
def test_kernel_equals_the_reference_bit_for_bit(simd, rounding, n):
    gen = torch.Generator().manual_seed(n)
    p = torch.randn(n, generator=gen)
    m = _encoded(torch.randn(n, generator=gen) * 0.1, "exp_avg", seed=1)
    v = _encoded(torch.randn(n, generator=gen).pow(2) * 1e-3, "exp_avg_sq", seed=1)
    hyper = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, wd=0.01)
    for step in (1, 2, 3):
        g = torch.randn(n, generator=gen) * torch.logspace(-6, 0, n)
        seed = 7919 * step
        rp, rm, rv = _np_step(p, g, moments8.decode(m, n, "exp_avg"), moments8.decode(v, n, "exp_avg_sq"),
                              step=step, **hyper)
        out = torch.empty(n, dtype=torch.bfloat16)
        cpu_adam_step(p, g, m, v, step=step, lr=hyper["lr"], betas=hyper["betas"], eps=hyper["eps"],
                      weight_decay=hyper["wd"], out_lowp=out, moment_rounding=rounding, moment_seed=seed)
        assert torch.equal(p, rp)
        assert torch.equal(out, rp.bfloat16())
        s = None if rounding == "nearest" else seed
        assert torch.equal(m, _encoded(rm, "exp_avg", seed=s))
        assert torch.equal(v, _encoded(rv, "exp_avg_sq", seed=s))


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("grads", [torch.float32, torch.bfloat16])
def test_every_simd_path_equals_scalar_bit_for_bit(simd, rounding, grads, monkeypatch):
    n = 100_003  # several threads' ranges (whole blocks each) and a last, partial block
    runs = []
    for level in ("scalar", simd):
        monkeypatch.setenv("INFINITY_SIMD", level)
        gen = torch.Generator().manual_seed(5)
        p = torch.randn(n, generator=gen)
        m, v = _blob(n), _blob(n)
        out = torch.empty(n, dtype=torch.float16)
        for step in range(1, 4):
            cpu_adam_step(p, torch.randn(n, generator=gen).to(grads), m, v, step=step, lr=1e-2,
                          weight_decay=0.1, out_lowp=out, moment_rounding=rounding, moment_seed=step)
        runs.append([t.view(torch.uint8) for t in (p, m, v, out)])
    assert all(torch.equal(a, b) for a, b in zip(*runs))


def test_adam_with_l2_and_a_loss_scale(simd):
    """Adam (not AdamW): the L2 term joins the unscaled gradient, on every path as in the reference."""
    n = 2 * BLOCK
    gen = torch.Generator().manual_seed(3)
    p, g = torch.randn(n, generator=gen), torch.randn(n, generator=gen) * 128
    m, v = _blob(n), _blob(n)
    ref_p = p.clone()
    cpu_adam_step(p, g, m, v, step=1, lr=1e-3, weight_decay=0.1, adamw=False, grad_scale=128.0,
                  moment_rounding="nearest")
    ug = g / 128 + 0.1 * ref_p
    rp, rm, rv = _np_step(ref_p, ug, torch.zeros(n), torch.zeros(n), step=1, lr=1e-3, betas=(0.9, 0.999),
                          eps=1e-8, wd=0.0)
    assert torch.allclose(p, rp, rtol=1e-6, atol=1e-9)
    assert torch.equal(m, _encoded(rm, "exp_avg"))


def test_overflow_leaves_every_byte_alone():
    n = 1000
    p, g = torch.randn(n), torch.randn(n)
    g[500] = float("inf")
    m, v = _encoded(torch.randn(n), "exp_avg"), _encoded(torch.rand(n), "exp_avg_sq")
    before = [t.clone() for t in (p, m, v)]
    assert cpu_adam_step(p, g, m, v, step=1, lr=1e-3) is True
    assert all(torch.equal(a, b) for a, b in zip(before, (p, m, v)))


def test_nearest_stalls_the_second_moment_and_stochastic_keeps_it_decaying():
    """As with bf16 moments ([Note: bf16 moments]), but with 6 % steps: with zero gradients, each v of a block
    whose largest v is held up by its gradient should fall by beta2 per step. To nearest it never moves."""
    n, steps, beta2 = BLOCK, 300, 0.999
    g = torch.zeros(n)
    g[0] = 1.0  # the block's largest v stays put, so the others' scale does not fall with them
    runs = {}
    for rounding in ("nearest", "stochastic"):
        p, m, v = torch.zeros(n), _blob(n), _encoded(torch.full((n,), 1.0), "exp_avg_sq")
        for step in range(1, steps + 1):
            cpu_adam_step(p, g, m, v, step=step, lr=0.0, betas=(0.9, beta2), moment_rounding=rounding,
                          moment_seed=step)
        runs[rounding] = moments8.decode(v, n, "exp_avg_sq")[1:]
    want = beta2 ** steps  # 0.74
    assert torch.all(runs["nearest"] == 1.0)
    assert abs(runs["stochastic"].mean().item() - want) < 0.02


def test_stochastic_bits_are_the_kernels(simd):
    """From zero moments, one step stores (1 - beta1) g and sqrt((1 - beta2) g^2): what the kernel keeps is the
    rounding alone, which must be moments8's port of the hash."""
    n = 3 * BLOCK + 5
    g = torch.randn(n, generator=torch.Generator().manual_seed(9))
    m, v = _blob(n), _blob(n)
    cpu_adam_step(torch.zeros(n), g, m, v, step=1, lr=0.0, moment_rounding="stochastic", moment_seed=12345)
    f = np.float32
    w1, c2 = f(0.1), f(1.0 - 0.999)
    gm = torch.from_numpy(f(0.0) + w1 * (g.numpy() - f(0.0)))
    gv = torch.from_numpy((f(0.0) * f(0.999)) + (c2 * g.numpy()) * g.numpy())
    assert torch.equal(m, _encoded(gm, "exp_avg", seed=12345))
    assert torch.equal(v, _encoded(gv, "exp_avg_sq", seed=12345))
    assert moment_bits(12345, torch.arange(4)).tolist() != [0, 0, 0, 0]


def test_wrong_sizes_and_mixed_moments_are_named():
    n = 1000
    p, g = torch.zeros(n), torch.zeros(n)
    with pytest.raises(ValueError, match=r"exp_avg holds 1000 bytes, but 8-bit moments of 1000 elements take 1016"):
        cpu_adam_step(p, g, torch.zeros(n, dtype=torch.uint8), _blob(n), step=1, lr=1e-3)
    with pytest.raises(ValueError, match=r"exp_avg_sq has dtype float32; expected uint8"):
        cpu_adam_step(p, g, _blob(n), torch.zeros(n), step=1, lr=1e-3)
