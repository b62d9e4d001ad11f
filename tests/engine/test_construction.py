"""Sharded construction of models written the way people write them (not this repo's GPT).

Each model is built twice with the same seed, plainly and under zero_init, and
trained 6 steps with torch.optim.AdamW and with the engine on offload none, cpu
and nvme: values right after construction are bit-identical, every loss within
1e-5 relative.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from infinity.engine import gathered_parameters, initialize, zero_init
from infinity.testing.parity import engine_config, train_losses

TIERS = ["none", "cpu", "nvme"]
STEPS = 6
LR, WD = 1e-3, 0.01


# ------------------------------------------------------------- the GPT-2 recipe (nanoGPT)


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd, n_head):
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.n_head = n_head

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class MLP(nn.Module):
    def __init__(self, n_embd):
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd)
        self.c_proj = nn.Linear(4 * n_embd, n_embd)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, n_embd, n_head):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = MLP(n_embd)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class NanoGPT(nn.Module):
    """nanoGPT's model.py, shrunk: apply(_init_weights), then a scaled init of every c_proj, and a tied head."""

    def __init__(self, vocab=128, block=32, n_layer=2, n_embd=32, n_head=4):
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab, n_embd), wpe=nn.Embedding(block, n_embd),
            h=nn.ModuleList([Block(n_embd, n_head) for _ in range(n_layer)]), ln_f=nn.LayerNorm(n_embd)))
        self.lm_head = nn.Linear(n_embd, vocab, bias=False)
        self.transformer.wte.weight = self.lm_head.weight
        self.apply(self._init_weights)
        for pn, p in self.named_parameters():
            if pn.endswith("c_proj.weight"):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx, targets):
        pos = torch.arange(idx.shape[1])
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def lm_batch(step, vocab=128, seq=32):
    g = torch.Generator().manual_seed(step % 2)  # two batches, seen three times each: the loss falls
    x = torch.randint(0, vocab, (4, seq + 1), generator=g)
    return (x[:, :-1].contiguous(), x[:, 1:].contiguous()), {}


# ------------------------------------------------------- a parent that re-initialises its children


class ParentInit(nn.Module):
    """Every kind of write initialisation code does, from the parent, to children already built."""

    def __init__(self, vocab=128, dim=32):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim, padding_idx=0)
        self.a = nn.Linear(dim, dim)
        self.b = nn.Linear(dim, dim)
        self.c = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab)
        nn.init.normal_(self.tok.weight, std=0.02)
        self.tok.weight.data[0].zero_()  # the padding row, through .data and a view
        nn.init.trunc_normal_(self.a.weight, std=0.02)  # reads its own draw to clamp it
        nn.init.orthogonal_(self.b.weight)  # writes through view_as
        nn.init.xavier_uniform_(self.c.weight)
        with torch.no_grad():
            self.a.weight.mul_(0.5)
            self.a.bias.fill_(0.01)
            self.b.bias.uniform_(-0.1, 0.1)
            self.c.bias.copy_(torch.linspace(-1, 1, dim))
            self.head.bias.zero_()
        self.head.weight.data.normal_(0.0, 0.05)
        self.c.weight.data = self.c.weight.data * 2  # a same-shape assignment
        nn.init.kaiming_uniform_(self.head.weight, a=math.sqrt(5))
        nn.init.sparse_(self.b.weight, sparsity=0.25, std=0.01)

    def forward(self, idx, targets):
        x = self.tok(idx)
        x = x + torch.tanh(self.a(x))
        x = x + torch.tanh(self.b(x)) + torch.tanh(self.c(x))
        logits = self.head(x)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))


# ------------------------------------------------------------------ torchvision's ResNet recipe


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, inplanes, planes, stride=1, downsample=None):
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = downsample

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


