"""CPU Adam: every SIMD path equals the scalar reference; the kernel tracks torch's Adam/AdamW."""

import copy
import math

import pytest
import torch

from infinity.optim import CPUAdam, cpu_adam_step


def _state(n, seed, offset=0, grad_dtype=torch.float32):
    """Fresh (param, grad, exp_avg, exp_avg_sq) starting `offset` elements into their storage."""
    g = torch.Generator().manual_seed(seed)
    def t(scale=1.0, dtype=torch.float32):
        return (torch.randn(n + offset, generator=g) * scale).to(dtype)[offset:]
    return t(), t(dtype=grad_dtype), t(0.1), t(0.01).abs()


def _run(simd_level, monkeypatch, n, offset, grad_dtype, lowp, **kw):
    monkeypatch.setenv("INFINITY_SIMD", simd_level)
    p, g, m, v = _state(n, seed=n, offset=offset, grad_dtype=grad_dtype)
    out = torch.empty(n + offset, dtype=lowp)[offset:] if lowp is not None else None
    for step in (1, 2, 3):
        assert cpu_adam_step(p, g, m, v, step=step, lr=1e-2, out_lowp=out, **kw) is False
    return p, m, v, out


@pytest.mark.slow
@pytest.mark.parametrize("n", [0, 1, 15, 17, 1_000_003])
@pytest.mark.parametrize("offset", [0, 1])
@pytest.mark.parametrize("grad_dtype,lowp", [(torch.float32, None), (torch.bfloat16, torch.bfloat16),
                                             (torch.float16, torch.float16), (torch.float32, torch.bfloat16)])
@pytest.mark.parametrize("kw", [dict(), dict(weight_decay=0.1), dict(weight_decay=0.1, adamw=False),
                                dict(betas=(0.3, 0.99), bias_correction=False, grad_scale=8.0)])
def test_simd_path_equals_scalar_reference(simd, monkeypatch, n, offset, grad_dtype, lowp, kw):
    got = _run(simd, monkeypatch, n, offset, grad_dtype, lowp, **kw)
    ref = _run("scalar", monkeypatch, n, offset, grad_dtype, lowp, **kw)
    for name, a, b in zip(("param", "exp_avg", "exp_avg_sq", "out_lowp"), got, ref):
        if a is not None:
            assert torch.equal(a, b), f"{simd} differs from scalar in {name}"


def _max_rel(ours, theirs):
    return float((ours - theirs).abs().max() / theirs.abs().max())


@pytest.mark.parametrize("cls,kw", [(torch.optim.AdamW, dict(weight_decay=0.01)), (torch.optim.AdamW, dict(weight_decay=0.0)),
                                    (torch.optim.Adam, dict(weight_decay=0.01)), (torch.optim.Adam, dict(weight_decay=0.0))])
def test_100_steps_track_torch(simd, cls, kw):
    """Max relative error max|ours - torch| / max|torch| on the weights <= 1e-6 after 100 steps."""
    torch.manual_seed(0)
    n = 50_017
    ref = torch.randn(n).requires_grad_()
    mine = ref.detach().clone()
    m, v = torch.zeros(n), torch.zeros(n)
    opt = cls([ref], lr=1e-3, betas=(0.9, 0.999), eps=1e-8, foreach=False, **kw)
    for step in range(1, 101):
        grad = torch.randn(n)
        ref.grad = grad.clone()
        opt.step()
        cpu_adam_step(mine, grad, m, v, step=step, lr=1e-3, adamw=cls is torch.optim.AdamW, **kw)
    assert _max_rel(mine, ref.detach()) <= 1e-6
    assert _max_rel(m, opt.state[ref]["exp_avg"]) <= 1e-6
    assert _max_rel(v, opt.state[ref]["exp_avg_sq"]) <= 1e-6


def _edge_floats():
    tiny = torch.finfo(torch.float32).tiny
    vals = [0.0, -0.0, 1.0, -1.0, 1.00390625, 1.01171875, 1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8, 65504.0, 65519.99,
            65520.0, 1e5, -1e5, 3.0e38, tiny, tiny / 2, tiny / 3, 1e-39, -3e-40, 6e-8, 3e-8, 2.9e-8, 5.96e-8,
            6.1e-5, 6.09e-5, 1e-7, 1234.5678]
    bits = torch.randint(-2 ** 31, 2 ** 31 - 1, (100_000,), generator=torch.Generator().manual_seed(3),
                         dtype=torch.int64).to(torch.int32)
    rnd = bits.view(torch.float32)
    rnd = rnd[torch.isfinite(rnd)]
    return torch.cat([torch.tensor(vals, dtype=torch.float32), rnd, torch.randn(10_000) * 1e-3])