class ResNet(nn.Module):
    """torchvision.models.resnet.ResNet's constructor, shrunk: the init loop over modules() and zero_init_residual."""

    def __init__(self, layers=(1, 1), num_classes=10, width=8, zero_init_residual=True):
        super().__init__()
        self.inplanes = width
        self.conv1 = nn.Conv2d(3, width, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.layer1 = self._make_layer(width, layers[0])
        self.layer2 = self._make_layer(2 * width, layers[1], stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(2 * width, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, (nn.BatchNorm2d, nn.GroupNorm)):
                nn.init.constant_(m.weight, 1)
                nn.init.constant_(m.bias, 0)
        if zero_init_residual:
            for m in self.modules():
                if isinstance(m, BasicBlock) and m.bn2.weight is not None:
                    nn.init.constant_(m.bn2.weight, 0)

    def _make_layer(self, planes, blocks, stride=1):
        downsample = None
        if stride != 1 or self.inplanes != planes:
            downsample = nn.Sequential(nn.Conv2d(self.inplanes, planes, 1, stride, bias=False), nn.BatchNorm2d(planes))
        layers = [BasicBlock(self.inplanes, planes, stride, downsample)]
        self.inplanes = planes
        layers += [BasicBlock(planes, planes) for _ in range(1, blocks)]
        return nn.Sequential(*layers)

    def forward(self, x, y):
        x = self.relu(self.bn1(self.conv1(x)))
        x = self.layer2(self.layer1(x))
        x = torch.flatten(self.avgpool(x), 1)
        return F.cross_entropy(self.fc(x), y)


def image_batch(step):
    g = torch.Generator().manual_seed(0)  # one batch, learnt: the loss falls
    return (torch.randn(4, 3, 16, 16, generator=g), torch.randint(0, 10, (4,), generator=g)), {}


# --------------------------------------------------------------------------------- harness


def assert_same_values(plain, model):
    with gathered_parameters(model):
        for (name, p), (_, q) in zip(plain.named_parameters(), model.named_parameters()):
            assert torch.equal(p, q), f"{name} differs from a plain build"
    for (name, b), (_, c) in zip(plain.named_buffers(), model.named_buffers()):
        assert torch.equal(b, c), f"buffer {name} differs from a plain build"


def plain_losses(model, batches, groups=None):
    opt = torch.optim.AdamW(groups if groups is not None else [p for p in model.parameters() if p.requires_grad],
                            lr=LR, weight_decay=WD)
    return train_losses(model, batches, STEPS, optimizer=opt)


def engine_losses(model, cfg, batches, groups=None):
    engine = initialize(model, cfg, model_parameters=groups)
    try:
        return train_losses(engine, batches, STEPS)
    finally:
        engine.close()


def assert_close(want, got):
    worst = max(abs(a - b) / abs(a) for a, b in zip(want, got))
    assert worst <= 1e-5, f"losses differ by {worst:.2e} relative: torch {want}, engine {got}"


def run_parity(build, batches, tier, disk_dir, *, largest=40_000, groups=None):
    torch.manual_seed(0)
    plain = build()
    cfg = engine_config(tier, disk_dir, largest=largest)
    torch.manual_seed(0)
    with zero_init(cfg):
        model = build()
    assert_same_values(plain, model)
    want = plain_losses(plain, batches, None if groups is None else groups(plain))
    got = engine_losses(model, cfg, batches, None if groups is None else groups(model))
    assert_close(want, got)
    assert want[-1] < want[0]


@pytest.mark.parametrize("tier", TIERS)
def test_gpt2_recipe_init_loop_in_the_top_level_constructor(tier, disk_dir):
    run_parity(NanoGPT, lm_batch, tier, disk_dir)


@pytest.mark.parametrize("tier", TIERS)
def test_a_parent_reinitialising_its_children_with_every_kind_of_write(tier, disk_dir):
    run_parity(ParentInit, lm_batch, tier, disk_dir)


@pytest.mark.parametrize("tier", TIERS)
def test_torchvision_resnet_init_loop_with_batchnorm_buffers(tier, disk_dir):
    run_parity(ResNet, image_batch, tier, disk_dir, largest=16 * 16 * 9)


def two_groups(model):
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0, "lr": 3e-3}]


@pytest.mark.parametrize("tier", TIERS)
def test_two_parameter_groups_with_their_own_weight_decay_and_lr(tier, disk_dir):
    run_parity(NanoGPT, lm_batch, tier, disk_dir, groups=two_groups)