@pytest.mark.parametrize("lowp", [torch.bfloat16, torch.float16])
def test_lowp_copy_equals_torch_to(simd, lowp):
    """With lr=0 the weights stay put, so out_lowp must equal param.to(dtype) bit for bit."""
    p = _edge_floats()
    before = p.clone()
    out = torch.empty(p.numel(), dtype=lowp)
    g = torch.ones_like(p)
    assert not cpu_adam_step(p, g, torch.zeros_like(p), torch.zeros_like(p), step=1, lr=0.0, out_lowp=out)
    assert torch.equal(p, before)
    assert torch.equal(out.view(torch.int16), p.to(lowp).view(torch.int16))


@pytest.mark.parametrize("lowp", [torch.bfloat16, torch.float16])
def test_lowp_copy_after_real_steps(simd, lowp):
    p, g, m, v = _state(100_003, seed=5)
    out = torch.empty(p.numel(), dtype=lowp)
    for step in range(1, 4):
        cpu_adam_step(p, g, m, v, step=step, lr=1e-2, out_lowp=out)
        assert torch.equal(out.view(torch.int16), p.to(lowp).view(torch.int16))


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("where", [0, 16_384, 99_999])
@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
def test_nonfinite_grad_leaves_everything_untouched(simd, grad_dtype, where, bad):
    p, g, m, v = _state(100_000, seed=1, grad_dtype=grad_dtype)
    g[where] = bad
    out = torch.full((100_000,), 7.0, dtype=torch.bfloat16)
    saved = [t.clone() for t in (p, m, v, out)]
    assert cpu_adam_step(p, g, m, v, step=1, lr=1e-2, out_lowp=out) is True
    for before, after in zip(saved, (p, m, v, out)):
        assert torch.equal(before, after)


def test_unscale_overflow_is_nonfinite(simd):
    p, g, m, v = _state(1000, seed=2)
    saved = p.clone()
    assert cpu_adam_step(p, g * 1e30, m, v, step=1, lr=1e-2, grad_scale=1e-20) is True
    assert torch.equal(p, saved)


def test_grad_scale_divides(simd):
    a = _state(10_001, seed=4)
    b = [t.clone() for t in a]
    cpu_adam_step(*a, step=1, lr=1e-2)
    cpu_adam_step(b[0], b[1] * 1024, b[2], b[3], step=1, lr=1e-2, grad_scale=1024.0)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_lowp_grads_equal_their_fp32_value(simd):
    for dt in (torch.bfloat16, torch.float16):
        p, g, m, v = _state(10_001, seed=6, grad_dtype=dt)
        q, h, mm, vv = p.clone(), g.float(), m.clone(), v.clone()
        cpu_adam_step(p, g, m, v, step=1, lr=1e-2)
        cpu_adam_step(q, h, mm, vv, step=1, lr=1e-2)
        assert torch.equal(p, q) and torch.equal(m, mm) and torch.equal(v, vv)


def test_check_finite_off_propagates_like_torch():
    p, g, m, v = _state(100, seed=7)
    g[3] = math.nan
    assert cpu_adam_step(p, g, m, v, step=1, lr=1e-2, check_finite=False) is False
    assert math.isnan(p[3]) and not torch.isnan(p[4])