def test_parameters_left_out_of_model_parameters_are_not_trained(disk_dir):
    cfg = engine_config("nvme", disk_dir, largest=40_000)
    torch.manual_seed(0)
    with zero_init(cfg):
        model = NanoGPT()
    with gathered_parameters(model.transformer.wpe):
        before = model.transformer.wpe.weight.detach().clone()
    rest = [p for n, p in model.named_parameters() if not n.startswith("transformer.wpe")]
    engine = initialize(model, cfg, model_parameters=rest)
    try:
        assert len(engine.optimizer.param_groups) == 1
        for s in range(2):
            (x, y), _ = lm_batch(s)
            engine.backward(engine(x, y))
            engine.step()
        with gathered_parameters(model.transformer.wpe):
            assert torch.equal(model.transformer.wpe.weight, before), "a parameter outside model_parameters changed"
    finally:
        engine.close()


def test_an_lr_scheduler_drives_every_parameter_group(disk_dir):
    cfg = engine_config("cpu", disk_dir, largest=40_000)
    torch.manual_seed(0)
    with zero_init(cfg):
        model = NanoGPT()
    engine = initialize(model, cfg, model_parameters=two_groups(model),
                        lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 ** s))
    try:
        assert [g["lr"] for g in engine.optimizer.param_groups] == [LR, 3e-3]
        for s in range(2):
            (x, y), _ = lm_batch(s)
            engine.backward(engine(x, y))
            engine.step()
        assert [g["lr"] for g in engine.optimizer.param_groups] == [LR / 4, 3e-3 / 4]
    finally:
        engine.close()


def test_bad_parameter_groups_are_refused_with_the_reason(disk_dir):
    cfg = engine_config("none", disk_dir, largest=40_000)
    model = NanoGPT()
    p = next(model.parameters())
    with pytest.raises(ValueError, match=r"parameter group 0 has keys \['momentum'\] that Adam does not take"):
        initialize(model, cfg, model_parameters=[{"params": [p], "momentum": 0.9}])
    with pytest.raises(ValueError, match="1 parameters appear in more than one parameter group"):
        initialize(model, cfg, model_parameters=[{"params": [p]}, {"params": [p]}])
    with pytest.raises(ValueError, match="1 of model_parameters are not parameters of the model"):
        initialize(model, cfg, model_parameters=[nn.Parameter(torch.zeros(2))])


# ------------------------------------------------------------------ the silent case, per tier


@pytest.mark.parametrize("tier", TIERS)
def test_every_tier_keeps_a_write_after_zero_init_or_raises(tier, disk_dir):
    """Writes after the zero_init block (before initialize) land; after initialize they raise."""
    cfg = engine_config(tier, disk_dir, largest=40_000)
    torch.manual_seed(0)
    with zero_init(cfg):
        model = NanoGPT()
    nn.init.normal_(model.transformer.wpe.weight, std=0.5)
    with torch.no_grad():
        model.transformer.h[0].mlp.c_fc.weight.fill_(0.25)
    model.transformer.h[1].attn.c_attn.weight.data = torch.full((96, 32), 0.125)
    with gathered_parameters(model):
        assert abs(float(model.transformer.wpe.weight.std()) - 0.5) < 0.05
        assert bool((model.transformer.h[0].mlp.c_fc.weight == 0.25).all())
        assert bool((model.transformer.h[1].attn.c_attn.weight == 0.125).all())
    engine = initialize(model, cfg)
    try:
        with gathered_parameters(model):  # what the optimizer's master weights start from
            assert bool((model.transformer.h[0].mlp.c_fc.weight == 0.25).all())
        w = model.transformer.h[0].mlp.c_fc.weight
        with torch.no_grad():
            w.fill_(1.0)  # torch lets this one through on the placeholder; the next gather refuses it
        (x, y), _ = lm_batch(0)
        with pytest.raises(RuntimeError, match=r"transformer.h.0.mlp.c_fc.weight was written in place after "
                                                r"initialize\(\)"):
            engine(x, y)
    finally:
        engine.close()


@pytest.mark.parametrize("tier", TIERS)
def test_a_data_assignment_after_initialize_raises(tier, disk_dir):
    cfg = engine_config(tier, disk_dir, largest=40_000)
    with zero_init(cfg):
        model = NanoGPT()
    engine = initialize(model, cfg)
    try:
        w = model.transformer.h[0].mlp.c_fc.weight
        w.data = torch.ones(w.shape)
        (x, y), _ = lm_batch(0)
        with pytest.raises(RuntimeError, match=r"transformer.h.0.mlp.c_fc.weight.data was assigned after "
                                                r"initialize\(\)"):
            engine(x, y)
    finally:
        engine.close()