class TestBadInput:
    def args(self, n=10):
        return [torch.zeros(n), torch.zeros(n), torch.zeros(n), torch.zeros(n)]

    @pytest.mark.parametrize("index,name", [(1, "grad"), (2, "exp_avg"), (3, "exp_avg_sq")])
    def test_mismatched_length(self, index, name):
        a = self.args()
        a[index] = torch.zeros(11)
        with pytest.raises(ValueError, match=f"cpu_adam_step: {name} has 11 elements but param has 10"):
            cpu_adam_step(*a, step=1, lr=1e-3)

    def test_wrong_dtype(self):
        a = self.args()
        a[0] = a[0].double()
        with pytest.raises(ValueError, match="cpu_adam_step: param has dtype float64; expected float32"):
            cpu_adam_step(*a, step=1, lr=1e-3)
        a = self.args()
        a[1] = a[1].to(torch.int32)
        with pytest.raises(ValueError, match="cpu_adam_step: grad has dtype int32; expected float32, bfloat16, "
                                             "float16"):
            cpu_adam_step(*a, step=1, lr=1e-3)
        with pytest.raises(ValueError, match="cpu_adam_step: out_lowp has dtype float32; expected bfloat16, float16"):
            cpu_adam_step(*self.args(), step=1, lr=1e-3, out_lowp=torch.zeros(10))

    def test_non_contiguous(self):
        a = self.args()
        a[2] = torch.zeros(20)[::2]
        with pytest.raises(ValueError, match=r"cpu_adam_step: exp_avg is not contiguous .*pass exp_avg.contiguous\(\)"):
            cpu_adam_step(*a, step=1, lr=1e-3)

    def test_overlapping_buffers(self):
        base = torch.zeros(25)
        a = self.args()
        a[2], a[3] = base[:10], base[5:15]
        with pytest.raises(ValueError, match="cpu_adam_step: exp_avg and exp_avg_sq overlap in memory"):
            cpu_adam_step(*a, step=1, lr=1e-3)
        a = self.args()
        a[1] = a[0]
        with pytest.raises(ValueError, match="cpu_adam_step: param and grad overlap in memory"):
            cpu_adam_step(*a, step=1, lr=1e-3)

    @pytest.mark.parametrize("kw,message", [
        (dict(step=0), "step must be an int >= 1"),
        (dict(lr=-1.0), "lr must be a finite number >= 0, got -1.0"),
        (dict(betas=(0.9, 1.0)), r"betas\[1\] must be in \[0, 1\), got 1.0"),
        (dict(eps=math.nan), "eps must be a finite number >= 0"),
        (dict(grad_scale=0.0), "grad_scale must be a finite number > 0, got 0.0"),
        (dict(weight_decay=-0.1), "weight_decay must be a finite number >= 0, got -0.1"),
    ])
    def test_bad_scalars(self, kw, message):
        args = dict(step=1, lr=1e-3)
        args.update(kw)
        with pytest.raises(ValueError, match=f"cpu_adam_step: {message}"):
            cpu_adam_step(*self.args(), **args)


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))


def _train(model, opt, sched=None, steps=30):
    torch.manual_seed(1)
    for _ in range(steps):
        x = torch.randn(8, 16)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if sched:
            sched.step()
    return [p.detach().clone() for p in model.parameters()]


def _groups(model, cls, **kw):
    w = [p for n, p in model.named_parameters() if n.endswith("weight")]
    b = [p for n, p in model.named_parameters() if n.endswith("bias")]
    return cls([{"params": w, "weight_decay": 0.1}, {"params": b, "lr": 3e-3}], lr=1e-3, weight_decay=0.0, **kw)


def test_cpu_adam_optimizer_matches_adamw_with_groups_and_scheduler():
    ref_model, my_model = _model(), _model()
    ref = _groups(ref_model, torch.optim.AdamW, foreach=False)
    mine = _groups(my_model, CPUAdam)
    ref_s = torch.optim.lr_scheduler.StepLR(ref, step_size=10, gamma=0.5)
    my_s = torch.optim.lr_scheduler.StepLR(mine, step_size=10, gamma=0.5)
    for a, b in zip(_train(ref_model, ref, ref_s), _train(my_model, mine, my_s)):
        assert _max_rel(b, a) <= 1e-6
    assert mine.param_groups[1]["lr"] == pytest.approx(3e-3 * 0.125)


def test_state_dict_moves_between_cpu_adam_and_adamw():
    a_model, b_model = _model(), _model()
    adamw = torch.optim.AdamW(a_model.parameters(), lr=1e-3, foreach=False)
    _train(a_model, adamw, steps=5)
    b_model.load_state_dict(a_model.state_dict())
    mine = CPUAdam(b_model.parameters(), lr=1e-3)
    # load_state_dict may alias the given tensors; copy so the two runs stay apart.
    mine.load_state_dict(copy.deepcopy(adamw.state_dict()))  # AdamW -> CPUAdam
    for a, b in zip(_train(a_model, adamw, steps=5), _train(b_model, mine, steps=5)):
        assert _max_rel(b, a) <= 1e-6
    back = torch.optim.AdamW(a_model.parameters(), lr=1e-3, foreach=False)
    back.load_state_dict(copy.deepcopy(mine.state_dict()))  # CPUAdam -> AdamW
    sd = back.state_dict()["state"][0]
    assert set(sd) == {"step", "exp_avg", "exp_avg_sq"} and float(sd["step"]) == 10.0


def test_grads_finite():
    from infinity.optim import grads_finite

    gs = [torch.randn(100_003), torch.randn(7).to(torch.bfloat16), torch.zeros(0)]
    assert grads_finite(gs)
    gs[1][3] = math.inf
    assert not grads_finite(gs)
    assert not grads_finite([torch.full((10,), 1e30)], grad_scale=1e-20)  # overflow after unscaling