def test_a_placeholder_read_after_initialize_is_nan(disk_dir):
    cfg = engine_config("none", disk_dir, largest=40_000)
    with zero_init(cfg):
        model = NanoGPT()
    engine = initialize(model, cfg)
    try:
        assert math.isnan(float(model.transformer.h[0].mlp.c_fc.weight.sum()))
    finally:
        engine.close()


def test_reads_between_zero_init_and_initialize_see_the_real_values(disk_dir):
    cfg = engine_config("nvme", disk_dir, largest=40_000)
    torch.manual_seed(0)
    plain = NanoGPT()
    torch.manual_seed(0)
    with zero_init(cfg):
        model = NanoGPT()
    assert torch.equal(model.lm_head.weight.sum(), plain.lm_head.weight.sum())
    assert torch.equal(model.transformer.h[0].attn.c_attn.weight[3], plain.transformer.h[0].attn.c_attn.weight[3])
    engine = initialize(model, cfg)
    engine.close()


def test_a_shape_changing_assignment_names_the_parameter(disk_dir):
    cfg = engine_config("none", disk_dir, largest=40_000)
    with zero_init(cfg):
        model = NanoGPT()
    model.transformer.h[0].mlp.c_fc.weight.data = torch.zeros(3, 3)
    with pytest.raises(ValueError, match=r"transformer.h.0.mlp.c_fc.weight.data was assigned a torch.float32 tensor of shape \(3, 3\), "
                                         r"but the partitioned parameter is floating point with shape \(128, 32\)"):
        initialize(model, cfg)


def test_meta_device_construction_is_refused_with_the_fix(disk_dir):
    with pytest.raises(ValueError, match=r"is on the meta device.*build the model without torch.device\('meta'\)"):
        with zero_init(engine_config("none", disk_dir, largest=40_000)):
            with torch.device("meta"):
                nn.Linear(4, 4)


def test_a_whole_model_conversion_before_initialize_stays_bounded(disk_dir):
    """model.double() assigns every converted parameter to .data (Module._apply): each is re-partitioned at the
    next op, so at most two full parameters exist; the values keep the conversion's rounding."""
    cfg = engine_config("nvme", disk_dir, largest=40_000)
    torch.manual_seed(0)
    plain = NanoGPT().double().float()
    torch.manual_seed(0)
    with zero_init(cfg):
        model = NanoGPT()
    store = next(iter(model.parameters()))._infinity.store
    seen = []
    orig = store.adopt_reassigned

    def counting(mps):
        mps = list(mps)
        seen.append(sum(1 for mp in store.params if mp.reassigned()))
        return orig(mps)

    store.adopt_reassigned = counting
    model.double()
    store.adopt_reassigned = orig
    assert max(seen) <= 2, f"{max(seen)} full parameters were held at once"
    assert_same_values(plain, model)
    initialize(model, cfg).close()


def test_two_models_built_then_initialized_in_either_order_leave_no_mode_behind(disk_dir):
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    from infinity.engine.construct import PartitionedAccess

    cfg = engine_config("cpu", disk_dir, largest=40_000)
    with zero_init(cfg) as policy_store:
        policy = NanoGPT()
    with zero_init(cfg) as reference_store:
        reference = NanoGPT()
    modes = [policy_store.access, reference_store.access]
    nn.init.zeros_(policy.lm_head.weight)  # both access modes are live: the policy's write lands
    first = initialize(policy, cfg)  # its mode is under the reference's
    try:
        with gathered_parameters(policy.lm_head):
            assert bool((policy.lm_head.weight == 0).all())
        nn.init.ones_(reference.lm_head.weight)
        second = initialize(reference, cfg)
        with gathered_parameters(reference.lm_head):
            assert bool((reference.lm_head.weight == 1).all())
        second.close()
    finally:
        first.close()
    assert all(isinstance(m, PartitionedAccess) for m in modes)
    assert not any(m in _get_current_dispatch_mode_stack() for m in modes)
